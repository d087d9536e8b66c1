"""The divergent tail without a cluster: the mirror's epoch rule, the quarantine and replay
headers, the primary the worker follows, and the acked prefix after a failed quarantine
write."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.primary import PrimaryRecord
from crossdc.quarantine import quarantine_headers
from crossdc.topology import Flow
from dr.controller.tail import TailRecord, UnknownTailIds, _select, replay_headers
from mirror.primary import PrimaryWatch
from mirror.rules import epoch_rule, plan
from mirror.worker import MirrorWorker

pytestmark = pytest.mark.unit


def _h(mode: str | None = "ordered", epoch: str | None = "4") -> list[tuple[str, bytes]]:
    out = [("app", b"a"), ("dr-id", b"x"), ("dr-origin", b"east"), ("dr-path", b"east")]
    if mode is not None:
        out.append(("dr-mode", mode.encode()))
    if epoch is not None:
        out.append(("dr-epoch", epoch.encode()))
    return out


WEST_5 = PrimaryRecord(region="west", epoch=5)


@pytest.mark.parametrize(("headers", "primary", "want"), [
    (_h("ordered", "4"), WEST_5, "quarantine"),      # older epoch into the writable primary
    (_h("sync", "4"), WEST_5, "quarantine"),
    (_h("ordered", "5"), WEST_5, "carry"),           # the current epoch
    (_h("ordered", "6"), WEST_5, "carry"),
    (_h("nearest", "4"), WEST_5, "carry"),           # nearest records have no order to keep
    (_h(None, "4"), WEST_5, "carry"),
    (_h("ordered", None), WEST_5, "carry"),          # no epoch: cannot judge
    (_h("ordered", "four"), WEST_5, "carry"),
    ([("app", b"a")], WEST_5, "carry"),              # headerless
    (_h("ordered", "4"), None, "carry"),             # primary unknown
    (_h("ordered", "4"), PrimaryRecord(region="west", epoch=5, fenced=True), "carry"),  # drain
    (_h("ordered", "4"), PrimaryRecord(region="east", epoch=5), "carry"),  # not the primary
])
def test_epoch_rule(headers: list[tuple[str, bytes]], primary: PrimaryRecord | None,
                    want: str) -> None:
    assert epoch_rule(headers, target="west", primary=primary) == want


def test_the_rule_sees_what_plan_would_write() -> None:
    # A headerless record is stamped nearest by plan(): carried, whatever the epoch.
    planned = plan([("app", b"a")], source="east", target="west", timestamp_ms=1)
    assert planned is not None
    assert epoch_rule(planned, target="west", primary=WEST_5) == "carry"
    planned = plan(_h("ordered", "4"), source="east", target="west", timestamp_ms=1)
    assert planned is not None
    assert epoch_rule(planned, target="west", primary=WEST_5) == "quarantine"


def test_quarantine_headers_say_where_the_record_came_from() -> None:
    once = quarantine_headers(_h(), source="east", topic="t", partition=2, offset=17, epoch=5)
    twice = quarantine_headers(once, source="east", topic="t", partition=2, offset=17,
                               epoch=6)
    h = dict(twice)
    assert h["dr-q-source"] == b"east"
    assert h["dr-q-topic"] == b"t"
    assert h["dr-q-partition"] == b"2"
    assert h["dr-q-offset"] == b"17"
    assert h["dr-q-reason"] == b"epoch-superseded"
    assert h["dr-q-epoch"] == b"6"
    assert [k for k, _ in twice].count("dr-q-epoch") == 1  # replaced, not appended
    assert h["dr-id"] == b"x"
    assert h["app"] == b"a"


def _tail(headers: list[tuple[str, bytes]], dr_id: str = "x") -> TailRecord:
    return TailRecord(region="west", source="east", topic="t", partition=2, offset=17,
                      dr_id=dr_id, epoch=4, quarantine_epoch=5, reason="epoch-superseded",
                      quarantine_offset=0, key=b"k", value=b"v", headers=tuple(headers))


def test_replay_headers() -> None:
    planned = plan(_h("ordered", "4"), source="east", target="west", timestamp_ms=1)
    assert planned is not None
    rec = _tail(quarantine_headers(planned, source="east", topic="t", partition=2,
                                   offset=17, epoch=5))
    assert rec.held_by() == ["east"]
    out = replay_headers(rec, PrimaryRecord(region="west", epoch=7))
    h = dict(out)
    assert not [k for k, _ in out if k.startswith("dr-q-")]
    assert h["dr-epoch"] == b"7"
    assert h["dr-replayed-from"] == b"east:t:2:17"
    assert h["dr-path"] == b"east,west"
    assert (h["dr-id"], h["dr-origin"], h["dr-mode"], h["app"]) == (b"x", b"east",
                                                                      b"ordered", b"a")
    assert [k for k, _ in out].count("dr-epoch") == 1


def test_unknown_ids_are_bad_input() -> None:
    recs = [_tail(_h(), "a"), _tail(_h(), "b")]
    assert _select(recs, ["b"]) == [recs[1]]
    assert _select(recs, None) == recs
    with pytest.raises(UnknownTailIds, match="nope") as info:
        _select(recs, ["b", "nope"])
    assert info.value.exit_code == 2


def test_the_watch_keeps_the_newest_record() -> None:
    w = PrimaryWatch(["127.0.0.1:1", "127.0.0.1:2"])
    fenced = PrimaryRecord(region="east", epoch=5, fenced=True)
    w._seen("a", PrimaryRecord(region="east", epoch=4))
    w._seen("b", fenced)
    assert w.current == fenced
    w._seen("a", PrimaryRecord(region="east", epoch=4))  # a stale datacenter: ignored
    assert w.current == fenced
    w._seen("b", WEST_5)  # the promotion at the fenced epoch
    assert w.current == WEST_5
    w._seen("a", None)  # absent there: nothing changes
    w._failed("a", OSError("down"))
    assert w.current == WEST_5


def _done(offset: int | None = None, exc: BaseException | None = None) -> asyncio.Future[Any]:
    f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(SimpleNamespace(offset=offset))
    return f


async def test_a_failed_quarantine_write_ends_the_acked_prefix() -> None:
    """At-least-once, a batch of source offsets 0..5 where 3 is quarantined: the carried
    records were acked but the quarantine write failed. The retry must start at 3 (records
    4 and 5 sent again), or record 3 would be skipped as 'acked' and lost."""
    w = MirrorWorker(Flow(source="east", target="west", topics="t"),
                     KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:2"))
    tp = TopicPartition("t", 0)
    sent = {tp: [([0, 1, 2, 4], [1, 1, 1, 1], _done(100)), ([5], [1], _done(104))]}
    failed = _done(exc=OSError("quarantine write failed"))
    await w._settle(sent, {tp: [(3, failed)]})
    assert w._acked[tp] == [(0, 100), (1, 101), (2, 102)]
    assert w.metrics.redelivered.labels("east", "west", "t")._value.get() == 2


async def test_acked_quarantine_writes_keep_the_whole_prefix() -> None:
    w = MirrorWorker(Flow(source="east", target="west", topics="t"),
                     KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:2"))
    tp = TopicPartition("t", 0)
    sent = {tp: [([0, 1, 2, 4], [1, 1, 1, 1], _done(100))]}
    await w._settle(sent, {tp: [(3, _done(0))]})
    assert w._acked[tp] == [(0, 100), (1, 101), (2, 102), (4, 103)]


async def test_an_unreachable_consul_keeps_the_last_record() -> None:
    import socket

    from structlog.testing import capture_logs
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nobody listens on
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        w = PrimaryWatch([addr], retry_s=0.05)
        w.current = WEST_5
        with capture_logs() as logs:
            await w.refresh(timeout_s=2.0)
            stop = asyncio.Event()
            task = asyncio.create_task(w.run(stop))
            await asyncio.sleep(0)  # the follower tries, fails, pauses on `stop`
            stop.set()
            await asyncio.wait_for(task, 10)
        await w.close()
    finally:
        s.close()
    assert w.current == WEST_5
    assert [e["event"] for e in logs].count("primary_unreadable") == 1  # once per outage


async def test_the_view_is_fresh_only_while_the_target_datacenter_answered_lately() -> None:
    """Issue 36, item 6: a mirror carries a batch only on a view of the target datacenter's
    primary record at most `max_age_s` old; when the watch has not heard from it since, it
    reads it now, and a datacenter that does not answer makes the view stale (the batch
    waits) instead of leaving the last record in force."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nobody listens on: the target's Consul is cut off
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        w = PrimaryWatch([addr, "127.0.0.1:1"])
        assert w.confirmed_age_s() is None
        assert not await w.fresh(1.0, timeout_s=2.0)  # never answered
        w._seen(addr, WEST_5)  # the watch heard from it just now
        assert await w.fresh(1.0, timeout_s=2.0)
        w._seen("127.0.0.1:1", WEST_5)  # another datacenter's answer confirms nothing
        w._confirmed[addr] -= 5.0  # the last answer is 5 s old: read again, and fail
        assert not await w.fresh(1.0, timeout_s=2.0)
        assert w.current == WEST_5  # the record stands; the batch waits for a fresh one
        await w.close()
    finally:
        s.close()


@pytest.mark.parametrize(("source", "epoch", "want"), [
    ("east", "4", "quarantine"),  # the failback's fence leaves west: east's older tail is late
    ("east", "5", "carry"),       # not older than the fenced epoch
    ("west", "4", "carry"),       # the drain: the region being left, its tail goes on
    (None, "4", "carry"),         # source unknown: as before
])
def test_while_fenced_only_the_region_being_left_drains_its_older_epochs(
        source: str | None, epoch: str, want: str) -> None:
    fenced = PrimaryRecord(region="west", epoch=5, fenced=True)
    assert epoch_rule(_h("ordered", epoch), target="west", primary=fenced,
                      source=source) == want
    assert epoch_rule(_h("nearest", epoch), target="west", primary=fenced,
                      source=source) == "carry"
