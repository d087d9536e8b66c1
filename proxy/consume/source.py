"""Where a topic is read from, with what settings, and the move to a new primary. Pure.

- `read_region`: ordered and sync topics are read from the current writable primary (None
  while the record is fenced: a failover is under way, nothing is read), nearest topics
  from the proxy's own region (never moved: a region's consumers read that region's copy).
- `stream_settings`: the ack deadline, deliveries and dead-letter topic a stream gets for a
  topic: what it asked for, never more than the topic's rule (`consume:`).
- `Switch`: what the reader of the primary does when the primary moves, as a state machine
  driven by events (the primary records the proxy's watch sees, and the end of each step it
  asked for), answering with actions for the driver to run:

      running ──fenced──→ pausing ──promoted elsewhere──→ committing → translating → resuming
         │                   └──promoted back: resume in place          │              │
         └──promoted elsewhere (fence not seen)──→ committing           └──────────────┴→ running

  *pausing*: no new deliveries from the old region; acks still count. *committing*: the
  acknowledged prefix of every partition committed to the old region (best effort: it may be
  down; the proxy's own positions are what the handover carries). *translating*: the
  positions and the acknowledged records translated into the new primary through the mirror's
  offset map (`proxy.consume.handover`). *resuming*: the proxy joins the group in the new
  region and reads from the handover's positions. A newer record that arrives during a step
  is kept (`latest`) and decides where the step leads when it ends, so the machine never
  resumes into a region that is no longer the primary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from crossdc.primary import PrimaryRecord
from proxy.errors import InvalidConsume
from proxy.policy import ConsumeSettings, Rule

__all__ = [
    "MIN_ACK_DEADLINE_S",
    "Action",
    "Commit",
    "Event",
    "Pause",
    "Phase",
    "PrimarySeen",
    "ReadSettings",
    "Resume",
    "StepDone",
    "Switch",
    "Translate",
    "read_region",
    "stream_settings",
]

MIN_ACK_DEADLINE_S = 1.0
"""The shortest ack deadline a stream may ask for (the policy's lower bound too): shorter
ones would mostly measure the network and redeliver what is being processed."""


def read_region(rule: Rule, primary: PrimaryRecord, own: str) -> str | None:
    """The region `rule`'s topic is read from: nearest → `own`; ordered and sync → the
    writable primary, None while fenced (wait for the promotion)."""
    if rule.dr_mode == "nearest":
        return own
    return primary.writable


@dataclass(frozen=True)
class ReadSettings:
    """What a stream gets for one topic."""

    ack_deadline_s: float
    max_deliveries: int
    dead_letter_topic: str


def stream_settings(rule: ConsumeSettings, topic: str, *, ack_deadline_s: float = 0.0,
                    max_deliveries: int = 0) -> ReadSettings:
    """The settings of a stream that asked for `ack_deadline_s` and `max_deliveries` (0: the
    rule's) on `topic`: the rule's values bound them (asking for more gets the rule's).
    Raises `InvalidConsume` for a value no rule could allow."""
    if not math.isfinite(ack_deadline_s) or ack_deadline_s < 0 or (
            0 < ack_deadline_s < MIN_ACK_DEADLINE_S):
        raise InvalidConsume(f"ack_deadline_s {ack_deadline_s}: 0 (the rule's) or at least "
                             f"{MIN_ACK_DEADLINE_S:g} s")
    if max_deliveries < 0:
        raise InvalidConsume(f"max_deliveries {max_deliveries}: 0 (the rule's) or more")
    deadline = rule.ack_deadline_s if ack_deadline_s == 0 else min(ack_deadline_s,
                                                                   rule.ack_deadline_s)
    deliveries = rule.max_deliveries if max_deliveries == 0 else min(max_deliveries,
                                                                     rule.max_deliveries)
    return ReadSettings(deadline, deliveries, rule.dead_letter_for(topic))


# -- the switch to a new primary ----------------------------------------------------------------

Phase = Literal["running", "pausing", "committing", "translating", "resuming"]
Step = Literal["commit", "translate", "resume"]


@dataclass(frozen=True)
class Pause:
    """Stop new deliveries of the partitions read from `region`; tell the streams (PAUSED);
    commit what is acked so far (not awaited: the controller's offsets step, which runs
    before the promotion, then reads a recent prefix). Acks and nacks still apply."""

    region: str
    epoch: int


@dataclass(frozen=True)
class Commit:
    """Commit every partition's acknowledged prefix to `region`'s group; then `StepDone`
    ("commit"), ok or not (the region may be down: the handover does not need it)."""

    region: str


@dataclass(frozen=True)
class Translate:
    """Snapshot every partition's positions and settled records (acks for `source` after
    this are stale), translate them into `target` and store the handover there; then
    `StepDone("translate", ok)`: not ok means no handover (resume from the group's committed
    offsets in `target`, more duplicates, counted)."""

    source: str
    target: str


@dataclass(frozen=True)
class Resume:
    """Read from `region` (at `epoch`). `moved`: join the group there and start each
    partition from its handover (`handover`: one was stored) or else from the group's
    committed offset there; not moved: go on where delivery stopped. Tell the streams
    (RESUMED); then `StepDone("resume", ok)`. Not ok: nothing was resumed (the driver left
    what it joined); asked again, or what the newest record needs instead."""

    region: str
    epoch: int
    moved: bool
    handover: bool = True


Action = Pause | Commit | Translate | Resume


@dataclass(frozen=True)
class PrimarySeen:
    """The proxy's primary watch saw `record` (older ones are ignored)."""

    record: PrimaryRecord


@dataclass(frozen=True)
class StepDone:
    """A step the machine asked for has ended."""

    step: Step
    ok: bool = True


Event = PrimarySeen | StepDone

_STEP_OF: dict[Phase, Step] = {"committing": "commit", "translating": "translate",
                               "resuming": "resume"}


@dataclass(frozen=True)
class Switch:
    """The reader of the primary. `region`: read now (running) or being left (None before
    the first promotion seen); `target`: the region being moved to; `latest`: the newest
    record seen; `epoch`: the epoch read under."""

    phase: Phase
    region: str | None
    epoch: int
    latest: PrimaryRecord
    target: str | None = None
    resume: Resume | None = None  # resuming: the action under way (asked again if it fails)

    @classmethod
    def start(cls, record: PrimaryRecord) -> tuple[Switch, tuple[Action, ...]]:
        """The machine for a proxy that starts under `record`."""
        w = record.writable
        if w is None:
            return cls("pausing", None, record.epoch, record), ()
        # join the group there and read from its committed offsets: nothing to hand over
        return cls("resuming", None, record.epoch, record)._resuming(
            Resume(w, record.epoch, moved=True, handover=False))

    def on(self, event: Event) -> tuple[Switch, tuple[Action, ...]]:
        """The next state and the actions to run, in order."""
        if isinstance(event, PrimarySeen):
            return self._seen(event.record)
        if _STEP_OF.get(self.phase) != event.step:
            raise ValueError(f"step {event.step!r} ended while {self.phase}")
        if event.step == "commit":
            return self._from_old()
        if event.step == "translate":
            return self._translated(event.ok)
        assert self.resume is not None
        if not event.ok:
            if self.latest.writable == self.resume.region:
                return self, (self.resume,)
            # the primary moved on meanwhile: positions are still the old region's
            return replace(self, phase="pausing", target=None, resume=None)._follow()
        done = replace(self, phase="running", region=self.resume.region, target=None,
                       epoch=self.resume.epoch, resume=None)
        return done._follow()  # a record seen while resuming may already name another

    # -- transitions -----------------------------------------------------------------------
    def _seen(self, record: PrimaryRecord) -> tuple[Switch, tuple[Action, ...]]:
        if not record.supersedes(self.latest):
            return self, ()  # an older or the same record (a stale datacenter): ignored
        new = replace(self, latest=record)
        if self.phase in ("running", "pausing"):
            return new._follow()
        return new, ()  # the step under way ends first; `latest` decides what follows

    def _follow(self) -> tuple[Switch, tuple[Action, ...]]:
        """Running or pausing: act on `latest`."""
        w, epoch = self.latest.writable, self.latest.epoch
        r = self.region
        if w is None:
            if self.phase == "running" and r is not None:
                return replace(self, phase="pausing"), (Pause(r, epoch),)
            return self, ()
        if r is None:  # nothing read yet: no positions to carry
            return self._resuming(Resume(w, epoch, moved=True, handover=False))
        if w == r:
            if self.phase == "pausing":  # promoted back: resume where delivery stopped
                return self._resuming(Resume(r, epoch, moved=False))
            return replace(self, epoch=epoch), ()
        pause: tuple[Action, ...] = (Pause(r, epoch),) if self.phase == "running" else ()
        return replace(self, phase="committing", target=w), (*pause, Commit(r))

    def _from_old(self) -> tuple[Switch, tuple[Action, ...]]:
        """The commit ended: where `latest` points now decides."""
        w, epoch, r = self.latest.writable, self.latest.epoch, self.region
        assert r is not None
        if w is None:
            return replace(self, phase="pausing", target=None), ()
        if w == r:
            return self._resuming(Resume(r, epoch, moved=False))
        return replace(self, phase="translating", target=w), (Translate(r, w),)

    def _translated(self, ok: bool) -> tuple[Switch, tuple[Action, ...]]:
        w, epoch, r = self.latest.writable, self.latest.epoch, self.region
        assert r is not None
        if w != self.target:  # the primary moved again meanwhile: positions are still r's
            return self._from_old()
        assert w is not None
        return self._resuming(Resume(w, epoch, moved=True, handover=ok))

    def _resuming(self, action: Resume) -> tuple[Switch, tuple[Action, ...]]:
        return replace(self, phase="resuming", target=action.region, resume=action), (action,)
