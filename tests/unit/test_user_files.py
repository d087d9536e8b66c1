"""Files a user names are read one bounded way (`crossdc.files.read_user_file`): regular files
only, refused by size before reading, never blocking on a pipe or a device; every loader goes
through it (topology, policy, auth, TLS, passwords, the live policy's reloads); and policy
validation is linear in the rules."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crossdc.errors import ConfigError
from crossdc.files import read_user_file, read_user_text
from crossdc.security import KafkaSecurity
from crossdc.topology import load_topology
from crossdc.yamlfile import LIMITS
from crossdc_client import files  # crossdc.files re-exports it
from dr.stack.paths import REPO_ROOT
from proxy.auth import load_auth
from proxy.policy import load_policy, parse_policy
from proxy.reload import PolicyStore

POLICY = "default:\n  mode: nearest\n"
TOPOLOGY = REPO_ROOT / "policies" / "topology.local.yaml"


def _issue(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    [issue] = exc.value.issues
    return str(issue)


def _bounded(fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """Run `fn` in a daemon thread and fail (instead of hanging the suite) if it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for more than {seconds}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    os.mkfifo(path)
    return path


# -- the kernel function ---------------------------------------------------------------

def test_a_regular_file_and_a_link_to_one_are_read(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_bytes(b"x: 1\n")
    (tmp_path / "link.yaml").symlink_to(f)
    assert read_user_file(f, max_bytes=10, timeout_s=1) == b"x: 1\n"
    assert read_user_file(tmp_path / "link.yaml", max_bytes=10, timeout_s=1) == b"x: 1\n"
    assert read_user_text(f, max_bytes=5, timeout_s=1) == "x: 1\n"  # exactly the limit


def test_a_fifo_is_refused_at_once_with_or_without_a_writer(fifo: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _bounded(lambda: read_user_file(fifo, max_bytes=100, timeout_s=1))
    assert _issue(info) == f"{fifo}: is a named pipe (FIFO), not a regular file; refused"
    # a writer holding the pipe open changes nothing
    fd = os.open(fifo, os.O_RDWR)  # O_RDWR: open without waiting for a reader
    try:
        os.write(fd, b"rules: []\n")
        with pytest.raises(ConfigError, match="named pipe"):
            _bounded(lambda: read_user_file(fifo, max_bytes=100, timeout_s=1))
    finally:
        os.close(fd)


def test_a_device_behind_a_symlink_is_refused_naming_the_target(tmp_path: Path) -> None:
    link = tmp_path / "policy.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as info:
        _bounded(lambda: read_user_file(link, max_bytes=LIMITS.max_bytes, timeout_s=1))
    assert _issue(info) == (f"{link}: is a character device (a link to /dev/zero), not a "
                            "regular file; refused")


def test_a_directory_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        read_user_file(tmp_path, max_bytes=10, timeout_s=1)
    with pytest.raises(ConfigError) as info:
        read_user_file(tmp_path / "nope.yaml", max_bytes=10, timeout_s=1, field="tls.key")
    assert _issue(info) == f"{tmp_path / 'nope.yaml'} tls.key: file not found"


def test_a_file_over_the_limit_is_refused_by_its_size_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "big.yaml"
    f.write_bytes(b"x" * 101)
    opened: list[str] = []
    real_open = os.open
    def recording_open(path: str, *a: Any, **k: Any) -> int:
        opened.append(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("crossdc_client.files.os.open", recording_open)
    with pytest.raises(ConfigError) as info:
        read_user_file(f, max_bytes=100, timeout_s=1)
    assert _issue(info) == f"{f}: the file is 101 bytes; the limit is 100 bytes"
    assert opened == []  # refused by its size: never opened


def test_a_file_larger_than_its_stat_says_is_cut_at_the_limit() -> None:
    # /proc files say 0 bytes and hold more: the read stops at max_bytes + 1
    with pytest.raises(ConfigError, match="grew past the limit of 16 bytes"):
        read_user_file("/proc/self/status", max_bytes=16, timeout_s=1)


def test_a_fifo_swapped_in_after_the_look_is_refused_on_the_open_descriptor(
        fifo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    regular = tmp_path / "regular.yaml"
    regular.write_text(POLICY)
    real_stat = os.stat
    # the look (os.stat) sees a regular file; by the open, a FIFO is there
    monkeypatch.setattr("crossdc_client.files.os.stat", lambda p, *a, **k: real_stat(regular)
                        if str(p) == str(fifo) else real_stat(p, *a, **k))
    with pytest.raises(ConfigError, match="named pipe"):
        _bounded(lambda: read_user_file(fifo, max_bytes=100, timeout_s=1))


def test_the_time_bound_is_held_between_reads(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "slow.yaml"
    f.write_bytes(b"x" * 64)
    clock = iter(range(1000))
    monkeypatch.setattr("crossdc_client.files.time.monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(files, "CHUNK_BYTES", 8)  # each read "takes" a second
    with pytest.raises(ConfigError, match="reading it took longer than 3s"):
        read_user_file(f, max_bytes=100, timeout_s=3)


def test_text_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 9\)"):
        read_user_text(f, max_bytes=100, timeout_s=1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_says_permission_denied(tmp_path: Path) -> None:
    f = tmp_path / "secret.yaml"
    f.write_text("x: 1\n")
    f.chmod(0)
    with pytest.raises(ConfigError, match="cannot read: permission denied"):
        read_user_file(f, max_bytes=100, timeout_s=1)


# -- every loader goes through it ------------------------------------------------------

@pytest.mark.parametrize("load", [load_topology, load_policy, load_auth],
                         ids=["topology", "policy", "auth"])
def test_loaders_refuse_a_fifo_and_a_device(load: Callable[[Path], Any], fifo: Path,
                                            tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="named pipe"):
        _bounded(lambda: load(fifo))
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="character device"):
        _bounded(lambda: load(zero))


def test_tls_and_password_files_go_through_it(fifo: Path) -> None:
    from proxy.config import TlsSettings
    from proxy.tls import read_tls
    with pytest.raises(ConfigError) as info:
        _bounded(lambda: read_tls(TlsSettings(cert_file=fifo, key_file=fifo)))
    assert "tls.cert_file: is a named pipe" in _issue(info)
    sec = KafkaSecurity(username="me", password_file=fifo)
    with pytest.raises(ConfigError, match="password of Kafka principal 'me': is a named pipe"):
        _bounded(lambda: sec.credentials("me"))


@pytest.mark.parametrize("command", [["topology", "validate"], ["policy", "validate"]])
def test_validate_commands_answer_a_pipe_with_one_line(command: list[str],
                                                       fifo: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dr.cli", *command, str(fifo)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 65  # a file refused (dr/exits.py)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "is a named pipe (FIFO), not a regular file" in lines[0]


# -- the live policy: refused, never stuck, and later good files are accepted ------------

async def test_a_policy_replaced_by_a_fifo_or_dev_zero_is_refused_and_reloads_go_on(
        tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    store = PolicyStore(path, poll_interval_s=60, load_timeout_s=2)
    async with store:
        path.unlink()
        os.mkfifo(path)
        async with asyncio.timeout(5):
            assert await store.reload_async() is False   # refused at once, not stuck
        path.unlink()
        path.symlink_to("/dev/zero")
        async with asyncio.timeout(5):
            assert await store.reload_async() is False
        assert store._loading is None                    # no load left running
        path.unlink()
        path.write_text(POLICY + "strict: false\n")
        async with asyncio.timeout(5):
            assert await store.reload_async() is True     # a good file is accepted again
        assert store.version == 2
        refused = store.registry.get_sample_value("crossdc_proxy_policy_reloads_total",
                                                  {"result": "refused"})
        assert refused == 2


async def test_an_unreadable_policy_is_refused_once_per_change_not_every_poll(
        tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    store = PolicyStore(path, poll_interval_s=60)
    async with store:
        path.unlink()
        os.mkfifo(path)
        for _ in range(3):  # what the watch loop does each poll
            await store._check(force=False)
        refused = store.registry.get_sample_value("crossdc_proxy_policy_reloads_total",
                                                  {"result": "refused"})
        assert refused == 1
        assert stat.S_ISFIFO(os.stat(path).st_mode)


async def test_a_policy_that_starts_as_a_fifo_is_a_config_error(fifo: Path) -> None:
    store = PolicyStore(fifo)
    with pytest.raises(ConfigError, match="named pipe"):
        async with asyncio.timeout(5):
            await store.start()
    await store.stop()


# -- validation is linear in the rules -------------------------------------------------

def _policy_text(n: int, glob_every: int = 20) -> str:
    lines = ["rules:"]
    for i in range(n):
        if i % glob_every == 0:
            lines.append(f"  - topic: 'g{i}.*'")       # a glob with its own literal prefix
        elif i % glob_every == 1:
            lines.append(f"  - topic: '*.dlq{i}'")     # ... or its own literal suffix
        else:
            lines.append(f"  - topic: t.{i}")
    return "\n".join(lines) + "\n"


def test_a_20000_rule_policy_validates_with_work_linear_in_the_rules() -> None:
    n = 20_000
    text = _policy_text(n)
    assert len(text.encode()) < LIMITS.max_bytes
    topo = load_topology(TOPOLOGY)
    policy = parse_policy(text, "p.yaml", topo)  # within the loader's bounds
    assert len(policy.rules) == n
    index = policy._index
    assert index is not None
    index.tests = index.probes = 0
    assert list(policy.problems(topo)) == []
    # each exact rule: one probe per distinct literal-prefix and -suffix length (a handful
    # here) per lookup, three lookups (an earlier rule hiding it; its dead-letter topic's
    # rule; the source rule that topic follows, no rule naming it), glob tests only for
    # globs whose literal ends it has (none), and a glob's sample topic and its dead-letter
    # topic a test each: no pair of rules is ever compared, where the old check compared
    # every rule with every earlier one
    exact = sum(1 for r in policy.rules if not r.is_glob)
    assert index.tests <= 2 * (n - exact)
    assert index.probes <= 3 * 12 * exact
    # matching still finds the first rule
    assert policy.rule_for("t.2") is not None
    assert policy.rule_for("g40.x").topic == "g40.*"  # type: ignore[union-attr]
    assert policy.rule_for("a.dlq41").topic == "*.dlq41"  # type: ignore[union-attr]


def test_hidden_and_repeated_rules_are_still_found_by_the_index() -> None:
    text = ("rules:\n  - topic: 'orders.*'\n  - topic: '*.dlq'\n  - topic: '*'\n"
            "  - topic: orders.eu\n  - topic: x.dlq\n  - topic: plain\n  - topic: 'orders.*'\n")
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml")
    assert [i.message for i in info.value.issues] == [
        "never used: rules[0] ('orders.*') matches 'orders.eu' first; move this rule above it",
        "never used: rules[1] ('*.dlq') matches 'x.dlq' first; move this rule above it",
        "never used: rules[2] ('*') matches 'plain' first; move this rule above it",
        "'orders.*' repeats rules[0]; each topic pattern once",
    ]
    with pytest.raises(ConfigError, match=r"'a' repeats rules\[0\]"):
        parse_policy("rules:\n  - topic: a\n  - topic: b\n  - topic: a\n", "p.yaml")


def test_globs_that_share_their_literal_ends_are_bounded_by_a_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy import policy as policy_mod
    monkeypatch.setattr(policy_mod, "_MAX_OVERLAP_TESTS", 1000)
    text = ("rules:\n" + "".join(f"  - topic: '*x{i}*'\n" for i in range(100))
            + "".join(f"  - topic: t.{i}\n" for i in range(100)))
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml")
    [issue] = info.value.issues
    assert issue.field == "rules"
    assert "more than 1,000 glob tests" in issue.message


def test_long_prefer_lists_and_many_regions_are_checked_in_linear_time() -> None:
    many = ", ".join(f"r{i}" for i in range(20_000))
    with pytest.raises(ConfigError, match=r"repeated: r1$"):
        parse_policy(f"rules:\n  - topic: a\n    mode: nearest\n    prefer: [{many}, r1]\n",
                     "p.yaml")
