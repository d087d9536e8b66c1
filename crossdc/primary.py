"""The primary region and its fencing epoch, as kept in Consul KV.

Key `crossdc/primary` in EVERY datacenter; value JSON
`{"region": "<name>", "epoch": <int>, "updated_ms": <int>, "by": "<who>", "fenced": <bool>}`.
A failover goes through two records: `fence()` (epoch + 1, `fenced: true`: no region takes
ordered or sync writes; `region` still names the one being left) and, once every proxy's lease
has run out, `promote(new)` (the same epoch, `fenced: false`): one epoch, at most one writable
primary. Written only by
compare-and-set (`crossdc.clients.primary.write_primary`), so two controllers can never both
win one epoch. When the key is absent, readers use the topology's `primary` with epoch 0
(`PrimaryRecord.initial`).

A record written by an operator's forced failover while fewer than a majority of datacenters
answered is marked `forced`: nobody knows whether the other side is dead or is the majority,
so such a record never overrides one that a majority held (`supersedes`: an unforced record
always wins over a forced one, whatever the epochs), no proxy takes writes under it, and it
becomes the routing truth only once the leader, reaching a majority where no unforced record
is left, adopts it (writes it again unforced).
Used by the proxy (a blocking-query watch) and by the controller (failover).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from crossdc.errors import CrossdcError
from crossdc.topology import Topology

__all__ = ["PRIMARY_KEY", "BadPrimaryRecord", "PrimaryRecord"]

PRIMARY_KEY = "crossdc/primary"


class BadPrimaryRecord(CrossdcError):
    """The KV value is not a valid PrimaryRecord (someone wrote it by hand?)."""


class PrimaryRecord(BaseModel):
    """Which region is primary, and since which epoch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = Field(description="The primary region's name.")
    epoch: int = Field(ge=0, description="Fencing epoch; +1 at every change of primary.")
    updated_ms: int = Field(0, ge=0, description="When it was written, ms since the epoch.")
    by: str = Field("", description="Who wrote it (controller id, operator, test).")
    fenced: bool = Field(False, description="No writable primary: a failover away from "
                         "`region` is under way; ordered and sync writes are refused.")
    lease_s: float = Field(0.0, ge=0, description="The lease the controller waits out before "
                           "it promotes: a proxy whose own lease is longer refuses ordered and "
                           "sync writes (0: not stated, an older writer).")
    write_s: float = Field(0.0, ge=0, description="The longest ordered or sync write the "
                           "controller waits for after the lease: a proxy starts such a write "
                           "only with this much lease left, and bounds it by this (0: not "
                           "stated).")
    forced: bool = Field(False, description="Written by an operator's forced failover with "
                         "fewer than a majority of datacenters answering: never overrides a "
                         "record a majority holds, no proxy writes under it, until the "
                         "leader adopts it (rewrites it unforced).")

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # `forced` only where true: a reader from before the flag (extra="forbid") still
        # reads every record a majority wrote
        out: dict[str, Any] = handler(self)
        if not self.forced:
            out.pop("forced", None)
        return out

    @classmethod
    def initial(cls, topology: Topology, *, lease_s: float = 0.0, write_s: float = 0.0
                ) -> PrimaryRecord:
        """The topology's primary at epoch 0: what the leader writes at a first start (a
        missing key confirms no lease: the proxies wait for it)."""
        return cls(region=topology.primary, epoch=0, updated_ms=0, by="topology",
                   lease_s=lease_s, write_s=write_s)

    @classmethod
    def decode(cls, raw: bytes) -> PrimaryRecord:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise BadPrimaryRecord(f"{PRIMARY_KEY} holds {raw[:200]!r}, not a primary "
                                   f"record: {exc.errors(include_url=False)[0]['msg']}") from None

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @property
    def writable(self) -> str | None:
        """The region that takes ordered and sync writes, None while fenced."""
        return None if self.fenced else self.region

    def successor(self, region: str, by: str) -> PrimaryRecord:
        """The record that makes `region` primary at the next epoch (no fenced step: for
        tests and a first start; failovers use `fence` then `promote`)."""
        return PrimaryRecord(region=region, epoch=self.epoch + 1,
                             updated_ms=int(time.time() * 1000), by=by)

    def fence(self, by: str, *, lease_s: float = 0.0, write_s: float = 0.0,
              epoch: int | None = None, forced: bool = False) -> PrimaryRecord:
        """Epoch + 1 (or `epoch`, when resolving a conflict above several records) with no
        writable primary (`region` keeps the one being left); `lease_s` and `write_s`: what
        the controller waits out before it promotes (the proxies check theirs against it);
        `forced`: written without a majority (see the class)."""
        return PrimaryRecord(region=self.region, epoch=self.epoch + 1 if epoch is None else epoch,
                             updated_ms=int(time.time() * 1000), by=by, fenced=True,
                             lease_s=lease_s, write_s=write_s, forced=forced)

    def promote(self, region: str, by: str) -> PrimaryRecord:
        """Name `region` primary at this (fenced) record's epoch."""
        if not self.fenced:
            raise ValueError(f"promote() needs a fenced record; epoch {self.epoch} names "
                             f"{self.region} writable")
        return PrimaryRecord(region=region, epoch=self.epoch,
                             updated_ms=int(time.time() * 1000), by=by, fenced=False,
                             lease_s=self.lease_s, write_s=self.write_s, forced=self.forced)

    def adopted(self, by: str) -> PrimaryRecord:
        """This forced record written again unforced (the leader found no majority record
        left to keep): the same region, epoch and fenced flag."""
        return self.model_copy(update={"forced": False, "by": by,
                                       "updated_ms": int(time.time() * 1000)})

    def supersedes(self, other: PrimaryRecord) -> bool:
        """Whether this record replaces `other` where both are seen: an unforced record over a
        forced one (whatever the epochs: a record a majority never held never overrides one it
        did); else a higher epoch, or the promotion that ends `other`'s fenced state at the
        same epoch, or the adoption of a forced record."""
        if self.forced != other.forced:
            return other.forced
        if self.epoch != other.epoch:
            return self.epoch > other.epoch
        return other.fenced and not self.fenced
