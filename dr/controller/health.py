"""Per-region health: probes (Kafka metadata, a canary round trip, the proxy's gRPC health)
and the hysteresis that turns probe rounds into up / degraded / down.

`Hysteresis` is pure (unit-tested with made-up rounds); `RegionProber` owns one region's
long-lived Kafka clients, so a probe costs a round trip, not a bootstrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from crossdc.aio import cancelled_from_outside
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin, TopicSpec
from crossdc.errors import ClientError
from crossdc.topology import Region
from dr.controller.config import HealthSettings
from dr.controller.state import CheckResult, RegionHealth, now_ms

if TYPE_CHECKING:
    from dr.controller.grpc_health import ServingProbe

__all__ = ["Hysteresis", "RegionProber", "Round"]

log = structlog.get_logger("crossdc.controller.health")

# What makes a region down: its Kafka does not answer, or cannot take and return a record.
# A failing proxy only degrades it (the region's data path is still there).
CRITICAL = ("kafka", "canary")
_METADATA_TRIES = 3  # brokers asked per metadata check, each picked at random by aiokafka


@dataclass
class Round:
    """One probe round of one region."""

    checks: dict[str, CheckResult]
    at_ms: int = field(default_factory=now_ms)

    @property
    def ok(self) -> bool:
        return all(c.ok for name, c in self.checks.items() if name in CRITICAL)

    @property
    def degraded(self) -> bool:
        return self.ok and not all(c.ok for c in self.checks.values())

    @property
    def canary_only(self) -> bool:
        """Failed, but Kafka answered metadata: the cluster is there, a write path is not."""
        kafka = self.checks.get("kafka")
        return not self.ok and kafka is not None and kafka.ok


class Hysteresis:
    """N consecutive failed rounds make a region down; M consecutive good ones bring it back.

    A run of failed rounds that are not all Kafka failures (in some only the canary failed,
    Kafka still answered metadata) downs the region only once it has lasted
    `canary_grace_ms`: a region of several brokers that lost one stalls acks=all writes
    until Kafka fences that broker and elects new leaders, and failing over from a cluster
    that heals itself in seconds would be the outage. Until then the region is degraded.
    N rounds in a row where Kafka itself failed down it at once (a dead cluster).

    The first failed round of a run is remembered (`first_failure_ms`): it is the best
    estimate of when the fault began, which RTO is measured from."""

    def __init__(self, region: str, failures_to_down: int, successes_to_up: int,
                 canary_grace_ms: int = 0) -> None:
        self.region = region
        self.failures_to_down = failures_to_down
        self.successes_to_up = successes_to_up
        self.canary_grace_ms = canary_grace_ms
        self.status: Literal["up", "degraded", "down", "unknown"] = "unknown"
        self.since_ms = now_ms()
        self.failures = 0
        self.hard_failures = 0
        self.successes = 0
        self.first_failure_ms: int | None = None
        self.last: Round | None = None

    def observe(self, rnd: Round) -> bool:
        """Take one round; True when the status changed."""
        self.last = rnd
        before = self.status
        if rnd.ok:
            self.successes += 1
            self.failures = self.hard_failures = 0
            if self.status in ("unknown", "up", "degraded") or \
                    self.successes >= self.successes_to_up:
                self.status = "degraded" if rnd.degraded else "up"
                self.first_failure_ms = None
        else:
            self.failures += 1
            self.successes = 0
            # Rounds where Kafka itself failed, in a row: a canary-only run counts for the
            # grace, never towards these (a metadata answer lost to the dying broker in the
            # middle of a canary-only run downed the region at once: chaos, leader-kill).
            self.hard_failures = 0 if rnd.canary_only else self.hard_failures + 1
            if self.first_failure_ms is None:
                self.first_failure_ms = rnd.at_ms
            past_grace = rnd.at_ms - self.first_failure_ms >= self.canary_grace_ms
            if self.hard_failures >= self.failures_to_down or \
                    (self.failures >= self.failures_to_down and past_grace):
                self.status = "down"
            elif rnd.canary_only and self.status == "up":
                self.status = "degraded"
        if self.status != before:
            self.since_ms = rnd.at_ms
            return True
        return False

    def forget(self, at_ms: int) -> bool:
        """No judgement this round: the controller reaches no majority of datacenters, so a
        failed probe may be its own isolation, not the region's (a three-way split judged
        every other region down; the first leader after the heal failed over a healthy
        primary on it). Back to `unknown`, counts reset: the rounds after judge afresh.
        True when the status changed."""
        self.failures = self.hard_failures = self.successes = 0
        self.first_failure_ms = None
        if self.status == "unknown":
            return False
        self.status = "unknown"
        self.since_ms = at_ms
        return True

    def snapshot(self, observed_by: str, mirror_lag: int | None = None) -> RegionHealth:
        return RegionHealth(region=self.region, status=self.status,
                            since_ms=self.since_ms, failures=self.failures,
                            first_failure_ms=self.first_failure_ms,
                            checks=dict(self.last.checks) if self.last else {},
                            mirror_lag_records=mirror_lag, observed_by=observed_by,
                            at_ms=self.last.at_ms if self.last else now_ms())


T = TypeVar("T")


async def _any_broker(call: Callable[[], Awaitable[T]]) -> T:
    """`call` (an admin request) answered by any broker. aiokafka sends each admin request to
    a random known broker, the dead one included until Kafka fences it (about 9 s): a region
    that lost one of three would otherwise fail a third of its rounds, and three in a row
    down the region (the chaos suite's leader-kill saw it twice: the metadata check, then the
    clients renewed after failed canary rounds listing topics). The admin tries each call
    once (`ONCE`): these tries are the only ones, with no pause between them."""
    for attempt in range(1, _METADATA_TRIES + 1):
        try:
            return await call()
        except (ClientError, OSError):
            if attempt == _METADATA_TRIES:
                raise
    raise AssertionError("unreachable")


def _ms(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 2)


class RegionProber:
    """Probes one region: `await prober.probe()` → a Round. `stop()` closes its clients.

    Its Kafka clients (an admin client for metadata, a producer and a consumer for the
    canary) live across rounds: a probe costs a round trip, not a bootstrap, and aiokafka
    reconnects to a broker that comes back. They are made on the first probe that needs them,
    under their own deadline (a region down at start never keeps the controller from
    starting), and made afresh after `RENEW_AFTER` failed rounds in a row (a client that saw
    its broker die may be wedged). They authenticate as `principal` (the controller's own)
    where the region has `security:`."""

    RENEW_AFTER = 5
    SETUP_TIMEOUT_S = 10.0

    def __init__(self, region: Region, settings: HealthSettings, controller_id: str, *,
                 principal: str | None = None) -> None:
        self.region = region
        self.kafka = KafkaConnection.of(region, principal=principal)
        self.settings = settings
        self.controller_id = controller_id
        self._configured = list(region.kafka.bootstrap_servers)
        self._learned: list[str] = []
        self._admin: KafkaAdmin | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tp = TopicPartition(settings.canary_topic, 0)
        self._closed = False
        self._failed_rounds = 0
        self._canary_task: asyncio.Task[CheckResult] | None = None
        self._serving: ServingProbe | None = None

    def bootstrap_servers(self) -> list[str]:
        """The configured servers, then every broker the last metadata answer named.

        The clients are renewed after failed rounds; bootstrapping again from the configured
        servers alone calls a region down when those are the brokers that died, though the
        others serve (the chaos suite's leader-kill: a 3-broker region whose topology named
        its first broker only). A client that keeps its metadata does the same."""
        return list(dict.fromkeys([*self._configured, *self._learned]))

    def learn(self, meta: dict[str, Any]) -> None:
        """Remember the brokers a metadata answer named (see `bootstrap_servers`)."""
        learned = [f"{b['host']}:{b['port']}" for b in meta.get("brokers", [])
                   if isinstance(b, dict) and b.get("host") and b.get("port")]
        if learned:
            self._learned = learned

    async def stop(self) -> None:
        """Close every client; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._drop_clients()
        serving, self._serving = self._serving, None
        if serving is not None:
            await serving.close()

    async def _drop_clients(self) -> None:
        admin, self._admin = self._admin, None
        await self._close_clients(admin)

    async def _drop_canary_clients(self) -> None:
        await self._close_clients(None)

    async def _close_clients(self, admin: KafkaAdmin | None) -> None:
        task, self._canary_task = self._canary_task, None
        # The canary's own set-up drops its clients from inside its task: not waited for.
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        producer, consumer = self._producer, self._consumer
        self._producer = self._consumer = None
        for name, obj, close in (("admin", admin, admin.stop if admin else None),
                                 ("producer", producer, producer.stop if producer else None),
                                 ("consumer", consumer, consumer.stop if consumer else None)):
            if close is None:
                continue
            try:
                async with asyncio.timeout(5.0):
                    await close()
            except (TimeoutError, KafkaError, OSError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise
                log.debug("probe_client_close_failed", region=self.region.name, client=name,
                          error=repr(exc))
                # Against a dead broker a producer waits to deliver its canary and a
                # consumer for its fetch before they close their connections; close the
                # underlying client here, or its metadata task outlives them.
                inner = getattr(obj, "client", None) or getattr(obj, "_client", None)
                if inner is not None:
                    with contextlib.suppress(TimeoutError, KafkaError, OSError):
                        async with asyncio.timeout(2.0):
                            await inner.close()

    async def _setup(self) -> None:
        """Make the admin client if it is missing (bounded by SETUP_TIMEOUT_S)."""
        if self._closed:
            raise ClientError("prober stopped")
        async with asyncio.timeout(self.SETUP_TIMEOUT_S):
            if self._admin is None:
                # One try per call, no deadline of its own: the probe's deadlines and
                # `_any_broker` bound and retry it.
                admin = KafkaAdmin(
                    self.kafka.with_servers(self.bootstrap_servers()), ONCE,
                    request_timeout_ms=int(self.settings.timeout_s * 1000))
                self._admin = admin  # kept even if start fails: stop() closes it
                await admin.start()

    async def _setup_canary(self) -> None:
        """Make the canary's topic and clients if they are missing (bounded by
        SETUP_TIMEOUT_S). Called once metadata answered: what fails here is the canary's,
        under its grace (a cluster just started, on a loaded machine, timed out creating the
        canary topic three rounds in a row, and the region it had just seen answer was called
        down and failed over: chaos suite, CI)."""
        assert self._admin is not None
        async with asyncio.timeout(self.SETUP_TIMEOUT_S):
            if self._producer is None:
                topics = await _any_broker(self._admin.list_topics)
                if self.settings.canary_topic not in topics:
                    # Replicated where the region has the brokers: a canary on one broker
                    # would call the region down for as long as that broker is.
                    cluster = await self._ask_any_broker(self._admin)
                    rf = max(1, min(3, len(cluster.get("brokers", []))))
                    # The broker's per-topic answer is not read: a canary topic it would
                    # not create fails the canary check, not this one.
                    await self._admin.create_topics([TopicSpec(
                        self.settings.canary_topic, 1, rf, {"retention.ms": "3600000"})],
                        unchecked=True)
                producer = AIOKafkaProducer(
                    **self.kafka.with_servers(self.bootstrap_servers()).aiokafka_kwargs(
                        "producer", client_id="crossdc-health-canary", acks="all", linger_ms=0,
                        request_timeout_ms=int(self.settings.timeout_s * 1000)))
                self._producer = producer
                await producer.start()
            if self._consumer is None:
                # Short request deadlines: closing a consumer whose broker died waits for
                # its in-flight fetch (40 s by default).
                consumer = Consumer(
                    **self.kafka.with_servers(self.bootstrap_servers()).aiokafka_kwargs(
                        "consumer", client_id="crossdc-health-canary", enable_auto_commit=False,
                        request_timeout_ms=int(max(2.0, self.settings.timeout_s * 2) * 1000),
                        fetch_max_wait_ms=200))
                self._consumer = consumer
                await consumer.start()
                consumer.assign([self._tp])
                await consumer.seek_to_end(self._tp)

    async def probe(self) -> Round:
        """One round; never raises (a failure is a failed check)."""
        try:
            return await self._probe()
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            await self._drop_clients()
            return Round({"kafka": CheckResult(ok=False, detail="probe cancelled inside "
                                               "the Kafka client"),
                          "canary": CheckResult(ok=False, detail="kafka unreachable")})

    async def _probe(self) -> Round:
        checks: dict[str, CheckResult] = {}
        t0 = time.monotonic()
        try:
            await self._setup()
        except (TimeoutError, ClientError, KafkaError, OSError) as exc:
            await self._drop_clients()
            why = f"connect: {exc.__class__.__name__} {exc}".strip()
            checks["kafka"] = CheckResult(ok=False, latency_ms=_ms(t0), detail=why)
            if self.settings.canary:
                checks["canary"] = CheckResult(ok=False, detail="kafka unreachable")
        else:
            checks["kafka"] = await self._kafka()
            if self.settings.canary and checks["kafka"].ok:
                checks["canary"], again = await self._canary_watched()
                if again is not None:
                    checks["kafka"] = again
            elif self.settings.canary:
                checks["canary"] = CheckResult(ok=False, detail="kafka unreachable")
        if self.settings.proxy:
            checks["proxy"] = await self._proxy()
        rnd = Round(checks)
        self._failed_rounds = 0 if rnd.ok else self._failed_rounds + 1
        if self._failed_rounds and self._failed_rounds % self.RENEW_AFTER == 0:
            await self._drop_clients()
        return rnd

    async def _kafka(self) -> CheckResult:
        t0 = time.monotonic()
        assert self._admin is not None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                meta = await self._ask_any_broker(self._admin)
            self.learn(meta)
            brokers = len(meta.get("brokers", []))
            return CheckResult(ok=brokers > 0, latency_ms=_ms(t0),
                               detail=f"{brokers} broker(s), controller "
                               f"{meta.get('controller_id')}")
        except (TimeoutError, ClientError, OSError) as exc:
            return CheckResult(ok=False, latency_ms=_ms(t0),
                               detail=f"metadata: {exc.__class__.__name__} {exc}".strip())

    @staticmethod
    async def _ask_any_broker(admin: KafkaAdmin) -> dict[str, Any]:
        """Cluster metadata from any broker that answers (see `_any_broker`)."""
        return await _any_broker(admin.describe_cluster)

    async def _canary_watched(self) -> tuple[CheckResult, CheckResult | None]:
        """The canary, with the metadata asked again every `interval_s` while it waits.

        A canary in flight when the cluster dies waits out its own deadline (a producer
        retries a dead broker): on a loaded machine the canary is in flight a good part of
        each round, and that round then ended 2 s late as a canary-only failure, which
        does not count towards `failures_to_down` (a drill measured detection 3.2 s against
        its 1.0-1.5 s). If the metadata fails meanwhile the round ends at once, a Kafka
        failure (the second value: the new metadata check). The canary goes on in its task
        and the next rounds wait for it rather than send another."""
        t0 = time.monotonic()
        old = self._canary_task
        if old is not None and old.done() and not old.cancelled():
            old.exception()  # an abandoned canary's end, read: no "never retrieved" warning
        task = old if old is not None and not old.done() else asyncio.create_task(
            self._canary_round(), name=f"controller:canary:{self.region.name}")
        self._canary_task = task
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.settings.interval_s)
            if done:
                self._canary_task = None
                return task.result(), None
            again = await self._kafka()
            if not again.ok and not task.done():
                return CheckResult(ok=False, latency_ms=_ms(t0),
                                   detail="canary unanswered, and the metadata failed "
                                   "while it waited"), again

    async def _canary_round(self) -> CheckResult:
        """The canary, its clients made first where they are missing."""
        t0 = time.monotonic()
        try:
            await self._setup_canary()
        except (TimeoutError, ClientError, KafkaError, OSError) as exc:
            await self._drop_canary_clients()
            return CheckResult(ok=False, latency_ms=_ms(t0),
                               detail=f"canary setup: {exc.__class__.__name__} {exc}".strip())
        return await self._canary()

    async def _canary(self) -> CheckResult:
        """Produce a record and read it back: the region takes and serves data."""
        t0 = time.monotonic()
        token = uuid.uuid4().hex.encode()
        assert self._producer is not None
        assert self._consumer is not None
        try:
            async with asyncio.timeout(self.settings.timeout_s * 2):
                meta = await self._producer.send_and_wait(
                    self.settings.canary_topic, token,
                    key=self.controller_id.encode(), partition=0)
                found = False
                while not found:
                    batch = await self._consumer.getmany(self._tp, timeout_ms=200)
                    found = any(r.value == token for recs in batch.values() for r in recs)
            return CheckResult(ok=True, latency_ms=_ms(t0), detail=f"offset {meta.offset}")
        except (TimeoutError, KafkaError, OSError) as exc:
            return CheckResult(ok=False, latency_ms=_ms(t0),
                               detail=f"canary: {exc.__class__.__name__} {exc}".strip())

    async def _proxy(self) -> CheckResult:
        from dr.controller.grpc_health import ServingProbe
        t0 = time.monotonic()
        if self._closed:  # a round ending after stop() makes no channel that nobody closes
            return CheckResult(ok=False, detail="prober stopped")
        if self._serving is None:
            self._serving = ServingProbe(self.region.proxy.endpoint)
        ok, detail = await self._serving.check(self.settings.timeout_s)
        return CheckResult(ok=ok, latency_ms=_ms(t0), detail=detail)
