"""Hostile gRPC requests against a real `dr proxy serve` process on the real stack: each gets
its exact status code, the proxy stays up and keeps serving good requests, and its memory
(the process's RSS, read from /proc) comes back to its baseline afterwards.

The requests: values over gRPC's message limit and over the rule's `max_record_bytes`,
bytes that are not UTF-8 in a header name and in a topic (sent raw: the protobuf library
would not encode them), reserved `dr-*` header names, a batch over `max_batch_records` and
one over the message limit, an empty topic, a topic no rule names, a missing key, streams
abandoned half-way (cancelled after their first answer, and others cut without reading
anything), and hundreds of clients at once, each on its own connection.

The baseline is taken after one warm-up round of the same requests (the allocator's arenas,
grpc's buffers and the caches are grown once; what matters is that repeating does not keep
growing). The memory the rounds free is given back by the proxy's heap trimmer
(`proxy.heap`: glibc keeps freed memory otherwise, and RSS grew every round); the tests check
that it ran. `make test` runs 2 rounds and 200 clients; the slow variant 10 rounds and 500,
and checks the RSS after each round's trim levels off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, eventually, unique, until_serving
from primary_helpers import agreed_primary

from dr.stack.ports import free_port
from proxy.api import SERVICE_NAME, pb, pb_grpc

# the first test of a file waits for the session stack (minutes on a busy machine)
pytestmark = pytest.mark.timeout(900)

POLICY = """\
strict: true
rules:
  - topic: "ord-*"
    mode: ordered
  - topic: "small-*"
    mode: ordered
    max_record_bytes: 64
  - topic: "near-*"
    mode: nearest
"""

MiB = 1024 * 1024
RSS_TOLERANCE_MIB = 24.0
"""Growth allowed over the warm baseline: RSS is never exact (what is in use at the moment
of reading, pages of arenas split by live allocations); a leak of the requests themselves
is far more (a round sends ~70 MiB)."""
SETTLED_TOLERANCE_MIB = 16.0
"""The long run: the RSS after each round's trim may exceed the trimmed warm baseline by
this much at most. Measured, 500 clients a round, baseline ~100 MiB: it rises to a plateau
+8-12 MiB by rounds 5-9 and stays there (12 rounds: 100.2, 100.2, 103.3, 104.2, 108.6,
111.9, 108.9, 108.9, 109.1, 110.0, 108.7, 106.5, 105.9; a 10-round run of this test: max
+13.5). Before proxy.heap RSS never came back (110.9 -> 145.7 MiB in 10 rounds on a quiet
machine); with the trim alone (no full gc) the trimmed RSS kept rising, +35 in 25 rounds."""

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class Proxy:
    proc: asyncio.subprocess.Process
    target: str
    metrics_port: int
    log: Path

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        assert seen, f"{name} not exported"
        return total


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    """Every datacenter holds one record naming east writable: a proxy renews its primary
    lease only from a majority of datacenters showing the same record, and an absent key
    renews nothing (the controller writes the epoch-0 record at its first start)."""
    await agreed_primary(two_regions.topology)


@pytest.fixture
async def proxy(two_regions, tmp_path: Path) -> AsyncIterator[Proxy]:  # type: ignore[no-untyped-def]
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    port, mport = free_port(), free_port()
    log = tmp_path / "proxy.log"
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dr.cli", "--log-format", "json", "proxy", "serve",
            "--topology", str(two_regions.topology_path), "--region", "east", "--policy",
            str(policy), "--port", str(port), "--metrics-port", str(mport), "--no-consul",
            "--grace", "1", "--workers", "1", stdout=f, stderr=f)
    p = Proxy(proc, f"127.0.0.1:{port}", mport, log)
    try:
        async with grpc.aio.insecure_channel(p.target) as ch:
            await until_serving(ch, proc, log)
        yield p
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call
    return ei.value.code()


def _raw_request(record: Any, swap: tuple[bytes, bytes]) -> bytes:
    """A serialized ProduceRequest with the bytes `swap[0]` replaced by `swap[1]` (the same
    length): how a client in another language sends a string that is not UTF-8."""
    data = pb.ProduceRequest(record=record).SerializeToString()
    old, new = swap
    assert len(old) == len(new)
    assert data.count(old) == 1
    return bytes(data.replace(old, new))


class Hostile:
    """One round of every hostile request, each checked for its exact code."""

    def __init__(self, proxy: Proxy, topic: str, small: str) -> None:
        self.proxy, self.topic, self.small = proxy, topic, small

    async def good(self, stub: Any) -> None:
        r = await stub.Produce(pb.ProduceRequest(record=pb.Record(
            topic=self.topic, key=b"k", value=b"good")), timeout=30)
        assert r.result.status == pb.STATUS_OK, r

    async def round(self, ch: grpc.aio.Channel, clients: int) -> None:
        stub = pb_grpc.ProxyStub(ch)
        t, rec = self.topic, pb.Record

        def one(record: Any) -> Any:
            return stub.Produce(pb.ProduceRequest(record=record), timeout=30)

        # values: over gRPC's 4 MiB message limit; over the rule's and the default limits
        assert await _code(one(rec(topic=t, key=b"k", value=b"x" * (5 * MiB)))) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _code(one(rec(topic=t, key=b"k", value=b"x" * (2 * MiB)))) == INVALID
        assert await _code(one(rec(topic=self.small, key=b"k", value=b"x" * 65))) == INVALID
        # not UTF-8: a header name, a topic
        raw = ch.unary_unary(f"/{SERVICE_NAME}/Produce")
        bad_header = _raw_request(rec(topic=t, key=b"k", value=b"v", headers=[
            pb.Header(key="h@@", value=b"v")]), (b"h@@", b"h\xff\xfe"))
        assert await _code(raw(bad_header, timeout=30)) == INVALID
        bad_topic = _raw_request(rec(topic=t + "@@", key=b"k"), (b"@@", b"\xc3\x28"))
        assert await _code(raw(bad_topic, timeout=30)) == INVALID
        assert await _code(raw(b"\xff" * 64, timeout=30)) == INVALID  # not protobuf at all
        # reserved header names, any case
        for name in ("dr-id", "DR-Epoch", "dr-"):
            assert await _code(one(rec(topic=t, key=b"k", value=b"v", headers=[
                pb.Header(key=name, value=b"1")]))) == INVALID
        # batches: more records than allowed; more bytes than a message may hold
        many = pb.ProduceBatchRequest(records=[rec(topic=t, key=b"k")] * 10_001)
        assert await _code(stub.ProduceBatch(many, timeout=30)) == INVALID
        heavy = pb.ProduceBatchRequest(records=[rec(topic=t, key=b"k", value=b"x" * 1000)]
                                       * 5000)
        assert await _code(stub.ProduceBatch(heavy, timeout=30)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        # topics: empty, unknown, absurdly long; a missing key where the rule needs one
        assert await _code(one(rec(topic="", key=b"k", value=b"v"))) == INVALID
        assert await _code(one(rec(topic="nope-" + "x" * 10_000, key=b"k"))) == \
            grpc.StatusCode.NOT_FOUND
        assert await _code(one(rec(topic=t, value=b"no key"))) == INVALID
        mixed = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
            rec(topic="", key=b"k"), rec(topic=t, key=b"k", value=b"ok"),
            rec(topic=t, key=b"k", headers=[pb.Header(key="dr-ts", value=b"0")])]),
            timeout=30)
        assert [r.code for r in mixed.results] == [INVALID.value[0], 0, INVALID.value[0]]
        # streams abandoned: after their first answer, and before any
        await asyncio.gather(*(self._abandon(stub, read_first=i % 2 == 0)
                               for i in range(20)))
        await self.good(stub)
        await self._crowd(clients)
        await self.good(stub)

    async def _abandon(self, stub: Any, *, read_first: bool) -> None:
        batch = pb.ProduceBatchRequest(records=[pb.Record(topic=self.topic, key=b"k",
                                                          value=b"s" * 100)] * 10)

        async def requests() -> AsyncIterator[Any]:
            for _ in range(3):
                yield batch
            await asyncio.Event().wait()  # never half-closes: the client walks away

        call = stub.ProduceStream(requests(), timeout=60)
        if read_first:
            first = await call.read()
            assert len(first.results) == 10
            # a good batch: written, or (Kafka slow to ack on a loaded machine) UNAVAILABLE
            # saying so; never another code
            bad = [(r.code, r.message) for r in first.results if r.status != pb.STATUS_OK
                   and r.code != grpc.StatusCode.UNAVAILABLE.value[0]]
            assert not bad, bad[:3]
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED

    async def _crowd(self, clients: int) -> None:
        """`clients` clients at once, each on its own connection, one record each."""
        channels = [grpc.aio.insecure_channel(self.proxy.target) for _ in range(clients)]
        try:
            results = await asyncio.gather(*(pb_grpc.ProxyStub(c).Produce(
                pb.ProduceRequest(record=pb.Record(topic=self.topic, key=b"c%d" % i,
                                                   value=b"crowd")), timeout=60)
                for i, c in enumerate(channels)), return_exceptions=True)
        finally:
            await asyncio.gather(*(c.close() for c in channels))
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} of {clients} clients failed: {errors[:3]}"
        assert all(r.result.status == pb.STATUS_OK for r in results)  # type: ignore[union-attr]


async def _trims(proxy: Proxy) -> float:
    return await asyncio.to_thread(proxy.metric, "crossdc_proxy_heap_trims_total")


async def _settled_rss(proxy: Proxy) -> float:
    """The proxy's RSS once it has given back what it freed (`proxy.heap`): after its next
    malloc_trim (every few seconds while glibc keeps >= 8 MiB freed; a round frees ~70)."""
    before = await _trims(proxy)

    async def trimmed() -> bool:
        return await _trims(proxy) > before
    await eventually(trimmed, 30, "the proxy's next heap trim")
    return _rss_mib(proxy.proc.pid)


async def _run(two_regions, proxy: Proxy, rounds: int, clients: int, *,  # type: ignore[no-untyped-def]
               per_round: bool = False) -> None:
    """`rounds` hostile rounds after a warm-up one. `per_round`: also the settled RSS after
    every round (the plateau check; a few seconds more per round)."""
    topic, small = unique("ord-hostile"), unique("small-hostile")
    for r in two_regions.topology.regions:
        for name in (topic, small):
            await create_topic(r.kafka.bootstrap, name, partitions=3)
    hostile = Hostile(proxy, topic, small)
    pid = proxy.proc.pid
    opts = [("grpc.max_send_message_length", 16 * MiB)]
    async with grpc.aio.insecure_channel(proxy.target, options=opts) as ch:
        await hostile.good(pb_grpc.ProxyStub(ch))
        start_mib = _rss_mib(pid)
        t0 = time.monotonic()
        await hostile.round(ch, clients)  # warm-up
        base_mib = await _settled_rss(proxy) if per_round else _rss_mib(pid)
        peaks, settled = [], []
        for _ in range(rounds):
            await hostile.round(ch, clients)
            peaks.append(_rss_mib(pid))
            assert proxy.proc.returncode is None, proxy.log.read_text()[-3000:]
            if per_round:
                settled.append(await _settled_rss(proxy))
        took = time.monotonic() - t0

        async def back() -> bool:
            return _rss_mib(pid) <= base_mib + RSS_TOLERANCE_MIB

        settled_ok = True
        try:
            await eventually(back, 20, "the proxy's RSS back near its baseline")
        except AssertionError:
            settled_ok = False
        end_mib = _rss_mib(pid)
        print(f"\nproxy RSS (MiB): after start {start_mib:.1f}, warm baseline {base_mib:.1f}"
              f"{' (trimmed)' if per_round else ''}, right after each of {rounds} rounds "
              f"{', '.join(f'{p:.1f}' for p in peaks)}"
              + (f"; after each round's trim {', '.join(f'{p:.1f}' for p in settled)}"
                 if per_round else "")
              + f"; end {end_mib:.1f} (tolerance +{RSS_TOLERANCE_MIB:g}); {clients} clients "
              f"per round; {rounds + 1} rounds in {took:.1f} s")
        assert settled_ok, (f"RSS {end_mib:.1f} MiB > baseline {base_mib:.1f} + "
                            f"{RSS_TOLERANCE_MIB:g} MiB")
        if per_round:
            over = [p for p in settled if p > base_mib + SETTLED_TOLERANCE_MIB]
            assert not over, (f"trimmed RSS over the trimmed baseline {base_mib:.1f} + "
                              f"{SETTLED_TOLERANCE_MIB:g} MiB: {settled}")
        await hostile.good(pb_grpc.ProxyStub(ch))

    async def gave_back() -> bool:  # the trimmer ran and returned memory to the OS
        return await asyncio.to_thread(
            proxy.metric, "crossdc_proxy_heap_trimmed_bytes_total") > 0
    await eventually(gave_back, 30, "freed memory given back (crossdc_proxy_heap_trims)")

    async def budget_free() -> bool:
        return await asyncio.to_thread(proxy.metric, "crossdc_proxy_inflight_bytes") == 0
    await eventually(budget_free, 10, "no bytes left in flight")
    assert await asyncio.to_thread(proxy.metric, "crossdc_proxy_serving") == 1.0
    assert await asyncio.to_thread(proxy.metric, "crossdc_proxy_undecodable_requests_total") \
        == 3 * (rounds + 1)
    text = proxy.log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert proxy.proc.returncode is None


async def test_hostile_requests_get_their_codes_and_memory_comes_back(  # type: ignore[no-untyped-def]
        two_regions, proxy: Proxy) -> None:
    await _run(two_regions, proxy, rounds=2, clients=200)


# The long run belongs with the long runs (`make chaos`): 10 rounds of 500 clients, the RSS
# settled (trimmed) after each must stay near the baseline (SETTLED_TOLERANCE_MIB). Before
# proxy.heap it grew about 3.5 MiB a round and never came back.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CROSSDC_CHAOS", "").lower() != "full",
                    reason="long run: `make chaos` (CROSSDC_CHAOS=full)")
async def test_hostile_requests_many_rounds(two_regions, proxy: Proxy) -> None:  # type: ignore[no-untyped-def]
    await _run(two_regions, proxy, rounds=10, clients=500, per_round=True)


