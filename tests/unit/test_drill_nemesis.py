"""The nemesis's schedules (dr/drill/nemesis.py): seeded, bounded, every fault healed."""

from __future__ import annotations

from dr.drill.nemesis import KINDS, Stage, kinds_of, schedule

STAGE = Stage(regions=("east", "west"), witnesses=("witness",),
              daemons=("controller-east", "controller-west", "mirror-east-west",
                       "mirror-west-east", "proxy-east", "proxy-west"))


def test_a_seed_replays_its_schedule_and_another_seed_differs() -> None:
    a, b = schedule(7, 180, STAGE), schedule(7, 180, STAGE)
    assert a == b
    assert schedule(8, 180, STAGE) != a


def test_every_fault_opened_is_healed_and_at_most_two_are_open_on_distinct_targets() -> None:
    for seed in range(1, 41):
        steps = schedule(seed, 180, STAGE)
        assert [s.at_s for s in steps] == sorted(s.at_s for s in steps)
        open_: dict[tuple[str, tuple[str, ...]], int] = {}
        for s in steps:
            key = (s.kind, s.targets)
            if s.kind == "force":
                assert not s.heal
                assert s.targets[0] in STAGE.regions
                continue
            if s.heal:
                assert open_.pop(key) >= 0, f"seed {seed}: heal of what is not open: {s}"
            else:
                held = [t for (_, ts) in open_ for t in ts]
                assert not set(s.targets) & set(held), f"seed {seed}: {s} on a busy target"
                open_[key] = 1
                assert len(open_) <= 2, f"seed {seed}: more than two faults open"
        assert not open_, f"seed {seed}: left open {open_}"
        assert all(s.at_s <= 180 for s in steps)


def test_the_long_run_covers_every_kind() -> None:
    """`make chaos`: 20 schedules of 180 s; together they open every fault kind, and most
    schedules several kinds."""
    seen: set[str] = set()
    for seed in range(1, 21):
        kinds = kinds_of(schedule(seed, 180, STAGE))
        assert len(kinds) >= 3, (seed, kinds)  # of 9 kinds (seed 2 opens 3 since skew came)
        seen |= kinds
    assert seen == set(KINDS)


def test_a_stage_without_daemons_or_witness_never_picks_them() -> None:
    bare = Stage(regions=("east", "west"))
    for seed in range(1, 11):
        for s in schedule(seed, 120, bare):
            assert s.kind not in ("kill", "freeze", "cut2"), s
            assert "witness" not in s.targets
