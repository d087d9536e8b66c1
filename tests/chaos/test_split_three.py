"""Issue #21: three regions split three ways (full chaos set only).

A stack of its own (tests/chaos/split_support.py): three regions of one broker each and no
witness (three datacenters: a majority is two), each in its own network namespace with its
Consul, proxy, controller, mirrors and a producer writing ordered, sync and nearest records
through its own region's proxy. Every region is cut off from every other at once: no side
holds a majority, so

- no side may fail over (before the fix two sides each named their own primary at the same
  epoch N + 1 and both streams interleaved after the heal);
- the stranded primary's proxy cannot renew its lease from a majority: once the lease, the
  longest write and the margin have run out, it acknowledges no ordered or sync write;
- nobody else acknowledges an ordered or sync write either;
- after the heal every datacenter names the primary of before, at its epoch, and the whole
  history passes the checker (dr/drill/history.py).

Each run's history goes to .crossdc/chaos-history/, its row to docs/reliability.md."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from chaos_results import record  # type: ignore[import-not-found]
from chaos_support import FULL  # type: ignore[import-not-found]
from split_support import (  # type: ignore[import-not-found]
    HEAL_BOUND_S,
    LOOPS,
    Run,
    SplitStack,
    split_stack,
)

from dr.controller.config import FailoverSettings
from dr.stack.netns import netns_available

pytestmark = [pytest.mark.timeout(1200),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root"),
              pytest.mark.skipif(not FULL, reason="full chaos set only (CROSSDC_CHAOS=full)")]

THREE = ["east", "west", "south"]

CUT_S = 40.0
"""How long the three-way split lasts: longer than detection, the wait period and a
failover, so a side that wrongly believed it had a majority would have failed over."""

_F = FailoverSettings()
LEASE_OUT_S = _F.primary_lease_s + _F.primary_write_s + _F.lease_margin_s
"""After the cut, the stranded primary's last lease (and the write it bounds) has run out."""


@pytest.fixture(scope="module")
async def three(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SplitStack]:
    async with split_stack(tmp_path_factory.mktemp("chaos-three"), THREE, ()) as stack:
        yield stack


@pytest.mark.parametrize("round_", range(LOOPS))
async def test_three_regions_split_three_ways_name_no_second_primary(
        three: SplitStack, tmp_path: Path, round_: int) -> None:
    async with Run(three, "three-way split", tmp_path) as run:
        await run.start()
        assert run.before is not None
        before = run.before
        for r in three.regions:
            await run.cut(r)
        cut_ms = run.mark("split")
        await asyncio.sleep(CUT_S)  # the split lasts: a wrong failover would show in it
        late = [a for a in run.acks() if a.mode in ("ordered", "sync") and not a.duplicate
                and a.t_ms > cut_ms + LEASE_OUT_S * 1000]
        for r in three.regions:
            await run.heal(r)
        agree_s, flow_s = await run.after_heal()
        v = await run.judge()
        after = v.after
        by_region = {r: sum(1 for a in late if a.via == r) for r in three.regions}
        recover = (f"every region cut from every other for {CUT_S:g} s: ordered/sync acks "
                   f"later than {LEASE_OUT_S:g} s into the split: "
                   + ", ".join(f"{r} {n}" for r, n in by_region.items())
                   + f"; heal: every datacenter on one writable primary "
                   f"{_secs(agree_s)}, every mode flowing {_secs(flow_s)}; primary "
                   f"{before.region}@{before.epoch} → "
                   f"{after.region if after else '?'}@{after.epoch if after else '?'}")
        record(v.row("split-brain: three regions split three ways", recover, round_))
        assert v.history.complete, v.history.lines()
        assert v.history.passed, f"{v.path}\n{v.history.explain()}"
        assert not run.notes, run.notes
        assert not late, f"ordered/sync writes acknowledged with no majority anywhere: {by_region}"
        assert after is not None
        assert (after.region, after.epoch) == (before.region, before.epoch), \
            "no side had a majority: nobody may fail over"


def _secs(x: float | None) -> str:
    return f"not within {HEAL_BOUND_S:g} s" if x is None else f"after {x:.1f} s"
