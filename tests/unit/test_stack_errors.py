"""The local stack's refusals: missing toolchain, taken port, a process that dies at start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from dr.errors import PortTaken, ProcessDied, ToolchainMissing
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.process import ManagedProcess, check_port_free
from dr.stack.toolchain import check_toolchain


def test_missing_java_mvn_go_are_all_named(tmp_path: Path) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(tmp_path))  # a PATH with nothing on it
    assert set(info.value.missing) == {"java", "mvn", "go"}
    msg = str(info.value)
    assert "java: not found on PATH; Java 17 or newer runs the Kafka brokers" in msg
    assert "go: not found on PATH; Go 1.23 or newer builds Consul" in msg


def test_cached_artifacts_need_only_java(tmp_path: Path) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    from dr.stack.toolchain import CONSUL_VERSION, kafka_libs_dir, spark_kafka_jars_dir
    for d in (kafka_libs_dir(paths), spark_kafka_jars_dir(paths)):
        d.parent.mkdir(parents=True)
        (d.parent / ".complete").write_text("x")
    built = paths.cache / f"consul-{CONSUL_VERSION}" / "consul"  # never an installed one
    built.parent.mkdir(parents=True)
    built.write_text("x")
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(tmp_path))
    assert set(info.value.missing) == {"java"}


def test_dr_up_without_java_prints_one_paragraph(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent),
           "CROSSDC_CACHE_DIR": str(tmp_path / "cache"),
           "CROSSDC_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "up"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "error: The local stack needs programs that are not installed: java:" in \
        " ".join(proc.stderr.split())
    assert not (tmp_path / "state" / "stack.json").exists()


def test_taken_port_names_port_field_and_holder() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortTaken) as info:
            check_port_free(port, "east kafka broker 1 client listener",
                            "regions[0].kafka.bootstrap_servers[0]")
    msg = str(info.value)
    assert f"Port 127.0.0.1:{port} (east kafka broker 1 client listener) is already in use" in msg
    assert "change regions[0].kafka.bootstrap_servers[0] in the topology file" in msg
    assert f"pid {os.getpid()}" in msg or "another process" in msg


def test_dr_up_with_a_taken_port_fails_before_starting_anything(tmp_path: Path) -> None:
    from tests_support import write_topology
    topo = free_topology(["east", "west"])
    path = write_topology(topo, tmp_path / "t.yaml")
    consul_http = int(topo.region("west").consul.http_addr.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", consul_http))
        sock.listen()
        env = {**os.environ, "CROSSDC_STATE_DIR": str(tmp_path / "state")}
        proc = subprocess.run([sys.executable, "-m", "dr.cli", "up", "-t", str(path)],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
    out = " ".join(proc.stderr.split())
    assert proc.returncode == 1, proc.stderr
    assert f"Port 127.0.0.1:{consul_http} (west consul agent HTTP API) is already in use" in out
    assert "regions[1].consul.http_addr" in out
    assert not list((tmp_path / "state").glob("*/*/pid"))


def test_process_that_dies_at_start_reports_cause_and_log(tmp_path: Path) -> None:
    script = "echo starting; echo 'java.lang.IllegalStateException: bad config' >&2; exit 3"
    proc = ManagedProcess("demo server", tmp_path, ["sh", "-c", script, str(tmp_path)])
    proc.start()
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessDied) as info:  # noqa: PT012 - poll until the child has exited
        while time.monotonic() < deadline:
            proc.check_alive()
            time.sleep(0.02)
    err = info.value
    assert err.returncode == 3
    assert err.cause == "java.lang.IllegalStateException: bad config"
    assert "starting" in err.log_tail
    assert str(err).startswith("demo server exited with status 3 while starting: "
                               "java.lang.IllegalStateException: bad config.")


def test_stop_is_idempotent_and_safe_before_start(tmp_path: Path) -> None:
    proc = ManagedProcess("sleeper", tmp_path, ["sh", "-c", "sleep 60", str(tmp_path)])
    assert proc.stop() is False
    proc.start()
    assert proc.running()
    assert proc.stop(timeout_s=5) is True
    assert not proc.running()
    assert proc.stop() is False


def test_free_topology_is_valid_and_distinct() -> None:
    topo = free_topology(["a", "b", "c"], seed=7)
    ports = [r.kafka_port for r in topo.regions]
    assert len(set(ports)) == 3
    assert topo.preference == ["a", "b", "c"]


def test_side_by_side_test_processes_pick_ports_from_their_own_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two xdist workers never pick the same port: while a drill has a region's Kafka down,
    its ports are free, and the other worker must not take them."""
    from dr.stack.ports import BLOCK, SLICE_ENV, free_port, free_topology
    seen: dict[str, tuple[set[int], set[int]]] = {}
    for i in ("0", "1"):
        monkeypatch.setenv(SLICE_ENV, f"{i}/2")
        singles = {free_port() for _ in range(30)}
        blocks = {r.local.kafka.controller_port // BLOCK for _ in range(10)  # type: ignore[union-attr]
                  for r in free_topology(["a"], witnesses=()).regions}
        seen[i] = (singles, blocks)
    assert max(seen["0"][0]) < 15000 <= min(seen["1"][0])
    assert not seen["0"][1] & seen["1"][1]
    monkeypatch.setenv(SLICE_ENV, "nonsense")  # ignored: the whole range
    assert 10000 <= free_port() < 20000


def test_free_port_stays_out_of_the_ephemeral_range_and_skips_taken_ones() -> None:
    """A service restarted on its old port must find it free: ports the kernel hands to
    outgoing connections are never chosen (a drill's heal once failed on exactly that)."""
    from dr.stack.ports import _ephemeral_low, free_port
    taken: set[int] = set()
    ports = [free_port(taken) for _ in range(50)]
    assert len(set(ports)) == 50
    assert set(ports) == taken
    assert all(p < _ephemeral_low() and p < 20000 for p in ports)
    held = socket.socket()
    held.bind(("127.0.0.1", ports[0]))
    held.listen()
    try:
        for _ in range(100):
            assert free_port() != ports[0]
    finally:
        held.close()


def test_cluster_ids_never_look_like_an_option() -> None:
    from dr.stack.kafka import _new_cluster_id
    ids = {_new_cluster_id() for _ in range(5000)}
    assert len(ids) == 5000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_free_topology_adds_a_witness_unless_told_not_to() -> None:
    topo = free_topology(["a", "b"], seed=3)
    [w] = topo.witnesses
    assert (w.name, w.consul.datacenter) == ("witness", "witness")
    assert w.local is not None
    ports = {int(a.rsplit(":", 1)[1]) for r in topo.regions
             for a in (r.consul.http_addr, r.consul.dns_addr)}
    assert not ports & {int(w.consul.http_addr.rsplit(":", 1)[1]),
                        int(w.consul.dns_addr.rsplit(":", 1)[1])}
    assert free_topology(["a"], witnesses=()).witnesses == []
    assert [w.name for w in free_topology(["a"], witnesses=["w1", "w2"]).witnesses] == \
        ["w1", "w2"]
    # the regions' ports do not move when a witness is added (seeded callers keep theirs)
    assert free_topology(["a", "b"], seed=3, witnesses=()).regions == topo.regions


def test_witness_agent_joins_every_region_and_they_join_it(tmp_path: Path) -> None:
    from dr.stack.consul import ConsulAgent
    topo = free_topology(["east", "west"])
    [w] = topo.witnesses
    assert w.local is not None
    agent = ConsulAgent(topo, w, 0, tmp_path / "witness" / "consul", Path("consul"))
    cfg = agent.config()
    assert cfg["datacenter"] == "witness"
    assert cfg["node_name"] == "witness-consul"
    assert cfg["bootstrap_expect"] == 1
    assert cfg["ports"]["serf_wan"] == w.local.consul.serf_wan_port  # type: ignore[index]
    assert sorted(cast(list[str], cfg["retry_join_wan"])) == sorted(
        f"127.0.0.1:{r.local.consul.serf_wan_port}" for r in topo.regions if r.local)
    east = ConsulAgent(topo, topo.region("east"), 0, tmp_path / "e", Path("consul"))
    assert f"127.0.0.1:{w.local.consul.serf_wan_port}" in east.wan_peers()
    fields = [f for _, _, f, _ in agent.ports()]
    assert fields[0] == "witnesses[0].consul.http_addr"
    assert "witnesses[0].local.consul.serf_wan_port" in fields
    assert agent.name == "witness consul agent"


def test_stack_refuses_a_witness_without_local_ports(tmp_path: Path) -> None:
    from dr.errors import StackError
    from dr.stack.local import LocalStack
    topo = free_topology(["east", "west"])
    bare = topo.model_copy(update={"witnesses": [
        topo.witnesses[0].model_copy(update={"local": None})]})
    with pytest.raises(StackError, match="regions or witnesses witness have no `local:`"):
        LocalStack(bare, tmp_path / "t.yaml")


def test_netns_topology_moves_witnesses_and_proxies_into_their_namespaces(
        tmp_path: Path) -> None:
    from dr.errors import StackError
    from dr.stack.local import LocalStack
    from dr.stack.netns import NetNamespaces, netns_topology
    base = free_topology(["east", "west"])
    net = NetNamespaces.for_topology(tmp_path / "state", base)
    assert net.regions == ["east", "west", "witness"]
    topo = netns_topology(base, net)
    [w], [bw] = topo.witnesses, base.witnesses
    assert w.consul.http_addr == f"{net.address('witness')}:{bw.consul.http_addr.split(':')[1]}"
    assert w.consul.dns_addr.startswith(net.address("witness") + ":")
    for r, b in zip(topo.regions, base.regions, strict=True):
        assert r.proxy.endpoint == f"{net.address(r.name)}:{b.proxy.endpoint.split(':')[1]}"
        assert r.consul.http_addr.startswith(net.address(r.name) + ":")
    assert len({net.address(n) for n in net.regions}) == 3
    assert len({net.host_link(n) for n in net.regions}) == 3
    two = NetNamespaces.for_state(tmp_path / "state", ["east", "west"])
    with pytest.raises(StackError, match="no network namespace for witness"):
        netns_topology(base, two)
    with pytest.raises(StackError, match="no network namespace for witness"):
        LocalStack(base, tmp_path / "t.yaml", netns=two)
    with pytest.raises(StackError, match="no network namespace for 'north'"):
        two.address("north")


def test_namespaced_consul_agents_join_over_the_bridge(tmp_path: Path) -> None:
    from dr.stack.local import LocalStack
    from dr.stack.netns import NetNamespaces, NetnsConsulAgent, netns_topology
    base = free_topology(["east", "west"])
    net = NetNamespaces.for_topology(tmp_path / "state", base)
    topo = netns_topology(base, net)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    stack = LocalStack(topo, tmp_path / "t.yaml", paths=paths, netns=net)
    agent = stack.agent(stack.site("witness"))
    assert isinstance(agent, NetnsConsulAgent)
    cfg = agent.config()
    assert cfg["bind_addr"] == cfg["client_addr"] == net.address("witness")
    assert sorted(cast(list[str], cfg["retry_join_wan"])) == sorted(
        f"{net.address(r.name)}:{r.local.consul.serf_wan_port}" for r in topo.regions if r.local)
    assert agent.process().argv[:4] == ["ip", "netns", "exec", net.namespace("witness")]
    east = stack.agent(stack.site("east")).config()
    assert any(p.startswith(net.address("witness") + ":")
               for p in cast(list[str], east["retry_join_wan"]))
    assert agent.workdir == paths.state / "witness" / "consul"


def test_services_run_inside_their_regions_namespaces(tmp_path: Path) -> None:
    """With namespaces, each proxy and controller runs in its region's namespace, each mirror
    in its target's, listening on the namespace's address; without, as before."""
    import json

    from crossdc.topology import Flow
    from dr.stack.netns import NetNamespaces, netns_topology
    from dr.stack.services import Services
    base = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics="t.*")]})
    net = NetNamespaces.for_topology(tmp_path / "state", base)
    topo = netns_topology(base, net)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    svc = Services(topo, tmp_path / "t.yaml", paths, netns=net, proxies_per_region=2)
    specs = svc._plan(tmp_path / "policy.yaml")
    for name, region in (("proxy-east", "east"), ("proxy-east-2", "east"),
                         ("controller-west", "west"), ("mirror-east-west", "west")):
        s = specs[name]
        addr = net.address(region)
        assert s.argv[:4] == ["ip", "netns", "exec", net.namespace(region)], name
        assert (s.metrics or "").startswith(addr + ":"), name
        assert s.address is None or s.address.startswith(addr + ":"), name
        assert svc._namespace_of(s) == region
    east = topo.region("east")
    assert specs["proxy-east"].address == east.proxy.endpoint
    assert specs["proxy-east"].argv[specs["proxy-east"].argv.index("--host") + 1] == \
        net.address("east")
    ctl = specs["controller-west"].argv
    assert ctl[ctl.index("--http-host") + 1] == net.address("west")
    mirror = specs["mirror-east-west"].argv
    assert mirror[mirror.index("--metrics-host") + 1] == net.address("west")
    # Any process finds the namespaces in stack.json (how `dr drill` builds its Services).
    paths.state.mkdir(parents=True)
    paths.stack_file.write_text(json.dumps({"netns": {"tag": net.tag,
                                                      "regions": net.regions}}))
    again = Services(topo, tmp_path / "t.yaml", paths)
    assert again.netns is not None
    assert again.netns.regions == net.regions
    # Without namespaces: loopback, no wrapper.
    plain = Services(base, tmp_path / "t.yaml",
                     StackPaths(state=tmp_path / "plain", cache=tmp_path / "cache"))
    assert plain.netns is None
    for s in plain._plan(tmp_path / "policy.yaml").values():
        assert s.argv[0] != "ip"
        assert "--http-host" not in s.argv
        assert "--metrics-host" not in s.argv
        assert s.metrics is not None
        assert s.metrics.startswith("127.0.0.1:")


async def test_a_restart_waits_a_moment_for_a_killed_process_s_ports() -> None:
    """A broker killed with SIGKILL may leave its sockets closing in the kernel for a moment:
    the heal waits (bounded) instead of refusing at once; a port still held then is named."""
    from dr.errors import PortTaken
    from dr.stack.local import _ports_released
    left = [2]

    def check() -> None:
        if left[0]:
            left[0] -= 1
            raise PortTaken(26159, "east kafka broker 1 controller listener",
                            "regions[0].local.kafka.controller_port", None)
    await _ports_released(check, 5.0)
    assert left == [0]

    def held() -> None:
        raise PortTaken(26159, "east kafka broker 1 controller listener",
                        "regions[0].local.kafka.controller_port", None)
    with pytest.raises(PortTaken, match="26159"):
        await _ports_released(held, 0.3)
