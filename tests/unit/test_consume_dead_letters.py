"""Dead letters written by the consume side go through the Produce path (`Router.route`,
issue 36 item 3): the dead-letter topic's mode decides where, an ordered or sync one only
under a write grant (the confirmed primary, its epoch, its bound); without a grant nothing
is written anywhere, the record stays unsettled (its partition's commit held) and the
refusal is counted by reason. A real Router over fake writers; the grant is a function."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest

from crossdc.headers import (
    DR_DL_DELIVERIES,
    DR_DL_GROUP,
    DR_DL_ID,
    DR_DL_OFFSET,
    DR_DL_PARTITION,
    DR_DL_REGION,
    DR_DL_TOPIC,
    DR_EPOCH,
    DR_ID,
    DR_MODE,
    DR_ORIGIN,
)
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from proxy.breaker import CircuitBreaker
from proxy.config import ConsumeConfig
from proxy.consume.acks import RecordState
from proxy.consume.dispatch import DeadLetter, Fetched
from proxy.consume.member import GroupMember, dead_letter_record
from proxy.errors import PrimaryUnavailable, RegionWriteFailed
from proxy.idempotency import IdempotencyWindow
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.primary import WriteGrant
from proxy.router import Incoming, Router
from proxy.writers import Outgoing, RegionWrite

pytestmark = pytest.mark.unit

TOPO = Topology.model_validate({
    "regions": [{"name": n, "kafka": {"bootstrap_servers": [f"127.0.0.1:{p}"]},
                 "consul": {"http_addr": f"127.0.0.1:{p + 1}", "datacenter": n,
                            "dns_addr": f"127.0.0.1:{p + 2}"},
                 "proxy": {"endpoint": f"127.0.0.1:{p + 3}"}}
                for n, p in (("east", 1000), ("west", 2000))],
    "preference": ["east", "west"], "primary": "east"})

POLICY = Policy.model_validate({"rules": [
    {"topic": "t", "mode": "nearest",
     "consume": {"max_deliveries": 1, "dead_letter_topic": "dlq.{topic}"}},
    {"topic": "dlq.*", "mode": "ordered"},
    {"topic": "dls.*", "mode": "ordered", "sync": True},
    {"topic": "dln.*", "mode": "nearest"}], "strict": True})


class _Body(NamedTuple):  # what aiokafka fetched (the fields a dead letter reads)
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp: int


class _Writer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.breaker = CircuitBreaker(name)
        self.sent: list[tuple[str, Outgoing, float]] = []

    writable = True

    def why_not_writable(self) -> str:
        return ""

    def known_partition_count(self, topic: str) -> int | None:
        return 2

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        return 2

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
        out: list[Any] = []
        for it in items:
            self.sent.append((topic, it, deadline))
            out.append(RegionWrite(self.name, it.partition or 0, len(self.sent) - 1))
        return out


class _Grant:
    """`PrimaryWatcher.grant` reduced to its answer: fenced, or a grant of `record`."""

    def __init__(self) -> None:
        self.record = PrimaryRecord(region="east", epoch=3).fence("ctl")
        self.calls = 0

    def __call__(self) -> WriteGrant:
        self.calls += 1
        if self.record.fenced:
            raise PrimaryUnavailable("fenced", reason="fenced", epoch=self.record.epoch)
        return WriteGrant(self.record, time.monotonic() + 1.5, 1.5)


def _letter(topic: str, offset: int = 4) -> DeadLetter:
    body = _Body("t", 1, offset, b"k", b"poison",
                 (("app", b"y"), (DR_ID, b"orig-1"), (DR_ORIGIN, b"east"),
                  (DR_EPOCH, b"2")), 0)
    return DeadLetter(("t", 1), offset, 5, topic, body)


def _member(router: Router, metrics: ProxyMetrics, region: str = "west") -> GroupMember:
    return GroupMember("g", "local", region, None, router.route,  # type: ignore[arg-type]
                       ConsumeConfig(), metrics, client_id="c")


def test_a_dead_letter_record_is_the_original_plus_dr_dl_headers_and_a_stable_key() -> None:
    x = _letter("dlq.t")
    rec = dead_letter_record("g", "west", x)
    assert (rec.topic, rec.key, rec.value) == ("dlq.t", b"k", b"poison")
    h = dict(rec.headers)
    assert not {DR_ID, DR_ORIGIN, DR_EPOCH} & set(h)  # the original's dr-*: the Router stamps
    assert h["app"] == b"y"
    assert {k: h[k] for k in (DR_DL_TOPIC, DR_DL_PARTITION, DR_DL_OFFSET, DR_DL_REGION,
                              DR_DL_GROUP, DR_DL_DELIVERIES, DR_DL_ID)} == {
        DR_DL_TOPIC: b"t", DR_DL_PARTITION: b"1", DR_DL_OFFSET: b"4", DR_DL_REGION: b"west",
        DR_DL_GROUP: b"g", DR_DL_DELIVERIES: b"5", DR_DL_ID: b"orig-1"}
    # the same record read in another region (or again) gets the same idempotency key
    assert dead_letter_record("g", "east", x).idempotency_key == rec.idempotency_key
    assert dead_letter_record("g2", "west", x).idempotency_key != rec.idempotency_key


async def test_a_client_still_may_not_set_dr_dl_headers() -> None:
    from proxy.errors import ReservedHeader
    router = Router("west", TOPO, {n: _Writer(n) for n in ("east", "west")},  # type: ignore[misc]
                    _Grant(), lambda: POLICY, IdempotencyWindow(60, 100), ProxyMetrics())
    rec = dead_letter_record("g", "west", _letter("dln.t"))
    out, = await router.route([Incoming(rec.topic, rec.key, rec.value, rec.headers)],
                              time.monotonic() + 5)
    assert isinstance(out.error, ReservedHeader)


async def test_an_ordered_dead_letter_waits_for_a_grant_then_lands_in_the_primary() -> None:
    writers = {n: _Writer(n) for n in ("east", "west")}
    grant = _Grant()
    metrics = ProxyMetrics()
    router = Router("west", TOPO, writers, grant,  # type: ignore[arg-type]
                    lambda: POLICY, IdempotencyWindow(60, 100), metrics,
                    current=lambda: grant.record)
    m = _member(router, metrics)
    tp = ("t", 1)
    m.dispatcher.add_partitions({tp})
    x = _letter("dlq.t", offset=0)
    m.dispatcher.fetched(tp, [Fetched(0, 10, x.body, 0)])

    # fenced: no grant, nothing written anywhere, the record not settled, counted by reason
    assert await m._write_dead("dlq.t", [x]) == [x]
    assert grant.calls >= 1
    assert writers["east"].sent == []
    assert writers["west"].sent == []
    assert m.dispatcher.acks_of(tp).state_of(0) != RecordState.SETTLED  # type: ignore[union-attr]
    sample = metrics.registry.get_sample_value
    assert sample("crossdc_proxy_consume_dead_letter_refused_total",
                  {"group": "g", "reason": "fenced"}) == 1
    assert sample("crossdc_proxy_consume_dead_letter_errors_total", {"group": "g"}) == 1
    assert m.dispatcher.commits().get(tp, 0) == 0  # the commit is held before it

    # promoted: the confirmed primary (east, not the region read, west) with its epoch,
    # bounded by the grant's `until`
    grant.record = grant.record.promote("east", "ctl")
    t0 = time.monotonic()
    assert await m._write_dead("dlq.t", [x]) == []
    assert writers["west"].sent == []
    (topic, sent, deadline), = writers["east"].sent
    assert topic == "dlq.t"
    assert deadline <= t0 + 1.5 + 0.5  # the grant's bound, not dead_letter_write_s (10 s)
    h = dict(sent.headers)
    assert (h[DR_MODE], h[DR_EPOCH], h[DR_ORIGIN]) == (b"ordered", b"4", b"east")
    assert h[DR_ID] == dead_letter_record("g", "west", x).idempotency_key.encode()
    assert h[DR_DL_REGION] == b"west"
    assert sample("crossdc_proxy_consume_dead_lettered_total", {"group": "g"}) == 1

    # written twice (a retry after an unknown outcome): the idempotency window answers
    assert await m._write_dead("dlq.t", [x]) == []
    assert len(writers["east"].sent) == 1


async def test_a_sync_dead_letter_goes_to_every_region_and_a_nearest_one_to_its_own() -> None:
    writers = {n: _Writer(n) for n in ("east", "west")}
    grant = _Grant()
    grant.record = grant.record.promote("east", "ctl")
    metrics = ProxyMetrics()
    router = Router("west", TOPO, writers, grant,  # type: ignore[arg-type]
                    lambda: POLICY, IdempotencyWindow(60, 100), metrics)
    m = _member(router, metrics, region="east")
    assert await m._write_dead("dls.t", [_letter("dls.t")]) == []
    assert [len(writers[n].sent) for n in ("east", "west")] == [1, 1]
    assert dict(writers["west"].sent[0][1].headers)[DR_MODE] == b"sync"
    calls = grant.calls
    # nearest: the proxy's own region (west), whatever region the record was read from, and
    # no grant asked
    assert await m._write_dead("dln.t", [_letter("dln.t")]) == []
    assert [len(writers[n].sent) for n in ("east", "west")] == [1, 2]
    assert dict(writers["west"].sent[1][1].headers)[DR_MODE] == b"nearest"
    assert grant.calls == calls


async def test_a_region_that_fails_leaves_the_dead_letter_to_be_retried() -> None:
    class Down(_Writer):
        async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                        deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
            return [RegionWriteFailed(self.name, topic, "connection refused") for _ in items]

    writers = {"east": Down("east"), "west": _Writer("west")}
    grant = _Grant()
    grant.record = grant.record.promote("east", "ctl")
    metrics = ProxyMetrics()
    router = Router("west", TOPO, writers, grant,  # type: ignore[arg-type]
                    lambda: POLICY, IdempotencyWindow(60, 100), metrics)
    m = _member(router, metrics)
    x = _letter("dlq.t")
    assert await m._write_dead("dlq.t", [x]) == [x]
    assert writers["west"].sent == []  # never the region read instead of the primary
    assert metrics.registry.get_sample_value(
        "crossdc_proxy_consume_dead_letter_errors_total", {"group": "g"}) == 1
