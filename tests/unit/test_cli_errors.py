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


# -- the bad-input audit (issue 37): hosts, ports and folders said before anything starts ---
@pytest.fixture
def free_topo(tmp_path: Path) -> Path:
    """A topology on ports nothing listens on: a check that let a daemon through would find
    no one else's servers."""
    from tests_support import write_topology

    from dr.stack.ports import free_topology
    return write_topology(free_topology(["east", "west"]), tmp_path / "topology.yaml")


def test_mirror_metrics_host_and_port_are_said_as_such(tmp_path: Path, free_topo: Path,
                                                       taken_port: int) -> None:
    run = ("mirror", "run", "-t", str(free_topo), "--from", "east", "--to", "west",
           "--topics", "x")
    proc = dr(*run, "--metrics-port", "0", "--metrics-host", "no-such-host.invalid",
              tmp=tmp_path)
    assert proc.returncode == 2
    line = one_line(proc)
    assert "--metrics-host no-such-host.invalid: the host does not resolve" in line
    assert "not free" not in line
    proc = dr(*run, "--metrics-port", str(taken_port), tmp=tmp_path)
    assert proc.returncode == 1
    assert (f"the mirror's metrics port 127.0.0.1:{taken_port} is not free" in
            (line := one_line(proc)))
    assert line.endswith("pass another --metrics-port")


def test_controller_http_host_and_port_name_their_option_or_field(
        tmp_path: Path, free_topo: Path, taken_port: int) -> None:
    run = ("controller", "run", "-t", str(free_topo), "-r", "east")
    proc = dr(*run, "--http-host", "no-such-host.invalid", tmp=tmp_path)
    assert proc.returncode == 2
    line = one_line(proc)
    assert "--http-host no-such-host.invalid: the host does not resolve" in line
    assert "not free" not in line
    proc = dr(*run, "--http-host", "192.0.2.1", tmp=tmp_path)
    assert proc.returncode == 2
    assert "--http-host 192.0.2.1: 192.0.2.1 is not an address of this machine" in \
        one_line(proc)
    proc = dr(*run, "--http-port", str(taken_port), tmp=tmp_path)
    assert proc.returncode == 1
    line = one_line(proc)
    assert f"port 127.0.0.1:{taken_port} is not free" in line
    assert line.endswith("pass another --http-port")
    config = tmp_path / "ctl.yaml"
    config.write_text(f"region: east\nhttp_port: {taken_port}\n")
    proc = dr(*run, "--config", str(config), tmp=tmp_path)
    assert proc.returncode == 1
    assert f"change http_port in {config}" in one_line(proc)
    config.write_text("region: east\nhttp_host: no-such-host.invalid\n")
    proc = dr(*run, "--config", str(config), tmp=tmp_path)
    assert proc.returncode == 2
    assert f"{config} http_host no-such-host.invalid: the host does not resolve" in \
        one_line(proc)


def test_proxy_address_from_the_topology_names_its_field(tmp_path: Path, free_topo: Path,
                                                         taken_port: int) -> None:
    import yaml

    data = yaml.safe_load(free_topo.read_text())
    data["regions"][0]["proxy"]["endpoint"] = f"127.0.0.1:{taken_port}"
    topo = tmp_path / "port.yaml"
    topo.write_text(yaml.safe_dump(data))
    proc = dr("proxy", "serve", "-t", str(topo), "-r", "east", "-p", POLICY, "--no-consul",
              tmp=tmp_path)
    assert proc.returncode == 1
    line = one_line(proc)
    assert f"gRPC port 127.0.0.1:{taken_port} is not free" in line
    assert f"pass --port (or change regions[0].proxy.endpoint in {topo})" in line
    data["regions"][0]["proxy"]["endpoint"] = "no-such-host.invalid:7000"
    topo.write_text(yaml.safe_dump(data))
    proc = dr("proxy", "serve", "-t", str(topo), "-r", "east", "-p", POLICY, "--no-consul",
              tmp=tmp_path)
    assert proc.returncode == 2
    assert (f"{topo} regions[0].proxy.endpoint no-such-host.invalid: the host does not "
            "resolve") in one_line(proc)


def test_dr_up_refuses_topology_hosts_the_local_stack_cannot_serve(
        tmp_path: Path, free_topo: Path) -> None:
    """Each field, with its file and line, before anything is fetched or started (not a
    region that "did not answer" after the start's timeout)."""
    import yaml

    data = yaml.safe_load(free_topo.read_text())
    data["regions"][0]["kafka"]["bootstrap_servers"] = ["no-such-host.invalid:9092"]
    data["witnesses"][0]["consul"]["http_addr"] = "192.0.2.7:8500"
    data["regions"][1]["proxy"]["endpoint"] = "no-such-host.invalid:7000"
    topo = tmp_path / "hosts.yaml"
    topo.write_text(yaml.safe_dump(data, sort_keys=False))
    lines = topo.read_text().splitlines()

    def line_of(text: str) -> int:
        return next(i for i, ln in enumerate(lines, 1) if text in ln)

    proc = dr("up", "-t", str(topo), "--timeout", "5", tmp=tmp_path)
    assert proc.returncode == 65, proc.stderr
    said = proc.stderr
    assert (f"{topo}:{line_of('no-such-host.invalid:9092')} regions[0].kafka."
            "bootstrap_servers[0]: the host no-such-host.invalid does not resolve") in said
    assert (f"{topo}:{line_of('192.0.2.7:8500')} witnesses[0].consul.http_addr: 192.0.2.7 is "
            "not 127.0.0.1, where the local stack runs all its servers") in said
    assert "proxy.endpoint" not in said  # the proxies run only with --services
    proc = dr("up", "-t", str(topo), "--services", "--timeout", "5", tmp=tmp_path)
    assert proc.returncode == 65
    assert f"{topo}:{line_of('no-such-host.invalid:7000')} regions[1].proxy.endpoint" in \
        proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing built


@pytest.mark.parametrize("where", ["under-a-file", "unwritable"])
def test_dr_up_state_dir_it_cannot_write_is_said_first(tmp_path: Path, free_topo: Path,
                                                       where: str) -> None:
    (tmp_path / "a-file").write_text("x")
    state = (tmp_path / "a-file" / "state" if where == "under-a-file"
             else Path("/proc/crossdc-state"))  # even root makes no folder in /proc
    proc = dr("up", "-t", str(free_topo), "--state-dir", str(state), "--timeout", "5",
              tmp=tmp_path)
    assert proc.returncode == 1
    assert f"--state-dir {state}: cannot write there" in one_line(proc)
    assert not (tmp_path / "cache").exists()


def test_dr_up_port_taken_names_the_port_and_its_field(tmp_path: Path, free_topo: Path,
                                                       taken_port: int) -> None:
    """Checked before any server starts (the cached Kafka and Consul are used: nothing is
    built; a stack that started anyway is stopped)."""
    import yaml

    from dr.stack.paths import StackPaths
    from dr.stack.toolchain import consul_binary, kafka_libs

    cache = StackPaths.default()
    if not kafka_libs(cache).exists() or not consul_binary(cache).exists():
        pytest.skip("Kafka or Consul is not in the cache yet (`dr setup`)")
    data = yaml.safe_load(free_topo.read_text())
    data["regions"][1]["kafka"]["bootstrap_servers"] = [f"127.0.0.1:{taken_port}"]
    topo = tmp_path / "port.yaml"
    topo.write_text(yaml.safe_dump(data))
    env = {"CROSSDC_CACHE_DIR": str(cache.cache)}
    try:
        proc = dr("up", "-t", str(topo), "--timeout", "30", tmp=tmp_path, env=env)
    finally:
        dr("down", tmp=tmp_path, env=env)
    assert proc.returncode == 1
    line = one_line(proc)
    assert f"Port 127.0.0.1:{taken_port} (west kafka broker 1 client listener)" in line
    assert "change regions[1].kafka.bootstrap_servers[0]" in line


def test_drill_report_folder_is_checked_before_the_stack_is_touched(
        tmp_path: Path, free_topo: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    bad = tmp_path / "a-file" / "reports"
    run = ("drill", "-s", "primary-outage", "-t", str(free_topo))
    proc = dr(*run, "--reports", str(bad), tmp=tmp_path)
    assert proc.returncode == 1
    assert f"--reports {bad}: cannot write there" in one_line(proc)  # not "no proxy known"
    config = tmp_path / "drill.yaml"
    config.write_text(f"reports: {bad}\n")
    proc = dr(*run, "-c", str(config), tmp=tmp_path)
    assert proc.returncode == 1
    assert f"{config} reports {bad}: cannot write there" in one_line(proc)
    proc = dr(*run, "-c", str(config), "--dry-run", tmp=tmp_path)  # writes nothing: not asked
    assert "cannot write there" not in proc.stderr
