"""Incremental runs: where the last run stopped, per region and partition.

A run judges records whose event time (dr-ts, else the Kafka timestamp) lies in
[since, until), with until = now - grace. The saved state holds `until` as the next run's
`since`, and per region/partition the lowest offset of a record not judged yet (newer than
`until`), else the end offset. The next run reads from there: every copy of a record not yet
judged sits at or after that offset in every region, and records older than `since` that
arrive late are counted (`before_window`) but not judged twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_text

__all__ = ["MAX_STATE_BYTES", "Watermarks", "load_watermarks", "save_watermarks"]

MAX_STATE_BYTES = 64 * 1024 * 1024
"""A saved state larger than this is refused unread (a million partitions fit)."""


class Watermarks(BaseModel):
    """The saved state of incremental runs (`--state FILE`)."""

    model_config = ConfigDict(extra="forbid")

    version: int = 1
    cutoff_ms: int
    offsets: dict[str, dict[str, dict[str, int]]]
    """region → topic → partition (as a string, JSON keys) → next offset to read."""

    def start(self, region: str, topic: str, partition: int) -> int | None:
        return self.offsets.get(region, {}).get(topic, {}).get(str(partition))


def load_watermarks(path: Path) -> Watermarks | None:
    """The saved state, or None when the file does not exist yet (first run)."""
    if not path.exists():
        return None
    text = read_user_text(path, max_bytes=MAX_STATE_BYTES, timeout_s=30.0)
    try:
        return Watermarks.model_validate_json(text)
    except ValidationError as exc:
        issues = [ConfigIssue(str(path), None, ".".join(str(x) for x in e["loc"]), e["msg"])
                  for e in exc.errors()]
        raise ConfigError(issues) from None


def save_watermarks(path: Path, marks: Watermarks) -> None:
    """Write atomically: a crash mid-write leaves the previous state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(marks.model_dump(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
