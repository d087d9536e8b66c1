"""Hints keep the primary's order (issue 36, item 2): positions, `dr-src`, the verdict, and the
replayer's batch against a target partition's newest record (fakes for the writers and the
tail reader; the real thing: tests/integration/test_hints.py)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry
from test_proxy_units import TOPO, FakeWriter  # type: ignore[import-not-found]

from crossdc.headers import Position, parse_src, src_value, sync_position
from crossdc.quarantine import QUARANTINE_TOPIC
from proxy.config import HintSettings
from proxy.headers import stamp
from proxy.hints import NOTHING, Hint, HintReplayer, Tail, _Hold, _Item, verdict
from proxy.idempotency import IdempotencyWindow
from proxy.metrics import ProxyMetrics
from proxy.writers import Outgoing, RegionWrite


def _headers(epoch: int | None = 7, path: str = "east,west,north",
             src: bytes | None = None) -> list[tuple[str, bytes]]:
    hs = stamp([("app", b"1")], dr_id="id", origin="east", ts_ms=1, mode="sync", epoch=epoch,
               path=path.split(","))
    return [*hs, ("dr-src", src)] if src is not None else hs


def test_dr_src_round_trip() -> None:
    assert src_value("east", 42) == b"east:42"
    assert parse_src(b"east:42") == ("east", 42)
    assert parse_src(b"us-east:1:7") == ("us-east:1", 7)  # the offset is after the last ':'
    for bad in (None, b"", b"east", b":4", b"east:x", b"east:-1"):
        assert parse_src(bad) is None, bad


def test_the_position_of_each_kind_of_copy() -> None:
    # the primary's own copy: its epoch and its own offset
    assert sync_position("east", 11, _headers()) == Position(7, 11)
    # another region's copy: the primary's offset, whatever its own
    assert sync_position("north", 3, _headers(src=b"east:11")) == Position(7, 11)
    # none that can be trusted (newer than any hint, for the replay)
    assert sync_position("north", 3, _headers()) is None              # no dr-src (older proxy)
    assert sync_position("west", 3, _headers(path="east,west")) is None   # the mirror's copy
    assert sync_position("east", 3, _headers(epoch=None)) is None     # no dr-epoch
    assert sync_position("east", 3, []) is None                       # written straight
    assert sync_position("north", 3, _headers(src=b"north:3")) is None  # names itself
    assert sync_position("north", 3, _headers(src=b"bad")) is None
    assert sync_position("east", 3, [*_headers(), ("dr-replayed-from", b"east:t:0:1")]) is None
    # the order: epoch first, then the primary's offset
    assert Position(7, 900) < Position(8, 0) < Position(8, 1)


def test_a_hints_position_from_dr_src_or_from_what_it_wrote() -> None:
    h = Hint("north", "t", 0, b"k", b"v", _headers(src=b"east:11"),
             written=[RegionWrite("east", 0, 11), RegionWrite("west", 0, 4)])
    assert (h.source, h.position) == (("east", 11), Position(7, 11))
    old = Hint("north", "t", 0, b"k", b"v", _headers(),  # an older proxy: no dr-src
               written=[RegionWrite("east", 0, 12), RegionWrite("west", 0, 5)])
    assert (old.source, old.position) == (("east", 12), Position(7, 12))
    assert Hint("north", "t", 0, b"k", b"v", _headers(epoch=None),
                written=[RegionWrite("east", 0, 1)]).position is None
    assert Hint("north", "t", 0, b"k", b"v", _headers(), written=[]).position is None


@pytest.mark.parametrize(("hint", "top", "want"), [
    (Position(7, 5), NOTHING, "replay"),         # an empty partition
    (Position(7, 5), Position(7, 4), "replay"),  # nothing newer
    (Position(8, 0), Position(7, 9), "replay"),  # a newer epoch
    (Position(7, 5), Position(7, 5), "held"),    # the newest record is this one
    (Position(7, 5), Position(7, 6), "late"),    # a newer record of the same epoch
    (Position(7, 5), Position(8, 0), "late"),    # the target promoted at a newer epoch
    (Position(7, 5), None, "late"),              # newest without a position: newer than all
    (None, NOTHING, "replay"),
    (None, Position(1, 0), "late"),
])
def test_verdict(hint: Position | None, top: Position | None, want: str) -> None:
    assert verdict(hint, top) == want


# -- the replayer's batch ------------------------------------------------------------------

class FakeTail:
    """The target partitions' newest records, as `TailReader` reads them."""

    def __init__(self, tails: dict[int, Tail], between: Sequence[Any] = ()) -> None:
        self.tails = tails
        self.between = list(between)
        self.reads = 0

    async def tail(self, topic: str, partition: int) -> Tail:
        self.reads += 1
        return self.tails[partition]

    async def records(self, topic: str, partition: int, start: int, stop: int) -> list[Any]:
        return [r for r in self.between if start <= r.offset < stop]

    async def close(self) -> None:
        pass


class GapWriter(FakeWriter):
    """Gives the record topic's writes offsets from `next_offset`, skipping `gap` first."""

    def __init__(self, name: str, next_offset: int, gap: int = 0) -> None:
        super().__init__(name)
        self.next_offset = next_offset + gap

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
        if topic == QUARANTINE_TOPIC:
            done: list[Any] = await super().write(topic, items, mode=mode, deadline=deadline)
            return done
        out = []
        for it in items:
            self.sent.append((topic, it))
            out.append(RegionWrite(self.name, it.partition or 0, self.next_offset))
            self.next_offset += 1
        return out


class FakeTxn:
    """`ReplayTxn` over a writer: the copies are written, `check` decides; an aborted
    transaction's copies are remembered as aborted (a read_committed reader never sees them)."""

    def __init__(self, writer: GapWriter) -> None:
        self.writer = writer
        self.committed: list[bytes | None] = []
        self.aborted: list[bytes | None] = []

    async def write(self, topic: str, items: Sequence[Outgoing], check: Any,
                    timeout_s: float) -> list[RegionWrite] | None:
        landed = await self.writer.write(topic, items, mode="hint-replay", deadline=0.0)
        if await check(landed):
            self.committed += [it.value for it in items]
            return landed
        self.aborted += [it.value for it in items]
        return None

    async def close(self) -> None:
        pass


def _replayer(north: FakeWriter, tail: FakeTail) -> tuple[HintReplayer, ProxyMetrics]:
    metrics = ProxyMetrics(CollectorRegistry())
    ws: dict[str, Any] = {n: FakeWriter(n) for n in ("east", "west")}
    ws["north"] = north
    r = HintReplayer("east", TOPO, ws, IdempotencyWindow(60.0, 100), metrics, HintSettings(),
                     client_id="t")
    r._readers["north"] = tail  # type: ignore[assignment]
    r._readers["north/uncommitted"] = tail  # type: ignore[assignment]
    assert isinstance(north, GapWriter)
    r._txns["north"] = FakeTxn(north)  # type: ignore[assignment]
    return r, metrics


def _item(offset: int, primary_offset: int, epoch: int = 7, partition: int = 0,
          key: bytes = b"k") -> _Item:
    h = Hint("north", "t", partition, key, f"v{primary_offset}".encode(),
             _headers(epoch, src=src_value("east", primary_offset)),
             written=[RegionWrite("east", partition, primary_offset)])
    return _Item(offset, SimpleNamespace(), h)


def _count(m: ProxyMetrics, name: str) -> float:
    return m.registry.get_sample_value(name, {"target": "north"}) or 0.0


async def test_a_batch_is_replayed_in_the_primarys_order_and_late_hints_are_quarantined() -> None:
    """The partition's newest record is at (7, 5): of hints at 8, 3, 6, 5 (hint order), 6
    then 8 are written (sorted), 3 is quarantined in north, 5 is there already. One read of
    the partition for the whole batch; every hint done (committed)."""
    north = GapWriter("north", next_offset=20)
    tail = FakeTail({0: Tail(20, Position(7, 5), 19)})
    r, m = _replayer(north, tail)
    items = [_item(100, 8), _item(101, 3), _item(102, 6), _item(103, 5)]
    done_to = await r._write(TopicPartition("_crossdc.proxy.hints.north", 0), "north", north,
                             "t", items)
    assert done_to == 104
    assert tail.reads == 1
    written = [o.value for t, o in north.sent if t == "t"]
    assert written == [b"v6", b"v8"]
    (q,) = [o for t, o in north.sent if t == QUARANTINE_TOPIC]
    hs = dict(q.headers)
    assert q.value == b"v3"
    assert (hs["dr-q-reason"], hs["dr-q-source"], hs["dr-q-topic"], hs["dr-q-partition"],
            hs["dr-q-offset"]) == (b"hint-late", b"east", b"t", b"0", b"3")
    assert hs["dr-src"] == b"east:3"  # the record's own headers kept
    assert "dr-repaired" not in hs    # not a copy in the topic
    assert [it.action for it in items] == ["replay", "late", "replay", "held"]
    assert _count(m, "crossdc_proxy_hints_quarantined_total") == 1
    assert _count(m, "crossdc_proxy_hints_replayed_total") == 2
    assert _count(m, "crossdc_proxy_hints_skipped_total") == 1
    assert _count(m, "crossdc_proxy_hints_raced_total") == 0


async def test_a_newer_epoch_or_an_unpositioned_record_makes_every_hint_late() -> None:
    for top in (Position(8, 0), None):
        north = GapWriter("north", next_offset=3)
        r, m = _replayer(north, FakeTail({0: Tail(3, top, 2), 1: Tail(0, NOTHING)}))
        items = [_item(0, 10), _item(1, 11), _item(2, 12, partition=1)]
        await r._write(TopicPartition("_crossdc.proxy.hints.north", 0), "north", north, "t",
                       items)
        assert [o.value for t, o in north.sent if t == "t"] == [b"v12"], top  # empty: in
        assert len([o for t, o in north.sent if t == QUARANTINE_TOPIC]) == 2, top
        assert _count(m, "crossdc_proxy_hints_quarantined_total") == 2


async def test_a_direct_write_between_the_check_and_the_replay_aborts_it() -> None:
    """The replayed copy landed at 21, not at 20 (the end read): the record at 20 is read; a
    newer one there (7, 9) means the copy (7, 6) is out of order: counted, its transaction
    aborted (never seen by a read_committed reader) and the hint held for a new verdict at
    once (short), not committed. An older one there is not a race: committed."""
    for between, raced in (((7, 9), 1), ((7, 2), 0)):
        rec = SimpleNamespace(offset=20, headers=_headers(between[0],
                                                          src=src_value("east", between[1])))
        north = GapWriter("north", next_offset=20, gap=1)
        r, m = _replayer(north, FakeTail({0: Tail(20, Position(7, 5), 19)}, [rec]))
        txn = r._txns["north"]
        assert isinstance(txn, FakeTxn)
        tp = TopicPartition("_crossdc.proxy.hints.north", 0)
        if raced:
            with pytest.raises(_Hold) as held:
                await r._write(tp, "north", north, "t", [_item(0, 6)])
            assert held.value.short
            assert held.value.offset == 0  # not done: read again, judged again
            assert (txn.committed, txn.aborted) == ([], [b"v6"])
            assert _count(m, "crossdc_proxy_hints_replayed_total") == 0
        else:
            assert await r._write(tp, "north", north, "t", [_item(0, 6)]) == 1
            assert (txn.committed, txn.aborted) == ([b"v6"], [])
        assert _count(m, "crossdc_proxy_hints_raced_total") == raced, between


async def test_after_an_aborted_replay_the_hint_is_judged_late_and_quarantined() -> None:
    """The retry of the raced run reads the partition again: its newest record is now the
    direct write (7, 9), so the hint (7, 6) is late: quarantined, committed, never in the
    topic after the newer record."""
    north = GapWriter("north", next_offset=22)
    r, m = _replayer(north, FakeTail({0: Tail(22, Position(7, 9), 20)}))
    done_to = await r._write(TopicPartition("_crossdc.proxy.hints.north", 0), "north", north,
                             "t", [_item(0, 6)])
    assert done_to == 1
    assert [o.value for t, o in north.sent if t == "t"] == []
    assert [o.value for t, o in north.sent if t == QUARANTINE_TOPIC] == [b"v6"]
    assert _count(m, "crossdc_proxy_hints_quarantined_total") == 1


async def test_an_unreadable_race_window_aborts_too() -> None:
    """The records between cannot be read in time: the copies are not committed unchecked."""
    class Unreadable(FakeTail):
        async def records(self, topic: str, partition: int, start: int,
                          stop: int) -> list[Any]:
            raise TimeoutError
    north = GapWriter("north", next_offset=20, gap=1)
    r, _ = _replayer(north, Unreadable({0: Tail(20, Position(7, 5), 19)}))
    with pytest.raises(_Hold):
        await r._write(TopicPartition("_crossdc.proxy.hints.north", 0), "north", north, "t",
                       [_item(0, 6)])
    txn = r._txns["north"]
    assert isinstance(txn, FakeTxn)
    assert txn.aborted == [b"v6"]


async def test_the_replay_tells_the_targets_breaker_how_its_transaction_ended() -> None:
    """CI's demo: the replay took north's half-open probe and, writing through its own
    transaction, never reported back, so the breaker stayed half-open and refused the direct
    sync writes for 69 s. Committed (or aborted: north answered) closes it; a transaction
    that fails opens it again."""
    from proxy.breaker import BreakerState
    from proxy.errors import RegionWriteFailed

    def half_open(w: FakeWriter) -> None:
        for _ in range(w.breaker.failure_threshold):
            w.breaker.record_failure()
        w.breaker._clock.t += w.breaker.reset_timeout_s + 1
        assert w.breaker.state is BreakerState.HALF_OPEN

    tp = TopicPartition("_crossdc.proxy.hints.north", 0)
    north = GapWriter("north", next_offset=20)
    r, _ = _replayer(north, FakeTail({0: Tail(20, Position(7, 5), 19)}))
    half_open(north)
    assert await r._write(tp, "north", north, "t", [_item(0, 6)]) == 1
    assert north.breaker.state is BreakerState.CLOSED
    assert north.breaker.allow()  # a direct write goes through

    # the hint is there already (held): nothing written, north answered the read: closed
    north = GapWriter("north", next_offset=20)
    r, _ = _replayer(north, FakeTail({0: Tail(20, Position(7, 5), 19)}))
    half_open(north)
    assert await r._write(tp, "north", north, "t", [_item(0, 5)]) == 1
    assert not north.sent
    assert north.breaker.state is BreakerState.CLOSED

    class Failing(FakeTxn):
        async def write(self, topic: str, items: Sequence[Outgoing], check: Any,
                        timeout_s: float) -> list[RegionWrite] | None:
            raise RegionWriteFailed("north", topic, "replay transaction: timed out")
    north = GapWriter("north", next_offset=20)
    r, _ = _replayer(north, FakeTail({0: Tail(20, Position(7, 5), 19)}))
    r._txns["north"] = Failing(north)  # type: ignore[assignment]
    half_open(north)
    with pytest.raises(_Hold):
        await r._write(tp, "north", north, "t", [_item(0, 6)])
    assert north.breaker.state is BreakerState.OPEN
