"""The simulated WAN's pure parts: Toxiproxy request bodies, a region's view of the others'
Kafka, the brokers' WAN listener, the services' per-region topology files, the recorded
ports. (The chaos test tests/chaos/test_wan_latency.py runs it for real.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from crossdc.topology import Flow, Topology
from dr.errors import StackError
from dr.stack.kafka import KafkaNode
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services
from dr.stack.toxiproxy import (
    ToxiproxyClient,
    ToxiproxyError,
    Wan,
    WanLink,
    latency_toxic,
    proxy_body,
    region_view,
)

LINKS = [WanLink("east", 1, 11001, 12001), WanLink("east", 2, 11002, 12002),
         WanLink("west", 1, 11003, 12003)]


def _topo() -> Topology:
    topo = free_topology(["east", "west"])
    return topo.model_copy(update={"flows": [Flow(source="east", target="west", topics="a.*"),
                                             Flow(source="west", target="east", topics="a.*")]})


def test_a_proxy_listens_on_loopback_and_forwards_to_the_listener() -> None:
    assert proxy_body("east-kafka-1", 12001, 11001) == {
        "name": "east-kafka-1", "listen": "127.0.0.1:12001", "upstream": "127.0.0.1:11001",
        "enabled": True}


@pytest.mark.parametrize("stream", ["upstream", "downstream"])
def test_a_latency_toxic_delays_one_direction(stream: str) -> None:
    body = latency_toxic(stream, 50, 10)  # type: ignore[arg-type]
    assert body == {"name": f"latency_{stream}", "type": "latency", "stream": stream,
                    "toxicity": 1.0, "attributes": {"latency": 50, "jitter": 10}}


@pytest.mark.parametrize(("latency", "jitter", "toxicity"),
                         [(-1, 0, 1.0), (10, -1, 1.0), (10, 20, 1.0), (10, 5, 1.5)])
def test_a_nonsense_toxic_is_refused_before_the_api(latency: int, jitter: int,
                                                    toxicity: float) -> None:
    with pytest.raises(ToxiproxyError):
        latency_toxic("upstream", latency, jitter, toxicity)
    assert issubclass(ToxiproxyError, StackError)


def test_a_region_sees_the_others_kafka_through_toxiproxy_and_its_own_direct() -> None:
    topo = _topo()
    east = region_view(topo, "east", LINKS)
    assert east.region("west").kafka.bootstrap_servers == ["127.0.0.1:12003"]
    assert east.region("east").kafka == topo.region("east").kafka
    assert east.region("west").consul == topo.region("west").consul, "Consul stays direct"
    west = region_view(topo, "west", LINKS)
    assert west.region("east").kafka.bootstrap_servers == ["127.0.0.1:12001",
                                                           "127.0.0.1:12002"]
    assert west.region("west").kafka == topo.region("west").kafka
    assert west.flows == topo.flows
    assert west.primary == topo.primary


def test_a_region_without_links_or_an_unknown_region_is_an_error() -> None:
    with pytest.raises(StackError):
        region_view(_topo(), "east", [lk for lk in LINKS if lk.region == "east"])
    with pytest.raises(KeyError):
        region_view(_topo(), "north", LINKS)


def test_a_wan_broker_advertises_its_toxiproxy_port(tmp_path: Path) -> None:
    topo = _topo()
    node = KafkaNode(topo.regions[0], 0, 1, 1, tmp_path, tmp_path, tmp_path, wan=LINKS[0])
    props = node.properties()
    assert props["listeners"].endswith(",WAN://127.0.0.1:11001")
    assert props["advertised.listeners"].endswith(",WAN://127.0.0.1:12001")
    assert props["listener.security.protocol.map"].endswith(",WAN:PLAINTEXT")
    assert props["inter.broker.listener.name"] == "PLAINTEXT", "brokers talk directly"
    assert 11001 in [p for p, _, _ in node.ports()]
    plain = KafkaNode(topo.regions[0], 0, 1, 1, tmp_path, tmp_path, tmp_path).properties()
    assert "WAN" not in plain["listeners"], "without `wan` nothing changes"


def test_the_ports_are_chosen_once_per_state_directory(tmp_path: Path) -> None:
    topo = _topo()
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    wan = Wan.plan(paths, topo, brokers=2)
    assert {(lk.region, lk.node_id) for lk in wan.links} == {
        ("east", 1), ("east", 2), ("west", 1), ("west", 2)}
    ports = [p for lk in wan.links for p in (lk.listener_port, lk.proxy_port)]
    assert len(set([*ports, wan.api_port])) == len(ports) + 1
    assert wan.process().argv[1:] == ["-host", "127.0.0.1", "-port", str(wan.api_port)]
    assert wan.process().workdir == paths.state / "toxiproxy", "`dr down` stops it"
    assert Wan.plan(paths, topo, brokers=2).links == wan.links
    assert Wan.plan(paths, topo, brokers=1).links != wan.links, "another size: new ports"


def test_each_region_s_services_start_with_its_view(tmp_path: Path) -> None:
    topo = _topo()
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    wan = Wan(paths, [*LINKS, WanLink("west", 2, 11004, 12004)], 13000)
    views = wan.write_views(topo, tmp_path / "views")
    doc = yaml.safe_load(views["east"].read_text())
    assert [r["kafka"]["bootstrap_servers"] for r in doc["regions"]] == [
        topo.region("east").kafka.bootstrap_servers, ["127.0.0.1:12003", "127.0.0.1:12004"]]
    main = tmp_path / "topology.yaml"
    main.write_text("{}")
    policy = tmp_path / "policy.yaml"
    policy.write_text("{}")
    specs = Services(topo, main, paths, region_topologies=views)._plan(policy)

    def topology_arg(name: str) -> str:
        argv = specs[name].argv
        return argv[argv.index("--topology") + 1]

    assert topology_arg("proxy-east") == str(views["east"].resolve())
    assert topology_arg("controller-west") == str(views["west"].resolve())
    assert topology_arg("mirror-east-west") == str(views["west"].resolve()), \
        "a mirror runs in its target region: it consumes over the WAN"
    assert topology_arg("mirror-west-east") == str(views["east"].resolve())
    plain = Services(topo, main, paths)._plan(policy)
    assert plain["proxy-east"].argv[plain["proxy-east"].argv.index("--topology") + 1] == \
        str(main.resolve())


async def test_the_client_says_which_call_failed_when_nothing_answers() -> None:
    from dr.stack.ports import free_port
    async with ToxiproxyClient(f"http://127.0.0.1:{free_port()}", timeout_s=1.0) as client:
        with pytest.raises(ToxiproxyError, match="does not answer"):
            await client.version()
        with pytest.raises(ToxiproxyError, match=r"POST http://.*/populate"):
            await client.populate([])
    with pytest.raises(ToxiproxyError, match="not open"):
        await client.proxies()
