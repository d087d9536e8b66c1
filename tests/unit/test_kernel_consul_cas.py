"""Compare-and-set in ConsulClient: a lost answer is resolved by reading the key back, never
by sending the CAS again blindly; refusals are not retried. The transport is a fake KV."""

from __future__ import annotations

from typing import Any

import consul.exceptions
import pytest

from crossdc.clients.consul import ConsulClient, KvEntry, cas_outcome
from crossdc.errors import CasAmbiguous, ClientError, ClientRefused
from crossdc.settings import RetrySettings

FAST = RetrySettings(attempts=3, total_s=5, call_timeout_s=1, backoff_initial_s=0.001,
                     backoff_max_s=0.002)


class FakeKv:
    """A one-datacenter KV with Consul's CAS rule, whose answers can be lost."""

    def __init__(self) -> None:
        self.data: dict[str, tuple[bytes, int]] = {}
        self.index = 10
        self.puts = 0
        self.lose_after_apply = 0
        """Next n puts apply, then their answer is lost (TimeoutError)."""
        self.lose_before_apply = 0
        """Next n puts are lost before they reach the server."""
        self.before_apply: Any = None
        """Called (once) before the next put applies: a competitor's write."""
        self.get_error: Exception | None = None
        self.put_error: Exception | None = None

    def write(self, key: str, value: bytes) -> None:
        self.index += 1
        self.data[key] = (value, self.index)

    async def put(self, key: str, value: bytes, cas: int | None = None, dc: str | None = None,
                  **_: Any) -> bool:
        self.puts += 1
        if self.put_error is not None:
            raise self.put_error
        if self.lose_before_apply:
            self.lose_before_apply -= 1
            raise TimeoutError("lost on the way")
        if self.before_apply is not None:
            hook, self.before_apply = self.before_apply, None
            hook()
        current = self.data.get(key)
        ok = cas is None or (cas == 0 and current is None) or (
            current is not None and current[1] == cas)
        if ok:
            self.write(key, value)
        if self.lose_after_apply:
            self.lose_after_apply -= 1
            raise TimeoutError("answer lost")
        return ok

    async def get(self, key: str, **_: Any) -> tuple[int, dict[str, Any] | None]:
        if self.get_error is not None:
            raise self.get_error
        if key not in self.data:
            return self.index, None
        value, idx = self.data[key]
        return self.index, {"Key": key, "Value": value, "ModifyIndex": idx}


@pytest.fixture
async def kv() -> Any:
    client = ConsulClient("127.0.0.1:1", FAST)
    fake = FakeKv()
    client._client.kv = fake
    try:
        yield client, fake
    finally:
        await client.close()


def test_cas_outcome_table() -> None:
    ours, theirs = b"ours", b"theirs"
    assert cas_outcome(KvEntry("k", ours, 12), ours, 11) is True
    assert cas_outcome(KvEntry("k", theirs, 12), ours, 11) is False
    assert cas_outcome(KvEntry("k", theirs, 11), ours, 11) is None  # not applied (yet)
    assert cas_outcome(None, ours, 11) is False                    # deleted: can never apply
    assert cas_outcome(None, ours, 0) is None                      # still absent
    assert cas_outcome(KvEntry("k", ours, 5), ours, 0) is True
    assert cas_outcome(KvEntry("k", theirs, 5), ours, 0) is False


async def test_cas_applied_but_answer_lost_is_a_win(kv: Any) -> None:
    client, fake = kv
    fake.write("k", b"old")
    cas = fake.data["k"][1]
    fake.lose_after_apply = 1
    assert await client.kv_put("k", b"new", cas=cas) is True
    assert fake.data["k"][0] == b"new"
    assert fake.puts == 1  # resolved by reading back, not by sending again


async def test_create_only_applied_but_answer_lost_is_a_win(kv: Any) -> None:
    client, fake = kv
    fake.lose_after_apply = 1
    assert await client.kv_put("k", b"new", cas=0) is True
    assert fake.puts == 1


async def test_cas_lost_answer_and_a_competitor_won_is_a_loss(kv: Any) -> None:
    client, fake = kv
    fake.write("k", b"old")
    cas = fake.data["k"][1]
    fake.before_apply = lambda: fake.write("k", b"theirs")
    fake.lose_after_apply = 1
    assert await client.kv_put("k", b"new", cas=cas) is False
    assert fake.data["k"][0] == b"theirs"


async def test_cas_lost_before_applying_is_sent_again(kv: Any) -> None:
    client, fake = kv
    fake.write("k", b"old")
    cas = fake.data["k"][1]
    fake.lose_before_apply = 1
    assert await client.kv_put("k", b"new", cas=cas) is True
    assert fake.puts == 2
    assert fake.data["k"][0] == b"new"


async def test_cas_never_answering_and_never_applying_is_ambiguous(kv: Any) -> None:
    client, fake = kv
    fake.write("k", b"old")
    fake.lose_before_apply = 99
    with pytest.raises(CasAmbiguous, match="may still apply"):
        await client.kv_put("k", b"new", cas=fake.data["k"][1])
    assert fake.puts == FAST.attempts


async def test_cas_read_back_failing_too_is_ambiguous(kv: Any) -> None:
    client, fake = kv
    fake.write("k", b"old")
    fake.lose_after_apply = 1
    fake.get_error = TimeoutError("read lost too")
    with pytest.raises(CasAmbiguous, match="reading the key back failed"):
        await client.kv_put("k", b"new", cas=fake.data["k"][1])
    assert fake.puts == 1


@pytest.mark.parametrize("error", [consul.exceptions.ACLPermissionDenied("Permission denied"),
                                   consul.exceptions.BadRequest("400 bad")])
async def test_refusals_are_not_retried(kv: Any, error: Exception) -> None:
    client, fake = kv
    fake.put_error = error
    with pytest.raises(ClientRefused):
        await client.kv_put("k", b"new", cas=0)
    with pytest.raises(ClientRefused):
        await client.kv_put("k", b"new")
    assert fake.puts == 2


async def test_rate_limiting_is_retried(kv: Any) -> None:
    client, fake = kv
    fake.put_error = consul.exceptions.ClientError("429 rate limit exceeded")
    with pytest.raises(ClientError) as info:
        await client.kv_put("k", b"new")
    assert info.value.retriable
    assert fake.puts == FAST.attempts
