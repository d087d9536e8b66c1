"""The worker supervisor of `dr proxy serve --workers N` (with stand-in worker processes: the
real ones are tested in tests/integration/test_proxy_workers.py), and the pure parts of the
region-shared idempotency log (what a process learns from it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from crossdc.clients.connection import KafkaConnection
from crossdc.topology import load_topology
from proxy.config import ProxyConfig
from proxy.errors import ProxyTaskFailed
from proxy.idempotency import IdempotencyLog, IdempotencyWindow, LogUnavailable
from proxy.metrics import ProxyMetrics
from proxy.workers import ProxySupervisor, WorkerSpec
from proxy.writers import RegionWrite

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "policies" / "topology.local.yaml"

# A stand-in worker: says it serves (as a real worker does, on stdout), then waits for
# SIGTERM and exits 0; on SIGHUP it reports NOT_SERVING. FAKE_WORKER=fail: exits 3 before
# serving.
FAKE = f"""#!{sys.executable}
import json, os, signal, sys, time
spec = json.loads(sys.argv[-1])
if os.environ.get("FAKE_WORKER") == "fail":
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGHUP, lambda *_: print(json.dumps({{"serving": False}}), flush=True))
print(json.dumps({{"serving": True, "pid": os.getpid()}}), flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _supervisor(python: str, workers: int = 2, **kw: Any) -> ProxySupervisor:
    topo = load_topology(TOPOLOGY)
    cfg = ProxyConfig(region="east", host="127.0.0.1", port=0, metrics_port=None,
                      register_consul=False, grace_s=1.0, close_timeout_s=1.0)
    spec = WorkerSpec(topology=TOPOLOGY, region="east", policy=Path("p.yaml"),
                      host="127.0.0.1", port=0)
    return ProxySupervisor(topo, cfg, spec, workers, python=python, restart_backoff_s=0.01,
                           **kw)


@pytest.fixture
async def running(fake_python: str) -> AsyncIterator[tuple[ProxySupervisor, asyncio.Event,
                                                           asyncio.Task[None]]]:
    sup = _supervisor(fake_python)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sup.run(stop, ready=ready), name="test:supervisor")
    try:
        async with asyncio.timeout(30):
            await ready.wait()
        yield sup, stop, task
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await asyncio.wait({task})


async def _until(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    """Poll `cond` to a deadline (the supervisor's state changes as its workers report)."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if cond():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"{what} not reached within {timeout_s}s") from None


def _metric(sup: ProxySupervisor, line_start: str) -> float:
    for line in generate_latest(sup.registry).decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not exported")


async def test_every_worker_starts_on_one_reserved_port_and_reports_serving(
        running: Any) -> None:
    sup, _, _ = running
    assert sup.port > 0  # port 0: one picked and held for every worker
    await _until(lambda: sup.health()["serving"], "serving")
    h = sup.health()
    assert [w["alive"] for w in h["workers"]] == [True, True]
    assert len({w["pid"] for w in h["workers"]}) == 2
    await _until(lambda: _metric(sup, "crossdc_proxy_workers_serving") == 2, "gauge")
    assert _metric(sup, "crossdc_proxy_workers_alive") == 2
    assert _metric(sup, "crossdc_proxy_workers") == 2


async def test_a_dead_worker_is_restarted_counted_and_logged(running: Any) -> None:
    from structlog.testing import capture_logs
    sup, _, _ = running
    old = sup.states[1].pid
    with capture_logs() as logs:
        os.kill(old, signal.SIGKILL)
        await _until(lambda: sup.states[1].restarts == 1 and sup.states[1].serving
                     and sup.states[1].pid != old, "restarted")
    assert _metric(sup, 'crossdc_proxy_worker_restarts_total{worker="1"}') == 1
    assert _metric(sup, 'crossdc_proxy_worker_restarts_total{worker="0"}') == 0
    died = [e for e in logs if e["event"] == "proxy_worker_died"]
    assert [(e["worker"], e["pid"], e["exit_code"]) for e in died] == \
        [(1, old, -signal.SIGKILL)]
    again = [e for e in logs if e["event"] == "proxy_worker_restarted"]
    assert [e["worker"] for e in again] == [1]
    assert sup.states[0].restarts == 0


async def test_sighup_is_passed_on_to_every_worker(running: Any) -> None:
    sup, _, _ = running
    await _until(lambda: all(s.serving for s in sup.states), "serving")
    sup.forward_sighup()
    await _until(lambda: not any(s.serving for s in sup.states), "every worker got SIGHUP")
    assert not sup.health()["serving"]
    assert all(s.alive for s in sup.states)


async def test_stop_drains_every_worker_and_ends_cleanly(running: Any) -> None:
    sup, stop, task = running
    pids = [s.pid for s in sup.states]
    metrics_dir = sup.metrics_dir
    assert metrics_dir is not None
    assert metrics_dir.is_dir()
    stop.set()
    async with asyncio.timeout(20):
        await task
    assert [s.last_exit for s in sup.states] == [0, 0]
    assert sup.drain_s is not None
    assert sup.drain_s < 5
    assert sup.states[0].restarts == sup.states[1].restarts == 0  # a drain is no death
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not metrics_dir.exists()
    assert not sup.health()["serving"]


async def test_a_worker_that_never_serves_stops_the_supervisor(
        fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_WORKER", "fail")
    sup = _supervisor(fake_python, workers=1, max_start_failures=3)
    with pytest.raises(ProxyTaskFailed) as ei:
        async with asyncio.timeout(30):
            await sup.run(asyncio.Event())
    assert "worker 0 ended 3 times in a row before serving (last exit code 3)" in \
        str(ei.value)
    assert sup.states[0].restarts == 3


async def test_a_stop_before_every_worker_started_still_ends(fake_python: str) -> None:
    sup = _supervisor(fake_python)
    stop = asyncio.Event()
    stop.set()
    async with asyncio.timeout(30):
        await sup.run(stop)
    assert all(s.restarts == 0 for s in sup.states)
    assert not any(s.alive for s in sup.states)


def test_a_worker_is_told_its_index_and_the_port(fake_python: str) -> None:
    spec = WorkerSpec(topology=TOPOLOGY, region="east", policy=Path("p.yaml"),
                      host="127.0.0.1", port=0)
    told = json.loads(spec.model_copy(update={"index": 1, "port": 7001}).model_dump_json())
    assert (told["index"], told["port"]) == (1, 7001)
    with pytest.raises(ValueError, match="at least 1"):
        _supervisor(fake_python, workers=0)


# -- the shared idempotency log: what a process learns ------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_an_outcome_learned_from_the_log_answers_a_retry_here() -> None:
    clock = _Clock()
    w = IdempotencyWindow(60.0, 100, clock=clock)
    log = IdempotencyLog(KafkaConnection.of("127.0.0.1:1"), "_crossdc.proxy.idempotency", w,
                         ProxyMetrics(CollectorRegistry()), client_id="t")
    result = ("id-1", "nearest", None, "east", 0, 41)
    now_ms = int(time.time() * 1000)
    other = [("o", b"another-process")]
    # one record carries many outcomes: a result, and a partial sync to resume from
    chunk = json.dumps([["orders", "id-1", list(result)],
                        ["ledger", "tx-1", None, [["east", 2, 7]]]]).encode()
    log._apply(b"another-process:1", chunk, now_ms, other)
    slot = w.claim_nowait("orders", "id-1")
    assert slot is not None
    assert not slot.owner
    assert slot.result == result
    slot = w.claim_nowait("ledger", "tx-1")
    assert slot is not None
    assert slot.owner
    assert slot.partial == [RegionWrite("east", 2, 7)]
    assert log.metrics.idem_log_learned._value.get() == 2
    # a one-outcome record of an earlier version is still read
    legacy = json.dumps({"o": "another-process", "r": list(result)}).encode()
    log._apply(b"orders\0id-0", legacy, now_ms)
    assert not w.claim_nowait("orders", "id-0").owner  # type: ignore[union-attr]
    # our own appends (skipped by their header, undecoded), and outcomes older than the
    # window, are not learned
    mine = json.dumps([["orders", "id-2", list(result)]]).encode()
    log._apply(f"{log.origin}:1".encode(), mine, now_ms, [("o", log.origin.encode())])
    log._apply(f"{log.origin}:2".encode(), b"{not even json", now_ms,
               [("o", log.origin.encode())])
    old = int((time.time() - 120) * 1000)
    log._apply(b"another-process:2", json.dumps([["orders", "id-3", list(result)]]).encode(),
               old, other)
    assert w.claim_nowait("orders", "id-2").owner  # type: ignore[union-attr]
    assert w.claim_nowait("orders", "id-3").owner  # type: ignore[union-attr]
    assert log.metrics.idem_log_errors.labels("tail")._value.get() == 0
    # a record that does not decode is counted, not fatal
    log._apply(b"another-process:3", b"{not json", 0, other)
    log._apply(b"another-process:4", b'[["t"]]', 0, other)
    assert log.metrics.idem_log_errors.labels("tail")._value.get() == 2


async def test_a_key_written_here_is_not_overwritten_by_the_log() -> None:
    w = IdempotencyWindow(60.0, 100)
    mine = w.claim_nowait("t", "k")
    assert mine is not None
    assert mine.owner
    assert not w.learn(("t", "k"), result=("x",))  # being written here
    w.finish(mine, ("ours",))
    assert not w.learn(("t", "k"), result=("theirs",))
    again = w.claim_nowait("t", "k")
    assert again is not None
    assert again.result == ("ours",)


async def test_finished_and_partial_outcomes_are_queued_for_the_log() -> None:
    w = IdempotencyWindow(60.0, 100)
    log = IdempotencyLog(KafkaConnection.of("127.0.0.1:1"), "_crossdc.proxy.idempotency", w,
                         ProxyMetrics(CollectorRegistry()), client_id="t")
    a = w.claim_nowait("t", "a")
    b = w.claim_nowait("t", "b")
    assert a is not None
    assert b is not None
    w.finish(a, ("a", "nearest", None, "east", 0, 1))
    w.fail(b, partial=[RegionWrite("east", 0, 2)])
    # one log record for both (what _send_queued encodes), naming them by topic and key
    entries = json.loads(json.dumps([e for _, e, _ in log._queue]))
    assert entries == [["t", "a", ["a", "nearest", None, "east", 0, 1]],
                       ["t", "b", None, [["east", 0, 2]]]]
    # a partial write's answer waits for its append (here: until stop() gives up on it)
    waiting = asyncio.create_task(log.published(asyncio.get_running_loop().time() + 5))
    await asyncio.sleep(0)
    assert not waiting.done()
    await log.stop()
    await waiting


async def test_a_log_that_timed_out_decides_retries_at_once_and_is_tried_again_later() -> None:
    """Own region's Kafka down: the first retry waits its bound, the next ones are answered
    from the local window at once (no wait), and one retry a `retry_s` tries the log again."""
    w = IdempotencyWindow(60.0, 100)
    log = IdempotencyLog(KafkaConnection.of("127.0.0.1:1"), "_crossdc.proxy.idempotency", w,
                         ProxyMetrics(CollectorRegistry()), client_id="t", retry_s=0.2)
    loop = asyncio.get_running_loop()
    with pytest.raises(LogUnavailable, match="not read up to its end in time"):
        await log.catch_up(loop.time() + 0.1)  # never connected: waits out its bound
    for _ in range(3):
        with pytest.raises(LogUnavailable, match="has not been readable for"):
            await log.catch_up(loop.time() + 5)  # known down: no wait (else 5 s each)
    await asyncio.sleep(0.25)  # retry_s passes
    with pytest.raises(LogUnavailable, match="not read up to its end in time"):
        await log.catch_up(loop.time() + 0.1)  # tried again
    # a partial write's answer no longer waits for an append the down log cannot take
    slot = w.claim_nowait("t", "p")
    assert slot is not None
    w.fail(slot, partial=[RegionWrite("west", 0, 3)])
    await asyncio.wait_for(log.published(loop.time() + 30), 1.0)
    assert log.metrics.idem_log_errors.labels("append")._value.get() == 1
    await log.stop()


async def test_a_partial_writes_answer_waits_at_most_wait_s_for_the_log() -> None:
    """The first partial write of an outage waits `wait_s` (not its whole deadline), then
    the log counts as down."""
    w = IdempotencyWindow(60.0, 100)
    log = IdempotencyLog(KafkaConnection.of("127.0.0.1:1"), "_crossdc.proxy.idempotency", w,
                         ProxyMetrics(CollectorRegistry()), client_id="t", wait_s=0.1)
    slot = w.claim_nowait("t", "p")
    assert slot is not None
    w.fail(slot, partial=[RegionWrite("west", 0, 3)])
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(log.published(loop.time() + 30), 5.0)  # not the 30 s deadline
    with pytest.raises(LogUnavailable, match="has not been readable for"):
        await log.catch_up(loop.time() + 30)  # down: a retry is decided at once
    await log.stop()
