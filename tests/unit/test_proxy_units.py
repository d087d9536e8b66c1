"""Pure logic of the proxy: breaker, headers, idempotency window, partitioner, router (with
fake region writers), the primary lease's logic (no Consul: its rounds fed by hand), error
table, generated code freshness."""

from __future__ import annotations

import asyncio
import gc
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from crossdc.headers import sync_position
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from crossdc_client.build_protos import is_fresh
from proxy.breaker import BreakerState, CircuitBreaker
from proxy.errors import (
    STATUS_TABLE,
    IncompleteSync,
    InvalidHeader,
    MissingKey,
    NoWritableRegion,
    PartitionMismatch,
    ProxyError,
    RecordTooLarge,
    RegionWriteFailed,
    ReservedHeader,
    UnknownTopic,
    code_name,
)
from proxy.headers import check_client_headers, stamp, uuid7
from proxy.hints import NOTHING, Tail
from proxy.idempotency import IdempotencyWindow
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.primary import WriteGrant
from proxy.router import Incoming, Outcome, Router
from proxy.writers import Outgoing, RegionWrite, partition_for

# -- partitioner: Kafka's Utils.murmur2 test vectors (UtilsTest.testMurmur2) ---------------


@pytest.mark.parametrize(("key", "java"), [(b"21", -973932308), (b"foobar", -790332482),
                                           (b"a-little-bit-long-string", -985981536),
                                           (b"abc", 479470107)])
def test_partition_for_matches_kafkas_default_partitioner(key: bytes, java: int) -> None:
    for n in (1, 3, 7, 12):
        assert partition_for(key, n) == (java & 0x7FFFFFFF) % n


# -- breaker ------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_then_half_open_probe_closes_or_reopens() -> None:
    clock = Clock()
    seen: list[BreakerState] = []
    b = CircuitBreaker("east", failure_threshold=3, reset_timeout_s=2.0, clock=clock,
                       on_change=lambda _r, s: seen.append(s))
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert not b.allow()
    assert not b.available()
    clock.t = 2.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()            # the one probe
    assert not b.allow()        # nobody else while it is out
    b.record_failure()          # probe failed: open again for another reset timeout
    assert b.state is BreakerState.OPEN
    clock.t = 3.9
    assert not b.available()
    clock.t = 4.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert b.allow()
    assert b.allow()
    assert seen == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN,
                    BreakerState.HALF_OPEN, BreakerState.CLOSED]


def test_breaker_success_resets_the_failure_count() -> None:
    b = CircuitBreaker("east", failure_threshold=2, clock=Clock())
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state is BreakerState.CLOSED


# -- headers ------------------------------------------------------------------------------

def test_uuid7_layout_and_order() -> None:
    a = uuid7(1_700_000_000_000)
    b = uuid7(1_700_000_000_001)
    assert a.version == 7
    assert a.variant == uuid.RFC_4122
    assert a.int >> 80 == 1_700_000_000_000
    assert str(a) < str(b)
    assert len({uuid7(5) for _ in range(100)}) == 100


def test_reserved_headers_refused_and_stamping() -> None:
    check_client_headers("t", [("app", b"1"), ("drx", b"ok")])
    with pytest.raises(ReservedHeader, match="'DR-id' is reserved"):
        check_client_headers("t", [("DR-id", b"x")])
    h = dict(stamp([("app", b"1")], dr_id="id1", origin="east", ts_ms=5, mode="sync", epoch=3,
                   path=["east", "west"]))
    assert h == {"app": b"1", "dr-id": b"id1", "dr-origin": b"east", "dr-ts": b"5",
                 "dr-mode": b"sync", "dr-epoch": b"3", "dr-path": b"east,west"}
    assert "dr-epoch" not in dict(stamp([], dr_id="i", origin="east", ts_ms=1, mode="nearest",
                                        epoch=None, path=["east"]))


# -- idempotency window -------------------------------------------------------------------

async def test_idempotency_window_first_result_and_waiting_duplicates() -> None:
    clock = Clock()
    w = IdempotencyWindow(window_s=10, max_keys=100, clock=clock)
    first = await w.claim("t", "k")
    assert first.owner
    waiter = asyncio.create_task(w.claim("t", "k"))
    await asyncio.sleep(0)
    assert not waiter.done()          # a concurrent duplicate waits for the first
    w.finish(first, "R1")
    dup = await waiter
    assert not dup.owner
    assert dup.result == "R1"
    assert (await w.claim("t", "k")).result == "R1"
    assert (await w.claim("other", "k")).owner   # keys are per topic
    clock.t = 11
    assert (await w.claim("t", "k")).owner       # the window passed: write again


async def test_idempotency_failed_attempt_is_forgotten_partial_is_resumed() -> None:
    w = IdempotencyWindow(window_s=10, max_keys=100, clock=Clock())
    s = await w.claim("t", "a")
    waiter = asyncio.create_task(w.claim("t", "a"))
    await asyncio.sleep(0)
    w.fail(s)
    again = await waiter
    assert again.owner
    assert again.partial is None
    w.fail(again, partial=["east-write"])
    third = await w.claim("t", "a")
    assert third.owner
    assert third.partial == ["east-write"]


async def test_idempotency_partial_writes_expire_with_the_window() -> None:
    clock = Clock()
    w = IdempotencyWindow(window_s=10, max_keys=100, clock=clock)
    w.fail(await w.claim("t", "old"), partial=["east-write"])
    clock.t = 6
    w.fail(await w.claim("t", "young"), partial=["west-write"])
    clock.t = 10
    kept = await w.claim("t", "old")              # exactly window_s old: still kept
    assert kept.partial == ["east-write"]
    w.fail(kept, partial=["east-write"])          # failed again at t=10: its age restarts
    clock.t = 16.5
    gone = await w.claim("t", "young")            # 10.5 s after its failure: forgotten
    assert gone.owner
    assert gone.partial is None
    w.fail(gone)
    assert (await w.claim("t", "old")).partial == ["east-write"]  # 6.5 s after its refresh


async def test_idempotency_partial_writes_capped_by_count() -> None:
    w = IdempotencyWindow(window_s=10, max_keys=2, clock=Clock())
    for k in ("a", "b", "c"):
        w.fail(await w.claim("t", k), partial=[k])
    assert (await w.claim("t", "a")).partial is None   # oldest forgotten beyond max_keys
    assert (await w.claim("t", "c")).partial == ["c"]


async def test_idempotency_claim_nowait_and_results_kept_out_of_the_collectors_way() -> None:
    w = IdempotencyWindow(window_s=10, max_keys=100, clock=Clock())
    first = w.claim_nowait("t", "k")
    assert first is not None
    assert first.owner
    assert w.claim_nowait("t", "k") is None        # being written: the caller must wait
    out = Outcome("k", "ordered", 3, [RegionWrite("east", 1, 42)])
    w.finish(first, out.remembered())
    gc.collect()
    gc.collect()  # the collector untracks one level of all-atomic tuples per pass
    assert not gc.is_tracked(w._done[("t", "k")])  # plain tuples: the collector skips them
    again = w.claim_nowait("t", "k")
    assert again is not None
    assert not again.owner
    dup = Outcome.duplicate_of(again.result)
    assert (dup.dr_id, dup.mode, dup.epoch, dup.duplicate) == ("k", "ordered", 3, True)
    assert dup.written == [RegionWrite("east", 1, 42)]


# -- router with fake writers -------------------------------------------------------------

class FakeWriter:
    def __init__(self, name: str, partitions: int | None = 4, up: bool = True) -> None:
        self.name = name
        self.partitions = partitions
        self.up = up
        self.breaker = CircuitBreaker(name, clock=Clock())
        self.sent: list[tuple[str, Outgoing]] = []
        self.offset = 0

    @property
    def writable(self) -> bool:
        return self.up

    def why_not_writable(self) -> str:
        return "" if self.up else "down"

    def known_partition_count(self, topic: str) -> int | None:
        return self.partitions

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        return self.partitions

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
        out: list[Any] = []
        for it in items:
            if not self.up:
                out.append(RegionWriteFailed(self.name, topic, "connection refused"))
                continue
            self.sent.append((topic, it))
            part = it.partition if it.partition is not None else 0
            out.append(RegionWrite(self.name, part, self.offset))
            self.offset += 1
        return out


TOPO = Topology.model_validate({
    "regions": [{"name": n, "kafka": {"bootstrap_servers": [f"127.0.0.1:{p}"]},
                 "consul": {"http_addr": f"127.0.0.1:{p + 1}", "datacenter": n,
                            "dns_addr": f"127.0.0.1:{p + 2}"},
                 "proxy": {"endpoint": f"127.0.0.1:{p + 3}"}}
                for n, p in (("east", 1000), ("west", 2000), ("north", 3000))],
    "preference": ["east", "west", "north"], "primary": "east"})

POLICY = Policy.model_validate({"rules": [
    {"topic": "ord", "mode": "ordered", "max_record_bytes": 50},
    {"topic": "sync", "mode": "ordered", "sync": True},
    {"topic": "q", "mode": "ordered", "sync": True, "quorum": 2},
    {"topic": "near", "mode": "nearest"},
    {"topic": "pref", "mode": "nearest", "prefer": ["north", "west"]}], "strict": True})


async def _fake_tail(w: FakeWriter, topic: str, partition: int) -> Tail:
    """The newest record a fake writer took for (topic, partition), as `read_tail` reads it."""
    mine = [(i, o) for i, (t, o) in enumerate(w.sent) if t == topic and o.partition == partition]
    if not mine:
        return Tail(0, NOTHING)
    i, last = mine[-1]
    return Tail(i + 1, sync_position(w.name, i, last.headers), i)


def _router(writers: dict[str, FakeWriter], own: str = "west",
            primary: str = "east") -> Router:
    grant = WriteGrant(PrimaryRecord(region=primary, epoch=7), math.inf, 2.0)
    return Router(own, TOPO, writers, lambda: grant,  # type: ignore[arg-type]
                  lambda: POLICY, IdempotencyWindow(60, 1000), ProxyMetrics(),
                  tail=_fake_tail)  # type: ignore[arg-type]


def _writers(**down: bool) -> dict[str, FakeWriter]:
    return {n: FakeWriter(n, up=not down.get(n, False)) for n in ("east", "west", "north")}


def _deadline() -> float:
    return time.monotonic() + 5


async def test_router_validation_errors() -> None:
    r = _router(_writers())
    outs = await r.route([Incoming("ord", None, b"v"), Incoming("ord", b"k", b"x" * 60),
                          Incoming("ord", b"k", b"v", (("dr-ts", b"1"),)),
                          Incoming("nope", b"k", b"v"), Incoming("near", None, b"v")],
                         _deadline())
    assert isinstance(outs[0].error, MissingKey)
    assert isinstance(outs[1].error, RecordTooLarge)
    assert isinstance(outs[2].error, ReservedHeader)
    assert isinstance(outs[3].error, UnknownTopic)
    assert outs[4].error is None
    assert outs[4].written[0].region == "west"


@pytest.mark.parametrize(("name", "why"), [
    ("", "it is empty"), ("trace\nid", "control or unprintable"),
    ("a\x00b", "control or unprintable"), ("h" * 1025, "1025 characters, at most 1024")])
async def test_a_header_name_that_is_no_header_name_is_refused(name: str, why: str) -> None:
    r = _router(_writers())
    outs = await r.route([Incoming("near", b"k", b"v", ((name, b"x"),)),
                          Incoming("near", b"k", b"v", (("trace id ü", b"x"),))], _deadline())
    assert isinstance(outs[0].error, InvalidHeader)
    assert why in str(outs[0].error)
    assert code_name(outs[0].error) == "INVALID_ARGUMENT"
    assert outs[1].error is None  # spaces and letters of any script are fine


async def test_an_empty_key_is_refused_like_a_missing_one() -> None:
    r = _router(_writers())
    outs = await r.route([Incoming("ord", b"", b"v"), Incoming("near", b"", b"v")], _deadline())
    assert isinstance(outs[0].error, MissingKey)
    assert "this record's key is empty" in str(outs[0].error)
    assert outs[1].error is None  # a mode that needs no key takes it


async def test_router_ordered_goes_to_primary_with_epoch_and_key_partition() -> None:
    ws = _writers()
    outs = await _router(ws).route([Incoming("ord", b"abc", b"v")], _deadline())
    assert [w.region for w in outs[0].written] == ["east"]
    assert outs[0].epoch == 7
    (_, sent), = ws["east"].sent
    assert sent.partition == partition_for(b"abc", 4)
    h = dict(sent.headers)
    assert h["dr-origin"] == b"east"
    assert h["dr-epoch"] == b"7"
    assert h["dr-mode"] == b"ordered"
    outs = await _router(_writers(east=True)).route([Incoming("ord", b"k", b"v")], _deadline())
    assert isinstance(outs[0].error, NoWritableRegion)
    assert "east: down" in str(outs[0].error)


async def test_router_partition_mismatch_refuses_ordered() -> None:
    ws = _writers()
    ws["north"].partitions = 5
    outs = await _router(ws).route([Incoming("sync", b"k", b"v")], _deadline())
    assert isinstance(outs[0].error, PartitionMismatch)
    assert "east=4, north=5, west=4" in str(outs[0].error)
    assert not ws["east"].sent


async def test_router_sync_same_partition_partial_not_acked_then_resumed() -> None:
    ws = _writers(north=True)
    r = _router(ws)
    rec = Incoming("sync", b"acct-1", b"v", idempotency_key="tx-9")
    out, = await r.route([rec], _deadline())
    assert out.status == "partial"
    assert isinstance(out.error, IncompleteSync)
    assert [w.region for w in out.written] == ["east", "west"]
    assert "not written to north: down" in str(out.error)
    parts = {w.partition for w in out.written}
    assert parts == {partition_for(b"acct-1", 4)}
    ws["north"].up = True
    again, = await r.route([rec], _deadline())    # same key: only north is written now
    assert again.status == "ok"
    assert [w.region for w in again.written] == ["east", "west", "north"]
    assert [len(ws[n].sent) for n in ("east", "west", "north")] == [1, 1, 1]
    assert dict(ws["north"].sent[0][1].headers)["dr-path"] == b"east,west,north"


async def test_router_sync_quorum_acks_with_one_region_down() -> None:
    out, = await _router(_writers(north=True)).route([Incoming("q", b"k", b"v")], _deadline())
    assert out.status == "ok"
    assert [w.region for w in out.written] == ["east", "west"]


async def test_router_nearest_fails_over_in_preference_order() -> None:
    out, = await _router(_writers(west=True)).route([Incoming("near", b"k", b"v")],
                                                     _deadline())
    assert [w.region for w in out.written] == ["east"]
    out, = await _router(_writers(north=True)).route([Incoming("pref", b"k", b"v")],
                                                      _deadline())
    assert [w.region for w in out.written] == ["west"]
    out, = await _router(_writers(east=True, west=True, north=True)).route(
        [Incoming("near", b"k", b"v")], _deadline())
    assert isinstance(out.error, NoWritableRegion)
    assert list(out.error.tried) == ["west", "east", "north"]


async def test_router_duplicate_key_in_one_batch_is_written_once() -> None:
    ws = _writers()
    outs = await _router(ws).route([Incoming("ord", b"k", b"v", idempotency_key="x"),
                                    Incoming("ord", b"k", b"v", idempotency_key="x")],
                                   _deadline())
    assert outs[0].dr_id == outs[1].dr_id == "x"
    assert outs[1].duplicate
    assert len(ws["east"].sent) == 1


async def test_two_calls_sharing_keys_never_wait_for_each_other_in_a_cycle() -> None:
    # X = [B, C, A] while another request writes C; then Y = [A, B]. Claiming key by key,
    # X held B and waited for C; Y took A and waited for B; C done, X waited for A: each
    # waited for the other until the deadline. A call claims all its free keys first.
    ws = _writers()
    r = _router(ws)
    other = r.window.claim_nowait("ord", "C")  # a write of C elsewhere, in flight
    assert other is not None
    assert other.owner

    def recs(*keys: str) -> list[Incoming]:
        return [Incoming("ord", b"k", b"v", idempotency_key=k) for k in keys]

    deadline = time.monotonic() + 3
    x = asyncio.create_task(r.route(recs("B", "C", "A"), deadline))
    await asyncio.sleep(0)
    y = asyncio.create_task(r.route(recs("A", "B"), deadline))
    await asyncio.sleep(0)
    r.window.finish(other, Outcome("C", "ordered", 7, [RegionWrite("east", 0, 99)]).remembered())
    async with asyncio.timeout(1.5):  # well before the calls' deadline
        xs, ys = await asyncio.gather(x, y)
    assert [o.error for o in xs + ys] == [None] * 5
    assert [o.duplicate for o in xs] == [False, True, False]
    assert [o.duplicate for o in ys] == [True, True]  # X wrote A and B
    assert len(ws["east"].sent) == 2


async def test_a_key_freed_by_a_failed_write_does_not_make_two_waiting_calls_a_cycle() -> None:
    # X = [K, A] holds A and waits for K (another request writes it). That write fails, and
    # before X wakes, Z = [K, A] takes the freed K and must wait for A (X's). Holding K while
    # waiting for a smaller key, Z made X wait for K in turn: both waited out the deadline.
    # Keys are taken in one order by a call that waits: Z gives K back and waits for A.
    ws = _writers()
    r = _router(ws)
    other = r.window.claim_nowait("ord", "K")
    assert other is not None

    def recs(*keys: str) -> list[Incoming]:
        return [Incoming("ord", b"k", b"v", idempotency_key=k) for k in keys]

    deadline = time.monotonic() + 3
    x = asyncio.create_task(r.route(recs("K", "A"), deadline))
    await asyncio.sleep(0)  # X holds A, waits for K
    z = asyncio.create_task(r.route(recs("K", "A"), deadline))  # runs before X wakes
    r.window.fail(other)
    async with asyncio.timeout(1.5):  # well before the calls' deadline
        xs, zs = await asyncio.gather(x, z)
    assert [o.error for o in xs + zs] == [None] * 4
    assert sorted(o.duplicate for o in xs + zs) == [False, False, True, True]
    assert len(ws["east"].sent) == 2  # K and A written once each


async def test_a_call_cancelled_while_it_waits_releases_every_key_it_claimed() -> None:
    # [C, A] with C in flight elsewhere: A is claimed at once, then the call waits for C.
    # Cancelled there (the client went away, the proxy stops), A must not stay claimed: a
    # later write of A would wait for a write that never ends.
    r = _router(_writers())
    other = r.window.claim_nowait("ord", "C")
    assert other is not None
    call = asyncio.create_task(r.route(
        [Incoming("ord", b"k", b"v", idempotency_key=k) for k in ("C", "A")],
        time.monotonic() + 5))
    await asyncio.sleep(0)
    assert r.window.claim_nowait("ord", "A") is None  # claimed by the waiting call
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    again = r.window.claim_nowait("ord", "A")
    assert again is not None
    assert again.owner


def test_finishing_while_more_keys_are_in_flight_than_the_window_keeps() -> None:
    w = IdempotencyWindow(60, max_keys=2)
    slots = w.claim_all_nowait([("t", k) for k in "abcd"])  # 4 in flight, 2 kept at most
    first = slots[0]
    assert first is not None
    w.finish(first, ("a",))  # no more finished keys to drop than there are
    assert len(w) <= 4


# -- errors and generated code ------------------------------------------------------------

def test_error_table_codes() -> None:
    assert code_name(MissingKey("t", "ordered")) == "INVALID_ARGUMENT"
    assert code_name(UnknownTopic("t", "x")) == "NOT_FOUND"
    assert code_name(PartitionMismatch("t", {"a": 1, "b": 2})) == "FAILED_PRECONDITION"
    assert code_name(NoWritableRegion("t", "ordered", {"a": "down"})) == "UNAVAILABLE"
    assert code_name(ProxyError("x")) == "INTERNAL"
    assert all(issubclass(c, ProxyError) for c in STATUS_TABLE)


def test_generated_code_is_fresh() -> None:
    import proxy.api  # noqa: F401  (builds it when missing or stale)
    assert is_fresh()


# -- nearest stays local (issue 12) ---------------------------------------------------------

def _rule(prefer: list[str] | None) -> Any:
    policy = Policy.model_validate({"rules": [{"topic": "t", "mode": "nearest",
                                               "prefer": prefer}]})
    return policy.rules[0]


@pytest.mark.parametrize(("own", "prefer", "order"), [
    ("east", None, ["east", "west", "north"]),
    ("west", None, ["west", "east", "north"]),
    # prefer without `local` orders the OTHER regions: the own region stays first
    ("west", ["east", "west"], ["west", "east"]),
    ("east", ["east", "west"], ["east", "west"]),
    ("north", ["west"], ["north", "west"]),
    # `local` places the own region explicitly
    ("east", ["west", "local"], ["west", "east"]),
    ("west", ["west", "local"], ["west"]),
    ("north", ["west", "local", "east"], ["west", "north", "east"]),
    ("east", ["local", "north"], ["east", "north"]),
])
def test_nearest_order_keeps_the_own_region_first_unless_local_places_it(
        own: str, prefer: list[str] | None, order: list[str]) -> None:
    assert _router(_writers(), own=own).nearest_order(_rule(prefer)) == order


def test_shipped_policies_never_send_every_proxy_to_one_region() -> None:
    from pathlib import Path

    from proxy.policy import load_policy
    policies = Path(__file__).parents[2] / "policies"
    for name in ("default.yaml", "clickstream.yaml"):
        policy = load_policy(policies / name)
        rule = policy.rule_for("clickstream.web")
        assert rule is not None
        for own in ("east", "west"):
            assert _router(_writers(), own=own).nearest_order(rule)[0] == own, (name, own)


async def test_nearest_on_local_loss_goes_to_the_next_in_prefer_order() -> None:
    out, = await _router(_writers(north=True), own="north").route(
        [Incoming("pref", b"k", b"v")], _deadline())  # prefer [north, west]: own north first
    assert [w.region for w in out.written] == ["west"]
    out, = await _router(_writers(), own="east").route([Incoming("pref", b"k", b"v")],
                                                       _deadline())
    assert [w.region for w in out.written] == ["east"]  # before: north for every proxy


# -- the primary lease and the fenced record (issues 12, 21) -------------------------------

def _watcher(clock: Clock, **kw: Any) -> Any:
    """A watcher whose rounds are not run: its lease logic fed by `confirm` and `offer`."""
    from proxy.primary import PrimaryWatcher
    return PrimaryWatcher(None, PrimaryRecord(region="east", epoch=0, by="topology"),  # type: ignore[arg-type]
                          ProxyMetrics(), regions=["east", "west", "north"], clock=clock, **kw)


def test_lease_refuses_until_confirmed_and_after_it_runs_out() -> None:
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock)
    gauge = w._metrics.registry.get_sample_value
    with pytest.raises(PrimaryUnavailable) as ei:  # never confirmed: no primary at all
        w.writable()
    assert ei.value.reason == "unconfirmed"
    assert "primary not confirmed since start" in str(ei.value)
    assert code_name(ei.value) == "UNAVAILABLE"
    assert gauge("crossdc_proxy_primary_lease_valid") == 0
    w.confirm(10.0, PrimaryRecord(region="east", epoch=0, by="ctl"))
    clock.t = 14.9
    assert w.writable().region == "east"
    assert w.current.by == "ctl"          # the confirmed copy replaces the topology's
    assert gauge("crossdc_proxy_primary_lease_valid") == 1
    clock.t = 16.1
    with pytest.raises(PrimaryUnavailable) as ei:
        w.writable()
    assert ei.value.reason == "lease_expired"
    assert str(ei.value).startswith("primary not confirmed for 6.1 s (lease 5 s): ")
    assert str(ei.value).endswith("ordered and sync writes refused so two regions never "
                                  "take them")
    assert gauge("crossdc_proxy_primary_lease_valid") == 0
    w.confirm(9.0, w.current)  # an older round confirms nothing newer
    assert not w.lease_valid
    w.confirm(16.0, w.current)
    assert w.writable().region == "east"


def test_tally_needs_the_same_record_in_a_majority_and_no_same_epoch_conflict() -> None:
    from proxy.primary import tally
    e7 = PrimaryRecord(region="east", epoch=7, by="a")
    e7b = PrimaryRecord(region="east", epoch=7, by="b", updated_ms=5)  # same record
    w7 = PrimaryRecord(region="west", epoch=7)
    f8 = e7.fence("ctl")
    t = tally({"east": e7, "west": e7b}, 2)
    assert (t.confirmed, t.agreeing, t.votes) == (e7, 2, 2)
    assert tally({"east": e7}, 2).confirmed is None             # 1 of 2: no majority
    assert tally({"east": e7, "west": f8}, 2).confirmed is None  # two records: no majority
    t = tally({"east": e7, "west": f8, "witness": f8}, 2)
    assert t.confirmed == f8
    assert t.agreeing == 2
    t = tally({"east": e7, "west": w7, "witness": w7}, 2)       # same epoch, two writable
    assert t.confirmed is None
    assert t.conflict == ("east", "west")
    # the promotion at the fence's epoch is no conflict (one of them is fenced)
    p8 = f8.promote("west", "ctl")
    assert tally({"east": f8, "west": p8, "witness": p8}, 2).confirmed == p8
    assert tally({}, 1).confirmed is None


def test_a_forced_record_is_no_vote_and_never_replaces_the_record_held() -> None:
    """Issue 36, defect 1: a forced failover on the minority wrote west@1 (forced) in west's
    datacenter; the majority kept east@0. The proxies keep confirming east@0 and never take
    west@1 as theirs (before: the newest epoch seen anywhere was `current`, unconfirmed, so
    every ordered write was refused at the heal until the leader copied west@1 everywhere)."""
    from proxy.primary import tally
    east0 = PrimaryRecord(region="east", epoch=0, lease_s=5.0, write_s=1.5)
    west1 = east0.fence("operator", forced=True).promote("west", "operator")
    t = tally({"east": east0, "witness": east0, "west": west1}, 2)
    assert t.confirmed == east0
    assert t.votes == 2, "the forced record did not vote"
    assert tally({"west": west1, "witness": west1}, 2).confirmed is None, \
        "a forced record is never confirmed, even where a majority shows it"
    watcher = _watcher(Clock())
    held = watcher.current
    assert watcher.offer(west1, "west") is False
    assert watcher.current == held


def test_write_starts_only_with_its_bound_left_of_the_lease() -> None:
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock, lease_s=5.0, write_s=2.0)
    rec = PrimaryRecord(region="east", epoch=3, write_s=1.5)
    w.offer(rec)
    w.confirm(0.0, rec)
    clock.t = 3.4
    g = w.grant()
    assert (g.record, g.bound_s, g.until) == (rec, 1.5, 3.4 + 1.5)  # the record's: smaller
    clock.t = 3.6
    assert w.writable() == rec                   # the lease holds ...
    with pytest.raises(PrimaryUnavailable) as ei:  # ... but not for a whole write
        w.grant()
    assert ei.value.reason == "lease_short"
    assert "only 1.40 s of the primary lease left" in str(ei.value)
    assert "needs 1.5 s (the record's write_s), so it was not started" in str(ei.value)
    assert code_name(ei.value) == "UNAVAILABLE"


def test_record_with_a_shorter_lease_than_the_proxys_is_refused() -> None:
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock, lease_s=5.0)
    rec = PrimaryRecord(region="east", epoch=3, lease_s=4.0)
    w.offer(rec)
    w.confirm(0.0, rec)
    assert w._metrics.registry.get_sample_value("crossdc_proxy_primary_lease_longer") == 1
    with pytest.raises(PrimaryUnavailable) as ei:
        w.writable()
    assert ei.value.reason == "lease_longer"
    assert str(ei.value).startswith(
        "this proxy's primary lease (5 s, primary_lease_s) is longer than the lease the "
        "controller waits out (4 s, in the primary record at epoch 3): set primary_lease_s "
        "to at most 4 here, or the controller's failover.primary_lease_s to at least 5")
    ok = PrimaryRecord(region="east", epoch=4, lease_s=5.0)
    w.offer(ok)
    w.confirm(0.1, ok)
    assert w.writable() == ok
    assert w._metrics.registry.get_sample_value("crossdc_proxy_primary_lease_longer") == 0


def test_fenced_record_refuses_then_promote_at_the_same_epoch_replaces_it() -> None:
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock)
    held = PrimaryRecord(region="east", epoch=7)
    assert w.offer(held)
    w.confirm(0.0, held)
    fenced = held.fence("ctl")
    assert w.offer(fenced)                        # seen anywhere: refused at once
    with pytest.raises(PrimaryUnavailable) as ei:
        w.writable()
    assert ei.value.reason == "fenced"
    assert str(ei.value) == "primary fenced at epoch 8: failover from east under way; retry"
    assert not w.offer(held)                      # a lower epoch never wins
    promoted = fenced.promote("west", "ctl")
    assert w.offer(promoted)                      # equal epoch: the promotion supersedes
    with pytest.raises(PrimaryUnavailable) as ei:  # ... but is not confirmed yet
        w.writable()
    assert ei.value.reason == "unconfirmed"
    assert "primary west@8 seen but not confirmed by a majority" in str(ei.value)
    w.confirm(0.5, promoted)
    assert (w.writable().region, w.writable().epoch) == ("west", 8)
    assert not w.offer(fenced)                    # the fence again (a stale DC): ignored
    assert not w.offer(PrimaryRecord(region="east", epoch=8))  # a second primary at 8: no
    assert w.writable().region == "west"


async def test_router_refuses_ordered_and_sync_without_lease_and_counts_by_reason() -> None:
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock)
    ws = _writers()
    metrics = ProxyMetrics()
    r = Router("west", TOPO, ws, w.grant, lambda: POLICY,  # type: ignore[arg-type]
               IdempotencyWindow(60, 1000), metrics, current=lambda: w.current)
    outs = await r.route([Incoming("ord", b"k", b"v"), Incoming("sync", b"k", b"v"),
                          Incoming("near", b"k", b"v")], _deadline())
    assert isinstance(outs[0].error, PrimaryUnavailable)
    assert isinstance(outs[1].error, PrimaryUnavailable)
    assert outs[2].error is None
    assert outs[2].written[0].region == "west"
    assert not ws["east"].sent
    assert metrics.registry.get_sample_value("crossdc_proxy_primary_refusals_total",
                                             {"reason": "unconfirmed"}) == 2
    w.confirm(0.0, w.current)
    w.offer(PrimaryRecord(region="east", epoch=3).fence("ctl"))
    out, = await r.route([Incoming("ord", b"k", b"v")], _deadline())
    assert isinstance(out.error, PrimaryUnavailable)
    assert out.error.reason == "fenced"
    w.offer(w.current.promote("west", "ctl"))
    w.confirm(0.0, w.current)
    out, = await r.route([Incoming("ord", b"k", b"v")], _deadline())
    assert out.error is None
    assert out.epoch == 4
    (_, sent), = ws["west"].sent[-1:]
    assert dict(sent.headers)["dr-epoch"] == b"4"
    clock.t = 3.75                                 # 1.25 s left, a write needs 1.5
    out, = await r.route([Incoming("ord", b"k", b"v")], _deadline())
    assert isinstance(out.error, PrimaryUnavailable)
    assert out.error.reason == "lease_short"
    clock.t = 5.0
    out, = await r.route([Incoming("ord", b"k", b"v")], _deadline())
    assert isinstance(out.error, PrimaryUnavailable)
    assert out.error.reason == "lease_expired"
    for reason in ("fenced", "lease_short", "lease_expired"):
        assert metrics.registry.get_sample_value("crossdc_proxy_primary_refusals_total",
                                                 {"reason": reason}) == 1


async def test_router_checks_the_lease_after_the_metadata_lookup() -> None:
    """A slow partition lookup must not eat the lease: the grant is taken after it."""
    from proxy.errors import PrimaryUnavailable
    clock = Clock()
    w = _watcher(clock, write_s=2.0)
    rec = PrimaryRecord(region="east", epoch=5)
    w.offer(rec)
    w.confirm(0.0, rec)
    ws = _writers()

    class SlowLookup(FakeWriter):
        def known_partition_count(self, topic: str) -> int | None:
            return None

        async def partition_count(self, topic: str, timeout_s: float) -> int | None:
            clock.t = 3.5          # the lookup took 3.5 s of a 5 s lease
            return 4

    ws["east"] = SlowLookup("east")
    r = Router("west", TOPO, ws, w.grant, lambda: POLICY,  # type: ignore[arg-type]
               IdempotencyWindow(60, 1000), ProxyMetrics(), current=lambda: w.current)
    out, = await r.route([Incoming("ord", b"k", b"v")], _deadline())
    assert isinstance(out.error, PrimaryUnavailable)
    assert out.error.reason == "lease_short"
    assert not ws["east"].sent


def test_watch_wait_and_rounds_fit_the_lease_and_the_write_bound() -> None:
    from pydantic import ValidationError

    from proxy.config import ProxyConfig
    from proxy.primary import read_s, round_s, watch_wait_s
    assert watch_wait_s(6.0) == 2.0
    assert watch_wait_s(6.0, 30.0) == 2.0          # the 30 s default is capped
    assert watch_wait_s(6.0, 1.5) == 1.5
    assert watch_wait_s(3.0, 0.2) == 1.0           # Consul's one-second granularity
    assert round_s(5.0, 2.0) == 1.0                # (5 - 2) / 3 < 5 / 4
    assert round_s(8.0, 1.0) == 2.0                # 8 / 4
    assert read_s(5.0, 2.0) == 3.0                 # a later answer renews nothing usable
    cfg = ProxyConfig(region="east")
    assert (cfg.primary_lease_s, cfg.primary_write_s) == (5.0, 1.5)
    with pytest.raises(ValidationError):
        ProxyConfig(region="east", primary_lease_s=2.0)
    with pytest.raises(ValidationError, match="must leave at least 1 s"):
        ProxyConfig(region="east", primary_lease_s=3.0, primary_write_s=2.5)


# -- hinted handoff (issue 21 defect 9, issue 23) ------------------------------------------------

class HintFailingWriter(FakeWriter):
    """A writer whose Kafka takes the records but refuses the hints topics (`refuse`), or
    holds hint writes until `gate` is set."""

    def __init__(self, name: str, up: bool = True) -> None:
        super().__init__(name, up=up)
        self.refuse = False
        self.gate: asyncio.Event | None = None

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
        if topic.startswith("_crossdc.proxy.hints."):
            if self.gate is not None:
                await self.gate.wait()
            if self.refuse:
                return [RegionWriteFailed(self.name, topic, "MessageSizeTooLargeError",
                                          retriable=False)] * len(items)
        return await super().write(topic, items, mode=mode, deadline=deadline)


def _hinted_router(ws: dict[str, Any], own: str = "west") -> tuple[Router, ProxyMetrics]:
    from proxy.hints import HintStore
    grant = WriteGrant(PrimaryRecord(region="east", epoch=7), math.inf, 2.0)
    metrics = ProxyMetrics()
    return Router(own, TOPO, ws, lambda: grant, lambda: POLICY,
                  IdempotencyWindow(60, 1000), metrics,
                  hints=HintStore(own, TOPO, ws, metrics)), metrics


def _hint_writers(**down: bool) -> dict[str, HintFailingWriter]:
    return {n: HintFailingWriter(n, up=not down.get(n, False)) for n in ("east", "west", "north")}


def _hints_in(w: FakeWriter, target: str) -> list[Outgoing]:
    return [o for t, o in w.sent if t == f"_crossdc.proxy.hints.{target}"]


async def test_a_quorum_ack_stores_a_hint_for_the_region_that_missed_the_record() -> None:
    from proxy.hints import decode_hint
    ws = _hint_writers(north=True)
    r, metrics = _hinted_router(ws)
    out, = await r.route([Incoming("q", b"acct", b"v", (("app", b"1"),),
                                   idempotency_key="tx-1")], _deadline())
    assert out.status == "ok"
    assert [w.region for w in out.written] == ["east", "west"]
    (hint,) = _hints_in(ws["west"], "north")        # in the own region
    (_, sent), = [(t, o) for t, o in ws["east"].sent if t == "q"]
    (_, replica), = [(t, o) for t, o in ws["west"].sent if t == "q"]
    h = decode_hint("north", hint.key, hint.value, hint.headers)
    assert (h.topic, h.partition, h.key, h.value) == ("q", sent.partition, b"acct", b"v")
    assert h.headers == replica.headers              # as sent to the other regions:
    # the primary's dr-id and dr-* headers, then its place in the primary's order
    assert replica.headers == [*sent.headers, ("dr-src", b"east:0")]
    assert h.position == (7, 0)
    assert dict(h.headers)["dr-id"] == b"tx-1"
    assert h.acked
    assert h.client_key
    assert [w.region for w in h.written] == ["east", "west"]
    assert metrics.registry.get_sample_value("crossdc_proxy_hints_written_total",
                                             {"target": "north"}) == 1
    # every region holds it: no hint
    out, = await _hinted_router(_hint_writers())[0].route([Incoming("q", b"k", b"v")],
                                                          _deadline())
    assert out.status == "ok"


async def test_no_ack_without_its_hint_and_the_retry_resumes() -> None:
    """The hint cannot be stored anywhere (own region west, then east, never north itself):
    the record is not acknowledged though a quorum holds it; a retry with the same key
    writes nothing twice and is acknowledged once its hint is stored."""
    from proxy.errors import code_name
    from proxy.hints import HintsUnavailable
    ws = _hint_writers(north=True)
    ws["west"].refuse = ws["east"].refuse = True
    r, metrics = _hinted_router(ws)
    rec = Incoming("q", b"acct", b"v", idempotency_key="tx-2")
    out, = await r.route([rec], _deadline())
    assert isinstance(out.error, HintsUnavailable)
    assert out.status == "partial"
    assert code_name(out.error) == "UNAVAILABLE"
    assert [w.region for w in out.written] == ["east", "west"]
    msg = str(out.error)
    assert "not acknowledged" in msg
    assert "north: down" in msg
    assert "west: MessageSizeTooLargeError" in msg
    assert "east: MessageSizeTooLargeError" in msg
    assert metrics.registry.get_sample_value("crossdc_proxy_hint_errors_total",
                                             {"step": "append"}) == 1
    ws["east"].refuse = False                        # east takes hints again (west still not)
    again, = await r.route([rec], _deadline())
    assert again.status == "ok"
    assert [len([s for s in ws[n].sent if s[0] == "q"]) for n in ("east", "west")] == [1, 1]
    assert len(_hints_in(ws["east"], "north")) == 1  # stored in the next region


async def test_the_answer_waits_for_the_hint() -> None:
    ws = _hint_writers(north=True)
    gate = ws["west"].gate = asyncio.Event()
    r, _ = _hinted_router(ws)
    task = asyncio.ensure_future(r.route([Incoming("q", b"k", b"v")], _deadline()))
    await asyncio.sleep(0.05)
    assert not task.done()                           # the record is in east and west: waits
    assert len(ws["west"].sent) == 1
    gate.set()
    out, = await task
    assert out.status == "ok"
    assert len(_hints_in(ws["west"], "north")) == 1


async def test_a_partial_sync_write_is_hinted_too() -> None:
    from proxy.hints import decode_hint
    ws = _hint_writers(north=True)
    r, _ = _hinted_router(ws)
    out, = await r.route([Incoming("sync", b"k", b"v")], _deadline())
    assert isinstance(out.error, IncompleteSync)     # fewer than all: not acked, as before
    (hint,) = _hints_in(ws["west"], "north")
    assert not decode_hint("north", hint.key, hint.value, hint.headers).acked
    out, = await r.route([Incoming("sync", b"k", b"v")], _deadline(), retry=False)
    assert len(_hints_in(ws["west"], "north")) == 2  # a new record (no key): a new hint
    # with a client key too (the replay and the client's retry are serialised by the key)
    out, = await r.route([Incoming("sync", b"k", b"v", idempotency_key="tx-1")], _deadline())
    assert isinstance(out.error, IncompleteSync)
    last = _hints_in(ws["west"], "north")[-1]
    keyed = decode_hint("north", last.key, last.value, last.headers)
    assert (keyed.acked, keyed.client_key, keyed.dr_id) == (False, True, "tx-1")


def test_hint_encoding_round_trip_and_cost() -> None:
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    from proxy.hints import BadHint, Hint, decode_hint, encode_hint
    headers = stamp([("app", b"1")], dr_id=str(uuid7()), origin="east", ts_ms=1_700_000_000_000,
                    mode="sync", epoch=12, path=["east", "west", "north"])
    h = Hint("north", "payments.transactions", 5, b"acct-42", b"x" * 200, headers,
             acked=True, client_key=False,
             written=[RegionWrite("east", 5, 123456), RegionWrite("west", 5, 98765)])
    enc = encode_hint(h)
    back = decode_hint("north", enc.key, enc.value, enc.headers)
    assert back == h
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
    plain = builder.size_in_bytes(0, 0, h.key, h.value, h.headers)
    hinted = builder.size_in_bytes(0, 0, enc.key, enc.value, enc.headers)
    # the docstring's figure: record + ~64 B (21-character topic, two regions written)
    assert hinted - plain == 63, hinted - plain      # offsets of 6 and 5 digits
    with pytest.raises(BadHint):
        decode_hint("north", b"k", b"v", [("dr-id", b"1")])
    with pytest.raises(BadHint):
        decode_hint("north", b"k", b"v", [("dr-hint", b"2|t|0|a|")])


async def test_the_drain_waits_for_hints_toward_the_target_and_reports_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dr.controller import failover
    from dr.controller.config import ControllerSettings, FailoverSettings
    from dr.controller.state import FailoverRecord
    left = {"east": [3, 1, 1, 1], "west": [0, 0, 0, 0], "north": [0, 0, 0, 0]}

    async def pending(conn: Any, region: str, targets: Sequence[str],
                      timeout_s: float = 5.0) -> dict[str, int]:
        assert list(targets) == ["west"]
        counts = left[region]
        return {"west": counts.pop(0) if len(counts) > 1 else counts[0]}

    async def behind(*_: Any, **__: Any) -> failover.Behind:
        return failover.Behind(2, 0.1)
    monkeypatch.setattr(failover, "pending_hints", pending)
    monkeypatch.setattr(failover, "behind", behind)
    settings = ControllerSettings(region="east", failover=FailoverSettings(drain_timeout_s=1.0))

    async def keep(r: FailoverRecord) -> FailoverRecord:
        return r
    engine = failover.FailoverEngine(TOPO, settings, None, keep,  # type: ignore[arg-type]
                                     majority=2, is_down=lambda r: r == "north")
    rec = await engine._drain(FailoverRecord(source="east", target="west"))
    detail = rec.step("drain").detail
    assert "hints toward west: 2 replayed, 1 left (east: 1)" in detail, detail
    assert "counted in the RPO" in detail
    assert "hints unknown in north (down)" in detail
    assert rec.rpo_records == 2 + 1                  # the mirror's 2 and the hint's 1


def test_a_proxy_bound_to_every_address_registers_its_topology_address() -> None:
    """`--host 0.0.0.0` (the compose deployment's proxies: reached over their datacenter's
    network and over `wan`) registers the endpoint's host in Consul, and Consul's agent
    checks it there; a proxy bound to one address registers that one."""
    from proxy.config import ProxyConfig
    from proxy.serve import _advertised
    from proxy.server import _consul_check

    bound_all = ProxyConfig(region="east", host="0.0.0.0", port=15700,
                            advertise_host=_advertised("0.0.0.0", "10.231.1.11"))
    assert bound_all.registered_host == "10.231.1.11"
    assert "10.231.1.11:15700" in str(_consul_check(bound_all, 15700))
    assert _advertised(None, "127.0.0.1") is None
    assert _advertised("10.213.5.2", "127.0.0.1") is None
    one = ProxyConfig(region="east", host="10.213.5.2", port=15700)
    assert one.registered_host == "10.213.5.2"


async def test_a_hint_commit_that_failed_is_made_again() -> None:
    """CI, 2026-11-27: east's replayer wrote 18 hints into west while east, which holds the
    hints topic and its group, was going down; the commit timed out and was never made again
    (no new hint for west, so the partition was not fetched again). The pending gauge said 18
    for good, and a restart would have written them twice. Now the commit is made again."""
    from aiokafka import TopicPartition
    from aiokafka.errors import RequestTimedOutError
    from prometheus_client import CollectorRegistry

    from proxy.config import HintSettings
    from proxy.hints import HintReplayer

    tp = TopicPartition("_crossdc.proxy.hints.west", 0)

    class Consumer:
        def __init__(self) -> None:
            self.failing = 2
            self.commits: list[dict[TopicPartition, int]] = []

        def assignment(self) -> set[TopicPartition]:
            return {tp}

        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            if self.failing:
                self.failing -= 1
                raise RequestTimedOutError()
            self.commits.append(offsets)

    r = HintReplayer("east", TOPO, {}, IdempotencyWindow(60.0, 100),
                     ProxyMetrics(CollectorRegistry()), HintSettings(retry_s=0.05),
                     client_id="t")
    c = Consumer()
    await r._commit(c, tp, 50)
    assert c.commits == []
    assert tp not in r._committed
    await r._commit_again(c)  # not yet: its pause runs
    assert c.failing == 1
    deadline = time.monotonic() + 5
    while not c.commits and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the pause between attempts
        await r._commit_again(c)
    assert c.commits == [{tp: 50}]
    assert r._committed[tp] == 50
    assert not r._uncommitted
    await r._commit_again(c)  # done: not made a third time
    assert c.commits == [{tp: 50}]


def test_a_write_handed_to_kafka_and_never_answered_is_of_unknown_outcome() -> None:
    """Issue 36: the proxy answered FAILED ("written nowhere") for a Kafka write that timed
    out, and the chaos suite read the record back (the broker had appended it). Now such a
    write is UNKNOWN; a refusal before any write stays FAILED."""
    import asyncio as _asyncio

    from proxy.api import pb
    from proxy.errors import NoWritableRegion, RegionWriteFailed
    from proxy.router import Outcome
    from proxy.server import _STATUS, _written_md
    from proxy.writers import RegionWriter

    timed_out = NoWritableRegion("t", "ordered", {"east": "no ack"}, maybe_written=True)
    refused = NoWritableRegion("t", "ordered", {"east": "not writable"})
    assert Outcome("id", "ordered", 0, [], timed_out).status == "unknown"
    assert Outcome("id", "ordered", 0, [], refused).status == "failed"
    assert _STATUS["unknown"] == pb.STATUS_UNKNOWN
    assert ("dr-status", "unknown") in _written_md(Outcome("id", "ordered", 0, [], timed_out))

    w = RegionWriter.__new__(RegionWriter)
    w.name = "east"
    results: list[Any] = [None, None, None]
    loop = _asyncio.new_event_loop()
    try:
        pending = loop.create_future()                       # on the wire, never answered
        lost = loop.create_future()
        from crossdc.clients.errors import KafkaConnectionError, RecordTooLargeError
        lost.set_exception(KafkaConnectionError("connection lost"))
        big = loop.create_future()
        big.set_exception(RecordTooLargeError())             # the broker refused it
        for i, f in enumerate((pending, lost, big)):
            w._settle("t", i, f, 1.0, results, [])
        lost.exception()
        big.exception()
    finally:
        loop.close()
    assert all(isinstance(r, RegionWriteFailed) for r in results)
    assert [r.maybe_written for r in results] == [True, True, False]
