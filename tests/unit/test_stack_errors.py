"""The local stack's refusals: missing toolchain, taken port, a process that dies at start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dr.errors import PortTaken, ProcessDied, ToolchainMissing
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.process import ManagedProcess, check_port_free
from dr.stack.toolchain import check_toolchain


def test_missing_java_mvn_go_are_all_named(tmp_path: Path) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(tmp_path))  # a PATH with nothing on it
    assert set(info.value.missing) == {"java", "mvn", "go"}
    msg = str(info.value)
    assert "java: not found on PATH; Java 17 or newer runs the Kafka brokers" in msg
    assert "go: not found on PATH; Go 1.23 or newer builds Consul" in msg


def test_cached_artifacts_need_only_java(tmp_path: Path) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    from dr.stack.toolchain import consul_binary, kafka_libs_dir, spark_kafka_jars_dir
    for d in (kafka_libs_dir(paths), spark_kafka_jars_dir(paths)):
        d.parent.mkdir(parents=True)
        (d.parent / ".complete").write_text("x")
    consul_binary(paths).parent.mkdir(parents=True)
    consul_binary(paths).write_text("x")
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(tmp_path))
    assert set(info.value.missing) == {"java"}


def test_dr_up_without_java_prints_one_paragraph(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent),
           "CROSSDC_CACHE_DIR": str(tmp_path / "cache"),
           "CROSSDC_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "up"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "error: The local stack needs programs that are not installed: java:" in \
        " ".join(proc.stderr.split())
    assert not (tmp_path / "state" / "stack.json").exists()


def test_taken_port_names_port_field_and_holder() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortTaken) as info:
            check_port_free(port, "east kafka broker 1 client listener",
                            "regions[0].kafka.bootstrap_servers[0]")
    msg = str(info.value)
    assert f"Port 127.0.0.1:{port} (east kafka broker 1 client listener) is already in use" in msg
    assert "change regions[0].kafka.bootstrap_servers[0] in the topology file" in msg
    assert f"pid {os.getpid()}" in msg or "another process" in msg


def test_dr_up_with_a_taken_port_fails_before_starting_anything(tmp_path: Path) -> None:
    from tests_support import write_topology  # type: ignore[import-not-found]
    topo = free_topology(["east", "west"])
    path = write_topology(topo, tmp_path / "t.yaml")
    consul_http = int(topo.region("west").consul.http_addr.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", consul_http))
        sock.listen()
        env = {**os.environ, "CROSSDC_STATE_DIR": str(tmp_path / "state")}
        proc = subprocess.run([sys.executable, "-m", "dr.cli", "up", "-t", str(path)],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
    out = " ".join(proc.stderr.split())
    assert proc.returncode == 1, proc.stderr
    assert f"Port 127.0.0.1:{consul_http} (west consul agent HTTP API) is already in use" in out
    assert "regions[1].consul.http_addr" in out
    assert not list((tmp_path / "state").glob("*/*/pid"))


def test_process_that_dies_at_start_reports_cause_and_log(tmp_path: Path) -> None:
    script = "echo starting; echo 'java.lang.IllegalStateException: bad config' >&2; exit 3"
    proc = ManagedProcess("demo server", tmp_path, ["sh", "-c", script, str(tmp_path)])
    proc.start()
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessDied) as info:  # noqa: PT012 - poll until the child has exited
        while time.monotonic() < deadline:
            proc.check_alive()
            time.sleep(0.02)
    err = info.value
    assert err.returncode == 3
    assert err.cause == "java.lang.IllegalStateException: bad config"
    assert "starting" in err.log_tail
    assert str(err).startswith("demo server exited with status 3 while starting: "
                               "java.lang.IllegalStateException: bad config.")


def test_stop_is_idempotent_and_safe_before_start(tmp_path: Path) -> None:
    proc = ManagedProcess("sleeper", tmp_path, ["sh", "-c", "sleep 60", str(tmp_path)])
    assert proc.stop() is False
    proc.start()
    assert proc.running()
    assert proc.stop(timeout_s=5) is True
    assert not proc.running()
    assert proc.stop() is False


def test_free_topology_is_valid_and_distinct() -> None:
    topo = free_topology(["a", "b", "c"], seed=7)
    ports = [r.kafka_port for r in topo.regions]
    assert len(set(ports)) == 3
    assert topo.preference == ["a", "b", "c"]


def test_free_port_stays_out_of_the_ephemeral_range_and_skips_taken_ones() -> None:
    """A service restarted on its old port must find it free: ports the kernel hands to
    outgoing connections are never chosen (a drill's heal once failed on exactly that)."""
    from dr.stack.ports import _ephemeral_low, free_port
    taken: set[int] = set()
    ports = [free_port(taken) for _ in range(50)]
    assert len(set(ports)) == 50
    assert set(ports) == taken
    assert all(p < _ephemeral_low() and p < 20000 for p in ports)
    held = socket.socket()
    held.bind(("127.0.0.1", ports[0]))
    held.listen()
    try:
        for _ in range(100):
            assert free_port() != ports[0]
    finally:
        held.close()


def test_cluster_ids_never_look_like_an_option() -> None:
    from dr.stack.kafka import _new_cluster_id
    ids = {_new_cluster_id() for _ in range(5000)}
    assert len(ids) == 5000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
