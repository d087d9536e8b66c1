"""The drill reader process's log (dr/drill/reader.py): what `_Writer` appends is what
`read_reader_log` reads back, each delivery once, and the argv runs it wrapped."""

from __future__ import annotations

import io
import json
from pathlib import Path

from dr.drill.history import Delivery
from dr.drill.reader import ReaderProcess, _Writer, read_reader_log
from dr.drill.readers import Readers
from dr.drill.traffic import drill_topics


def test_the_writer_appends_only_what_is_new_and_reads_back_equal(tmp_path: Path) -> None:
    topics = drill_topics("rlog")
    readers = Readers({"east": "127.0.0.1:1"}, topics, group_prefix="g")
    got = readers.deliveries()["east"]
    out = io.StringIO()
    w = _Writer(out, readers, "east")
    a = Delivery("east", topics["ordered"], 0, 5, "east", "r-1", 100, 101, 0, 1)
    b = Delivery("east", topics["ordered"], 0, 6, "west", "r-2", 110, None, 1, 2)
    got.append(a)
    w.flush()
    readers.restarts()["east"].append((109, 1))
    got.append(b)
    w.flush()
    w.flush()  # nothing new: nothing written
    path = tmp_path / "d.jsonl"
    path.write_text(out.getvalue() + '["d", "east", "tr', encoding="utf-8")  # a torn line
    log = read_reader_log(path)
    assert log.deliveries == [a, b]
    assert log.restarts == [(109, 1)]
    assert [json.loads(x)[0] for x in out.getvalue().splitlines()] == ["d", "r", "d"]


def test_a_missing_log_is_empty(tmp_path: Path) -> None:
    assert read_reader_log(tmp_path / "none.jsonl").deliveries == []


def test_the_process_runs_wrapped_with_its_topics(tmp_path: Path) -> None:
    topics = drill_topics("rlog")
    p = ReaderProcess("west", "10.0.0.2:7000", topics, folder=tmp_path, group_prefix="chaos-x",
                      wrap=lambda argv: ["ip", "netns", "exec", "ns-west", *argv])
    argv = p.argv()
    assert argv[:4] == ["ip", "netns", "exec", "ns-west"]
    assert argv[argv.index("--proxy") + 1] == "10.0.0.2:7000"
    assert f"nearest={topics['nearest']}" in argv
    assert p.out == tmp_path / "deliveries-west.jsonl"
