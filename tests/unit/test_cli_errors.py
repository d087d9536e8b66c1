"""Defect 13: the errors that used to end in a traceback (or after a whole Spark run) are one
line, and come before any work is done."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dr.stack.paths import REPO_ROOT

TOPOLOGY = str(REPO_ROOT / "policies" / "topology.local.yaml")
POLICY = str(REPO_ROOT / "policies" / "default.yaml")


def dr(*args: str, tmp: Path, env: dict[str, str] | None = None
       ) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "CROSSDC_STATE_DIR": str(tmp / "state"),
            "CROSSDC_CACHE_DIR": str(tmp / "cache"), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dr.cli", *args], capture_output=True,
                          text=True, env=full, cwd=tmp, timeout=90, check=False)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_mirror_same_region_twice(tmp_path: Path) -> None:
    proc = dr("mirror", "run", "-t", TOPOLOGY, "--from", "east", "--to", "east", "--topics",
              "x", tmp=tmp_path)
    assert proc.returncode == 2
    assert "source and target must be different regions" in one_line(proc)


def test_mirror_topics_not_a_regex(tmp_path: Path) -> None:
    proc = dr("mirror", "run", "-t", TOPOLOGY, "--from", "east", "--to", "west", "--topics",
              "([", tmp=tmp_path)
    assert proc.returncode == 2
    assert "not a regular expression" in one_line(proc)


def test_unknown_option_is_one_line(tmp_path: Path) -> None:
    proc = dr("status", "--bogus", tmp=tmp_path)
    assert proc.returncode == 2
    line = one_line(proc)
    assert line.startswith("error: No such option: --bogus (see '")
    assert line.endswith(" status --help')")


def test_reconcile_state_is_a_folder(tmp_path: Path) -> None:
    proc = dr("reconcile", "-t", TOPOLOGY, "--regions", "east,west", "--topics", "x",
              "--state", str(tmp_path), tmp=tmp_path)
    assert proc.returncode == 2
    assert f"--state {tmp_path}: is a folder" in one_line(proc)


@pytest.mark.parametrize("where", ["file", "unwritable"])
def test_reconcile_out_checked_before_spark(tmp_path: Path, where: str) -> None:
    """An --out that cannot be written fails first: no jars fetched, no Spark started (the
    cache folder stays untouched)."""
    if where == "file":
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "report"
    else:
        if os.geteuid() == 0:
            out = Path("/proc/crossdc-report")  # even root cannot make folders in /proc
        else:
            (tmp_path / "ro").mkdir(mode=0o500)
            out = tmp_path / "ro" / "report"
    proc = dr("reconcile", "-t", TOPOLOGY, "--regions", "east,west", "--topics", "x",
              "--out", str(out), tmp=tmp_path)
    assert proc.returncode == 1
    assert f"--out {out}: cannot write there" in one_line(proc)
    assert not (tmp_path / "cache").exists()


def test_no_topology_file_says_pass_topology(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    for args in (["status"], ["reconcile", "--regions", "a,b", "--topics", "x"]):
        proc = dr(*args, tmp=tmp_path, env={"CROSSDC_TOPOLOGY": str(missing)})
        assert proc.returncode == 2
        line = one_line(proc)
        assert "pass --topology" in line
        assert str(missing) in line


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_proxy_port_taken_is_named_before_starting(tmp_path: Path, taken_port: int,
                                                   option: str) -> None:
    other = "--metrics-port" if option == "--port" else "--port"
    proc = dr("proxy", "serve", "-t", TOPOLOGY, "-r", "east", "-p", POLICY, "--no-consul",
              other, "0", option, str(taken_port), tmp=tmp_path)
    assert proc.returncode == 1
    line = one_line(proc)
    assert f"127.0.0.1:{taken_port} is not free" in line
    assert f"pass {option}" in line


def test_fenced_writes_with_librdkafka_are_refused_before_starting(tmp_path: Path) -> None:
    proc = dr("proxy", "serve", "-t", TOPOLOGY, "-r", "east", "-p", POLICY, "--no-consul",
              "--kafka-client", "librdkafka", "--fenced-writes", tmp=tmp_path,
              env={"CROSSDC_PROXY_FENCED_WRITES": ""})
    assert proc.returncode != 0
    assert "--fenced-writes needs --kafka-client aiokafka" in one_line(proc)


def test_version_and_short_help(tmp_path: Path) -> None:
    from importlib.metadata import version

    proc = dr("--version", tmp=tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"dr (crossdc) {version('crossdc')}")
    for args in (["-h"], ["proxy", "serve", "-h"], ["failover", "-h"]):
        proc = dr(*args, tmp=tmp_path)
        assert proc.returncode == 0, (args, proc.stderr)
        out = " ".join(proc.stdout.split())
        assert f"{' '.join(['Usage:', *args[:-1]])}" in out.replace("python -m dr.cli ", "")


def test_validate_json_says_valid_or_every_issue(tmp_path: Path) -> None:
    import json

    good = dr("policy", "validate", POLICY, "--json", tmp=tmp_path)
    assert good.returncode == 0, good.stderr
    body = json.loads(good.stdout)
    assert (body["valid"], body["file"]) == (True, POLICY)
    assert body["rules"] > 0
    topo = json.loads(dr("topology", "validate", TOPOLOGY, "--json", tmp=tmp_path).stdout)
    assert topo["valid"] is True
    assert topo["primary"] in topo["regions"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - topic: x\n    dr_mode: bogus\n", encoding="utf-8")
    for what in ("policy", "topology"):
        proc = dr(what, "validate", str(bad), "--json", tmp=tmp_path)
        assert proc.returncode == 65  # a file refused (dr/exits.py)
        body = json.loads(proc.stdout)
        assert body["valid"] is False
        assert body["issues"], body
        assert all(i["file"] == str(bad) for i in body["issues"])
    issue = json.loads(dr("policy", "validate", str(bad), "--json", tmp=tmp_path).stdout)
    assert issue["issues"] == [{"file": str(bad), "line": 3, "field": "rules[0].dr_mode",
                                "message": "unknown field (check the spelling)"}]


def test_help_keeps_the_defaults_written_in_it(tmp_path: Path) -> None:
    # "[default: ...]" in a help string is text, not Rich markup that vanishes
    out = " ".join(dr("status", "-h", tmp=tmp_path).stdout.split())
    assert "Topology file [default: the running stack's, else policies/topology.local.yaml]" \
        in out
    serve = " ".join(dr("proxy", "serve", "-h", tmp=tmp_path).stdout.split())
    assert "[default: the region's proxy.endpoint]" in serve
    assert "env var: CROSSDC_PROXY_FENCED_WRITES" in serve


@pytest.mark.parametrize(("host", "says"), [
    ("nohost.invalid", "--host nohost.invalid: the host does not resolve"),
    ("192.0.2.1", "--host 192.0.2.1: 192.0.2.1 is not an address of this machine")])
def test_a_host_that_cannot_be_bound_is_said_as_such_not_as_a_port(
        tmp_path: Path, host: str, says: str) -> None:
    proc = dr("proxy", "serve", "-t", TOPOLOGY, "-r", "east", "-p", POLICY, "--no-consul",
              "--host", host, tmp=tmp_path)
    assert proc.returncode == 2
    line = one_line(proc)
    assert says in line
    assert "not free" not in line
