"""The compose deployment for real (`dr up --docker` of policies/topology.docker.yaml): a network
per datacenter, and east cut off `wan` by compose/docker/partition.sh; the controllers on the
majority side promote west, east's cut-off proxy refuses ordered writes, and after the heal every
datacenter agrees on west.

A module of its own, so the stack of tests/integration/test_docker_stack.py (module-scoped) is
down before this one starts: two deployments at once on two cores left this one unhealthy past
its 420 s (a CI run, 2026-12-01). Skipped, saying why, where no Docker engine answers or the
images are not built. Slow: `make test-more`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
from kafka_helpers import create_topic, eventually, unique
from primary_helpers import read_everywhere
from stacks import docker_skip_reason, save_container_logs

from crossdc.clients.consul import ConsulClient
from crossdc.topology import Topology, load_topology
from dr.controller.state import LEADER_KEY, LeaderRecord
from dr.stack.compose import DOCKER_TOPOLOGY, PROJECT, ComposeDeployment, container_states
from dr.stack.containers import NetworkPlan, topology_view
from dr.stack.paths import REPO_ROOT, StackPaths
from proxy.client import AsyncProducer
from proxy.errors import ProduceFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# -- the compose deployment: a network per datacenter, a partition by `docker network` -------

_PROBE = ("import socket, sys\n"
          "for a in sys.argv[1:]:\n"
          "    h, p = a.rsplit(':', 1)\n"
          "    s = socket.socket(); s.settimeout(2)\n"
          "    try:\n        s.connect((h, int(p))); print(a, 'ok')\n"
          "    except OSError:\n        print(a, 'cut')\n"
          "    finally:\n        s.close()\n")


def _reach(container: str, *addresses: str) -> dict[str, bool]:
    """address -> whether a TCP connection from inside `container` gets through."""
    proc = subprocess.run(["docker", "exec", container, "python3", "-c", _PROBE, *addresses],
                          capture_output=True, text=True, timeout=60, check=True)
    return {a: r == "ok" for a, r in (line.split() for line in proc.stdout.splitlines())}


async def _leaders(topo: Topology) -> dict[str, str | None]:
    """Datacenter -> the region of the controller holding the leader lock there."""
    out: dict[str, str | None] = {}
    for dc in topo.datacenters:
        async with ConsulClient(dc.consul.http_addr) as c:
            _, entry = await c.kv_get(LEADER_KEY)
        out[dc.name] = (LeaderRecord.model_validate_json(entry.value).region
                        if entry is not None and entry.session and entry.value else None)
    return out


async def _east_leads(topo: Topology) -> None:
    """Make east's controller the leader (the harder case: the majority side must take the
    lock over before it can fail over): west's restarted gives it up at its clean stop."""
    if set((await _leaders(topo)).values()) == {"east"}:
        return
    await asyncio.to_thread(subprocess.run, ["docker", "restart", "crossdc-controller-west"],
                            capture_output=True, text=True, timeout=120, check=True)

    async def east() -> bool:
        return set((await _leaders(topo)).values()) == {"east"}
    await eventually(east, 60, "east's controller holding the lock everywhere")


_TELLING = ("leadership_changed", "region_status", "lead_round_failed", "failover_",
            "automatic_failover", "lag")


def _why_not_promoted(topo: Topology) -> str:
    """West's controller as it answers /health now (its HTTP port is its proxy's + 100,
    dr/stack/containers.py), and the telling lines of its log: what a CI failure of the
    promote shows (the containers' logs go with the run's /tmp)."""
    out = []
    port = int(topo.region("west").proxy.endpoint.rsplit(":", 1)[1]) + 100
    url = f"http://{NetworkPlan(topo).home('west', 12)}:{port}/health"
    try:
        import urllib.request
        with urllib.request.urlopen(url, timeout=5) as r:
            h = json.loads(r.read())
        out.append("west's controller: " + json.dumps(
            {k: h.get(k) for k in ("leading", "why_not_leading", "datacenters_answering",
                                   "automatic_failover_blocked", "primary", "regions")}))
    except (OSError, ValueError) as exc:
        out.append(f"west's controller {url}: {exc!r}")
    proc = subprocess.run(["docker", "logs", "--tail", "400", "crossdc-controller-west"],
                          capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if any(t in ln for t in _TELLING)]
    out.append("its log: " + " | ".join(ln[:300] for ln in lines[-12:]))
    return "; ".join(out)


def _partition(action: str, dc: str) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "compose" / "docker" / "partition.sh"), action, dc],
                   capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
async def deployed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ComposeDeployment]:
    """`dr up --docker` of policies/topology.docker.yaml (no Prometheus), in a state dir of
    its own; skipped while the deployment already runs (same names and subnets)."""
    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    if container_states(PROJECT):
        pytest.skip(f"the compose deployment (project {PROJECT}) runs already: `dr down` it")
    root = tmp_path_factory.mktemp("compose")
    root.chmod(0o755)
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    dep = ComposeDeployment(load_topology(DOCKER_TOPOLOGY), DOCKER_TOPOLOGY, paths,
                            prometheus_port=None)
    try:
        t0 = time.monotonic()
        await dep.up(timeout_s=420)
        print(f"compose deployment up and healthy after {time.monotonic() - t0:.1f} s")
        yield dep
    finally:
        logs = save_container_logs(PROJECT, root / "logs")
        print(f"the containers' logs: {root / 'logs'} ({len(logs)} files)")
        saved = json.loads(paths.stack_file.read_text(encoding="utf-8"))
        await ComposeDeployment.down(paths, saved["docker"])


async def test_a_region_cut_off_wan_is_partitioned_fails_over_and_heals(
        deployed: ComposeDeployment) -> None:
    """east's containers off `wan` (compose/docker/partition.sh): from inside them the other
    datacenters are unreachable (also through the host: the bridges do not forward), and the
    other way round; their own region and the host still reach them. The controllers on the
    majority side (west + witness) promote west, the cut-off east proxy stops taking ordered
    writes; reconnected, every datacenter agrees on west. East's controller leads at the cut
    (the harder case, and CI's failure of 6813a1c: the one taking over had no lag figure and
    refused the failover for good)."""
    topo = deployed.topology
    plan = NetworkPlan(topo)
    east_kafka = topo.region("east").kafka.bootstrap
    west_kafka = topo.region("west").kafka.bootstrap
    east_view, west_view = topology_view(topo, plan, "east"), topology_view(topo, plan, "west")
    across_from_east = [east_view.region("west").kafka.bootstrap,   # west's WAN listener
                        east_view.region("west").consul.http_addr,
                        east_view.witnesses[0].consul.http_addr,
                        west_kafka, topo.region("west").consul.http_addr]  # west's home: via host
    across_from_west = [west_view.region("east").kafka.bootstrap,
                        west_view.region("east").consul.http_addr, east_kafka]
    assert all(_reach("crossdc-proxy-east", east_view.region("west").kafka.bootstrap,
                      east_view.witnesses[0].consul.http_addr).values())

    topic = unique("payments.netcut")
    for r in ("east", "west"):
        await create_topic(topo.region(r).kafka.bootstrap, topic, 1)
    async with AsyncProducer(topo.region("east").proxy.endpoint, deadline_s=5.0) as p:
        async def written() -> bool:
            try:
                await p.produce(topic, b"before", key=b"k", idempotency_key=unique("nc"))
            except ProduceFailed:
                return False
            return True
        await eventually(written, 60, "an ordered write through east's proxy before the cut")
        await _east_leads(topo)

        t0 = time.monotonic()
        _partition("cut", "east")
        try:
            got = _reach("crossdc-proxy-east", east_kafka, *across_from_east)
            assert got.pop(east_kafka), got            # its own region still answers
            assert not any(got.values()), got          # no other datacenter, not via the host
            got = _reach("crossdc-proxy-west", *across_from_west,
                         west_view.witnesses[0].consul.http_addr)
            assert got.pop(west_view.witnesses[0].consul.http_addr), got
            assert not any(got.values()), got

            async def promoted() -> bool:  # east's Consul still answers the host, stale
                held = await read_everywhere(topo)
                return all((r := held[dc]) is not None and r.region == "west" and not r.fenced
                           for dc in ("west", "witness"))
            try:
                await eventually(promoted, 120, "west and the witness promote west")
            except AssertionError as exc:  # say why in CI's output: the logs go with /tmp
                raise AssertionError(f"{exc}; {_why_not_promoted(topo)}") from None
            failover_s = time.monotonic() - t0

            async def refused() -> bool:
                try:
                    await p.produce(topic, b"cut", key=b"k", idempotency_key=unique("nc"))
                except ProduceFailed:
                    return True
                return False
            await eventually(refused, 60, "the cut-off east proxy refuses ordered writes")
            fenced_s = time.monotonic() - t0
        finally:
            _partition("heal", "east")
    print(f"partition of east: west primary after {failover_s:.1f} s, east's proxy refusing "
          f"ordered writes after {fenced_s:.1f} s")
    assert all(_reach("crossdc-proxy-east", *across_from_east[:3]).values())

    async def agreed() -> bool:
        held = await read_everywhere(topo)
        return all(r is not None and r.region == "west" and not r.fenced for r in held.values())
    await eventually(agreed, 120, "every datacenter, east included, on west after the heal")

