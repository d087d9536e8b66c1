"""What the SDK knows of the `dr-*` record headers (the wire contract: `crossdc.headers`,
which takes `DR_ID` from here) and the ids it gives records: UUIDv7 idempotency keys."""

from __future__ import annotations

import os
import time
import uuid
from typing import Final

__all__ = ["DR_ID", "uuid7"]

DR_ID: Final = "dr-id"
"""A record's id in every region: the client's idempotency key, else a UUIDv7."""


def uuid7(ms: int | None = None) -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit ms timestamp, then random bits; sorts by time."""
    ts = int(time.time() * 1000) if ms is None else ms
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ts & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76                                   # version 7
    value |= ((rand >> 62) & 0xFFF) << 64                # rand_a, 12 bits
    value |= 0b10 << 62                                  # variant
    value |= rand & ((1 << 62) - 1)                      # rand_b, 62 bits
    return uuid.UUID(int=value)
