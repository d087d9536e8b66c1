"""The primary region and its fencing epoch, as kept in Consul KV.

Key `crossdc/primary` in EVERY datacenter; value JSON
`{"region": "<name>", "epoch": <int>, "updated_ms": <int>, "by": "<who>"}`. Written only by
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

    @classmethod
    def initial(cls, topology: Topology) -> PrimaryRecord:
        """What a missing key means: the topology's primary at epoch 0."""
        return cls(region=topology.primary, epoch=0, updated_ms=0, by="topology")

    @classmethod
    def decode(cls, raw: bytes) -> PrimaryRecord:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise BadPrimaryRecord(f"{PRIMARY_KEY} holds {raw[:200]!r}, not a primary "
                                   f"record: {exc.errors(include_url=False)[0]['msg']}") from None

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    def successor(self, region: str, by: str) -> PrimaryRecord:
        """The record that makes `region` primary at the next epoch."""
        return PrimaryRecord(region=region, epoch=self.epoch + 1,
                             updated_ms=int(time.time() * 1000), by=by)
