"""A real `dr proxy serve` whose live policy is swapped for hostile files (issue 22): a named
pipe, then a link to /dev/zero, each followed by SIGHUP. Each is refused at once (no reload
left running, no memory read from /dev/zero), a good policy after them is accepted, and
SIGTERM still ends the process within its drain bound. No stack is needed: the proxy's Kafka
and Consul are down (NOT_SERVING), which changes nothing about its policy file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests_support import write_topology

from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_port, free_topology

POLICY = "default:\n  mode: nearest\n"


def _metric(port: int, name: str, labels: str = "") -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)  # polling another process's metrics
    raise AssertionError(f"not within {seconds}s: {what}")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_live_policy_swapped_for_a_fifo_or_dev_zero_is_refused_and_the_proxy_goes_on(
        tmp_path: Path) -> None:
    topo = write_topology(free_topology(["east", "west"]), tmp_path / "topology.yaml")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    port, mport = free_port(), free_port()
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dr.cli", "--log-format", "json", "--log-level", "info",
         "proxy", "serve", "-r", "east", "-p", str(policy), "-t", str(topo), "--no-consul",
         "--workers", "1", "--grace", "1", "--port", str(port), "--metrics-port", str(mport)],
        stdout=log, stderr=log, cwd=REPO_ROOT)
    refused = 'crossdc_proxy_policy_reloads_total{result="refused"}'
    try:
        _until(lambda: _metric(mport, "crossdc_proxy_policy_version") == 1.0, 60,
               "the proxy serving its first policy")
        base_rss = _rss_mib(proc.pid)

        policy.unlink()
        os.mkfifo(policy)
        proc.send_signal(signal.SIGHUP)
        _until(lambda: _metric(mport, refused) == 1.0, 10, "the FIFO refused")

        policy.unlink()
        policy.symlink_to("/dev/zero")
        proc.send_signal(signal.SIGHUP)
        _until(lambda: _metric(mport, refused) == 2.0, 10, "/dev/zero refused")
        assert _rss_mib(proc.pid) < base_rss + 64, "the proxy read from /dev/zero"

        policy.unlink()
        policy.write_text(POLICY + "strict: false\n")
        proc.send_signal(signal.SIGHUP)
        _until(lambda: _metric(mport, "crossdc_proxy_policy_version") == 2.0, 10,
               "a good policy accepted after the hostile ones")

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "proxy.log").read_text(errors="replace")
    assert "is a named pipe (FIFO), not a regular file" in text
    assert "is a character device (a link to /dev/zero)" in text
    assert "an earlier load is still running" not in text
