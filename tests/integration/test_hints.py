"""Hinted handoff against real Kafka (issue 21 defect 9, issue 23): a sync record acknowledged by a
quorum while one region's Kafka is stopped reaches that region once it is back, with the same
dr-id and headers; an acknowledgement is never given without its hint; the failover's drain
step reports the hints toward its target. Issue 36 item 2: a hint whose region holds a newer
record of its partition by the time it is replayed is quarantined there, never written after it.

The region that misses the writes is this module's own `north` (stopped and started here), so
the session's east and west are never disturbed. The proxy runs in east: its hints go to east's
`_crossdc.proxy.hints.north`, replayed by the group `_crossdc.proxy.hints-east`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import (
    create_topic,
    eventually,
    read_all,
    unique,
)
from primary_helpers import agreed_primary

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.quarantine import QUARANTINE_TOPIC
from crossdc.topology import Topology
from dr.controller.config import ControllerSettings, FailoverSettings
from dr.controller.failover import FailoverEngine
from dr.controller.state import FailoverRecord
from proxy.api import pb, pb_grpc
from proxy.config import HintSettings, KafkaWriterSettings, ProxyConfig
from proxy.hints import HintReplayer, hints_topic, pending_hints
from proxy.server import ProxyServer

# ~100 s of server time (a region brought down and up per test): in `make test-more` (CI),
# keeping `make test` under 10 min (719 s measured in a CI rehearsal with them)
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

POLICY = """\
strict: true
rules:
  - topic: "hq-*"
    mode: ordered
    sync: true
    quorum: 2
  - topic: "hall-*"
    mode: ordered
    sync: true
    quorum: 3
  - topic: "hone-*"
    mode: ordered
    sync: true
    quorum: 1
"""


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    await agreed_primary(two_regions.topology)  # east, agreed by east and west (2 of 3)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("hints-policy") / "policy.yaml"
    p.write_text(POLICY)
    return p


@pytest.fixture
def topo(two_regions: Any, north: Any) -> Topology:
    _, ntopo = north
    base: Topology = two_regions.topology
    return base.model_copy(update={"regions": [*base.regions, *ntopo.regions],
                                   "preference": ["east", "west", "north"]})


def _cfg(region: str = "east") -> ProxyConfig:
    return ProxyConfig(region=region, register_consul=False, primary_wait_s=5.0, grace_s=2.0,
                       kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                       hints=HintSettings(backoff_s=0.2, backoff_max_s=1.0,
                                          pending_interval_s=0.3))


@pytest.fixture
async def proxy(topo: Topology, policy_file: Path) -> AsyncIterator[tuple[ProxyServer, Any]]:
    async with ProxyServer(topo, _cfg(), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield server, pb_grpc.ProxyStub(ch)


async def _topic(topo: Topology, prefix: str = "hq") -> str:
    name = str(unique(prefix))
    for r in topo.regions:
        await create_topic(r.kafka.bootstrap, name, partitions=2)
    return name


async def _hint_topics_ready(topo: Topology) -> None:
    """The proxy created the hints topics toward north in east and west (at its start)."""
    async def ready() -> bool:
        for region in ("east", "west"):
            async with KafkaAdmin(KafkaConnection.of(topo.region(region))) as admin:
                if hints_topic("north") not in await admin.list_topics():
                    return False
        return True
    await eventually(ready, 30, "hints topics created")


async def _pending(topo: Topology) -> int:
    east = KafkaConnection.of(topo.region("east"))
    return (await pending_hints(east, "east", ["north"]))["north"]


def _metric(server: ProxyServer, name: str, **labels: str) -> float:
    return server.registry.get_sample_value(name, labels) or 0.0


async def _north_down(server: ProxyServer, stack: Any) -> None:
    await stack.stop_kafka("north")

    async def unwritable() -> bool:
        return not server.writers["north"].writable
    await eventually(unwritable, 20, "north seen down")


async def _north_up(server: ProxyServer, stack: Any) -> None:
    await stack.start_kafka("north")

    async def writable() -> bool:
        return server.writers["north"].writable
    await eventually(writable, 60, "north writable again")


async def _drain(topo: Topology, north_down: bool) -> FailoverRecord:
    """The failover's drain step toward north, on its own (the mirror has no flow there)."""
    settings = ControllerSettings(region="east", failover=FailoverSettings(drain_timeout_s=1.0))

    async def keep(r: FailoverRecord) -> FailoverRecord:
        return r
    engine = FailoverEngine(topo, settings, None, keep, majority=2,  # type: ignore[arg-type]
                            is_down=lambda r: north_down and r == "north")
    return await engine._drain(FailoverRecord(source="east", target="north"))


def _hints_left(detail: str) -> int:
    m = re.search(r"hints toward north: \d+ replayed, (\d+) left", detail)
    assert m is not None, detail
    return int(m.group(1))


async def test_an_acked_sync_record_reaches_the_region_that_missed_it(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, proxy) -> None:
    stack, _ = north
    server, stub = proxy
    topic = await _topic(topo)
    await _hint_topics_ready(topo)
    await _north_down(server, stack)
    try:
        rec = pb.Record(topic=topic, key=b"acct-7", value=b"ledger-7",
                        headers=[pb.Header(key="app", value=b"x")],
                        idempotency_key=unique("tx"))
        r = (await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)).result
        assert r.status == pb.STATUS_OK
        assert [w.region for w in r.written] == ["east", "west"]
        assert _metric(server, "crossdc_proxy_hints_written_total", target="north") == 1
        assert await _pending(topo) >= 1
        # the drain step reports what is pending toward north (north down: not replayed)
        drained = await _drain(topo, north_down=True)
        detail = drained.step("drain").detail
        assert _hints_left(detail) >= 1, detail
        assert "counted in the RPO" in detail
        # hints are never stored in the region they are for: north is not asked
        assert "unknown in north" not in detail, detail
    finally:
        await _north_up(server, stack)

    east_copy = next(x for x in await read_all(topo.region("east").kafka.bootstrap, topic, 2)
                     if x.key == b"acct-7")

    async def arrived() -> bool:
        got = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
        return any(x.key == b"acct-7" for x in got)
    await eventually(arrived, 60, "the record replayed into north")
    north_recs = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
    [copy] = [x for x in north_recs if x.key == b"acct-7"]
    assert copy.value == b"ledger-7"
    assert copy.partition == east_copy.partition
    # same dr-id, dr-* and app headers as the copies outside the primary (the primary's, then
    # its place in the primary's order), and the mark of a late copy (counted as repaired)
    west_copy = next(x for x in await read_all(topo.region("west").kafka.bootstrap, topic, 2)
                     if x.key == b"acct-7")
    assert list(west_copy.headers) == [*east_copy.headers,
                                       ("dr-src", f"east:{east_copy.offset}".encode())]
    assert list(copy.headers) == [*west_copy.headers, ("dr-repaired", b"east")]
    assert dict(copy.headers)["dr-id"] == rec.idempotency_key.encode()
    assert dict(copy.headers)["dr-path"] == b"east,west,north"

    async def committed() -> bool:
        return await _pending(topo) == 0
    await eventually(committed, 30, "the hint committed (pending 0)")
    assert _metric(server, "crossdc_proxy_hints_replayed_total", target="north") >= 1

    async def gauge_zero() -> bool:
        return _metric(server, "crossdc_proxy_hints_pending", target="north") == 0
    await eventually(gauge_zero, 10, "the pending gauge at 0")
    drained = await _drain(topo, north_down=False)
    assert _hints_left(drained.step("drain").detail) == 0
    # a retry of the acknowledged call is answered from the window: still one copy in north
    again = (await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)).result
    assert again.duplicate
    north_recs = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
    assert [x.key for x in north_recs].count(b"acct-7") == 1


async def test_a_partial_write_told_failed_converges_once_and_its_retry_writes_nothing_twice(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, proxy) -> None:
    """Quorum 3 with north down: the client is told the write failed (east and west hold
    it), and its retry too. Once north is back the hints make it whole: one copy in every
    region (the two hints, first attempt and retry, are one record), and a retry then is
    acknowledged without a write."""
    stack, _ = north
    server, stub = proxy
    topic = await _topic(topo, "hall")
    await _hint_topics_ready(topo)
    await _north_down(server, stack)
    rec = pb.Record(topic=topic, key=b"acct-3", value=b"ledger-3",
                    idempotency_key=unique("tx"))
    try:
        for attempt in (1, 2):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, attempt
            md = dict(ei.value.trailing_metadata() or ())
            assert sorted(x.split(":")[0] for x in md["dr-written"].split(",")) == \
                ["east", "west"], (attempt, md)
        assert _metric(server, "crossdc_proxy_hints_written_total", target="north") >= 1
    finally:
        await _north_up(server, stack)

    async def whole() -> bool:
        got = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
        return any(x.key == b"acct-3" for x in got) and await _pending(topo) == 0
    await eventually(whole, 60, "the told-failed record replayed into north, hints committed")
    # two hints (the first attempt's, the retry's), one write: the second is skipped
    assert _metric(server, "crossdc_proxy_hints_replayed_total", target="north") == 1
    assert _metric(server, "crossdc_proxy_hints_skipped_total", target="north") >= 1
    for r in topo.regions:
        got = [x for x in await read_all(r.kafka.bootstrap, topic, 2) if x.key == b"acct-3"]
        assert len(got) == 1, (r.name, len(got))
        assert dict(got[0].headers)["dr-id"] == rec.idempotency_key.encode()
        assert (dict(got[0].headers).get("dr-repaired") == b"east") == (r.name == "north")
    done = (await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)).result
    assert done.status == pb.STATUS_OK
    for r in topo.regions:
        got = await read_all(r.kafka.bootstrap, topic, 2)
        assert [x.key for x in got].count(b"acct-3") == 1, r.name


async def _max_message_bytes(topo: Topology, regions: list[str], value: str | None) -> None:
    """Set (or, None: take away) max.message.bytes of the hints topic toward north."""
    want = value or str(8 * 1024 * 1024)
    for region in regions:
        async with KafkaAdmin(KafkaConnection.of(topo.region(region))) as admin:
            await admin.alter_topic_configs(hints_topic("north"), {"max.message.bytes": want})

            async def applied(admin: KafkaAdmin = admin) -> bool:  # the broker's own view
                got = await admin.topic_configs(hints_topic("north"))
                return got.get("max.message.bytes") == want
            await eventually(applied, 15, f"max.message.bytes {want} in {region}")


async def test_no_ack_when_the_hint_cannot_be_stored(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, proxy) -> None:
    """east and west refuse the hint (its topic takes no record that large): the record is
    in a quorum (east, west) but NOT acknowledged; the retry, once the hint is stored, is
    acknowledged and nothing is written twice anywhere."""
    stack, _ = north
    server, stub = proxy
    topic = await _topic(topo)
    await _hint_topics_ready(topo)
    await _north_down(server, stack)
    try:
        await _max_message_bytes(topo, ["east", "west"], "64")
        rec = pb.Record(topic=topic, key=b"acct-9", value=b"ledger-9",
                        idempotency_key=unique("tx"))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        msg = ei.value.details() or ""
        assert "not acknowledged" in msg, msg
        assert "its hint could not be stored" in msg, msg
        md = dict(ei.value.trailing_metadata() or ())
        assert [x.split(":")[0] for x in md["dr-written"].split(",")] == ["east", "west"]
        assert _metric(server, "crossdc_proxy_hint_errors_total", step="append") >= 1
        await _max_message_bytes(topo, ["east", "west"], None)
        done = (await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)).result
        assert done.status == pb.STATUS_OK
        assert [w.region for w in done.written] == ["east", "west"]
    finally:
        await _max_message_bytes(topo, ["east", "west"], None)
        await _north_up(server, stack)

    async def arrived() -> bool:
        got = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
        return any(x.key == b"acct-9" for x in got)
    await eventually(arrived, 60, "the record replayed into north")
    for r in topo.regions:
        got = await read_all(r.kafka.bootstrap, topic, 2)
        assert [x.key for x in got].count(b"acct-9") == 1, r.name


# -- order (issue 36, item 2) -------------------------------------------------------------------

def _by_key(records: list[Any], key: bytes) -> list[bytes]:
    """The values of `key`'s records, in the partition's order."""
    return [x.value for x in sorted(records, key=lambda x: (x.partition, x.offset))
            if x.key == key]


async def _quarantined(topo: Topology, region: str) -> list[Any]:
    return await read_all(topo.region(region).kafka.bootstrap, QUARANTINE_TOPIC, 1)


async def test_hints_with_nothing_newer_are_replayed_in_the_primarys_order(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, proxy) -> None:
    """Three records of one key while north is down, nothing written there since: the three
    hints are replayed, in the primary's order, none quarantined."""
    stack, _ = north
    server, stub = proxy
    topic = await _topic(topo)
    await _hint_topics_ready(topo)
    await _north_down(server, stack)
    try:
        for v in (b"v1", b"v2", b"v3"):
            r = (await stub.Produce(pb.ProduceRequest(record=pb.Record(
                topic=topic, key=b"acct-1", value=v)), timeout=15)).result
            assert r.status == pb.STATUS_OK
    finally:
        await _north_up(server, stack)

    async def replayed() -> bool:
        return await _pending(topo) == 0
    await eventually(replayed, 60, "the hints replayed (pending 0)")
    north_recs = await read_all(topo.region("north").kafka.bootstrap, topic, 2)
    assert _by_key(north_recs, b"acct-1") == [b"v1", b"v2", b"v3"]
    assert all(dict(x.headers)["dr-repaired"] == b"east" for x in north_recs)
    assert not [q for q in await _quarantined(topo, "north")
                if dict(q.headers).get("dr-q-topic") == topic.encode()]
    assert _metric(server, "crossdc_proxy_hints_quarantined_total", target="north") == 0


@pytest.mark.parametrize(("prefix", "acked"), [("hall", False), ("hone", True)],
                         ids=["told-failed", "quorum-1"])
async def test_a_hint_behind_a_newer_record_of_its_key_is_quarantined_not_replayed(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, policy_file: Path, prefix: str,
        acked: bool) -> None:
    """Record A of a key is written while north is down (told failed with quorum 3; with
    quorum 1 acknowledged): east's proxy stores its hint. That proxy stops before north is
    back; then a later record B of the same key is written into every region, north included,
    through west's proxy. When east's proxy replays A's hint, north's partition holds B, newer
    in the primary's order: A is quarantined in north (reason hint-late), not written after
    B. north's order per key is the primary's; so is every region's."""
    stack, _ = north
    topic = await _topic(topo, prefix)
    rec_a = pb.Record(topic=topic, key=b"acct-5", value=b"A", idempotency_key=unique("tx"))
    async with ProxyServer(topo, _cfg(), policy_file) as east, \
            grpc.aio.insecure_channel(f"127.0.0.1:{east.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        await _hint_topics_ready(topo)
        await _north_down(east, stack)
        if acked:
            r = (await stub.Produce(pb.ProduceRequest(record=rec_a), timeout=15)).result
            assert r.status == pb.STATUS_OK
            assert [w.region for w in r.written] == ["east", "west"]
        else:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Produce(pb.ProduceRequest(record=rec_a), timeout=15)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _metric(east, "crossdc_proxy_hints_written_total", target="north") == 1
    # east's proxy is gone, its hint for north stays in east's hints topic, unreplayed
    assert await _pending(topo) >= 1
    async with ProxyServer(topo, _cfg("west"), policy_file) as west, \
            grpc.aio.insecure_channel(f"127.0.0.1:{west.port}") as ch:
        await _north_up(west, stack)
        r = (await pb_grpc.ProxyStub(ch).Produce(pb.ProduceRequest(record=pb.Record(
            topic=topic, key=b"acct-5", value=b"B")), timeout=15)).result
        assert r.status == pb.STATUS_OK
        assert [w.region for w in r.written] == ["east", "west", "north"]
    async with ProxyServer(topo, _cfg(), policy_file) as east:
        async def replayed() -> bool:
            return await _pending(topo) == 0
        await eventually(replayed, 60, "A's hint done (pending 0)")
        got = {r.name: await read_all(r.kafka.bootstrap, topic, 2) for r in topo.regions}
        assert _by_key(got["east"], b"acct-5") == [b"A", b"B"]    # the primary's order
        assert _by_key(got["west"], b"acct-5") == [b"A", b"B"]
        assert _by_key(got["north"], b"acct-5") == [b"B"]         # never A after B
        assert _metric(east, "crossdc_proxy_hints_quarantined_total", target="north") == 1
        assert _metric(east, "crossdc_proxy_hints_replayed_total", target="north") == 0
    [a_east] = [x for x in got["east"] if x.value == b"A"]
    [q] = [x for x in await _quarantined(topo, "north")
           if dict(x.headers).get("dr-q-topic") == topic.encode()]
    hs = dict(q.headers)
    assert (q.key, q.value) == (b"acct-5", b"A")
    assert hs["dr-id"] == rec_a.idempotency_key.encode()
    assert (hs["dr-q-reason"], hs["dr-q-source"], hs["dr-q-partition"], hs["dr-q-offset"]) == \
        (b"hint-late", b"east", str(a_east.partition).encode(), str(a_east.offset).encode())


async def test_a_direct_write_racing_the_replay_never_lands_before_the_hint(  # type: ignore[no-untyped-def]
        two_regions, north, topo: Topology, policy_file: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race CI's partition drill found (7 told-failed records after later acknowledged
    ones of their keys): record A of a key is told failed while north is down, its hint
    stored in east. When east's proxy replays it, north's partition is read (nothing newer),
    and then, before the copy is written, a later record B of the key goes into every region
    through west's proxy. The copy lands after B; its transaction is aborted (no
    read_committed reader sees it) and the hint, judged again, is quarantined. north's order
    per key stays the primary's: B alone."""
    stack, _ = north
    topic = await _topic(topo, "hall")
    async with ProxyServer(topo, _cfg(), policy_file) as east, \
            grpc.aio.insecure_channel(f"127.0.0.1:{east.port}") as ch:
        await _hint_topics_ready(topo)
        await _north_down(east, stack)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await pb_grpc.ProxyStub(ch).Produce(pb.ProduceRequest(record=pb.Record(
                topic=topic, key=b"acct-7", value=b"A")), timeout=15)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    async with ProxyServer(topo, _cfg("west"), policy_file) as west, \
            grpc.aio.insecure_channel(f"127.0.0.1:{west.port}") as wch:
        await _north_up(west, stack)
        raced: list[str] = []
        tails = HintReplayer._tails

        async def read_then_race(self: HintReplayer, target: str, t: str,
                                 todo: list[Any]) -> Any:
            out = await tails(self, target, t, todo)
            if t == topic and not raced:  # once: B lands between the read and the copy
                r = (await pb_grpc.ProxyStub(wch).Produce(pb.ProduceRequest(
                    record=pb.Record(topic=topic, key=b"acct-7", value=b"B")),
                    timeout=15)).result
                assert [w.region for w in r.written] == ["east", "west", "north"]
                raced.append(r.status)
            return out
        monkeypatch.setattr(HintReplayer, "_tails", read_then_race)
        async with ProxyServer(topo, _cfg(), policy_file) as east:
            async def replayed() -> bool:
                return await _pending(topo) == 0
            await eventually(replayed, 60, "A's hint done (pending 0)")
            assert raced == [pb.STATUS_OK]
            assert _metric(east, "crossdc_proxy_hints_raced_total", target="north") == 1
            assert _metric(east, "crossdc_proxy_hints_quarantined_total", target="north") == 1
            assert _metric(east, "crossdc_proxy_hints_replayed_total", target="north") == 0
    bootstrap = topo.region("north").kafka.bootstrap
    committed = await read_all(bootstrap, topic, 2, isolation_level="read_committed")
    assert _by_key(committed, b"acct-7") == [b"B"]  # never A after B
    # the copy did land after B, in the aborted transaction: the race really happened
    assert _by_key(await read_all(bootstrap, topic, 2), b"acct-7") == [b"B", b"A"]
    assert [q.value for q in await _quarantined(topo, "north")
            if dict(q.headers).get("dr-q-topic") == topic.encode()] == [b"A"]
