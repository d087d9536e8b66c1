"""The two-region stack (and its witness datacenter) answers the way the issue's 'done when'
says, to real clients."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import dns.resolver
import pytest
from stacks import StackInfo

from crossdc.clients.consul import ConsulClient
from crossdc.settings import RetrySettings
from crossdc.topology import split_hostport
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.toolchain import consul_binary
from dr.status import probe_topology

WAN = ["east-consul.east", "west-consul.west", "witness-consul.witness"]


async def test_status_reports_both_regions_healthy(two_regions: StackInfo) -> None:
    st = await probe_topology(two_regions.topology, str(two_regions.topology_path), 1)
    assert st.healthy, st.model_dump_json(indent=1)
    for region in st.regions:
        assert region.kafka.brokers_up == 1
        assert region.kafka.quorum_leader == 1
        assert region.consul.leader
        assert region.consul.wan_members == WAN
    [witness] = st.witnesses
    assert witness.healthy
    assert witness.consul.datacenter == "witness"
    assert witness.consul.leader
    assert witness.consul.wan_members == WAN
    assert [r.primary for r in st.regions] == [True, False]


def test_dr_status_json_cli(two_regions: StackInfo) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dr.cli", "status", "--json", "--topology",
         str(two_regions.topology_path)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["healthy"] is True
    assert {r["region"] for r in data["regions"]} == {"east", "west"}
    assert all(r["consul"]["datacenter"] == r["region"] for r in data["regions"])
    [witness] = data["witnesses"]
    assert witness["witness"] == "witness"
    assert witness["healthy"] is True
    assert witness["consul"]["wan_expected"] == 3


def _dr_json(two_regions: StackInfo, *args: str) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run(
        [sys.executable, "-m", "dr.cli", *args, "--json", "--topology",
         str(two_regions.topology_path)], capture_output=True, text=True, timeout=120,
        check=False)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()  # one JSON object, nothing else on stdout
    return json.loads(line)  # type: ignore[no-any-return]


def test_failover_dry_run_and_gate_answer_json(two_regions: StackInfo) -> None:
    """`--json` on the operator's commands that print a result (issue 37): the failover's
    plan (nothing written), the gate closed then opened again."""
    # --force: this stack's topology declares no mirror flow, so the lag is unknown
    plan = _dr_json(two_regions, "failover", "--to", "west", "--dry-run", "--force")
    assert (plan["kind"], plan["source"], plan["target"]) == ("failover", "east", "west")
    assert plan["dry_run"] is True
    assert plan["done"] is False
    assert any(step.startswith("fence:") for step in plan["plan"]), plan["plan"]
    assert plan["record"]["state"] == "running"
    assert plan["behind"]["records"] is None  # no flow: unknown, said in its error
    assert "no mirror flow" in plan["behind"]["error"]
    try:
        closed = _dr_json(two_regions, "gate", "close", "--reason", "json test")
        assert closed == {"gate": "closed", "reason": "json test", "not_written_in": {}}
    finally:
        opened = _dr_json(two_regions, "gate", "open")
    assert opened["gate"] == "open"
    assert opened["not_written_in"] == {}


def test_dr_status_table_cli(two_regions: StackInfo) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dr.cli", "status", "--topology", str(two_regions.topology_path)],
        capture_output=True, text=True, timeout=60, check=False, env={"COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    assert "region east (primary)" in proc.stdout
    assert "region west" in proc.stdout
    assert "witness witness (Consul only) — healthy" in proc.stdout
    assert "all regions healthy, and every witness" in proc.stdout


@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat (Debian package) not installed")
@pytest.mark.parametrize("region", ["east", "west"])
def test_kcat_lists_the_regions_broker(two_regions: StackInfo, region: str) -> None:
    bootstrap = two_regions.bootstrap(region)
    out = subprocess.run(["kcat", "-b", bootstrap, "-L", "-m", "10"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert f"broker 1 at {bootstrap}" in out


@pytest.mark.parametrize("region", ["east", "west"])
def test_consul_dns_answers_for_each_datacenter(two_regions: StackInfo, region: str) -> None:
    host, port = split_hostport(two_regions.topology.region(region).consul.dns_addr)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
    resolver.lifetime = 10
    for dc in ("east", "west", "witness"):  # each agent answers for the others over WAN
        answer = resolver.resolve(f"consul.service.{dc}.consul", "A")
        assert sorted(r.to_text() for r in answer) == ["127.0.0.1"], dc


def test_consul_members_wan_lists_every_datacenter(two_regions: StackInfo) -> None:
    if two_regions.kind != "local":
        pytest.skip("the consul binary is inside the containers on the Docker path")
    binary = consul_binary(StackPaths.default())
    addr = two_regions.topology.region("west").consul.http_addr
    out = subprocess.run([str(binary), "members", "-wan", f"-http-addr={addr}"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    lines = [line.split() for line in out.splitlines()[1:]]
    assert {(cols[0], cols[2]) for cols in lines} == {(m, "alive") for m in WAN}


@pytest.mark.parametrize("region", ["east", "west"])
async def test_the_witness_is_wan_joined_with_every_region(two_regions: StackInfo,
                                                           region: str) -> None:
    """Each region's agent knows the witness's datacenter, and a KV write and read with
    ?dc=witness through it reach the witness's own agent (and back through the other
    region's)."""
    topo = two_regions.topology
    [witness] = topo.witnesses
    other = next(r for r in topo.regions if r.name != region)
    retry = RetrySettings(attempts=3, total_s=10.0, call_timeout_s=5.0)
    key = f"crossdc-test/witness-from-{region}-{uuid.uuid4().hex[:8]}"
    async with ConsulClient(topo.region(region).consul.http_addr, retry) as here, \
            ConsulClient(other.consul.http_addr, retry) as there, \
            ConsulClient(witness.consul.http_addr, retry) as own:
        assert sorted(await here.datacenters()) == ["east", "west", "witness"]
        assert sorted(await own.datacenters()) == ["east", "west", "witness"]
        assert await here.kv_put(key, region.encode(), dc="witness")
        _, got = await own.kv_get(key)  # the witness's own datacenter holds it
        assert got is not None
        assert got.value == region.encode()
        _, got = await there.kv_get(key, dc="witness")
        assert got is not None
        assert got.value == region.encode()
        _, local = await here.kv_get(key)  # written there, not in the region's own KV
        assert local is None
        await here.kv_delete(key, dc="witness")


async def test_up_again_is_idempotent(two_regions: StackInfo) -> None:
    if two_regions.kind != "local":
        pytest.skip("local stack only")
    stack = two_regions.stack
    assert isinstance(stack, LocalStack)
    before = sorted(p.pid() or 0 for p in _procs(stack))
    await stack.up(timeout_s=60)
    after = sorted(p.pid() or 0 for p in _procs(stack))
    assert before == after
    assert 0 not in after


@pytest.mark.slow  # ~21 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_broker_stop_and_start_shows_in_status(two_regions: StackInfo) -> None:
    if two_regions.kind != "local":
        pytest.skip("local stack only")
    stack = two_regions.stack
    assert isinstance(stack, LocalStack)
    await stack.stop_kafka("west")
    st = await probe_topology(two_regions.topology, "t", 1, timeout_s=2.0)
    west = next(r for r in st.regions if r.region == "west")
    assert not west.healthy
    assert west.kafka.error is not None
    assert next(r for r in st.regions if r.region == "east").healthy
    await stack.start_kafka("west", timeout_s=90)
    st = await probe_topology(two_regions.topology, "t", 1)
    assert st.healthy


def _procs(stack: LocalStack) -> list:  # type: ignore[type-arg]
    procs = []
    for region in stack.topology.regions:
        procs += [stack.kafka_process(n) for n in stack.nodes(region)]
        procs.append(stack.consul_process(stack.agent(region)))
    procs += [stack.consul_process(stack.agent(w)) for w in stack.topology.witnesses]
    return procs


def test_the_stack_file_records_the_witness(two_regions: StackInfo) -> None:
    if two_regions.kind != "local":
        pytest.skip("local stack only")
    stack = two_regions.stack
    assert isinstance(stack, LocalStack)
    saved = json.loads(stack.paths.stack_file.read_text())
    assert saved["regions"] == ["east", "west"]
    assert saved["witnesses"] == ["witness"]
    assert "netns" not in saved
    assert stack.consul_pid("witness") is not None
    assert (stack.paths.state / "witness" / "consul" / "agent.json").is_file()


