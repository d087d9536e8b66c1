"""Loop prevention and header stamping: what a flow A → B does with one record.

The rules (shared/DESIGN.md, "Record headers"):
- never write a record into a region already in its `dr-path`;
- never mirror `sync` records (the proxy already wrote them everywhere);
- a record without dr-* headers originated in the source: it gets them stamped;
- by default a flow A → B carries only records that originated in A (`forward=False`), so in
  an A ↔ B ↔ C mesh every region receives each record once, from its origin; with
  `forward=True` (chains A → B → C) records from elsewhere are carried on too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from crossdc.headers import DR_ID, DR_MODE, DR_ORIGIN, DR_PATH, DR_TS

__all__ = ["Headers", "plan"]

Headers = list[tuple[str, bytes]]


def plan(headers: Sequence[tuple[str, bytes]], *, source: str, target: str,
         timestamp_ms: int, forward: bool = False,
         id_hint: str | None = None) -> Headers | None:
    """The headers to write into `target`, or None when the record must not go there."""
    dr = {k: v for k, v in headers if k.startswith("dr-")}
    if DR_ID not in dr:
        # Written straight into the source cluster: it originated there.
        rid = id_hint or uuid.uuid4().hex
        return [*headers, (DR_ID, rid.encode()), (DR_ORIGIN, source.encode()),
                (DR_TS, str(timestamp_ms).encode()), (DR_MODE, b"nearest"),
                (DR_PATH, f"{source},{target}".encode())]
    if dr.get(DR_MODE) == b"sync":
        return None
    path = [p for p in dr.get(DR_PATH, b"").decode().split(",") if p]
    if target in path:
        return None
    origin = dr.get(DR_ORIGIN, b"").decode()
    if not forward and origin and origin != source:
        return None
    if not path or path[-1] != source:
        path.append(source)
    path.append(target)
    out = [(k, v) for k, v in headers if k != DR_PATH]
    out.append((DR_PATH, ",".join(path).encode()))
    return out


