"""A client's names echoed back in a status message are cut: the message travels in the
trailing metadata, and one over the client's metadata limit reaches it as RESOURCE_EXHAUSTED
(or, between gRPC's soft and hard limits, at random) instead of the status it explains."""

from __future__ import annotations

import pytest

from proxy.errors import (
    MAX_MESSAGE_CHARS,
    InvalidHeader,
    MissingKey,
    PartitionMismatch,
    PermissionDenied,
    ProxyError,
    RecordTooLarge,
    ReservedHeader,
    UnknownTopic,
)

LONG = "t" * 50_000


@pytest.mark.parametrize("error", [
    UnknownTopic(LONG, "the policy is strict and no rule names it"),
    ReservedHeader("t", "dr-" + LONG), ReservedHeader(LONG, "dr-id"),
    InvalidHeader("t", "h" * 50_000, "50000 characters, at most 1024"),
    MissingKey(LONG, "ordered"), RecordTooLarge(LONG, 10, limit=5),
    PartitionMismatch(LONG, {"east": 1, "west": 2}), PermissionDenied(LONG, "writer"),
    ProxyError("x" * 100_000),
])
def test_messages_stay_short_and_say_how_long_the_name_was(error: ProxyError) -> None:
    msg = str(error)
    assert len(msg) <= MAX_MESSAGE_CHARS + 40
    assert "characters)" in msg or "tttt" not in msg  # cut, or the name is not in it


def test_short_names_are_shown_whole() -> None:
    assert str(UnknownTopic("orders", "no rule")) == "topic 'orders': no rule"
    assert "'DR-id' is reserved" in str(ReservedHeader("t", "DR-id"))
