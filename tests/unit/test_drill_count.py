"""The drill's judge (acks against what the regions hold), the ack log and the per-second
series: pure logic on hand-made inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dr.drill.count import all_replicated, judge
from dr.drill.traffic import Ack, drill_topics, per_second, read_ack_log
from dr.errors import DrError

REGIONS = ["east", "west"]
T = drill_topics("abc")
ORD, SYNC, NEAR = T["ordered"], T["sync"], T["nearest"]


def ack(dr_id: str, mode: str = "ordered", t_ms: int = 1000, *, topic: str | None = None,
        via: str = "east", first: str = "east") -> Ack:
    return Ack(dr_id=dr_id, mode=mode, topic=topic or T[mode], via=via,
               written=((first, 0, 1),), t_ms=t_ms)


def test_drill_topics_match_the_default_policy_rules() -> None:
    from proxy.policy import load_policy
    policy = load_policy(Path(__file__).parents[2] / "policies" / "default.yaml")
    assert T == {"ordered": "payments.drill-abc", "sync": "ledger.drill-abc",
                 "nearest": "clickstream.drill-abc"}
    for mode, topic in T.items():
        rule = policy.rule_for(topic)
        assert rule is not None, topic
        assert rule.dr_mode == mode, topic


def test_everything_everywhere_once_is_clean() -> None:
    acks = [ack("a"), ack("b"), ack("s", "sync"), ack("n", "nearest", first="west")]
    held = {r: {ORD: {"a": 1, "b": 1}, SYNC: {"s": 1}, NEAR: {"n": 1}} for r in REGIONS}
    j = judge(acks, held, REGIONS)
    assert list(j.modes) == ["ordered", "sync", "nearest"]
    assert (j.acked, j.rpo_records, j.duplicates, j.missing_replicas) == (4, 0, 0, 0)
    assert j.modes["ordered"].acked == 2
    assert all_replicated(acks, held, REGIONS)


def test_absent_from_every_region_is_lost_absent_from_one_is_a_missing_replica() -> None:
    acks = [ack("a"), ack("b"), ack("c")]
    held = {"east": {ORD: {"a": 1, "c": 1}}, "west": {ORD: {"a": 1}}}
    j = judge(acks, held, REGIONS)
    m = j.modes["ordered"]
    assert m.lost == 1
    assert m.lost_ids == ("b",)
    assert m.missing_replicas == {"west": 1}   # c: in east only
    assert j.rpo_records == 1
    assert j.missing_replicas == 1
    assert not all_replicated(acks, held, REGIONS)


def test_a_region_that_could_not_be_read_holds_nothing() -> None:
    j = judge([ack("a")], {"east": {ORD: {"a": 1}}}, REGIONS)
    assert j.modes["ordered"].missing_replicas == {"west": 1}
    assert j.rpo_records == 0


def test_duplicates_count_every_extra_copy_per_region() -> None:
    acks = [ack("a"), ack("b")]
    held = {"east": {ORD: {"a": 3, "b": 1}}, "west": {ORD: {"a": 1, "b": 2}}}
    j = judge(acks, held, REGIONS)
    assert j.duplicates == 3  # east: a twice more; west: b once more
    assert set(j.modes["ordered"].duplicate_ids) == {"a", "b"}
    assert j.rpo_records == 0


def test_the_same_dr_id_acked_twice_counts_once() -> None:
    acks = [ack("a", t_ms=1), ack("a", t_ms=2)]  # an idempotent retry answered twice
    held = {r: {ORD: {"a": 1}} for r in REGIONS}
    j = judge(acks, held, REGIONS)
    assert j.acked == 1
    assert j.duplicates == 0


def test_sync_lost_and_missing_are_judged_like_the_others() -> None:
    acks = [ack("s1", "sync"), ack("s2", "sync"), ack("s3", "sync")]
    held = {"east": {SYNC: {"s1": 1, "s2": 1}}, "west": {SYNC: {"s1": 1}}}
    j = judge(acks, held, REGIONS)
    s = j.modes["sync"]
    assert (s.acked, s.lost, s.missing_replicas) == (3, 1, {"west": 1})
    assert s.lost_ids == ("s3",)


def test_unacked_records_are_informational_and_per_mode() -> None:
    acks = [ack("a"), ack("n", "nearest")]
    held = {r: {ORD: {"a": 1, "x": 1}, NEAR: {"n": 1, "y": 1, "z": 1}} for r in REGIONS}
    j = judge(acks, held, REGIONS)
    assert j.modes["ordered"].unacked_present == 1
    assert j.modes["nearest"].unacked_present == 2
    assert j.rpo_records == 0
    assert j.duplicates == 0


def test_records_of_another_topic_do_not_count() -> None:
    acks = [ack("a")]
    held = {r: {ORD: {"a": 1}, "other": {"a": 5}} for r in REGIONS}
    j = judge(acks, held, REGIONS)
    assert j.duplicates == 0
    assert j.modes["ordered"].unacked_present == 0


def test_a_mode_without_acks_is_absent() -> None:
    j = judge([ack("a")], {r: {ORD: {"a": 1}} for r in REGIONS}, REGIONS)
    assert list(j.modes) == ["ordered"]


def test_ack_log_round_trips_and_tolerates_a_cut_last_line(tmp_path: Path) -> None:
    acks = [ack("a", t_ms=5), Ack("b", "sync", SYNC, "west", (("east", 1, 7), ("west", 1, 3)), 9)]
    log = tmp_path / "acks.jsonl"
    log.write_text("".join(a.to_json() + "\n" for a in acks) + '{"dr_id": "c", "mo')
    assert read_ack_log(log) == acks
    log.write_text('not json\n' + acks[0].to_json() + "\n")
    with pytest.raises(DrError, match=r"acks.jsonl:1: not an acknowledgement"):
        read_ack_log(log)


def test_per_second_counts_by_the_region_written_first_with_zero_seconds() -> None:
    acks = [ack("a", t_ms=10_100), ack("b", t_ms=10_900), ack("c", t_ms=13_000, first="west"),
            ack("d", t_ms=9_000)]  # before the start: left out
    series = per_second(acks, start_ms=10_000, end_ms=15_000)
    assert series["east"] == [(0.5, 2.0), (1.5, 0.0), (2.5, 0.0), (3.5, 0.0), (4.5, 0.0)]
    assert series["west"][3] == (3.5, 1.0)
    assert sum(y for _, y in series["west"]) == 1
