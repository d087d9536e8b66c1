"""A Spark standalone cluster on this machine: one master and N workers, started from the
launcher that ships inside the pip `pyspark` package (`bin/spark-class`), no Docker.

For the integration test and the benchmark: the job runs against it unchanged with
`--master spark://127.0.0.1:PORT`. Every process binds to the loopback, lives in its own
process group and is stopped (TERM, then KILL) by `stop()`, which is idempotent; `with
StandaloneCluster(...) as c:` always stops it.

    python -m dr.reconcile.cluster --workers 2 --memory 512m   # prints the master URL
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import structlog

from dr.reconcile.errors import SparkFailed
from dr.stack.ports import free_port

__all__ = ["StandaloneCluster", "spark_class"]

log = structlog.get_logger("crossdc.reconcile.cluster")

HOST = "127.0.0.1"


def spark_class() -> Path:
    """`bin/spark-class` of the installed pyspark (its SPARK_HOME is the package folder)."""
    import pyspark
    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _free_port() -> int:
    return free_port(host=HOST)


class StandaloneCluster:
    """`workers` workers of `cores` cores and `memory` each (executors get that heap)."""

    def __init__(self, workers: int = 2, *, cores: int = 1, memory: str = "512m",
                 work_dir: Path | None = None, start_timeout_s: float = 120.0) -> None:
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.start_timeout_s = start_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="crossdc-spark-")
            work_dir = Path(self._tmp.name)
        self.work_dir = work_dir
        self.port = _free_port()
        self.ui_port = _free_port()
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "SPARK_LOCAL_IP": HOST, "SPARK_LOCAL_HOSTNAME": "localhost",
                "SPARK_LOG_DIR": str(self.work_dir / "logs"),
                # executors start Python workers (if ever) with this venv's interpreter
                "PYSPARK_PYTHON": sys.executable,
                "SPARK_WORKER_DIR": str(self.work_dir / "work")}

    def _spawn(self, name: str, args: list[str]) -> None:
        log_path = self.work_dir / f"{name}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen([str(spark_class()), *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env(),
                                    start_new_session=True)
        self._procs.append((name, proc))

    def alive_workers(self) -> int:
        """Workers the master lists as ALIVE (its JSON status page); 0 while it starts."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.ui_port}/json/",
                                        timeout=2) as resp:
                status = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return 0
        return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")

    def start(self) -> StandaloneCluster:
        """Start the master and the workers; return when every worker has registered."""
        (self.work_dir / "work").mkdir(parents=True, exist_ok=True)
        try:
            self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", HOST,
                                   "--port", str(self.port), "--webui-port",
                                   str(self.ui_port)])
            for i in range(self.workers):
                self._spawn(f"worker-{i}", [
                    "org.apache.spark.deploy.worker.Worker", "--host", HOST,
                    "--webui-port", str(_free_port()), "--cores", str(self.cores),
                    "--memory", self.memory, "--work-dir", str(self.work_dir / "work"),
                    self.master_url])
            deadline = time.monotonic() + self.start_timeout_s
            while self.alive_workers() < self.workers:
                dead = [n for n, p in self._procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    why = f"{', '.join(dead)} exited" if dead else \
                        f"not ready in {self.start_timeout_s:.0f} s"
                    raise SparkFailed(f"the Spark standalone cluster did not start ({why}); "
                                      f"logs in {self.work_dir}")
                time.sleep(0.5)  # polling the master's status page to a deadline
        except BaseException:
            self.stop()
            raise
        log.info("spark_cluster_up", master=self.master_url, workers=self.workers,
                 memory=self.memory)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every process (workers first): TERM to its group, KILL after `timeout_s`."""
        procs, self._procs = list(reversed(self._procs)), []
        for _, p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("spark_cluster_kill", process=name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main() -> None:
    """Start a cluster and keep it until Ctrl-C (to try `dr reconcile --master ...`)."""
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--memory", default="512m")
    a = ap.parse_args()
    with StandaloneCluster(a.workers, cores=a.cores, memory=a.memory) as cluster:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print(cluster.master_url, flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    main()
