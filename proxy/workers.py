"""`dr proxy serve --workers N`: N proxy processes serving one port, under a supervisor.

One Python process tops out near one core, so the proxy runs N worker processes, each a full
`ProxyServer` (its own producers, primary watch, policy store, idempotency window) bound to
the same gRPC port with SO_REUSEPORT: the kernel spreads new connections over the workers
(a gRPC channel is one connection: one worker per channel). This process is the supervisor:

- it starts the workers (`python -m proxy.workers SPEC`), each with PROMETHEUS_MULTIPROC_DIR
  set to a fresh directory, and serves every worker's metrics together on the one metrics
  port (prometheus-client's multiprocess mode: `proxy.metrics` says how gauges combine) next
  to its own (`crossdc_proxy_workers*`, `crossdc_proxy_worker_restarts_total{worker}`);
- a worker that ends without being asked to is logged (`proxy_worker_died`, with its index,
  pid and exit code), counted, and started again (`proxy_worker_restarted`, with the time it
  took to serve again); after a pause that doubles while it keeps dying before it served
  (0.5 s, 1 s, 2 s, at most 5 s). A worker that dies `max_start_failures` times in a row
  without ever serving (a bad certificate, a port taken) stops the supervisor:
  `ProxyTaskFailed`, exit non-zero;
- health: each worker reports its gRPC health (SERVING / NOT_SERVING) on its stdout; the
  supervisor's `health()` and the gauges `crossdc_proxy_workers_alive` /
  `crossdc_proxy_workers_serving` say how many run and serve; `crossdc_proxy_serving` (the
  max over live workers) is 1 while any does. Clients and Consul's gRPC check on the port
  reach a worker (a dead worker's socket is closed: the kernel sends nothing to it);
- Consul: the supervisor registers ONE service instance for the proxy (not one per worker)
  once a worker serves, and removes it on exit;
- SIGTERM/SIGINT: every worker gets SIGTERM and drains (NOT_SERVING, calls in flight finish,
  producers flushed, clients closed, exit 0); bounded: a worker still running after
  `grace_s + close_timeout_s + 5 s` is killed. SIGHUP is passed on (policy and auth reload).
- a worker dies with its supervisor (PR_SET_PDEATHSIG: SIGKILL, as the supervisor was when
  it ends without draining them, e.g. `kill -9`), so none is left serving alone.

Idempotency across workers (and the region's other proxies) goes through the shared log of
`proxy.idempotency` (`idempotency_log`, on by default with the command).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from pydantic import BaseModel, ConfigDict

from crossdc.clients.consul import ConsulClient
from crossdc.errors import CrossdcError
from crossdc.security import PROXY
from crossdc.settings import Backoff
from crossdc.topology import Topology
from proxy.config import ProxyConfig, TlsSettings
from proxy.errors import ProxyTaskFailed
from proxy.metrics import WorkerMetrics

__all__ = ["ProxySupervisor", "WorkerSpec", "WorkerState", "worker_main"]

log = structlog.get_logger("crossdc.proxy.workers")

SUPERVISOR_PID_ENV = "CROSSDC_PROXY_SUPERVISOR_PID"


class WorkerSpec(BaseModel):
    """What a worker process is told (JSON on its command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topology: Path
    region: str
    policy: Path
    kafka_principal: str = PROXY
    kafka_client: Literal["aiokafka", "librdkafka"] = "aiokafka"
    fenced_writes: bool | None = None
    host: str
    port: int
    grace_s: float = 10.0
    auth: Path | None = None
    tls: TlsSettings | None = None
    primary_lease_s: float = 5.0
    primary_write_s: float = 1.5
    idempotency_log: bool = True
    journal: bool = True
    log_format: Literal["console", "json"] = "console"
    log_level: str = "warning"
    index: int = 0


@dataclass
class WorkerState:
    """What the supervisor knows of one worker slot."""

    index: int
    pid: int | None = None
    alive: bool = False
    started: bool = False  # reported serving-ready since its last (re)start
    serving: bool = False
    restarts: int = 0
    last_exit: int | None = None
    died_at: float | None = None
    proc: asyncio.subprocess.Process | None = None


class ProxySupervisor:
    """Runs `workers` worker processes of one proxy until `run(stop)`'s event is set."""

    def __init__(self, topology: Topology, config: ProxyConfig, spec: WorkerSpec,
                 workers: int, *, restart_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 max_start_failures: int = 3, python: str = sys.executable) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.topology = topology
        self.config = config
        self.region = topology.region(config.region)
        self.spec = spec
        self.workers = workers
        self.restart_backoff_s = restart_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_start_failures = max_start_failures
        self.python = python
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, workers)
        self.states = [WorkerState(i) for i in range(workers)]
        self.port = config.port
        self.metrics_port: int | None = None
        self.metrics_dir: Path | None = None
        self.drain_s: float | None = None
        self._stop = asyncio.Event()
        self._all_started = asyncio.Event()
        self._any_serving = asyncio.Event()
        self._reserve: socket.socket | None = None
        self._http: Any = None
        self._consul: ConsulClient | None = None
        self._service_id: str | None = None
        self.log = log.bind(region=config.region)

    # -- state -------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Serving while any worker serves (and no drain began); per worker: pid, alive,
        serving, restarts."""
        return {"region": self.config.region, "port": self.port,
                "serving": not self._stop.is_set() and any(s.serving for s in self.states),
                "workers": [{"index": s.index, "pid": s.pid, "alive": s.alive,
                             "serving": s.serving, "restarts": s.restarts,
                             "last_exit": s.last_exit} for s in self.states]}

    def _gauges(self) -> None:
        self.metrics.alive.set(sum(s.alive for s in self.states))
        self.metrics.workers_serving.set(sum(s.serving for s in self.states))
        if any(s.serving for s in self.states):
            self._any_serving.set()
        if all(s.started for s in self.states):
            self._all_started.set()

    def forward_sighup(self) -> None:
        """SIGHUP to every live worker (each reloads its policy and auth file)."""
        for s in self.states:
            if s.proc is not None and s.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    s.proc.send_signal(signal.SIGHUP)

    # -- run ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, ready: asyncio.Event | None = None) -> None:
        """Start the workers, keep them running until `stop` is set, then drain them all.
        ProxyTaskFailed when a worker keeps dying before it serves."""
        self._prepare()
        try:
            async with asyncio.TaskGroup() as tg:
                keepers = [tg.create_task(self._keep(s), name=f"proxy:worker-{s.index}")
                           for s in self.states]
                tg.create_task(self._announce(ready), name="proxy:workers-ready")
                tg.create_task(self._drain_on(stop, keepers), name="proxy:workers-drain")
        except* ProxyTaskFailed as group:
            raise group.exceptions[0] from None
        finally:
            await self._cleanup()

    def _prepare(self) -> None:
        cfg = self.config
        if self.port == 0:  # pick one, and hold it (bound, not listening) while we run
            sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((cfg.host, 0))
            self._reserve = sock
            self.port = int(sock.getsockname()[1])
        self.metrics_dir = Path(tempfile.mkdtemp(prefix=f"crossdc-proxy-{cfg.region}-"
                                                 "metrics-"))
        MultiProcessCollector(self.registry, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]
        if cfg.metrics_port is not None:
            port = cfg.metrics_port
            if port == 0:
                with socket.socket() as s:
                    s.bind((cfg.host, 0))
                    port = int(s.getsockname()[1])
            self._http, _ = start_http_server(port, addr=cfg.host, registry=self.registry)
            self.metrics_port = port
        self._gauges()

    async def _cleanup(self) -> None:
        if self._consul is not None:
            if self._service_id is not None:
                try:
                    async with asyncio.timeout(5.0):
                        await self._consul.deregister_service(self._service_id)
                except (CrossdcError, TimeoutError) as exc:
                    self.log.warning("consul_deregister_failed", error=str(exc))
            await self._consul.close()
        if self._http is not None:
            http, self._http = self._http, None
            await asyncio.to_thread(http.shutdown)
            http.server_close()
        if self._reserve is not None:
            self._reserve.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    async def _announce(self, ready: asyncio.Event | None) -> None:
        """Once every worker started: log, tell `ready`; once one serves: register."""
        await self._all_started.wait()
        if self._stop.is_set():  # stopped before every worker started
            return
        self.log.warning("proxy_serving", workers=self.workers,
                         endpoint=f"{self.config.host}:{self.port}",
                         metrics_port=self.metrics_port,
                         pids=[s.pid for s in self.states],
                         serving=sum(s.serving for s in self.states))
        if ready is not None:
            ready.set()
        if not self.config.register_consul:
            return
        await self._any_serving.wait()
        if self._stop.is_set():
            return
        self._consul = ConsulClient(self.region.consul, self.config.consul_retry,
                                    principal=PROXY)
        from proxy.server import CONSUL_SERVICE, _consul_check, _service_meta
        host = self.config.registered_host
        sid = f"{CONSUL_SERVICE}-{self.config.region}-{host}-{self.port}"
        while not self._stop.is_set():
            try:
                await self._consul.register_service(
                    CONSUL_SERVICE, sid, host, self.port,
                    check=_consul_check(self.config, self.port), tags=[self.config.region],
                    meta=_service_meta(self.config.region, self.metrics_port,
                                       workers=str(self.workers)))
            except CrossdcError as exc:
                self.log.warning("consul_register_failed", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5.0):
                        await self._stop.wait()
                continue
            self._service_id = sid
            self.log.info("consul_registered", service=CONSUL_SERVICE, service_id=sid)
            return

    async def _drain_on(self, stop: asyncio.Event, keepers: list[asyncio.Task[None]]) -> None:
        await stop.wait()
        t0 = time.monotonic()
        self._stop.set()
        self.log.warning("proxy_draining", workers=sum(s.alive for s in self.states),
                         grace_s=self.config.grace_s)
        for s in self.states:
            if s.proc is not None and s.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    s.proc.terminate()
        bound = self.config.grace_s + self.config.close_timeout_s + 5.0
        _, pending = await asyncio.wait(keepers, timeout=bound)
        if pending:
            for s in self.states:
                if s.proc is not None and s.proc.returncode is None:
                    self.log.error("proxy_worker_killed", worker=s.index, pid=s.pid,
                                   why=f"still running {bound:.0f}s after SIGTERM")
                    with contextlib.suppress(ProcessLookupError):
                        s.proc.kill()
            await asyncio.wait(pending)
        self.drain_s = time.monotonic() - t0
        self._all_started.set()  # wake `_announce` if it still waits: it sees the stop
        self._any_serving.set()
        self.log.warning("proxy_drained", seconds=round(self.drain_s, 3),
                         exits=[s.last_exit for s in self.states])

    async def _keep(self, st: WorkerState) -> None:
        """Run worker `st.index` until the drain; start it again whenever it dies."""
        quick = 0  # deaths in a row before it served
        while not self._stop.is_set():
            code, served = await self._run_once(st)
            if self._stop.is_set():
                return
            st.restarts += 1
            st.died_at = time.monotonic()
            self.metrics.restarts.labels(str(st.index)).inc()
            quick = 0 if served else quick + 1
            self.log.error("proxy_worker_died", worker=st.index, pid=st.pid, exit_code=code,
                           restarts=st.restarts, served=served)
            if quick >= self.max_start_failures:
                raise ProxyTaskFailed(f"proxy:worker-{st.index}", RuntimeError(
                    f"worker {st.index} ended {quick} times in a row before serving "
                    f"(last exit code {code}); see its log above"))
            pause = Backoff(self.restart_backoff_s, self.max_backoff_s,
                            jitter_s=self.restart_backoff_s / 5).pause(quick) if quick else 0.0
            if pause:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._stop.wait()

    async def _run_once(self, st: WorkerState) -> tuple[int, bool]:
        """One life of a worker: its exit code, and whether it got to serve."""
        assert self.metrics_dir is not None
        spec = self.spec.model_copy(update={"index": st.index, "port": self.port})
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
               SUPERVISOR_PID_ENV: str(os.getpid())}
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "proxy.workers", spec.model_dump_json(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=env)
        st.proc, st.pid, st.alive, st.started, st.serving = proc, proc.pid, True, False, False
        self._gauges()
        reader = asyncio.create_task(self._read_status(st, proc),
                                     name=f"proxy:worker-{st.index}-status")
        try:
            await proc.wait()
        finally:
            if proc.returncode is None:  # cancelled (another worker failed): end this one
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    async with asyncio.timeout(self.config.grace_s
                                               + self.config.close_timeout_s + 5.0):
                        await proc.wait()
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
            await asyncio.wait({reader})
            served = st.started
            st.alive, st.serving, st.last_exit = False, False, proc.returncode
            mark_process_dead(proc.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
            self._gauges()
        return proc.returncode if proc.returncode is not None else -1, served

    async def _read_status(self, st: WorkerState, proc: asyncio.subprocess.Process) -> None:
        """The worker's status lines: `{"serving": bool}` on start and on every change."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            try:
                status = json.loads(line)
                serving = bool(status["serving"])
            except (ValueError, KeyError, TypeError):
                continue  # not ours (a library printing to stdout)
            if not st.started:
                st.started = True
                if st.died_at is not None:
                    self.log.warning("proxy_worker_restarted", worker=st.index, pid=st.pid,
                                     restarts=st.restarts,
                                     restart_s=round(time.monotonic() - st.died_at, 3))
            if serving != st.serving:
                self.log.info("proxy_worker_health", worker=st.index, pid=st.pid,
                              serving=serving)
            st.serving = serving
            self._gauges()


# -- the worker process ------------------------------------------------------------------------
def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the supervisor dies (Linux): a `kill -9` of the proxy ends
    all of it at once, as it did with one process. End now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        raise SystemExit(1)


def _emit(status: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, ValueError):  # the supervisor is gone
        sys.stdout.write(json.dumps(status) + "\n")
        sys.stdout.flush()


async def _report(server: Any) -> None:
    """Tell the supervisor this worker serves, and every change of its health."""
    last: bool | None = None
    while True:
        serving = bool(server.health()["serving"])
        if serving != last:
            _emit({"serving": serving, "pid": os.getpid()})
            last = serving
        await asyncio.sleep(0.2)


def worker_main(argv: list[str]) -> int:
    """`python -m proxy.workers SPEC_JSON`: one worker (exit 0 after a drain)."""
    from crossdc.logs import configure_logging
    from proxy.serve import serve

    spec = WorkerSpec.model_validate_json(argv[1])
    parent = os.environ.get(SUPERVISOR_PID_ENV)
    _die_with_parent(int(parent) if parent else None)
    configure_logging(spec.log_format, spec.log_level, quiet_kafka_client=True)
    structlog.contextvars.bind_contextvars(worker=spec.index)
    # label children are cleared on policy changes; in multiprocess mode that is a no-op
    # (the values stay in the files) and prometheus-client warns at each one
    warnings.filterwarnings("ignore", message="Clearing labels has not been implemented")
    try:
        asyncio.run(serve(spec.topology, spec.region, spec.policy, port=spec.port,
                          serve_metrics=False, host=spec.host, grace_s=spec.grace_s,
                          register_consul=False, auth_path=spec.auth, tls=spec.tls,
                          primary_lease_s=spec.primary_lease_s,
                          primary_write_s=spec.primary_write_s, reuse_port=True,
                          kafka_principal=spec.kafka_principal,
                          kafka_client=spec.kafka_client,
                          fenced_writes=spec.fenced_writes,
                          idempotency_log=spec.idempotency_log, journal=spec.journal,
                          watch=_report))
    except CrossdcError as exc:
        log.error("proxy_worker_failed", worker=spec.index, error=str(exc))
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv))
