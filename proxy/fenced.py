"""Fenced writes (`kafka.fenced_writes`): ordered and sync records written inside Kafka
transactions, so that a write the proxy abandoned at its bound is never seen, even when a
broker appends it later.

Why. An ordered or sync write is bounded by the lease (`primary_write_s`): unanswered then,
the producer is dropped and the client told UNKNOWN, and the controller's fence waits that
bound out before another region takes writes. Bytes already in a broker's socket cannot be
called back: with a region's brokers frozen (SIGSTOP, a paused VM) while the controller
fails over, the brokers append the queued produce requests when they resume, after the
fence has ended (the nemesis found them: `late_append` in dr/drill/history.py). Inside a
transaction such an append is harmless: the records of a transaction that is never committed
are never seen by a read_committed reader (every reader crossdc has: the proxy's consumers,
the mirror, the retry lookups, the controller's tail reader, the drills' read-back, the
reconciliation), and a producer that gave up never commits: the coordinator aborts the
transaction when the next producer with the same transactional id starts (KIP-98's zombie
fencing) or at `transaction_timeout_ms`. Since Kafka 3.6 a produce request of a transaction
that is no longer ongoing is refused when it arrives (KIP-890).

Group commit. One transaction at a time per producer (Kafka's rule), shared: a write joins
the open transaction, sends its records and waits for their acks; the first write to finish
closes the transaction to newcomers, and the last one of it to finish ends it, off the
writers' tasks (a cancelled write does not leave it hanging): committed when every member's
records were answered; otherwise (a member's records unanswered at its bound: the producer
was dropped; a member cancelled, which only the writer's stop does: a client that gives up
on its call leaves its write running to its bound, `RegionWriter._write_fenced_detached`)
never committed. Newcomers wait for the end, then open the
next one, together. A commit costs the coordinator a round trip (EndTxn, and its markers)
per transaction, not per record.

What a write is told (`TxnEnd`): committed, and every record answered, is success (an ack
that came after the write's bound is still UNKNOWN, `RegionWriter._late_acks`); a transaction
the coordinator aborted (the commit refused) wrote nothing: failed; one abandoned or whose
commit went unanswered: UNKNOWN (its records were appended in time, before their acks, and a
commit request still in a socket may yet be applied: then they become visible, as a record
appended just before a fence does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import structlog
from aiokafka import AIOKafkaProducer

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import close_producer, start_or_close

__all__ = ["WRITE_TXN_PREFIX", "TxnEnd", "TxnGroup", "write_transactional_id"]

log = structlog.get_logger("crossdc.proxy.fenced")

WRITE_TXN_PREFIX = "crossdc-proxy-writes-"
"""Every fenced-write transactional id starts so (the proxy's ACL is on this prefix)."""
TXN_TIMEOUT_MS = 10_000
"""A transaction its producer gave up on (dropped, the process killed) is aborted by the
coordinator after this at the latest; until then read_committed readers of its partitions
wait at its first record (the last stable offset)."""
_CLOSE_S = 5.0


_ids = itertools.count(1)


def write_transactional_id(own: str, target: str) -> str:
    """The fenced writes' transactional id of one proxy of region `own` toward region
    `target`: unique among live proxies (host, pid, and a count within the process: two proxy
    servers in one process fenced each other, the loser's producer fatal), so that two proxies
    never fence each other; a producer its `TxnGroup` renews keeps it, and its start aborts
    what the dropped one left open."""
    return (f"{WRITE_TXN_PREFIX}{own}-{socket.gethostname()}-{os.getpid()}-{next(_ids)}-"
            f"{target}")


class TxnEnd(NamedTuple):
    """How a shared transaction ended, for each of its writes."""

    committed: bool
    why: str = ""
    maybe_written: bool = False
    """Not committed: whether its records may still become visible (a commit unanswered)
    or may be in the log at all (abandoned): UNKNOWN rather than failed."""


_ABORTED_SURE = TxnEnd(False, "", False)


class Txn:
    """One open transaction of a `TxnGroup`: its producer and members."""

    __slots__ = ("closed", "done", "ending", "failed", "joined", "members", "producer")

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.members = 0
        self.joined = 0
        """Writes that took part in it (group commit)."""
        self.closed = False
        """Takes no new member (one has finished)."""
        self.failed: str | None = None
        """Why it must never be committed (a member's records unanswered, a member gone)."""
        self.done: asyncio.Future[TxnEnd] = asyncio.get_running_loop().create_future()
        self.ending = False


Drop = Callable[[AIOKafkaProducer, str], Awaitable[None]]


class TxnGroup:
    """The transactional producer of one region for the strict modes and its shared
    transactions; `join()` a transaction, send with its `producer`, `release()` it, then
    `outcome()`. `drop(producer, why)` is the writer's: stop it at once, sockets reset."""

    def __init__(self, region: str, conn: KafkaConnection,
                 producer_kwargs: Callable[[], dict[str, Any]],
                 *, transactional_id: str, drop: Drop, commit_timeout_s: float,
                 on_end: Callable[[str, int], None] | None = None) -> None:
        self.region = region
        self.conn = conn
        self.producer_kwargs = producer_kwargs
        self.transactional_id = transactional_id
        self.commit_timeout_s = commit_timeout_s
        self._drop = drop
        self._on_end = on_end
        """Told (outcome, writes) at each end: committed, aborted, abandoned or unknown."""
        self._producer: AIOKafkaProducer | None = None
        self._txn: Txn | None = None
        self._begin = asyncio.Lock()
        self._ends: set[asyncio.Task[None]] = set()
        self._closed = False
        self.commits = 0
        self.aborts = 0
        self.abandoned = 0
        self.log = log.bind(region=region, transactional_id=transactional_id)

    @property
    def producer(self) -> AIOKafkaProducer | None:
        return self._producer

    def forget(self, producer: AIOKafkaProducer) -> None:
        """`producer` was dropped: the next transaction starts a new one (whose start
        aborts what this one left open)."""
        if self._producer is producer:
            self._producer = None
        t = self._txn
        if t is not None and t.producer is producer and t.failed is None:
            t.failed = "the producer was dropped"

    async def _ready(self) -> AIOKafkaProducer:
        p = self._producer
        if p is None or getattr(p, "_closed", False):
            p = AIOKafkaProducer(**self.producer_kwargs(), transactional_id=self.transactional_id,
                                 transaction_timeout_ms=TXN_TIMEOUT_MS)
            # init_transactions: fences the dropped producer, aborts what it left open
            await start_or_close(p, self.commit_timeout_s * 2)
            self._producer = p
        return p

    async def prepare(self, timeout_s: float) -> bool:
        """Start the producer ahead of the first write (init_transactions: a coordinator
        found, the producer id fetched); False when the region does not answer (the writer's
        probe calls it again)."""
        if self._closed:
            return False
        try:
            async with asyncio.timeout(max(0.001, timeout_s)):
                async with self._begin:
                    await self._ready()
            return True
        except (KafkaError, OSError, TimeoutError) as exc:
            self.log.info("fenced_producer_not_started", error=repr(exc))
            return False

    async def join(self, timeout_s: float) -> Txn:
        """A member's place in the open transaction (beginning one, and the producer, when
        none is open). TimeoutError after `timeout_s`; KafkaError/OSError: none could begin."""
        async with asyncio.timeout(max(0.001, timeout_s)):
            while True:
                if self._closed:
                    raise KafkaError("the region's writer is stopping")
                t = self._txn
                if t is not None:
                    if not t.closed:
                        t.members += 1
                        t.joined += 1
                        return t
                    await asyncio.shield(t.done)
                    continue
                async with self._begin:
                    if self._txn is not None:
                        continue
                    p = await self._ready()
                    try:
                        await p.begin_transaction()
                    except Exception:
                        self._producer = None
                        await self._drop(p, "begin_transaction failed")
                        raise
                    t = self._txn = Txn(p)
                    t.members = t.joined = 1
                    return t

    def release(self, txn: Txn, abandoned: str | None = None) -> None:
        """A member is done sending (its records answered, or `abandoned`: why not). The
        first release closes the transaction to newcomers; the last one ends it."""
        txn.members -= 1
        txn.closed = True
        if abandoned is not None and txn.failed is None:
            txn.failed = abandoned
        if txn.members <= 0 and not txn.ending:
            txn.ending = True
            task = asyncio.ensure_future(self._end(txn))
            self._ends.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._ends.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved, and said
            self.log.error("fenced_transaction_end_failed", error=repr(task.exception()))

    async def outcome(self, txn: Txn, timeout_s: float) -> TxnEnd:
        """How `txn` ended (UNKNOWN, `maybe_written`, if that is not known within
        `timeout_s`)."""
        try:
            async with asyncio.timeout(max(0.001, timeout_s)):
                return await asyncio.shield(txn.done)
        except TimeoutError:
            return TxnEnd(False, f"the transaction's end not known within {timeout_s:.2f}s",
                          True)

    async def _end(self, txn: Txn) -> None:
        p = txn.producer
        end: TxnEnd
        try:
            if txn.failed is not None:
                self.abandoned += 1
                if not getattr(p, "_closed", False):
                    await self._drop(p, f"transaction abandoned: {txn.failed}")
                self.forget(p)
                end = TxnEnd(False, f"transaction abandoned, never committed: {txn.failed}",
                             True)
            else:
                end = await self._commit(p)
        except BaseException as exc:  # cancelled at close: say so, then propagate
            end = TxnEnd(False, f"transaction end interrupted: {exc!r}", True)
            raise
        finally:
            if self._txn is txn:
                self._txn = None
            if not txn.done.done():
                txn.done.set_result(end)
            if self._on_end is not None:
                self._on_end("committed" if end.committed else "abandoned"
                             if txn.failed is not None else "unknown" if end.maybe_written
                             else "aborted", txn.joined)

    async def _commit(self, p: AIOKafkaProducer) -> TxnEnd:
        try:
            async with asyncio.timeout(self.commit_timeout_s):
                await p.commit_transaction()
            self.commits += 1
            return TxnEnd(True)
        except TimeoutError:
            self.forget(p)
            await self._drop(p, f"commit unanswered within {self.commit_timeout_s:g}s")
            return TxnEnd(False, f"commit unanswered within {self.commit_timeout_s:g}s: "
                          "outcome unknown", True)
        except AssertionError as exc:
            # aiokafka's state machine: the producer is in a fatal state (fenced by another
            # producer of its transactional id, refused by the coordinator); it cannot
            # commit or abort. Renewed (its successor's start aborts what it left open), and
            # the write is UNKNOWN: the coordinator decides its transaction's end, not us.
            self.forget(p)
            await self._drop(p, f"no commit from a producer in a fatal state: {exc}")
            return TxnEnd(False, f"the transactional producer failed ({exc}): outcome "
                          "unknown", True)
        except KafkaError as exc:
            why = f"{exc.__class__.__name__}: {exc}"
        try:  # the commit was refused (an abortable error): abort, then nothing is written
            async with asyncio.timeout(self.commit_timeout_s):
                await p.abort_transaction()
            self.aborts += 1
            self.log.warning("fenced_write_aborted", why=why)
            return _ABORTED_SURE._replace(why=f"transaction aborted ({why})")
        except (KafkaError, TimeoutError) as exc2:
            self.forget(p)
            await self._drop(p, f"abort failed after a refused commit: {exc2!r}")
            return TxnEnd(False, f"commit refused ({why}), abort unanswered: outcome "
                          "unknown", True)

    async def close(self) -> None:
        """Stop: a transaction still open is abandoned (never committed), the producer
        closed (bounded)."""
        self._closed = True
        t = self._txn
        if t is not None and t.failed is None and not t.ending:
            t.failed = "the writer stopped"
        for task in list(self._ends):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(self.commit_timeout_s):
                    await asyncio.shield(task)
        p, self._producer = self._producer, None
        if p is not None and not getattr(p, "_closed", False):
            tm = getattr(p, "_txn_manager", None)
            with contextlib.suppress(KafkaError, OSError, TimeoutError, AssertionError):
                if tm is not None and tm.is_in_transaction():
                    async with asyncio.timeout(_CLOSE_S):
                        await asyncio.shield(p.abort_transaction())
            await asyncio.shield(close_producer(p, _CLOSE_S))
