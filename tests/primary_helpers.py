"""The primary record in every Consul datacenter, for tests that run proxies against the
session's stack.

A proxy renews its primary lease only from a majority of datacenters showing the SAME record
(`proxy.primary`; with two regions and no witness: both), and an absent key renews nothing:
a test that starts a proxy before anything wrote the key (the controller writes the epoch-0
record explicitly at its first start) writes it here first.
"""

from __future__ import annotations

from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology

__all__ = ["agreed_primary", "put_primary", "read_everywhere"]


async def read_everywhere(topology: Topology) -> dict[str, PrimaryRecord | None]:
    """Datacenter name → the record its KV holds (None: absent)."""
    out: dict[str, PrimaryRecord | None] = {}
    for dc in topology.datacenters:
        async with ConsulClient(dc.consul) as c:
            out[dc.name], _ = await read_primary(c)
    return out


async def put_primary(http_addr: str, record: PrimaryRecord) -> None:
    """Write `record` into the datacenter of the agent at `http_addr` (compare-and-set on
    what is there)."""
    async with ConsulClient(http_addr) as c:
        for _ in range(5):
            _, idx = await read_primary(c)
            if await write_primary(c, record, idx):
                return
    raise AssertionError(f"could not write {record} through {http_addr}")


async def agreed_primary(topology: Topology, region: str | None = None, *,
                         lease_s: float = 0.0, write_s: float = 0.0) -> PrimaryRecord:
    """Make every datacenter of `topology` hold one unfenced record naming `region` (default:
    the topology's primary): kept when they all hold it already, else the epoch-0 record
    (`PrimaryRecord.initial`) where the key is absent everywhere, else the region at an epoch
    above every one seen. The record held everywhere is returned."""
    region = region or topology.primary
    held = await read_everywhere(topology)
    records = list(held.values())
    first = records[0] if records else None
    if (first is not None and not first.fenced and first.region == region
            and (first.lease_s, first.write_s) == (lease_s, write_s)
            and all(r is not None and (r.region, r.epoch, r.fenced)
                    == (first.region, first.epoch, first.fenced) for r in records)):
        return first
    if all(r is None for r in records) and region == topology.primary:
        record = PrimaryRecord.initial(topology).model_copy(
            update={"lease_s": lease_s, "write_s": write_s, "by": "test"})
    else:
        top = max((r.epoch for r in records if r is not None), default=0)
        record = PrimaryRecord(region=region, epoch=top + 1, by="test", lease_s=lease_s,
                               write_s=write_s)
    for dc in topology.datacenters:
        await put_primary(dc.consul.http_addr, record)
    return record
