"""proxy.lookup: how an unanswered write is kept beside partial writes (issue 36: a retry
after UNKNOWN must not write a landed record twice)."""

from __future__ import annotations

from proxy.idempotency import IdempotencyWindow
from proxy.lookup import MaybeWrite, log_entry, maybe_entry, merged
from proxy.writers import RegionWrite


def test_a_landed_write_outlives_an_unanswered_one_of_its_region() -> None:
    landed = RegionWrite("east", 1, 7)
    maybe = MaybeWrite("east", 1, 1000)
    other = MaybeWrite("west", -1, 1000)
    assert merged([landed], [maybe, other]) == [landed, other]
    assert merged([maybe], [landed]) == [landed]
    # a newer unanswered attempt replaces an older one (its time: the earliest kept by the router)
    assert merged([maybe], [MaybeWrite("east", 1, 2000)]) == [MaybeWrite("east", 1, 2000)]


def test_the_shared_log_tells_the_two_kinds_apart() -> None:
    for w in (RegionWrite("east", 2, 5), MaybeWrite("east", 2, 5), MaybeWrite("west", -1, 9)):
        back = maybe_entry(log_entry(w))
        assert back == w
        assert type(back) is type(w)


def test_a_retry_claims_the_unanswered_write_back_from_the_window() -> None:
    window = IdempotencyWindow(60.0, 100)
    slot = window.claim_nowait("t", "k")
    assert slot is not None
    window.fail(slot, partial=[MaybeWrite("east", 0, 1000)])
    again = window.claim_nowait("t", "k")
    assert again is not None
    assert again.owner
    assert again.partial == [MaybeWrite("east", 0, 1000)]
    # learned from another process's log record, it is the same
    other = IdempotencyWindow(60.0, 100)
    assert other.learn(("t", "k"), partial=[maybe_entry(log_entry(MaybeWrite("east", 0, 1)))])
    got = other.claim_nowait("t", "k")
    assert got is not None
    assert type(got.partial[0]) is MaybeWrite
