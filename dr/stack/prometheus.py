"""A real Prometheus server for the local stack, the scrape configuration it reads, and the
alert rules as written for an installation.

`scrape_config(targets)` builds a Prometheus configuration (a dict, dumped as YAML) from the
daemons a stack runs, each target `(component, region, "host:port")`: one job per component
(`crossdc-proxy`, `crossdc-mirror`, `crossdc-controller`) and no target label of ours. The
alert rules and the Grafana dashboard key on neither: each daemon labels its own
`crossdc_build_info` with its component and `home_region`, so they work the same under a
scrape crossdc did not write (observability/prometheus.consul_sd.yml, kube-prometheus).

`alert_rules(runbook_base)` is observability/alerts.yml with its `runbook_url` annotations
under another base (the shipped file links https://crossdc.example/runbooks, a placeholder);
`dr prometheus rules --runbook-base` writes it.

The topology declares only the proxies' metrics ports (`regions[].proxy.metrics_port`);
mirrors and controllers choose theirs when started (`--metrics-port`, `--http-port`: the
controller serves /metrics on its HTTP port), so `scrape_targets_from_topology()` gives the
proxies and the caller adds the daemons it started (`extra=`).

`PrometheusServer` runs the `prometheus` binary (Debian's `prometheus` package) as a
`ManagedProcess` on a free loopback port, with the alert rules crossdc ships
(`alerts_path()`, observability/alerts.yml, package data; written with their runbook links
under `local_runbook_base()`), a small retention and everything
under the stack's state directory (so `dr down` stops it with the rest):

    <state>/prometheus/prometheus.yml   the scrape configuration
    <state>/prometheus/rules/           the rule files (alerts.yml linking the checkout's
                                        runbooks/, file://; CROSSDC_RUNBOOK_BASE wins)
    <state>/prometheus/data/            the TSDB
    <state>/prometheus/server.json      its port
    <state>/prometheus/server.log, pid
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog
import yaml

from crossdc.topology import Topology, split_hostport
from dr.errors import StackError, StartTimeout, ToolchainMissing
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_port
from dr.stack.process import ManagedProcess, check_port_free

__all__ = ["COMPONENTS", "RUNBOOK_BASE_DEFAULT", "RUNBOOK_BASE_ENV", "PrometheusServer",
           "Target", "alert_rules", "alerts_path", "check_runbook_base", "dashboard_path",
           "find_prometheus", "job_name", "local_runbook_base", "scrape_config",
           "scrape_targets_from_topology"]

log = structlog.get_logger("crossdc.stack.prometheus")

Target = tuple[str, str, str]
"""(component, region it runs in, "host:port" of its /metrics). The region is not written into
the configuration: the daemon labels its own crossdc_build_info with it."""

COMPONENTS = ("proxy", "mirror", "controller")
"""The components crossdc's alerts and dashboard know (others get a job too)."""

_OBSERVABILITY = Path(__file__).resolve().parents[1] / "observability"


def alerts_path() -> Path:
    """observability/alerts.yml: in a checkout `dr/observability` links to it; an installed
    package carries it as package data."""
    return (_OBSERVABILITY / "alerts.yml").resolve()


def dashboard_path() -> Path:
    """observability/grafana/crossdc.json, the Grafana dashboard (same places)."""
    return (_OBSERVABILITY / "grafana" / "crossdc.json").resolve()


RUNBOOK_BASE_DEFAULT = "https://crossdc.example/runbooks"
"""Where the shipped alerts.yml links its runbooks: a placeholder (`.example` is a reserved
domain) that says "set me" in every alert it appears in, rather than a guessed address."""

RUNBOOK_BASE_ENV = "CROSSDC_RUNBOOK_BASE"
"""Environment variable giving the runbook base (`dr prometheus rules`, the local stack)."""

_URL_UNSAFE = re.compile(r"[\s\"'\\{}<>`#?]")


def check_runbook_base(base: str) -> str:
    """`base` without its trailing slashes, when it is an absolute http, https or file URL;
    ValueError saying why not. Refused too: characters that would end the annotation's
    quoted YAML string or start a Prometheus template (quotes, backslash, braces), blanks,
    and `?`/`#` (each link appends `/<runbook>.md#<section>`)."""
    bad = _URL_UNSAFE.search(base)
    if bad:
        raise ValueError(f"{base!r} holds {bad.group()!r}: give a plain URL, e.g. "
                         f"https://git.example/ops/crossdc/runbooks")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https", "file"):
        raise ValueError(f"{base!r} is not an absolute http(s):// or file:// URL")
    if parts.scheme != "file" and not parts.netloc:
        raise ValueError(f"{base!r} names no host")
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost")
                                   or not parts.path.startswith("/")):
        raise ValueError(f"{base!r}: a file URL names an absolute path on this machine "
                         f"(file:///...)")
    return base.rstrip("/")


def alert_rules(runbook_base: str | None = None) -> str:
    """The text of observability/alerts.yml with every `runbook_url` under `runbook_base`
    (None or the default: the file as shipped). Comments and layout kept: the annotations
    are rewritten in place, not re-dumped."""
    text = alerts_path().read_text(encoding="utf-8")
    if runbook_base is None:
        return text
    base = check_runbook_base(runbook_base)
    if base == RUNBOOK_BASE_DEFAULT:
        return text
    shipped = f'runbook_url: "{RUNBOOK_BASE_DEFAULT}/'
    if text.count(shipped) != text.count("runbook_url:"):
        raise StackError(f"{alerts_path()}: a runbook_url not under {RUNBOOK_BASE_DEFAULT}")
    return (f"# Written by `dr prometheus rules --runbook-base {base}` from {alerts_path()}\n"
            + text.replace(shipped, f'runbook_url: "{base}/'))


def local_runbook_base() -> str:
    """The runbook base of a Prometheus on this machine: $CROSSDC_RUNBOOK_BASE, else the
    checkout's runbooks/ as a file:// URL, else (an installed package, no runbooks/ beside
    it) the shipped placeholder."""
    env = os.environ.get(RUNBOOK_BASE_ENV)
    if env:
        return env
    here = REPO_ROOT / "runbooks"
    return here.as_uri() if here.is_dir() else RUNBOOK_BASE_DEFAULT


def job_name(component: str) -> str:
    """The Prometheus job of a component's daemons: `crossdc-<component>`."""
    return f"crossdc-{component}"


def _duration(seconds: float) -> str:
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scrape_config(targets: Sequence[Target], *, interval_s: float = 2.0,
                  rule_files: Sequence[Path] = ()) -> dict[str, Any]:
    """A Prometheus configuration scraping `targets` every `interval_s` (rules evaluated as
    often), one job per component, no target labels (the daemons label themselves)."""
    if interval_s <= 0:
        raise StackError(f"scrape interval must be positive, not {interval_s}")
    by_job: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()
    for component, region, address in targets:
        if not component or not component.replace("-", "").replace("_", "").isalnum():
            raise StackError(f"scrape target {address!r}: component {component!r} is not a "
                             f"name (letters, digits, '-', '_')")
        try:
            split_hostport(address)
        except ValueError as exc:
            raise StackError(f"scrape target of {component} in {region}: {exc}") from exc
        if (component, address) in seen:
            continue
        seen.add((component, address))
        by_job.setdefault(component, []).append(address)
    order = sorted(by_job, key=lambda c: (COMPONENTS.index(c) if c in COMPONENTS
                                         else len(COMPONENTS), c))
    return {
        "global": {"scrape_interval": _duration(interval_s),
                   "scrape_timeout": _duration(min(interval_s, 10.0)),
                   "evaluation_interval": _duration(interval_s)},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job_name(component),
             "static_configs": [{"targets": by_job[component]}]}
            for component in order],
    }


def scrape_targets_from_topology(topology: Topology, *,
                                 extra: Sequence[Target] = ()) -> list[Target]:
    """The proxies whose topology entry names a `metrics_port` (on the host of their gRPC
    endpoint), then `extra` (the mirrors and controllers a caller started)."""
    out: list[Target] = []
    for region in topology.regions:
        if region.proxy.metrics_port is not None:
            host = split_hostport(region.proxy.endpoint)[0]
            host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            out.append(("proxy", region.name, f"{host}:{region.proxy.metrics_port}"))
    return out + [t for t in extra if t not in out]


def find_prometheus() -> Path:
    """The `prometheus` binary on PATH (ToolchainMissing says how to install it)."""
    found = shutil.which("prometheus")
    if found is None:
        raise ToolchainMissing({"prometheus": "not on PATH (Debian: apt-get install "
                                "prometheus; compose/local/system-deps.sh does)"})
    return Path(found)


class PrometheusServer:
    """The stack's Prometheus: `start()`, `await wait_ready()`, `url`, `stop()`.

    `start()` is idempotent (a server already running from this state directory is kept,
    with its port); `set_targets()` rewrites the configuration and reloads a running server
    (SIGHUP); `stop()` is idempotent and bounded."""

    def __init__(self, paths: StackPaths, targets: Sequence[Target] = (), *,
                 port: int | None = None, interval_s: float = 2.0,
                 retention: str = "2h", rule_files: Sequence[Path] | None = None,
                 runbook_base: str | None = None, binary: Path | None = None) -> None:
        self.paths = paths
        self.targets: list[Target] = list(targets)
        self.interval_s = interval_s
        self.retention = retention
        self.rule_files = [alerts_path()] if rule_files is None else list(rule_files)
        self.runbook_base = check_runbook_base(runbook_base or local_runbook_base())
        """The base of the runbook links in crossdc's alerts.yml as this server loads it."""
        self._binary = binary
        self._port = port
        self._proc: ManagedProcess | None = None

    # -- where ---------------------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        return self.paths.state / "prometheus"

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def _server_file(self) -> Path:
        return self.workdir / "server.json"

    @property
    def port(self) -> int:
        """The port it listens on (chosen at the first `start()`, kept while it runs)."""
        if self._port is None:
            try:
                self._port = int(json.loads(self._server_file.read_text("utf-8"))["port"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                raise StackError("Prometheus has no port yet: start() it first") from None
        return self._port

    @property
    def url(self) -> str:
        """http://127.0.0.1:<port> (the web UI, /api/v1/..., /alerts, /targets)."""
        return f"http://127.0.0.1:{self.port}"

    # -- configuration -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The configuration it runs with (rule files as copied under its workdir)."""
        return scrape_config(self.targets, interval_s=self.interval_s,
                             rule_files=[self.workdir / "rules" / p.name
                                         for p in self.rule_files])

    def write_config(self) -> None:
        """Write prometheus.yml and the rule files beside it: crossdc's alerts.yml written
        with `runbook_base`, any other copied as it is."""
        rules = self.workdir / "rules"
        rules.mkdir(parents=True, exist_ok=True)
        for src in self.rule_files:
            try:
                if src.resolve() == alerts_path():
                    (rules / src.name).write_text(alert_rules(self.runbook_base), "utf-8")
                else:
                    shutil.copyfile(src, rules / src.name)
            except OSError as exc:
                raise StackError(f"alert rules {src}: {exc.strerror or exc}") from exc
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text("# written by crossdc (dr/stack/prometheus.py); rewritten at start\n"
                       + yaml.safe_dump(self.config(), sort_keys=False), encoding="utf-8")
        tmp.replace(self.config_path)

    def process(self) -> ManagedProcess:
        if self._proc is None:
            binary = self._binary or find_prometheus()
            self._proc = ManagedProcess("prometheus", self.workdir, [
                str(binary),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--storage.tsdb.retention.time={self.retention}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ])
        return self._proc

    # -- lifecycle -----------------------------------------------------------------------
    def running(self) -> bool:
        return ManagedProcess("prometheus", self.workdir, []).running()

    def start(self) -> None:
        """Write the configuration and start the server, unless it already runs (then it
        reloads the configuration). Returns at once: `await wait_ready()`."""
        if self.running():
            self.write_config()
            self.reload()
            return
        if self._port is None:
            self._port = free_port()
        else:
            check_port_free(self._port, "Prometheus", "the port option")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._server_file.write_text(json.dumps({"port": self._port}), encoding="utf-8")
        self.write_config()
        self._proc = None
        self.process().start()
        log.info("prometheus_started", url=self.url, targets=len(self.targets))

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Poll /-/ready until it answers 200; ProcessDied at once if the server exited
        (a bad configuration), StartTimeout at the deadline."""
        deadline = time.monotonic() + timeout_s
        pause = 0.1
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                self.process().check_alive()
                try:
                    async with http.get(f"{self.url}/-/ready") as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() >= deadline:
                    raise StartTimeout(f"Prometheus did not answer {self.url}/-/ready within "
                                       f"{timeout_s:.0f}s; see {self.workdir / 'server.log'}")
                await asyncio.sleep(pause)
                pause = min(pause * 1.5, 1.0)

    def set_targets(self, targets: Sequence[Target]) -> None:
        """Scrape `targets` from now on (a running server reloads its configuration)."""
        self.targets = list(targets)
        if self.running():
            self.write_config()
            self.reload()

    def reload(self) -> bool:
        """SIGHUP: the server reads prometheus.yml and its rules again; False if not running."""
        pid = ManagedProcess("prometheus", self.workdir, []).pid()
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
            return True
        return False

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); True if it ran."""
        proc = self._proc or ManagedProcess("prometheus", self.workdir, [])
        return proc.stop(timeout_s)
