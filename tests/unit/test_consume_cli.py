"""`dr consume` without a proxy: bad input is one line and exit 2 before anything connects,
a proxy that does not answer is exit 1 naming it, and the two output formats."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dr.cli.consume import record_json, record_line
from dr.stack.paths import REPO_ROOT
from proxy.consumer_client import ConsumedRecord

pytestmark = pytest.mark.unit

TOPOLOGY = str(REPO_ROOT / "policies" / "topology.local.yaml")


def dr(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CROSSDC_STATE_DIR": str(tmp / "state"),
           "CROSSDC_CACHE_DIR": str(tmp / "cache"), "COLUMNS": "200"}
    env.pop("CROSSDC_PROXY_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "dr.cli", "consume", *args],
                          capture_output=True, text=True, env=env, cwd=tmp, timeout=90,
                          check=False)


def _error(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    assert proc.stdout == ""
    return lines[0]


@pytest.mark.parametrize(("args", "says"), [
    (["--group", "g", "--topic", "t"], "give --region REGION"),
    (["--group", "g", "--topic", "t", "--region", "east", "--target", "127.0.0.1:1"],
     "give --region REGION"),
    (["--group", "g", "--target", "127.0.0.1:1"], "give --topic TOPIC"),
    (["--group", "g", "--target", "127.0.0.1:1", "--topic", "t", "--pattern", "t*"],
     "give --topic TOPIC"),
    (["--group", "g", "--target", "nowhere", "--topic", "t"], "--target"),
    (["--group", "g", "--target", "127.0.0.1:1", "--topic", "t", "--max", "0"], "--max"),
    (["--group", "g", "--target", "127.0.0.1:1", "--topic", "t", "--ack-deadline-s",
      "0.5"], "--ack-deadline-s"),
    (["--group", "a b", "--target", "127.0.0.1:1", "--topic", "t"], "--group"),
    (["--group", "g", "--region", "mars", "--topic", "t", "-t", TOPOLOGY], "mars"),
    (["--target", "127.0.0.1:1", "--topic", "t"], "--group"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str],
                                          says: str) -> None:
    proc = dr(*args, tmp=tmp_path)
    assert says in _error(proc)
    assert proc.returncode == 2


def test_dr_consume_starts_without_the_other_commands_the_topology_or_grpc() -> None:
    """`dr.cli.main` builds `dr consume` alone (its start-up: bench/results/consume-cli.md);
    the SDK and grpc load when it reads, the topology only with --region."""
    heavy = ("dr.cli.stack", "dr.cli.proxy", "dr.cli.controller", "dr.stack.local",
             "crossdc.topology", "grpc", "aiokafka")
    code = ("import sys\nsys.argv = ['dr', 'consume', '--help']\nfrom dr.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "Usage: dr consume" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "[]"


def test_a_proxy_that_does_not_answer_is_exit_1_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    proc = dr("--group", "g", "--target", target, "--topic", "t", "--reconnect-attempts", "1",
              tmp=tmp_path)
    line = _error(proc)
    assert proc.returncode == 1
    assert line.startswith(f"error: reading through {target} failed: UNAVAILABLE: 2 attempts")
    assert "no proxy answered" in line


def _rec(key: bytes | None, value: bytes | None,
         headers: tuple[tuple[str, bytes], ...] = ()) -> ConsumedRecord:
    return ConsumedRecord("orders", 2, 41, "east", key, value, headers, 1700000000000, 2, 30.0)


def test_a_line_per_record_with_control_characters_and_bad_bytes_escaped() -> None:
    assert record_line(_rec(b"k1", b"hello world")) == "orders/2@41\teast\tk1\thello world"
    assert record_line(_rec(None, b"two\nlines\tand\x00\xff")) == \
        "orders/2@41\teast\t\ttwo\\nlines\\tand\\x00\\xff"
    assert record_line(_rec(b"k", None)) == "orders/2@41\teast\tk\t"


def test_a_json_object_per_record_with_headers_and_base64_for_bytes() -> None:
    doc = json.loads(record_json(_rec(b"k", b"\xff\xfe", (("dr-id", b"abc"),
                                                           ("bin", b"\x80"))),))
    assert doc == {"topic": "orders", "partition": 2, "offset": 41, "region": "east",
                   "key": "k", "value": None,
                   "value_base64": base64.b64encode(b"\xff\xfe").decode(),
                   "headers": [{"key": "dr-id", "value": "abc"},
                               {"key": "bin", "value": None, "value_base64": "gA=="}],
                   "timestamp_ms": 1700000000000, "delivery_attempt": 2, "dr_id": "abc"}
    assert json.loads(record_json(_rec(None, b"v")))["key"] is None
    assert "\n" not in record_json(_rec(b"k", b"a\nb"))
