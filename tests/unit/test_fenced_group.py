"""The fenced writes' group commit (proxy/fenced.py `TxnGroup`), its state machine alone: a
stand-in for the transactional producer records what the group asks of it (the real
producer and broker: tests/integration/test_fenced_writes.py)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from proxy.fenced import TxnGroup


class Producer:
    """What the group calls on a transactional aiokafka producer."""

    def __init__(self, *, commit: str = "ok") -> None:
        self.calls: list[str] = []
        self.commit = commit
        self._closed = False
        self.release_commit = asyncio.Event()

    async def begin_transaction(self) -> None:
        self.calls.append("begin")

    async def commit_transaction(self) -> None:
        self.calls.append("commit")
        if self.commit == "hang":
            await self.release_commit.wait()
        if self.commit == "refused":
            raise KafkaError("refused")
        if self.commit == "fatal":  # aiokafka's transaction manager, fenced by a namesake
            raise AssertionError("Invalid state transition TransactionState.FATAL_ERROR -> "
                                 "TransactionState.COMMITTING_TRANSACTION")

    async def abort_transaction(self) -> None:
        self.calls.append("abort")


def group(producers: list[Producer], dropped: list[str], *, commit_timeout_s: float = 5.0
          ) -> TxnGroup:
    async def drop(p: Any, why: str) -> None:
        p._closed = True
        dropped.append(why)

    g = TxnGroup("east", KafkaConnection(("127.0.0.1:1",)), dict,
                 transactional_id="t", drop=drop, commit_timeout_s=commit_timeout_s)

    async def ready() -> Any:
        p = g._producer
        if p is None or p._closed:
            p = producers.pop(0)
            g._producer = p
        return p
    g._ready = ready  # type: ignore[method-assign]
    return g


async def test_writes_share_the_open_transaction_and_one_commit_ends_it() -> None:
    p = Producer()
    dropped: list[str] = []
    g = group([p], dropped)
    a = await g.join(1)
    b = await g.join(1)
    assert a is b
    assert a.members == 2
    g.release(a)  # the first to finish closes it to newcomers
    late = asyncio.ensure_future(g.join(1))
    await asyncio.sleep(0)
    assert not late.done()  # waits for the end, then opens the next one
    g.release(b)
    end = await g.outcome(a, 1)
    assert end.committed
    c = await late
    assert c is not a
    assert p.calls == ["begin", "commit", "begin"]
    assert not dropped


async def test_a_member_unanswered_at_its_bound_means_never_committed() -> None:
    p = Producer()
    dropped: list[str] = []
    g = group([p, Producer()], dropped)
    a = await g.join(1)
    b = await g.join(1)
    g.release(a, "1 record unanswered at its bound")
    g.release(b)
    for t in (a, b):
        end = await g.outcome(t, 1)
        assert not end.committed
        assert end.maybe_written  # UNKNOWN: its records may be in the log, never visible
    assert "commit" not in p.calls
    assert dropped  # the producer dropped: its start-over aborts the transaction
    assert g.abandoned == 1
    assert (await g.join(1)).producer is not p  # the next transaction, a new producer


async def test_a_refused_commit_is_aborted_and_nothing_was_written() -> None:
    p = Producer(commit="refused")
    dropped: list[str] = []
    g = group([p], dropped)
    t = await g.join(1)
    g.release(t)
    end = await g.outcome(t, 1)
    assert not end.committed
    assert not end.maybe_written  # aborted: failed, not unknown
    assert p.calls == ["begin", "commit", "abort"]
    assert not dropped


async def test_an_unanswered_commit_is_unknown_and_drops_the_producer() -> None:
    p = Producer(commit="hang")
    dropped: list[str] = []
    g = group([p], dropped, commit_timeout_s=0.2)
    t = await g.join(1)
    g.release(t)
    end = await g.outcome(t, 5)
    assert not end.committed
    assert end.maybe_written
    assert dropped
    assert g._txn is None  # the next write opens a new one


async def test_a_producer_in_a_fatal_state_is_unknown_and_renewed(
        caplog: pytest.LogCaptureFixture) -> None:
    """aiokafka's state machine asserts on a commit from a fatal producer (two proxies in one
    process fenced each other, CI): the write is UNKNOWN, the producer dropped and the next
    transaction on a new one, and nothing is left as a task exception never retrieved."""
    p = Producer(commit="fatal")
    dropped: list[str] = []
    g = group([p, Producer()], dropped)
    t = await g.join(1)
    g.release(t)
    end = await g.outcome(t, 1)
    assert not end.committed
    assert end.maybe_written
    assert "fatal state" in dropped[0]
    assert (await g.join(1)).producer is not p
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_cancelled_write_never_leaves_the_transaction_hanging(cancel_first: bool
                                                                       ) -> None:
    """The release runs in the write's `finally` (cancelled too) and the end on a task of the
    group: the others learn the outcome, and the group opens the next transaction."""
    p = Producer()
    dropped: list[str] = []
    g = group([p, Producer()], dropped)
    a = await g.join(1)
    b = await g.join(1)
    first, second = (a, b) if cancel_first else (b, a)
    g.release(first, "a write in it ended early (CancelledError)")
    g.release(second)
    end = await g.outcome(second, 1)
    assert not end.committed
    assert end.maybe_written
    assert await g.join(1) is not a


class _StartAsserts:
    """An aiokafka client whose start() fails as a transactional producer's does when the
    metadata lists no broker (a thawed, still fenced broker): with an AssertionError."""

    instances: ClassVar[list[_StartAsserts]] = []

    def __init__(self, **_kw: Any) -> None:
        self.stopped = False
        self._closed = False
        _StartAsserts.instances.append(self)

    async def start(self) -> None:
        raise AssertionError("Did we not perform bootstrap?")

    async def stop(self) -> None:
        self.stopped = True


async def test_start_or_close_turns_aiokafkas_no_broker_assertion_into_a_connection_error(
        ) -> None:
    from crossdc.clients.errors import KafkaConnectionError
    from crossdc.clients.kafka import start_or_close

    client = _StartAsserts()
    with pytest.raises(KafkaConnectionError, match="Did we not perform bootstrap"):
        await start_or_close(client, 5.0)
    assert client.stopped  # closed, not left half-started


async def test_prepare_says_not_started_when_no_broker_is_listed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the long nemesis, seed 16: the assertion escaped prepare() and ended the health loop
    import proxy.fenced

    monkeypatch.setattr(proxy.fenced, "AIOKafkaProducer", _StartAsserts)
    dropped: list[str] = []

    async def drop(p: Any, why: str) -> None:
        dropped.append(why)

    g = TxnGroup("east", KafkaConnection(("127.0.0.1:1",)), dict, transactional_id="t",
                 drop=drop, commit_timeout_s=1.0)
    assert await g.prepare(2.0) is False
    assert g.producer is None
    with pytest.raises(KafkaError):  # a write's join: a Kafka error its writer handles
        await g.join(2.0)
    assert all(c.stopped for c in _StartAsserts.instances)


def test_two_proxies_in_one_process_never_share_a_transactional_id() -> None:
    from proxy.fenced import WRITE_TXN_PREFIX, write_transactional_id

    a, b = write_transactional_id("east", "west"), write_transactional_id("east", "west")
    assert a != b
    assert a.startswith(WRITE_TXN_PREFIX + "east-")
    assert a.endswith("-west")
