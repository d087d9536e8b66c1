"""The hint replay's writer: each run of replayed copies in one Kafka transaction of its own,
committed only once nothing newer is found to have landed before them.

The replay checks a target partition's newest record, then writes the hints still in order
after it (proxy/hints.py, "Order"). A direct sync write of a newer record can land between
that read and the copies (the partition drill in CI: 7 records told failed ended after later
acknowledged ones of their keys). Kafka has no conditional append, but a transaction is one:
the copies are written inside it, the records between the end read and them are looked at
(`check`), and the transaction commits only when none is newer; otherwise it is aborted, and
an aborted transaction's records are never seen by a read_committed reader (the proxy's
consumers, the mirror in exactly-once mode, the drill's read-back, the tail reader itself).
The hints are then judged again against the new newest record: late, quarantined.

Aborting also recalls what a dropped request would not: bytes of the transaction handed to a
socket before the abort are refused when they arrive (the transaction is no longer ongoing).
One transactional id per (replaying region, target region), the hints topic's one replayer in
its group: a new owner fences an old one that is still writing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import close_producer, start_or_close
from proxy.errors import RegionWriteFailed
from proxy.writers import Outgoing, RegionWrite

log = structlog.get_logger("crossdc.proxy.hints")

_CLOSE_S = 10.0
_TXN_TIMEOUT_MS = 30_000  # an abandoned transaction (the process died) is aborted by then

Check = Callable[[list[RegionWrite]], Awaitable[bool]]


REPLAY_TXN_PREFIX = "crossdc-proxy-hints-"
"""Every replay transactional id starts so (the proxy's ACL is on this prefix)."""


def replay_transactional_id(own: str, target: str) -> str:
    """The replay's transactional id for hints stored in `own` toward `target`."""
    return f"{REPLAY_TXN_PREFIX}{own}-{target}"


class ReplayTxn:
    """The transactional producer of one target region for the hints replay (started at the
    first write; a failure closes it and the next write starts a new one)."""

    def __init__(self, target: str, conn: KafkaConnection, transactional_id: str,
                 client_id: str) -> None:
        self.target = target
        self.conn = conn
        self.transactional_id = transactional_id
        self.client_id = client_id
        self._producer: AIOKafkaProducer | None = None

    async def _ready(self, timeout_s: float) -> AIOKafkaProducer:
        p = self._producer
        if p is None:
            p = AIOKafkaProducer(**self.conn.aiokafka_kwargs(
                "producer", client_id=self.client_id, acks="all", enable_idempotence=True,
                transactional_id=self.transactional_id, transaction_timeout_ms=_TXN_TIMEOUT_MS,
                request_timeout_ms=max(1000, int(timeout_s * 1000))))
            await start_or_close(p, timeout_s)  # init_transactions: fences an older owner
            self._producer = p
        return p

    async def write(self, topic: str, items: Sequence[Outgoing], check: Check,
                    timeout_s: float) -> list[RegionWrite] | None:
        """Write `items` (in this order) in one transaction; commit when `check` of where
        they landed says so, else abort. The copies made, or None: aborted (nothing of it is
        visible to a read_committed reader). RegionWriteFailed when the target did not take
        it within `timeout_s` (aborted as far as the target answers; the producer dropped)."""
        try:
            async with asyncio.timeout(timeout_s):
                p = await self._ready(timeout_s)
                await p.begin_transaction()
                futs = [await p.send(topic, it.value, key=it.key, partition=it.partition,
                                     headers=list(it.headers))
                        for it in items]
                metas = await asyncio.gather(*futs)
                written = [RegionWrite(self.target, m.partition, m.offset) for m in metas]
                if await check(written):
                    await p.commit_transaction()
                    return written
                await p.abort_transaction()
                return None
        except (KafkaError, OSError, TimeoutError) as exc:
            await self.close()
            raise RegionWriteFailed(self.target, topic, f"replay transaction: {exc!r}",
                                    maybe_written=False) from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Abort a transaction still open (bounded), close the producer, forget it."""
        p, self._producer = self._producer, None
        if p is None:
            return
        with contextlib.suppress(KafkaError, OSError, TimeoutError, AssertionError):
            if _in_transaction(p):
                async with asyncio.timeout(_CLOSE_S):
                    await asyncio.shield(p.abort_transaction())
        await asyncio.shield(close_producer(p, _CLOSE_S))  # the project's bounded close


def _in_transaction(p: Any) -> bool:
    tm = getattr(p, "_txn_manager", None)
    return bool(tm is not None and tm.is_in_transaction())
