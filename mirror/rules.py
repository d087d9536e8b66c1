"""Loop prevention and header stamping: what a flow A → B does with one record.

The rules (shared/DESIGN.md, "Record headers"):
- never write a record into a region already in its `dr-path`;
- never mirror `sync` records (the proxy already wrote them everywhere);
- a record without dr-* headers originated in the source: it gets them stamped;
- by default a flow A → B carries only records that originated in A (`forward=False`), so in
  an A ↔ B ↔ C mesh every region receives each record once, from its origin; with
  `forward=True` (chains A → B → C) records from elsewhere are carried on too.

And the epoch rule (`epoch_rule`): into the writable primary at epoch E, an ordered or sync
record stamped with an older epoch is quarantined, not carried (the divergent tail).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from typing import Literal

from crossdc.headers import DR_EPOCH, DR_ID, DR_MODE, DR_ORIGIN, DR_PATH, DR_TS
from crossdc.primary import PrimaryRecord

__all__ = ["Decision", "Headers", "epoch_rule", "flow_headers", "plan", "stamp"]

Headers = list[tuple[str, bytes]]
Decision = Literal["carry", "quarantine"]


def plan(headers: Sequence[tuple[str, bytes]], *, source: str, target: str,
         timestamp_ms: int, forward: bool = False,
         id_hint: str | None = None) -> Headers | None:
    """The headers to write into `target`, or None when the record must not go there."""
    # dict() in C over all the headers: only dr-* keys are looked up (bench/results/profile.md)
    dr = dict(headers) if headers else None
    if not dr or DR_ID not in dr:
        # Written straight into the source cluster: it originated there.
        rid = id_hint or uuid.uuid4().hex
        return stamp(flow_headers(source, target), rid.encode(), timestamp_ms, headers)
    if dr.get(DR_MODE) == b"sync":
        return None
    src, dst = _names(source, target)
    raw = dr.get(DR_PATH)
    path = [p for p in raw.split(b",") if p] if raw else []
    if dst in path:
        return None
    origin = dr.get(DR_ORIGIN)
    if not forward and origin and origin != src:
        return None
    if not path or path[-1] != src:
        path.append(src)
    path.append(dst)
    out = [h for h in headers if h[0] != DR_PATH]
    out.append((DR_PATH, b",".join(path)))
    return out


@functools.lru_cache(maxsize=64)
def _names(source: str, target: str) -> tuple[bytes, bytes]:
    return source.encode(), target.encode()


FlowHeaders = tuple[tuple[str, bytes], tuple[str, bytes], tuple[str, bytes]]


@functools.lru_cache(maxsize=64)
def flow_headers(source: str, target: str) -> FlowHeaders:
    """The headers every record originating in `source` gets on the way to `target`, built
    once per flow, not per record (bench/results/profile.md): dr-origin, dr-mode, dr-path."""
    return ((DR_ORIGIN, source.encode()), (DR_MODE, b"nearest"),
            (DR_PATH, f"{source},{target}".encode()))


def stamp(flow: FlowHeaders, rid: bytes, timestamp_ms: int,
          headers: Sequence[tuple[str, bytes]] = ()) -> Headers:
    """The headers of a record that originated in the flow's source (it has no `dr-id`):
    its own, then dr-id, dr-origin, dr-ts, dr-mode and dr-path. `plan` decides that a record
    needs this; the mirror's copy loop calls it directly for a record with no headers at all
    (most records written straight into Kafka), skipping `plan`'s checks, which a record
    without headers passes anyway."""
    origin_h, mode_h, path_h = flow
    return [*headers, (DR_ID, rid), origin_h, (DR_TS, b"%d" % timestamp_ms), mode_h, path_h]


def epoch_rule(headers: Sequence[tuple[str, bytes]], *, target: str,
               primary: PrimaryRecord | None, source: str | None = None) -> Decision:
    """Whether a record the flow would carry into `target` goes to its topic (`carry`) or to
    the quarantine (`quarantine`): the divergent tail of a lost primary.

    Only when `target` is the WRITABLE primary at epoch E is an ordered or sync record stamped
    with an epoch below E kept out of its topic: it was acknowledged by a primary that has since
    been replaced, and writing it now would put it behind records of the newer epoch. While the
    primary record is fenced (the failover is draining the old primary) or names another
    region, or is unknown, everything is carried as before. Records without a readable
    `dr-epoch` (headerless records, `nearest` ones) are carried.

    While the record is fenced at epoch F (a failover away from `primary.region`), the drain
    carries the tail of the region being left; a flow from ANY OTHER `source` carrying an
    ordered or sync record of an epoch below F carries a tail older than the primary being
    left (issue 36, item 6: east's tail of epoch 0, held back by a cut, reaching west during
    the failback's drain, after west's records of epoch 1): quarantined too."""
    if primary is None:
        return "carry"
    if primary.writable != target and not (primary.fenced and source is not None
                                           and source != primary.region):
        return "carry"
    dr = {k: v for k, v in headers if k in (DR_MODE, DR_EPOCH)}
    if dr.get(DR_MODE) not in (b"ordered", b"sync"):
        return "carry"
    raw = dr.get(DR_EPOCH)
    if raw is None:
        return "carry"
    try:
        epoch = int(raw)
    except ValueError:
        return "carry"
    return "quarantine" if epoch < primary.epoch else "carry"
