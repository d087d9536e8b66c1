"""The reconciliation reads the proxies' outcome journals and the quarantine beside the data
(issue 23), against the real two regions and real Spark (local mode).

One topic is seeded straight into the clusters with east holding every record and west only
some, and east's journal saying what each record's client was told: the run classifies every
copy west lacks (acknowledged, told failed, unknown outcome, quarantined, no journal entry),
finds an acknowledged record that no region holds, and fails on the losses only, naming
them (that told-failed copies alone pass is a unit test of the verdict). Two sync records
reach west late, as hinted handoff writes them (`dr-repaired`, after records written there
since): counted as repaired in west, neither missing, altered nor out of order.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, produce, unique

from crossdc.outcomes import ACKED, FAILED, JOURNAL_TOPIC, UNKNOWN, Group, encode
from crossdc.quarantine import QUARANTINE_TOPIC, quarantine_headers
from dr.reconcile import Report, RunSettings, run

# a Spark run of its own (~30 s setup): in `make test-more` (CI), keeping `make test` under
# 10 min (test_reconcile.py keeps one Spark run in `make test`)
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _headers(dr_id: str, ts: int, mode: str = "ordered") -> list[tuple[str, bytes]]:
    path = b"east,west" if mode == "sync" else b"east"
    return [("dr-id", dr_id.encode()), ("dr-origin", b"east"), ("dr-ts", str(ts).encode()),
            ("dr-mode", mode.encode()), ("dr-epoch", b"1"), ("dr-path", path)]


@dataclass
class Seeded:
    prefix: str
    mixed: str
    ids: dict[str, list[str]] = field(default_factory=dict)
    """outcome → the dr-ids west lacks for that reason (mixed topic)."""
    lost_everywhere: str = ""
    both: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    """Sync records east took on time and west late, by hinted handoff."""
    unordered: list[str] = field(default_factory=list)
    """Two sync records of one key in west out of east's order, the first told failed."""


def _ids(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


@pytest.fixture(scope="module")
async def seeded(two_regions: Any) -> Seeded:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("rj")
    s = Seeded(prefix, f"{prefix}-mixed")
    for b in (east, west):
        await create_topic(b, s.mixed, partitions=1)
    await create_topic(east, JOURNAL_TOPIC)
    await create_topic(west, QUARANTINE_TOPIC)
    now = int(time.time() * 1000)
    s.ids = {"acknowledged": _ids(3), "told_failed": _ids(2), "unknown": _ids(1),
             "unjournaled": _ids(1), "quarantined": _ids(1)}
    s.both = _ids(2)
    s.repaired = _ids(2)
    s.lost_everywhere = uuid.uuid4().hex
    # with a user header: the content hash goes through array_except, which must drop
    # dr-repaired like every dr-* header (else the late copy would be "altered")
    sync = {i: [*_headers(i, now, "sync"), ("trace", i[:8].encode())] for i in s.repaired}
    in_east = [i for ids in s.ids.values() for i in ids] + s.both
    metas = await produce(east, s.mixed, [(b"k", i.encode(), sync.get(i) or _headers(i, now))
                                          for i in s.repaired + in_east], partition=0)
    at = {i: m.offset for i, m in zip(s.repaired + in_east, metas, strict=True)}
    west_metas = await produce(west, s.mixed, [(b"k", i.encode(), _headers(i, now))
                                               for i in s.both], partition=0)
    # a write told failed that west took anyway (its answer never came), after a later
    # record of the same key: out of order, but not of what was acknowledged
    s.unordered = _ids(2)
    u_east = await produce(east, s.mixed, [(b"u", i.encode(), _headers(i, now, "sync"))
                                           for i in s.unordered], partition=0)
    await produce(west, s.mixed, [(b"u", i.encode(), _headers(i, now, "sync"))
                                  for i in reversed(s.unordered)], partition=0)
    # the hints' replay: same key, value and headers plus dr-repaired, after `both` (records
    # east took later): out of east's order, which is no order violation for a late copy
    await produce(west, s.mixed, [(b"k", i.encode(), [*sync[i], ("dr-repaired", b"east")])
                                  for i in s.repaired], partition=0)
    [q] = s.ids["quarantined"]
    await produce(west, QUARANTINE_TOPIC, [(b"k", q.encode(), quarantine_headers(
        _headers(q, now), source="east", topic=s.mixed, partition=0, offset=at[q],
        epoch=2))])

    def group(topic: str, entries: list[tuple[str, str, str]]) -> Group:
        return Group(topic, str(now), [list(e) for e in entries])
    ack = s.ids["acknowledged"]
    groups = [
        # a first try told failed, then its retry acknowledged: the strongest outcome counts
        group(s.mixed, [(ack[0], FAILED, "")]),
        group(s.mixed, [(i, ACKED, f"east:0:{at[i]}") for i in ack]),
        group(s.mixed, [(i, FAILED, f"east:0:{at[i]}") for i in s.ids["told_failed"]]
              + [(i, UNKNOWN, "") for i in s.ids["unknown"]]),
        group(s.mixed, [(q, ACKED, f"east:0:{at[q]}")]),  # the deposed primary's ack
        group(s.mixed, [(i, ACKED, f"east:0:{at[i]},west:0:{m.offset}")
                        for i, m in zip(s.both, west_metas, strict=True)]),
        group(s.mixed, [(s.lost_everywhere, ACKED, "east:0:99999")]),
        # acknowledged at the quorum (east), west's hint stored, then replayed
        group(s.mixed, [(i, ACKED, f"east:0:{at[i]}") for i in s.repaired]),
        group(s.mixed, [(s.unordered[0], FAILED, f"east:0:{u_east[0].offset}"),
                        (s.unordered[1], ACKED, f"east:0:{u_east[1].offset}")]),
        group(f"{prefix}-elsewhere", [(uuid.uuid4().hex, ACKED, "east:0:1")])]
    # the journal of a proxy that wrote nothing else: no entry for the "unjournaled" one
    await produce(east, JOURNAL_TOPIC, [(None, encode(groups[:3]), []),
                                        (None, encode(groups[3:]), [])], partition=0)
    return s


def _run(two_regions: Any, topics: str, jars: Path) -> Report:
    return run(RunSettings(topology=two_regions.topology,
                           topology_path=str(two_regions.topology_path),
                           regions=["east", "west"], topics=topics, jars_dir=jars,
                           driver_memory="768m", grace_s=0.0))


@pytest.fixture(scope="module")
def report(two_regions: Any, seeded: Seeded, jars: Path, spark_cleanup: None) -> Report:
    return _run(two_regions, seeded.mixed, jars)


def test_every_missing_copy_is_classified_by_what_its_client_was_told(
        report: Report, seeded: Seeded) -> None:
    got: dict[str, set[tuple[str, str]]] = {}
    for m in report.missing:
        assert m.outcome is not None
        got.setdefault(m.outcome, set()).add((m.dr_id, m.region))
    expected = {o: {(i, "west") for i in ids} for o, ids in seeded.ids.items()}
    expected["acknowledged"] |= {(seeded.lost_everywhere, "east"),
                                 (seeded.lost_everywhere, "west")}
    assert got == expected
    t = report.totals
    assert t.missing_by_outcome == {
        "acknowledged": {"west": 4, "east": 1}, "unjournaled": {"west": 1},
        "told_failed": {"west": 2}, "unknown": {"west": 1}, "quarantined": {"west": 1}}
    assert (t.missing, t.lost) == (10, 6)
    assert t.journaled == len(seeded.both) + len(seeded.repaired) + len(seeded.unordered) + \
        sum(len(v) for k, v in seeded.ids.items() if k != "unjournaled") + 1
    [part] = report.topics[0].partitions
    assert part.missing == {"east": 1, "west": 9}
    # the lost one is expected too
    assert part.expected == len(seeded.both) + len(seeded.repaired) + \
        len(seeded.unordered) + 8 + 1


def test_out_of_order_with_a_write_told_failed_is_counted_not_a_violation(
        report: Report, seeded: Seeded) -> None:
    t = report.totals
    assert (t.order_violations, t.order_unacknowledged) == (0, 1)
    assert not report.order_violations
    assert report.verdict is not None
    assert "1 out of order among writes told failed or of unknown outcome" in \
        report.verdict.summary, report.verdict.summary


def test_a_record_no_region_holds_is_named_where_kafka_acknowledged_it(
        report: Report, seeded: Seeded) -> None:
    lost = [m for m in report.missing if m.dr_id == seeded.lost_everywhere]
    assert {(m.region, m.origin, m.origin_partition, m.origin_offset) for m in lost} == {
        ("east", "east", 0, 99999), ("west", "east", 0, 99999)}


def test_the_verdict_fails_on_losses_only_and_names_the_rest(report: Report) -> None:
    assert report.verdict is not None
    assert report.verdict.status == "fail"
    assert [b.name for b in report.breaches] == ["missing"]
    assert report.breaches[0].value == 6
    summary = report.verdict.summary
    assert summary.startswith("FAIL: 1 acknowledged missing in east, 4 in west, "
                              "1 missing with no journal entry in west"), summary
    assert ("no loss: 2 told-failed missing in west, 1 unknown-outcome missing in west, "
            "1 quarantined (set aside to keep order) in west") in summary, summary


def test_copies_written_late_by_hinted_handoff_are_counted_as_repaired(
        report: Report, seeded: Seeded) -> None:
    t = report.totals
    assert t.repaired == {"east": 0, "west": 2}
    [part] = report.topics[0].partitions
    assert part.repaired == {"east": 0, "west": 2}
    # present in west (not missing), same content (not altered), no duplicate, and out of
    # east's order without being an order violation
    assert part.present["west"] == len(seeded.both) + len(seeded.repaired) + \
        len(seeded.unordered)
    named = {m.dr_id for m in report.missing} | {d.dr_id for d in report.duplicates} \
        | {a.dr_id for a in report.altered} \
        | {i for o in report.order_violations for i in (o.first_id, o.second_id)}
    assert not named & set(seeded.repaired)
    assert (t.altered, t.duplicates, t.order_violations) == (0, 0, 0)
    # their latency is the hint's wait, not replication's: only the on-time copies count
    [lat] = report.latency
    assert (lat.origin, lat.region, lat.count + lat.unmeasured) == (
        "east", "west", len(seeded.both) + len(seeded.unordered))
