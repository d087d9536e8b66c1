"""The `dr-*` record headers: the wire contract between proxy, mirror and reconciliation.

See docs/architecture.md, "Record headers". proxy/ and mirror/ import these names from here
and never from each other.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "DR_EPOCH",
    "DR_ID",
    "DR_MODE",
    "DR_ORIGIN",
    "DR_PATH",
    "DR_PREFIX",
    "DR_REPAIRED",
    "DR_TS",
    "RESERVED_HEADERS",
    "Mode",
]

DR_PREFIX: Final = "dr-"
DR_ID: Final = "dr-id"
DR_ORIGIN: Final = "dr-origin"
DR_TS: Final = "dr-ts"
DR_MODE: Final = "dr-mode"
DR_EPOCH: Final = "dr-epoch"
DR_PATH: Final = "dr-path"
DR_REPAIRED: Final = "dr-repaired"
"""On a copy written late into a region that missed a sync write (hinted handoff,
`proxy.hints`): the region whose proxy stored the hint. Every other header is the original's;
the reconciliation counts these copies as repaired."""

RESERVED_HEADERS: Final = frozenset({DR_ID, DR_ORIGIN, DR_TS, DR_MODE, DR_EPOCH, DR_PATH,
                                     DR_REPAIRED})

Mode = Literal["ordered", "sync", "nearest"]
