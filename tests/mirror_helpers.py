"""What the mirror tests share: a flow with test settings, and the condition "the flow has
read everything its source holds" (from the offset map the mirror keeps in the target)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kafka_helpers import end_offsets, unique

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.offsets import load_offset_map
from crossdc.topology import Flow, Topology
from mirror import MirrorWorker

__all__ = ["drained", "flow", "start_mirrors"]


def flow(source: str, target: str, topics: str, *, discovery_interval_s: float = 1.0,
         group: str | None = None, **kw: Any) -> Flow:
    """A flow that looks for new topics every second, in a consumer group of its own."""
    return Flow(source=source, target=target, topics=topics,
                discovery_interval_s=discovery_interval_s,
                group=group or unique(f"mm-{source}-{target}"), **kw)


def drained(boot: Mapping[str, str], flow: Flow | tuple[str, str], topic: str,
            partitions: int = 1) -> Callable[[], Awaitable[bool]]:
    """For `eventually`: whether the flow (or a (source, target) pair) has read every record
    its source holds in `topic`. `boot`: region → bootstrap."""
    source, target = (flow.source, flow.target) if isinstance(flow, Flow) else flow

    async def check() -> bool:
        ends = await end_offsets(boot[source], topic, partitions)
        marks = await load_offset_map(KafkaConnection.of(boot[target]), source)
        return all(marks.next_src.get((topic, p), 0) >= end for p, end in ends.items() if end)

    return check


async def start_mirrors(topo: Topology) -> list[MirrorWorker]:
    """A started mirror worker per flow of `topo` (the caller stops them)."""
    out = []
    for f in topo.flows:
        w = MirrorWorker(f, KafkaConnection.of(topo.region(f.source)),
                         KafkaConnection.of(topo.region(f.target)))
        await w.start()
        out.append(w)
    return out
