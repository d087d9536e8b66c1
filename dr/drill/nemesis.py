"""A seeded random fault schedule (a "nemesis", as Jepsen calls it) for the chaos suite.

`schedule(seed, duration_s, stage)` is a pure function: the same seed and stage give the same
steps, so a failing run is replayed by its seed (the suite prints it and keeps it in the
history). A step opens a fault or heals one that is open; at the end every open fault is
healed. The kinds, each with its heal:

    cut        a side's link down (a region with its clients, or the witness)    heal: up
    cut2       two sides at once (whatever is left alone may be the majority)    heal: up
    latency    WAN latency on a side's link (tc netem, 40-120 ms)                heal: removed
    kill       kill -9 a daemon (proxy, controller, mirror)                      heal: start
    freeze     SIGSTOP a daemon (hung: ports open, nothing answers)              heal: SIGCONT
    brokers    kill -9 a region's Kafka brokers                                  heal: start
    pause      SIGSTOP a region's Kafka brokers                                  heal: SIGCONT
    force      an operator's `dr failover --to R --force --yes` run on R's side (cut off or
               not: from inside a cut "the others are dead" and "I am the minority" look
               the same)                                                        no heal
    skew       a daemon restarted with its wall clock off by 10-60 s either way
               (libfaketime; its monotonic clock left true, as on a host whose
               NTP is wrong)                                          heal: restarted true

At most `max_open` faults are open at once, at most one fault per target.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["KINDS", "Stage", "Step", "kinds_of", "schedule"]

KINDS: tuple[str, ...] = ("cut", "cut2", "latency", "kill", "freeze", "brokers", "pause",
                          "force", "skew")


@dataclass(frozen=True)
class Stage:
    """What a schedule can act on."""

    regions: tuple[str, ...]
    witnesses: tuple[str, ...] = ()
    daemons: tuple[str, ...] = ()
    """Service names (`proxy-east`, `controller-west`, `mirror-east-west`, ...)."""
    kinds: tuple[str, ...] = KINDS

    @property
    def sides(self) -> tuple[str, ...]:
        """What a cut can isolate: every region (with its clients) and every witness."""
        return (*self.regions, *self.witnesses)


@dataclass(frozen=True)
class Step:
    """One action at `at_s` seconds into the schedule."""

    at_s: float
    kind: str
    targets: tuple[str, ...]
    heal: bool = False
    detail: dict[str, str] = field(default_factory=dict)
    """E.g. the latency of a `latency` step (`delay_ms`, `jitter_ms`)."""

    def describe(self) -> str:
        what = f"{'heal ' if self.heal else ''}{self.kind} {'+'.join(self.targets)}"
        extra = ", ".join(f"{k} {v}" for k, v in self.detail.items())
        return f"{self.at_s:6.1f} s  {what}{f' ({extra})' if extra else ''}"


def _open(rng: random.Random, stage: Stage, at: float, busy: set[str]) -> Step | None:
    kinds = list(stage.kinds)
    rng.shuffle(kinds)
    for kind in kinds:
        if kind in ("cut", "latency", "force"):
            free = [s for s in (stage.sides if kind != "force" else stage.regions)
                    if s not in busy or kind == "force"]
            if free:
                side = rng.choice(free)
                if kind == "latency":
                    return Step(at, kind, (side,), detail={
                        "delay_ms": str(rng.choice((40, 60, 80, 120))),
                        "jitter_ms": str(rng.choice((5, 10, 20)))})
                return Step(at, kind, (side,))
        elif kind == "cut2":
            free = [s for s in stage.sides if s not in busy]
            if len(free) >= 2 and len(stage.sides) >= 3:
                return Step(at, kind, tuple(sorted(rng.sample(free, 2))))
        elif kind in ("kill", "freeze", "skew"):
            free = [d for d in stage.daemons if d not in busy]
            if free:
                if kind == "skew":
                    return Step(at, kind, (rng.choice(free),), detail={
                        "offset_s": str(rng.choice((-60, -25, -10, 10, 25, 60)))})
                return Step(at, kind, (rng.choice(free),))
        elif kind in ("brokers", "pause"):
            free = [r for r in stage.regions if f"kafka-{r}" not in busy]
            if free:
                return Step(at, kind, (f"kafka-{rng.choice(free)}",))
    return None


def schedule(seed: int, duration_s: float, stage: Stage, *, max_open: int = 2,
             gap_s: tuple[float, float] = (3.0, 12.0)) -> list[Step]:
    """The steps of one schedule: faults opened and healed at random moments (a pause of
    `gap_s` between two steps) for `duration_s`, every fault open then healed at the end."""
    rng = random.Random(seed)
    steps: list[Step] = []
    open_: list[Step] = []
    at = rng.uniform(*gap_s) / 2
    while at < duration_s:
        if open_ and (len(open_) >= max_open or rng.random() < 0.45):
            f = open_.pop(rng.randrange(len(open_)))
            steps.append(Step(at, f.kind, f.targets, heal=True, detail=f.detail))
        else:
            busy = {t for f in open_ for t in f.targets}
            step = _open(rng, stage, at, busy)
            if step is not None:
                steps.append(step)
                if step.kind != "force":
                    open_.append(step)
        at += rng.uniform(*gap_s)
    for f in open_:
        steps.append(Step(duration_s, f.kind, f.targets, heal=True, detail=f.detail))
    return steps


def kinds_of(steps: Sequence[Step]) -> set[str]:
    """The fault kinds a schedule opens."""
    return {s.kind for s in steps if not s.heal}
