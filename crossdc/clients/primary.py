"""Read and compare-and-set the primary record (`crossdc.primary`) in one datacenter's KV."""

from __future__ import annotations

from crossdc.clients.consul import ConsulClient
from crossdc.primary import PRIMARY_KEY, PrimaryRecord

__all__ = ["read_primary", "write_primary"]


async def read_primary(consul: ConsulClient, *, dc: str | None = None,
                       consistent: bool = False) -> tuple[PrimaryRecord | None, int]:
    """`(record or None when absent, ModifyIndex to CAS against; 0 when absent)`;
    `consistent`: through the datacenter's Raft leader with a quorum check."""
    _, entry = await consul.kv_get(PRIMARY_KEY, dc=dc, consistent=consistent)
    if entry is None:
        return None, 0
    return PrimaryRecord.decode(entry.value), entry.modify_index


async def write_primary(consul: ConsulClient, record: PrimaryRecord, cas_index: int, *,
                        dc: str | None = None) -> bool:
    """Compare-and-set the key: True if `cas_index` still matched (0 = only if absent)."""
    return await consul.kv_put(PRIMARY_KEY, record.encode(), cas=cas_index, dc=dc)
