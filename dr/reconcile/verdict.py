"""The verdict of a run: one line saying what was found, and whether it fails.

    FAIL: 12 acknowledged missing in west, 3 altered; within limits: 1 duplicate in west
    (at-least-once flows...)
    OK: 10,000 records compared, nothing acknowledged missing, altered or out of order, no
    duplicates; no loss: 1,109 told-failed missing in east, 4 quarantined (set aside to
    keep order) in west
    OK: 10,000 records compared, nothing missing, altered or out of order, no duplicates

A missing copy fails the verdict when its record was acknowledged to its client, or when no
proxy journaled it (written straight to Kafka: judged as before the journal existed); the
copies of records whose clients were told they failed, never got an answer, or that sit in
the quarantine are counted after "no loss" (docs/architecture.md, "The outcome journal").
    NOT JUDGED YET: all 40 records of the window are in flight; re-run after 12:00:31 UTC

A window whose records are all still in flight (newer than `until`) says so instead of OK:
nothing was compared, so nothing can be vouched for. The time to re-run is the event time
of the newest record in flight plus the grace: a run then has every one of them in its
window. Pure functions of the report; `run` calls them, the tests call them directly.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from datetime import UTC, datetime

from crossdc.topology import Flow
from dr.reconcile.model import (
    LOSSES,
    OUTCOMES,
    Breach,
    Report,
    Thresholds,
    TopicSummary,
    Verdict,
)

__all__ = ["conclude", "decide", "exactly_once_duplicates", "exactly_once_pairs", "judge",
           "loss_line"]


def judge(values: dict[str, float], thresholds: Thresholds) -> list[Breach]:
    """Each threshold set and passed becomes a Breach (thresholds without a value, such as
    latency when nothing was measured, are not judged)."""
    out = []
    for name, limit in thresholds.model_dump(exclude={"exactly_once_topics"}).items():
        value = values.get(name)
        if limit is not None and value is not None and value > limit:
            out.append(Breach(name=name, value=value, limit=limit))
    return out


def conclude(report: Report, exactly_once: Collection[tuple[str, str]] = ()) -> Report:
    """The report judged against its own thresholds: `breaches` and `verdict` filled in."""
    tot = report.totals
    values: dict[str, float] = {
        "missing": _lost(report), "duplicates": tot.duplicates, "altered": tot.altered,
        "order_violations": tot.order_violations,
        "headerless_unmatched": tot.headerless_unmatched, "unreadable": tot.unreadable,
        "duplicates_exactly_once": exactly_once_duplicates(report.topics, exactly_once)}
    p99 = max((x.p99_ms for x in report.latency if x.p99_ms is not None), default=None)
    if p99 is not None:
        values["latency_p99_ms"] = p99
    judged = report.model_copy(update={"breaches": judge(values, report.thresholds)})
    return judged.model_copy(update={"verdict": decide(judged, exactly_once)})


def exactly_once_pairs(topics: Sequence[str], regions: Sequence[str], flows: Sequence[Flow],
                       extra: str | None = None) -> set[tuple[str, str]]:
    """(topic, region) pairs where a duplicate is a defect: the region is the target of an
    exactly-once flow carrying the topic, or (`extra`, the thresholds' exactly_once_topics)
    the topic is declared exactly-once everywhere it is compared."""
    out = {(t, f.target) for f in flows if f.exactly_once and f.target in regions
           for t in topics if re.fullmatch(f.topics, t)}
    if extra is not None:
        out |= {(t, r) for t in topics if re.fullmatch(extra, t) for r in regions}
    return out


def exactly_once_duplicates(topics: Sequence[TopicSummary],
                            pairs: Collection[tuple[str, str]]) -> int:
    return sum(p.duplicates.get(r, 0) for t in topics for p in t.partitions
               for (topic, r) in pairs if topic == t.topic)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _plural(n: int | float, word: str, plural: str | None = None) -> str:
    return f"{n:,g} {word if n == 1 else (plural or word + 's')}"


def _per_region(report: Report, field: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in report.topics:
        for p in t.partitions:
            for r, n in getattr(p, field).items():
                if n:
                    out[r] = out.get(r, 0) + n
    return out


def _in_regions(counts: dict[str, int], noun: str) -> str:
    """"12 missing in west" / "3 missing in east, 12 in west"."""
    (r0, n0), *rest = sorted(counts.items())
    return ", ".join([f"{n0:,} {noun} in {r0}", *(f"{n:,} in {r}" for r, n in rest)])


_NOUN = {"acknowledged": "acknowledged missing",
         "unjournaled": "missing with no journal entry",
         "told_failed": "told-failed missing", "unknown": "unknown-outcome missing",
         "quarantined": "quarantined (set aside to keep order)"}
"""How the verdict names the missing copies of each outcome ("12 acknowledged missing in
west")."""


def _lost(report: Report) -> int:
    """Missing copies the `missing` threshold judges: acknowledged records and records with no
    journal entry (a report from before the journal: every missing copy)."""
    tot = report.totals
    if not tot.missing_by_outcome:
        return tot.missing
    return sum(n for o in LOSSES for n in tot.missing_by_outcome.get(o, {}).values())


def loss_line(report: Report) -> str:
    """The one-line answer to "was anything acknowledged lost?" (the journals' view)."""
    tot = report.totals
    ack = {r: n for r, n in tot.missing_by_outcome.get("acknowledged", {}).items() if n}
    if ack:
        where = ", ".join(f"{r} {n:,}" for r, n in sorted(ack.items()))
        return (f"acknowledged records lost: YES, {sum(ack.values()):,} missing copies "
                f"({where})")
    if not tot.journaled:
        return ("acknowledged records lost: not known (no proxy journal covers these "
                "records: they are judged by presence alone)")
    return (f"acknowledged records lost: none ({tot.journaled:,} journaled outcomes, every "
            f"acknowledged record in every region)")


def decide(report: Report, exactly_once: Collection[tuple[str, str]] = ()) -> Verdict:
    """The verdict for a report whose `breaches` are judged: what was found, failing or not.

    Each finding is named once: among the failures when its threshold was passed, else
    "within limits" (allowed, or not checked, with why)."""
    tot, limits = report.totals, report.thresholds
    breached = {b.name: b for b in report.breaches}
    judged = tot.compared + tot.headerless
    eo_dups = exactly_once_duplicates(report.topics, exactly_once)

    failing: list[str] = []
    allowed: list[str] = []

    def note(found: str, names: Sequence[str], why_allowed: str) -> None:
        hit = [breached[n] for n in names if n in breached]
        if hit:
            failing.append(found)
        else:
            allowed.append(f"{found} ({why_allowed})")

    def limit_text(name: str) -> str:
        value = getattr(limits, name)
        return "not checked" if value is None else f"limit {value:,g}"

    missing = _per_region(report, "missing")
    counted: list[str] = []  # missing copies that are no loss: what their clients were told
    if missing and not tot.missing_by_outcome:  # a report from before the journal
        note(_in_regions(missing, "missing"), ["missing"], limit_text("missing"))
    elif missing:
        by = tot.missing_by_outcome
        # no journal covers the window (no proxy wrote these records): plainly "missing"
        nouns = _NOUN if tot.journaled else {**_NOUN, "unjournaled": "missing"}
        losses = [_in_regions(by[o], nouns[o]) for o in LOSSES if by.get(o)]
        if losses:
            note(", ".join(losses), ["missing"], limit_text("missing"))
        counted = [_in_regions(by[o], _NOUN[o]) for o in OUTCOMES
                   if o not in LOSSES and by.get(o)]
    if tot.altered:
        note(f"{tot.altered:,} altered", ["altered"], limit_text("altered"))
    if tot.order_violations:
        note(_plural(tot.order_violations, "order violation"), ["order_violations"],
             limit_text("order_violations"))
    if tot.order_unacknowledged:
        counted.append(f"{tot.order_unacknowledged:,} out of order among writes told failed "
                       "or of unknown outcome")
    dups = _per_region(report, "duplicates")
    if dups:
        if limits.duplicates is not None:
            why = limit_text("duplicates")
        elif eo_dups:
            why = limit_text("duplicates_exactly_once") + " on exactly-once flows"
        else:
            why = "at-least-once flows: duplicates are expected, not checked"
        noun = "duplicate" if sum(dups.values()) == 1 else "duplicates"
        found = _in_regions(dups, noun)
        if eo_dups and eo_dups != sum(dups.values()):
            found += f" ({eo_dups:,} on exactly-once flows)"
        elif eo_dups:
            found += " (exactly-once flows)"
        note(found, ["duplicates", "duplicates_exactly_once"], why)
    if tot.headerless_unmatched:
        note(_plural(tot.headerless_unmatched, "headerless record") + " without a match",
             ["headerless_unmatched"], limit_text("headerless_unmatched"))
    if tot.unreadable:
        note(f"{tot.unreadable:,} unreadable (deleted by retention before compared)",
             ["unreadable"], limit_text("unreadable"))
    if "latency_p99_ms" in breached:
        b = breached["latency_p99_ms"]
        failing.append(f"replication latency p99 {b.value:,.0f} ms > {b.limit:,g} ms")

    in_flight = (f"; {_plural(tot.in_flight, 'record')} in flight, judged by a later run"
                 if tot.in_flight and judged else "")
    if counted:
        in_flight = f"; no loss: {', '.join(counted)}{in_flight}"
    if failing:
        rest = f"; within limits: {', '.join(allowed)}" if allowed else ""
        return Verdict(status="fail", summary=f"FAIL: {', '.join(failing)}{rest}{in_flight}")
    if judged == 0 and tot.in_flight:
        return _not_judged(report)
    if judged == 0:
        older = (f" ({_plural(tot.before_window, 'record')} read, all older than the window)"
                 if tot.before_window else "")
        return Verdict(status="ok", summary=f"OK: nothing to compare in this window{older}")
    lost = _lost(report) if tot.missing_by_outcome else sum(missing.values())
    clean = [w for w, n in (("acknowledged missing" if missing else "missing", lost),
                            ("altered", tot.altered),
                            ("out of order", tot.order_violations)) if not n]
    text = f"OK: {_plural(tot.compared, 'record')} compared"
    if clean:
        text += ", nothing " + (" or ".join(clean) if len(clean) <= 2
                                else ", ".join(clean[:-1]) + " or " + clean[-1])
    if not dups:
        text += ", no duplicates"
    if allowed:
        text += "; within limits: " + ", ".join(allowed)
    return Verdict(status="ok", summary=text + in_flight)


def _not_judged(report: Report) -> Verdict:
    tot, w = report.totals, report.window
    newest = tot.in_flight_newest_ms
    grace_ms = int(w.grace_s * 1000)
    head = (f"NOT JUDGED YET: all {_plural(tot.in_flight, 'record')} of the window are in "
            f"flight (newer than the window's end, {_when(w.until_ms)})")
    if newest is None:
        return Verdict(status="not_judged", summary=f"{head}; re-run later")
    after = newest + grace_ms + 1
    if after > report.generated_at_ms:
        wait_s = (after - report.generated_at_ms + 999) // 1000
        return Verdict(status="not_judged", rerun_after_ms=after,
                       summary=f"{head}; re-run after {_when(after)} (in {wait_s:,} s), "
                       f"when the newest has aged past the {w.grace_s:g} s grace")
    return Verdict(status="not_judged", rerun_after_ms=after,
                   summary=f"{head}; re-run now with a later --until, or without --until")
