"""`dr proxy serve --workers N` and the region-shared idempotency log, on the real stack.

- The command with two workers on one port: both serve, their metrics come out of the one
  endpoint, a killed worker is restarted and counted, SIGTERM drains both and exits 0.
- Idempotency across processes: two servers of the same region sharing the log (what two
  workers of one proxy are, and two proxies of one region): a retry carrying the same key
  that reaches the other one is answered from the first result, and a sync write that
  reached only some regions, retried through the other one, writes only the missing ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, eventually, read_all, unique
from primary_helpers import agreed_primary

from dr.stack.ports import free_port
from proxy.api import pb, pb_grpc
from proxy.config import BreakerSettings, KafkaWriterSettings, ProxyConfig
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "sync-*"
    mode: ordered
    sync: true
  - topic: "near-*"
    mode: nearest
"""

RETRY = (("dr-attempt", "2"),)


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    """Every datacenter holds one record naming east writable: a proxy renews its primary
    lease only from a majority of datacenters showing the same record, and an absent key
    renews nothing (the controller writes the epoch-0 record at its first start)."""
    await agreed_primary(two_regions.topology)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("policy") / "policy.yaml"
    p.write_text(POLICY)
    return p


def _scrape(port: int) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=5).read().decode())


def _samples(text: str, name: str) -> dict[str, float]:
    """Every sample of `name`: labels text -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


class _Events:
    """The JSON log lines of a process's stderr, collected as they come."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.task = asyncio.create_task(self._read(stream), name="test:stderr")

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace")
            self.raw.append(text)
            try:
                self.lines.append(json.loads(text))
            except ValueError:
                continue

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.lines if e.get("event") == event]

    def text(self) -> str:
        return "".join(self.raw)[-4000:]


async def _produce(port: int, topic: str, n: int, channels: int) -> int:
    """`n` records over `channels` separate connections (spread over the workers)."""
    ok = 0
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(channels)]
    try:
        for i in range(n):
            stub = pb_grpc.ProxyStub(chans[i % channels])
            r = await stub.Produce(pb.ProduceRequest(record=pb.Record(
                topic=topic, key=b"k%d" % i, value=b"v")), timeout=10)
            ok += r.result.status == pb.STATUS_OK
    finally:
        for ch in chans:
            await ch.close()
    return ok


@pytest.mark.slow  # starts three worker processes (~30 s, more on a loaded machine)
async def test_two_workers_serve_one_port_restart_a_dead_one_and_drain(  # type: ignore[no-untyped-def]
        two_regions, policy_file: Path) -> None:
    port, mport = free_port(), free_port()
    topic = unique("near-workers")
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, topic, partitions=2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "--log-format", "json", "--log-level", "info",
        "proxy", "serve", "--topology", str(two_regions.topology_path), "--region", "east",
        "--policy", str(policy_file), "--no-consul", "--grace", "2", "--workers", "2",
        "--port", str(port), "--metrics-port", str(mport), stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    events = _Events(proc.stderr)
    try:
        async def serving(n: int = 2) -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"dr proxy serve exited {proc.returncode}: "
                                     f"{events.text()}")
            try:
                text = await asyncio.to_thread(_scrape, mport)
            except OSError:
                return False
            return _samples(text, "crossdc_proxy_workers_serving").get("") == n

        try:
            await eventually(serving, 60, "two workers serving")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {events.text()}") from None
        pids = events.named("proxy_serving")[0]["pids"]
        assert len(set(pids)) == 2

        # both serve the one port: 40 records over 8 connections, all written, and the one
        # endpoint counts them all (each worker's counters summed)
        assert await _produce(port, topic, 40, 8) == 40
        text = await asyncio.to_thread(_scrape, mport)
        records = _samples(text, "crossdc_proxy_records_total")
        assert records['{mode="nearest",region="east"}'] == 40
        # metrics of both workers: the per-process policy version carries each pid
        versions = _samples(text, "crossdc_proxy_policy_version")
        assert {f'{{pid="{p}"}}' for p in pids} <= set(versions), versions
        assert _samples(text, "crossdc_proxy_serving")[""] == 1  # max over live workers

        # a killed worker is restarted and counted; the proxy keeps serving meanwhile
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)

        async def restarted() -> bool:
            text = await asyncio.to_thread(_scrape, mport)
            return (_samples(text, "crossdc_proxy_worker_restarts_total")
                    .get('{worker="0"}') == 1 and await serving())

        await eventually(restarted, 60, "worker 0 restarted and serving")
        restart_s = time.monotonic() - t0
        died = events.named("proxy_worker_died")
        assert [(e["worker"], e["pid"]) for e in died] == [(0, pids[0])]
        again = events.named("proxy_worker_restarted")
        assert [e["worker"] for e in again] == [0]
        assert again[0]["restart_s"] > 0
        assert await _produce(port, topic, 10, 4) == 10
        text = await asyncio.to_thread(_scrape, mport)
        # the dead worker's counts are kept: nothing counted is lost with a restart
        assert _samples(text, "crossdc_proxy_records_total")[
            '{mode="nearest",region="east"}'] == 50
        assert _samples(text, "crossdc_proxy_worker_restarts_total")['{worker="1"}'] == 0

        # SIGTERM drains every worker and exits 0
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(40):
            await proc.wait()
        await events.task
        assert proc.returncode == 0, events.text()
        drained = events.named("proxy_drained")
        assert [e["exits"] for e in drained] == [[0, 0]], events.text()
        assert "Traceback" not in events.text()
        print(f"restart: {restart_s:.2f}s (worker's own figure "
              f"{again[0]['restart_s']}s); drain: {drained[0]['seconds']}s")
        for pid in [*pids, again[0]["pid"]]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        events.task.cancel()
        await asyncio.wait({events.task})


# -- idempotency across processes ---------------------------------------------------------

def _cfg(**kw: Any) -> ProxyConfig:
    return ProxyConfig(region="east", register_consul=False, primary_wait_s=5.0, grace_s=1.0,
                       idempotency_log=True,
                       kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                       **kw)


@pytest.fixture
async def two_servers(two_regions, policy_file: Path  # type: ignore[no-untyped-def]
                      ) -> AsyncIterator[tuple[ProxyServer, ProxyServer]]:
    """Two servers of region east sharing the idempotency log: two workers of one proxy,
    or two proxies of one region, are exactly this. `a`'s breakers stay open once opened."""
    a = ProxyServer(two_regions.topology, _cfg(breaker=BreakerSettings(reset_timeout_s=120)),
                    policy_file)
    b = ProxyServer(two_regions.topology, _cfg(), policy_file)
    await asyncio.gather(a.start(), b.start())
    try:
        for s in (a, b):
            log = s.idem_log
            assert log is not None

            async def connected(log: Any = log) -> bool:
                return bool(log.connected)
            await eventually(connected, 30, "idempotency log connected")
        yield a, b
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def _stub(server: ProxyServer) -> tuple[grpc.aio.Channel, Any]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return ch, pb_grpc.ProxyStub(ch)


async def test_a_retry_reaching_another_process_is_answered_not_written(  # type: ignore[no-untyped-def]
        two_regions, two_servers) -> None:
    a, b = two_servers
    topic = unique("near-idem")
    await create_topic(two_regions.bootstrap("east"), topic, partitions=1)
    rec = pb.Record(topic=topic, key=b"k", value=b"once", idempotency_key="idem-1")
    ach, astub = await _stub(a)
    bch, bstub = await _stub(b)
    try:
        first = (await astub.Produce(pb.ProduceRequest(record=rec), timeout=10)).result
        assert first.status == pb.STATUS_OK
        assert not first.duplicate
        assert b.idem_log is not None
        # no retry yet: b only appends, it does not read the log (nor learn a's outcome)
        assert not b.idem_log.reading
        assert b.metrics.idem_log_learned._value.get() == 0
        b.idem_log.tail_idle_s = 2 * b.idem_log.wait_s  # pause soon after the retry

        # a client retries a result only when its answer was lost, 100 ms later at the
        # soonest (the SDK): by then the first attempt's outcome is appended (it lingers
        # `linger_s`, 20 ms, to share a log record with others)
        async def appended() -> bool:
            return bool(a.metrics.idem_log_appends._value.get() >= 1)
        await eventually(appended, 10, "a's outcome appended to the log")
        retry = (await bstub.Produce(pb.ProduceRequest(record=rec), timeout=10,
                                     metadata=RETRY)).result
        assert retry.duplicate
        assert [(w.region, w.partition, w.offset) for w in retry.written] == \
            [(w.region, w.partition, w.offset) for w in first.written]
        assert retry.dr_id == first.dr_id
        assert b.idem_log.reading  # the retry had the log read up to its end
    finally:
        await ach.close()
        await bch.close()
    recs = await read_all(two_regions.bootstrap("east"), topic, 1)
    assert [r.value for r in recs] == [b"once"]
    assert b.metrics.idem_log_learned._value.get() >= 1

    async def paused() -> bool:
        return not b.idem_log.reading
    await eventually(paused, 30, "b's reader paused after the last retry")


async def test_a_partial_sync_retried_through_another_process_writes_only_the_missing(  # type: ignore[no-untyped-def]
        two_regions, two_servers) -> None:
    a, b = two_servers
    topic = unique("sync-idem")
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, topic, partitions=1)
    west = a.writers["west"].breaker
    for _ in range(a.config.breaker.failure_threshold):  # a cannot write west
        west.record_failure()
    assert not west.available()
    rec = pb.Record(topic=topic, key=b"acct", value=b"ledger-1", idempotency_key="tx-9")
    ach, astub = await _stub(a)
    bch, bstub = await _stub(b)
    try:
        part = (await astub.ProduceBatch(pb.ProduceBatchRequest(records=[rec]),
                                         timeout=10)).results[0]
        assert part.status == pb.STATUS_PARTIAL
        assert [w.region for w in part.written] == ["east"]
        done = (await bstub.ProduceBatch(pb.ProduceBatchRequest(records=[rec]), timeout=10,
                                         metadata=RETRY)).results[0]
        assert done.status == pb.STATUS_OK, done.message
        assert [w.region for w in done.written] == ["east", "west"]
        # east's copy is the one a wrote (resumed, not written again)
        assert (done.written[0].partition, done.written[0].offset) == \
            (part.written[0].partition, part.written[0].offset)
    finally:
        await ach.close()
        await bch.close()
    for region in ("east", "west"):
        recs = await read_all(two_regions.bootstrap(region), topic, 1)
        assert [r.value for r in recs] == [b"ledger-1"], region
