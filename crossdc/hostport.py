"""`host:port` parsing, apart from the topology's models so that a command given an address
(`dr consume --target`) checks it without building them (about 0.2 s of pydantic)."""

from __future__ import annotations

import re

__all__ = ["split_hostport"]

_HOSTPORT = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def split_hostport(value: str) -> tuple[str, int]:
    """`"127.0.0.1:9092"` → `("127.0.0.1", 9092)`; ValueError naming the value when malformed."""
    m = _HOSTPORT.match(value)
    if not m or not 1 <= int(m.group("port")) <= 65535:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9092)")
    return m.group("host").strip("[]"), int(m.group("port"))
