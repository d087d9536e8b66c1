"""A real network partition: each region's Kafka, Consul, proxy, controller and mirror (and
the witness datacenter's Consul) run in their own network namespace (dr/stack/netns.py),
joined by veth pairs on a bridge; the fault takes the primary region's link down (every
packet to and from it dropped, no RST), the heal brings it up. The drill's producers run in
the root namespace here (they move to the other region's proxy when theirs is cut off); the
split-brain suite (test_split_brain.py) keeps each region's producers inside its namespace.
One broker a region (the partition cuts the whole region, so replicas inside it prove
nothing more), a stack of its own for this module; the namespaces, links and bridge are
removed at the end, also after a failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from chaos_results import record, update_reconciliation  # type: ignore[import-not-found]
from chaos_support import (  # type: ignore[import-not-found]
    RUN_TOPICS,
    ChaosStack,
    check_common,
    drill,
    reconcile,
    remember,
    row,
)
from split_support import split_stack  # type: ignore[import-not-found]

from dr.stack.netns import netns_available

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root")]


@pytest.fixture(scope="module")
async def netns_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChaosStack]:
    # the split-brain suite's stack (a witness: east and west alone are no majority when one
    # is cut off); the drill's producers stay in the root namespace here
    async with split_stack(tmp_path_factory.mktemp("chaos-netns")) as s:
        yield ChaosStack(s.stack, s.services, s.topology, s.topology_path)


async def test_partition_of_the_primary_fails_over_without_split_brain(
        netns_stack: ChaosStack, tmp_path: Path) -> None:
    """The primary's region cut off: the other region's controller fails over; the stranded
    region's proxy cannot confirm its lease through its unreachable Consul, so it refuses
    ordered writes (no second writer for the epoch) until the heal: the RTO, taken over
    every producer, runs past the heal (CP). After the heal every region converges and the
    drill fails back."""
    bound = 120.0
    r = await drill(netns_stack, "partition", tmp_path, duration_s=30, outage_s=15)
    record(row("partition", r, bound, brokers=1))
    assert not r.split_brain, r.split_brain
    assert r.rpo_records == 0, "no acknowledged record lost"
    check_common(r, bound)
    assert r.primary_after != r.primary_before, "the controller failed over"
    assert r.failback_ms is not None, "failed back after the heal"
    assert "failback:promote" in [s.name for s in r.steps]
    assert r.modes["sync"].lost == 0
    # every acknowledged record where its mode promises, by the Spark reconciliation job
    remember("partition", r)
    found = await asyncio.to_thread(reconcile, netns_stack,
                                    {"partition": RUN_TOPICS["partition"]})
    update_reconciliation("partition", found["partition"].cell())
    found["partition"].agrees_with("partition", r)
