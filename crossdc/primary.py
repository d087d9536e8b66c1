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
Used by the proxy (a blocking-query watch) and by the controller (failover).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
              epoch: int | None = None) -> PrimaryRecord:
        """Epoch + 1 (or `epoch`, when resolving a conflict above several records) with no
        writable primary (`region` keeps the one being left); `lease_s` and `write_s`: what
        the controller waits out before it promotes (the proxies check theirs against it)."""
        return PrimaryRecord(region=self.region, epoch=self.epoch + 1 if epoch is None else epoch,
                             updated_ms=int(time.time() * 1000), by=by, fenced=True,
                             lease_s=lease_s, write_s=write_s)

    def promote(self, region: str, by: str) -> PrimaryRecord:
        """Name `region` primary at this (fenced) record's epoch."""
        if not self.fenced:
            raise ValueError(f"promote() needs a fenced record; epoch {self.epoch} names "
                             f"{self.region} writable")
        return PrimaryRecord(region=region, epoch=self.epoch,
                             updated_ms=int(time.time() * 1000), by=by, fenced=False,
                             lease_s=self.lease_s, write_s=self.write_s)

    def supersedes(self, other: PrimaryRecord) -> bool:
        """Whether this record replaces `other` where both are seen: a higher epoch, or the
        promotion that ends `other`'s fenced state at the same epoch."""
        if self.epoch != other.epoch:
            return self.epoch > other.epoch
        return other.fenced and not self.fenced
