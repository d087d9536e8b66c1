"""Kafka record batches decoded in the client (issue 38, pass-through): the proxy forwards a
partition's v2 record batches as Kafka stored them and the SDK decodes them here, with the
same C decoder aiokafka's consumer uses (`aiokafka.record._crecords.DefaultRecordBatch`:
varints, headers and the codecs in C; about 0.2 µs per 200-byte record here).

That decoder comes with aiokafka, which the SDK does not otherwise need, so it is an extra:

    pip install 'crossdc-client[fast]'     # aiokafka and cramjam (snappy, lz4, zstd)

Without it `decode_batch` raises `DecoderMissing` naming the extra (and a client that cannot
decode batches keeps reading records one by one, as today). Gzip needs nothing more; snappy,
lz4 and zstd batches need cramjam (aiokafka's codecs), which the extra brings.

This module imports nothing of crossdc above the client floor; aiokafka only when a batch is
first decoded.
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from crossdc_client.errors import CrossdcError

__all__ = ["EXTRA", "BatchCorrupt", "BatchRecord", "DecoderMissing", "batch_records",
           "decode_batch", "decode_batches", "decoder_available", "decoder_installed", "split"]

EXTRA = "crossdc-client[fast]"
LOG_OVERHEAD = 12  # base offset int64, length int32
_LENGTH = struct.Struct(">i")
_CONTROL_FLAG = 0x20
_ATTRIBUTES_AT = 21  # attributes int16 in the batch header
_HEADER_BYTES = 61  # the v2 header through the record count


class DecoderMissing(CrossdcError):
    """aiokafka (the C batch decoder) is not installed: `pip install 'crossdc-client[fast]'`."""


class BatchCorrupt(CrossdcError):
    """A batch that fails its CRC or does not parse (cut short, not v2)."""


class BatchRecord(NamedTuple):
    """One record of a batch: its offset in the partition, timestamp (ms), key, value and
    headers as Kafka stored them."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


_decoder: Any = None


def _batch_class() -> Any:
    global _decoder
    if _decoder is None:
        try:
            from aiokafka.record.default_records import DefaultRecordBatch
        except ImportError as exc:
            raise DecoderMissing(
                f"decoding Kafka record batches needs aiokafka's decoder: pip install "
                f"'{EXTRA}' ({exc})") from exc
        _decoder = DefaultRecordBatch
    return _decoder


def decoder_installed() -> bool:
    """Whether the decoder's package is installed, without importing it (a consumer decides
    at construction whether to ask for batches; aiokafka is loaded at the first batch)."""
    return importlib.util.find_spec("aiokafka") is not None


def decoder_available() -> bool:
    """Whether batches can be decoded here (the `fast` extra is installed)."""
    try:
        _batch_class()
    except DecoderMissing:
        return False
    return True


def decode_batch(data: bytes | memoryview, first_offset: int = -1, *,
                 check_crc: bool = True) -> list[BatchRecord]:
    """The records of one complete v2 batch from `first_offset` on (a batch may start before
    the offset a reader asked for); none for a control batch (a transaction marker).
    `BatchCorrupt` for a CRC mismatch or a batch that does not parse; `DecoderMissing`
    without the extra."""
    records = batch_records(data, check_crc=check_crc)
    try:
        return [BatchRecord(r.offset, r.timestamp, r.key, r.value,
                            tuple(r.headers) if r.headers else ())
                for r in records if r.offset >= first_offset]
    except Exception as exc:  # the C decoder's own errors (struct, codec, corrupt record)
        raise BatchCorrupt(f"record batch does not decode: {exc!r}") from exc


def batch_records(data: bytes | memoryview, *, check_crc: bool = True) -> Iterable[Any]:
    """The records of one complete v2 batch as the C decoder gives them (`offset`,
    `timestamp`, `key`, `value`, `headers`), for a caller that builds its own record type
    (the SDK: one object per record, not two); none for a control batch. Errors as
    `decode_batch`'s (iterating may still raise the decoder's own for a corrupt record)."""
    cls = _batch_class()
    if len(data) < _HEADER_BYTES or data[16] != 2:
        raise BatchCorrupt(f"not a v2 record batch ({len(data)} bytes)")
    if data[_ATTRIBUTES_AT + 1] & _CONTROL_FLAG:
        return ()
    try:
        batch = cls(data)
        if check_crc and not batch.validate_crc():
            raise BatchCorrupt(f"record batch at offset {batch.base_offset} fails its CRC")
    except BatchCorrupt:
        raise
    except Exception as exc:
        raise BatchCorrupt(f"record batch does not decode: {exc!r}") from exc
    return batch  # type: ignore[no-any-return]


def split(data: bytes | memoryview) -> Iterator[memoryview]:
    """The batches of a run of whole batches laid end to end (zero-copy slices);
    `BatchCorrupt` when the run ends inside one."""
    buf = data if isinstance(data, memoryview) else memoryview(data)
    pos, size = 0, len(buf)
    while pos < size:
        if size - pos < LOG_OVERHEAD:
            raise BatchCorrupt(f"{size - pos} bytes after the last batch")
        end = pos + LOG_OVERHEAD + _LENGTH.unpack_from(buf, pos + 8)[0]
        if end > size:
            raise BatchCorrupt(f"the batch at byte {pos} is cut short")
        yield buf[pos:end]
        pos = end


def decode_batches(data: bytes | memoryview, first_offset: int = -1, *,
                   check_crc: bool = True) -> list[BatchRecord]:
    """The records of whole batches laid end to end (what the proxy forwards for one
    partition), from `first_offset` on, in offset order."""
    out: list[BatchRecord] = []
    for b in split(data):
        out += decode_batch(b, first_offset, check_crc=check_crc)
    return out
