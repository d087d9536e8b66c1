"""The fenced writes' group commit (proxy/fenced.py `TxnGroup`), its state machine alone: a
stand-in for the transactional producer records what the group asks of it (the real
producer and broker: tests/integration/test_fenced_writes.py)."""

from __future__ import annotations

import asyncio
from typing import Any

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
