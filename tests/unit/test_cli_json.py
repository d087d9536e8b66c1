"""`--json` bodies of the operator's commands (dr/cli): what a script reads (the commands
against a real stack: tests/integration/test_stack.py, test_mirror_ops.py)."""

from __future__ import annotations

import json

from crossdc.clients.offsets import Translated
from dr.cli.controller import failover_json
from dr.cli.mirror import offsets_json
from dr.controller.failover import Behind
from dr.controller.state import FailoverRecord


def _done(**kw: object) -> FailoverRecord:
    rec = FailoverRecord(source="east", target="west", **kw)
    for name in ("fence", "lease_wait", "drain", "offsets", "promote", "dns", "report"):
        rec = rec.with_step(name, status="done", started_ms=1, ended_ms=2)
    return rec.model_copy(update={"state": "done"})


def test_a_failover_says_done_and_keeps_its_record() -> None:
    body = json.loads(json.dumps(failover_json(_done())))
    assert (body["kind"], body["source"], body["target"]) == ("failover", "east", "west")
    assert body["done"] is True
    assert body["dry_run"] is False
    assert body["forced_without_majority"] is False
    assert body["record"]["steps"][0]["name"] == "fence"
    assert "plan" not in body


def test_a_forced_failover_on_a_minority_says_so() -> None:
    rec = _done(force=True, risk="fewer than a majority answered: this side may be the "
                                 "minority")
    assert failover_json(rec)["forced_without_majority"] is True


def test_a_dry_run_is_the_plan_and_the_lag_and_never_done() -> None:
    rec = FailoverRecord(source="east", target="west")
    body = failover_json(rec, dry_run=True, plan=["fence: ...", "promote: ..."],
                         behind=Behind(3, 1.5, error=None))
    assert body["done"] is False
    assert body["plan"] == ["fence: ...", "promote: ..."]
    assert body["behind"] == {"records": 3, "measured": True, "last_copy_age_s": 1.5,
                              "error": None}


def test_offsets_translate_json_names_each_partition() -> None:
    rows = [Translated("t", 0, 25, 25), Translated("t", 1, 7, None)]
    assert offsets_json("app", "east", "west", rows, 1) == {
        "group": "app", "from": "east", "to": "west", "applied": 1,
        "offsets": [{"topic": "t", "partition": 0, "source_offset": 25, "target_offset": 25},
                    {"topic": "t", "partition": 1, "source_offset": 7, "target_offset": None}]}
