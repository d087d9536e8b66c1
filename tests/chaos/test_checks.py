"""The suite's own checks, on made-up inputs: the split-brain verdict and the results
table (a rerun replaces a fault's row and keeps the others)."""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos_results import BEGIN, END, Row, record, update_reconciliation  # type: ignore[import-not-found]

from dr.drill.count import split_brain
from dr.stack.netns import NetNamespaces


def test_one_origin_per_epoch_is_no_split_brain() -> None:
    assert split_brain({"3": {"east": 10}, "4": {"west": 7}}) == []


def test_two_origins_under_one_epoch_are_named() -> None:
    found = split_brain({"3": {"east": 10}, "4": {"east": 2, "west": 7}})
    assert len(found) == 1
    assert "epoch 4" in found[0]
    assert "east: 2" in found[0]
    assert "west: 7" in found[0]


def _row(fault: str, acked: int) -> Row:
    return Row(fault=fault, load="x", acked=acked, lost=0, duplicated="0", recover="1 s",
               split_brain="none", converged="yes")


def test_a_rerun_replaces_only_its_rows(tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    doc.write_text(f"# title\n\n{BEGIN}\n{END}\n\nafter\n")
    record(_row("leader-kill", 10), doc)
    record(_row("partition", 20), doc)
    record(_row("leader-kill", 30), doc)
    update_reconciliation("partition", "missing 0, duplicates 0", doc)
    text = doc.read_text()
    body = text.split(BEGIN)[1].split(END)[0]
    rows = [ln for ln in body.splitlines() if ln.startswith("| leader-kill")
            or ln.startswith("| partition")]
    assert len(rows) == 2
    assert "| 30 |" in rows[0]
    assert "missing 0, duplicates 0" in rows[1]
    assert text.startswith("# title")
    assert text.rstrip().endswith("after")


def test_a_row_names_the_kafka_clients_when_not_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CROSSDC_TEST_KAFKA_CLIENT", raising=False)
    monkeypatch.delenv("CROSSDC_TEST_MIRROR_CONSUMER", raising=False)
    assert _row("partition", 1).line().endswith(" |")
    assert "librdkafka" not in _row("partition", 1).line()
    monkeypatch.setenv("CROSSDC_TEST_KAFKA_CLIENT", "librdkafka")
    assert "(proxy and mirror producers: librdkafka) |" in _row("partition", 1).line()
    monkeypatch.setenv("CROSSDC_TEST_MIRROR_CONSUMER", "librdkafka")
    assert "producers: librdkafka; mirror consumer: librdkafka) |" in \
        _row("partition", 1).line()


def test_namespace_names_fit_the_kernel_limits(tmp_path: Path) -> None:
    net = NetNamespaces.for_state(tmp_path / "state", ["east", "west"])
    assert len(net.bridge) <= 15
    assert all(len(net.host_link(r)) <= 15 for r in ("east", "west"))
    assert net.address("east") != net.address("west")
    assert net.wrap(["java"], "east")[:4] == ["ip", "netns", "exec", net.namespace("east")]
