"""bench/preflight.py: a bench names what to install before it starts, reports a dead
contender once with its log's tail, and stops processes that are already gone quietly."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _preflight() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_preflight", REPO_ROOT / "bench" / "preflight.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pf = _preflight()


def _mirror_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_mirror_run", REPO_ROOT / "bench" / "mirror" / "run.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_present_parts_pass() -> None:
    assert pf.missing(modules=["json"], tools=["sh"]) == []
    pf.require("bench/x.py", modules=["json"], tools=["sh"])  # no exit


def test_missing_module_names_the_extra() -> None:
    with pytest.raises(SystemExit) as err:
        pf.require("bench/mirror/run.py", modules=["confluent_kafka_not_here", "json"],
                   skip_hint="--only runs a subset")
    msg = str(err.value.code)
    assert msg.startswith("bench/mirror/run.py cannot run")
    assert "confluent_kafka_not_here" in msg
    assert "'json'" not in msg
    assert "--only runs a subset" in msg


def test_known_parts_say_how_to_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(pf.shutil, "which", lambda *a, **k: None)
    lines = pf.missing(modules=["confluent_kafka"], tools=["py-spy", "java", "mvn"])
    assert len(lines) == 4
    assert "pip install -e '.[bench]'" in lines[0]
    assert "pip install -e '.[bench]'" in lines[1]
    assert "Java" in lines[2]
    assert "Maven" in lines[3]


def test_tool_found_beside_the_interpreter(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "spy-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(pf.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert pf.find_tool("spy-tool") == str(tool)
    assert pf.find_tool("no-such-tool") is None


def test_died_quotes_the_cause_and_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "ceiling.log"
    log.write_text("".join(f"line {i}\n" for i in range(100))
                   + "ModuleNotFoundError: No module named 'confluent_kafka'\n")
    msg = pf.died("ceiling", 1, log, lines=3).splitlines()
    assert msg[0] == ("[ceiling] exited with code 1 before it finished: "
                      "ModuleNotFoundError: No module named 'confluent_kafka'")
    assert msg[1] == f"last lines of {log}:"
    assert [m.strip() for m in msg[2:]] == [
        "line 98", "line 99", "ModuleNotFoundError: No module named 'confluent_kafka'"]
    assert "(no output)" in pf.died("x", 2, tmp_path / "missing.log")
    stuck = pf.died("mm2_tuned", None, log, why="copied nothing for 120 s").splitlines()[0]
    assert stuck.startswith("[mm2_tuned] given up on: copied nothing for 120 s before it "
                            "finished: ModuleNotFoundError")


def test_stop_a_process_already_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    assert pf.stop(proc, 5, group=True) == 0  # its group is gone too: no ProcessLookupError
    assert pf.stop(proc, 5) == 0  # twice
    assert pf.signal_quietly(proc, signal.SIGTERM, group=True) is False


def test_stop_a_running_group() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    assert pf.stop(proc, 10, group=True) == -signal.SIGTERM


def test_stop_kills_what_ignores_sigterm() -> None:
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    assert pf.stop(proc, 0.5) == -signal.SIGKILL
    proc.stdout.close()


def test_spy_areas_from_speedscope(tmp_path: Path) -> None:
    """bench/spy.py reads py-spy's speedscope file: one count per sample, self by the
    innermost frame (C code under a loop callback as its own row), inclusive by any."""
    import json

    sys.path.insert(0, str(REPO_ROOT))
    from bench.spy import area_shares, load_speedscope, top_self

    frames = [{"name": "_run_once", "file": "/py/asyncio/base_events.py", "line": 1},
              {"name": "Handle._run", "file": "/py/asyncio/events.py", "line": 2},
              {"name": "route", "file": f"{REPO_ROOT}/proxy/router.py", "line": 3},
              {"name": "dumps", "file": "/py/json/__init__.py", "line": 4}]
    doc = {"shared": {"frames": frames}, "profiles": [
        {"type": "sampled", "samples": [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]],
         "weights": [0.01] * 4}]}
    path = tmp_path / "p.speedscope.json"
    path.write_text(json.dumps(doc))
    stacks = load_speedscope(path)
    assert sum(stacks.values()) == 4
    shares = {a: (s, i) for a, s, i in area_shares(stacks)}
    assert shares["JSON (json module)"] == (50.0, 50.0)
    assert shares["routing: router (proxy/router.py)"] == (25.0, 75.0)
    assert shares[next(a for a in shares if a.startswith("C code run by loop"))] == (25.0, 0.0)
    assert top_self(stacks, 1) == [("dumps (/py/json/__init__.py)", 50.0)]


def test_mirror_bench_asks_for_every_part_before_the_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--spy needs py-spy and a librdkafka contender confluent-kafka: both are asked for
    before the stack starts and the backlog is written (a missing py-spy used to be found
    only after minutes of writing)."""
    run = _mirror_run()
    asked: list[tuple[list[str], list[str]]] = []
    monkeypatch.setattr(run, "require", lambda bench, modules=(), tools=(), skip_hint="":
                        asked.append((list(modules), list(tools))))
    run.needs(["crossdc"], spy=True)
    run.needs(["crossdc_rdkafka"])
    run.needs(["crossdc_rdc"])
    run.needs(["crossdc"])
    assert "py-spy" in asked[0][1]
    assert "confluent_kafka" in asked[1][0]
    assert "confluent_kafka" in asked[2][0]
    assert asked[3] == (["matplotlib"], [])  # aiokafka on both sides: nothing more


def test_worst_seconds_find_a_stall() -> None:
    """The latency phase's tail, located: one second holding a stall comes first."""
    run = _mirror_run()
    src = {b"%d" % i: 1_000 + i * 10 for i in range(1000)}  # 100 records/s for 10 s
    dst = {k: ts + 20 for k, ts in src.items()}
    for i in range(500, 530):  # second 5: a 400 ms stall
        dst[b"%d" % i] = src[b"%d" % i] + 400
    worst = run.worst_seconds(src, dst, top=2)
    assert worst[0] == {"second": 5.0, "max_ms": 400.0, "over_slow": 30.0}
    assert worst[1]["max_ms"] == 20.0


def test_client_settings_read_from_a_kafka_config_dump() -> None:
    """MM2's log prints each client's config; the bench keeps the batch settings it saw."""
    log = ("[2026] INFO ConsumerConfig values: \n\tfetch.max.bytes = 67108864\n"
           "\tmax.poll.records = 20000\n\tgroup.id = x\n"
           "[2026] INFO ConsumerConfig values: \n\tmax.poll.records = 500\n"
           "[2026] INFO ProducerConfig values: \n\tbatch.size = 524288\n")
    assert _mirror_run().client_settings(log) == {
        "batch.size": ["524288"], "fetch.max.bytes": ["67108864"],
        "max.poll.records": ["20000", "500"]}


def test_targets_are_judged_from_the_run() -> None:
    row = {"rps": 90, "cpu_s_per_m": 13.0, "p99_ms": 50.0}
    rows = _mirror_run().targets({
        "ceiling": {"rps": 100, "cpu_s_per_m": 10.0, "p99_ms": 10.0},
        "mm2_tuned": {"rps": 50, "cpu_s_per_m": 30.0, "p99_ms": 100.0},
        "crossdc": row, "crossdc_eos": {**row, "rps": 80, "p99_ms": 150.0}})
    got = {t: (fig, ok) for t, fig, ok in rows}
    assert got["at-least-once >= 0.9x the ceiling"] == ("0.90x", True)
    assert got["CPU per record <= 1.3x the ceiling's (at-least-once)"] == ("1.30x", True)
    assert got["exactly-once >= 0.85x the ceiling"] == ("0.80x", False)
    assert got[">= 1.5x MirrorMaker 2 tuned (at-least-once)"] == ("1.80x", True)
    assert got["p99 replication latency at 10k/s <= MirrorMaker 2 tuned's (exactly-once)"] \
        == ("150 vs 100 ms", False)
    assert len(rows) == 7


def test_mirror_bench_refuses_a_name_that_is_no_contender() -> None:
    """A typo in --only used to run as crossdc (the last branch), after minutes of writing."""
    with pytest.raises(SystemExit) as err:
        _mirror_run().needs(["crossdc", "crosdc_eos"])
    msg = str(err.value.code)
    assert "'crosdc_eos'" in msg
    assert "crossdc_eos" in msg.split("contenders are ")[1]
