"""Client SDK: `AsyncProducer` (asyncio) and `Producer` (blocking, a loop in a thread);
`proxy.client` re-exports them.

    async with AsyncProducer("127.0.0.1:7000") as p:
        result = await p.produce("orders", b"value", key=b"customer-1")
        fut = await p.send("clicks", b"...")          # batched; await fut later

Records are batched (`linger_ms`, `max_batch_records`, `max_batch_bytes`) into ProduceBatch
calls, each with a deadline (`deadline_s`). Backpressure: at most `max_pending_records`
records and `max_pending_bytes` bytes are pending (sent, not yet answered); `send()` waits for
room beyond that (one record larger than the byte bound still goes when nothing is pending).
A record that fails with UNAVAILABLE (no writable region, incomplete sync, proxy draining) or
a call refused with UNAVAILABLE or RESOURCE_EXHAUSTED is sent again with the SAME idempotency
key (one is generated when the caller gives none), so the proxy's idempotency window turns a
retry of something that did land into the first result instead of a second copy. A retry
carries `dr-attempt: N` metadata (N >= 2): a proxy sharing its idempotency window with the
region's other processes then reads the shared log up to its end before deciding, so the
retry is recognised even when it reaches another worker or another proxy. Other codes
fail the record's future with `ProduceFailed` (`.code`, a grpc.StatusCode; `.result`, the
record's own answer; `.earlier`, what its retried attempts were answered: a caller judging
whether anything may have been written needs every attempt, not the last one).

Security: `token="cdc_..."` sends `authorization: Bearer <token>` metadata on every call.
`tls=True` (or any of `root_ca`, `client_cert`/`client_key`) opens a TLS channel: `root_ca`
is the CA bundle that signed the proxy's certificate (PEM bytes or a file; default: the
system roots), `client_cert` + `client_key` the client certificate a mTLS proxy requires,
`tls_server_name` the name to check the proxy's certificate against when it differs from
the target's host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from crossdc_client.api import pb, pb_grpc
from crossdc_client.connect import Connection, channel_credentials, retry_backoff
from crossdc_client.errors import ProduceFailed, ProxyError
from crossdc_client.headers import uuid7
from crossdc_client.lifecycle import Lifecycle

__all__ = ["AsyncProducer", "ProduceResult", "Producer", "Written", "channel_credentials"]

T = TypeVar("T")
_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class Written:
    region: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ProduceResult:
    dr_id: str
    mode: str
    epoch: int
    written: tuple[Written, ...]
    duplicate: bool = False
    status: str = "ok"
    """ok; partial (some regions hold it); failed (written nowhere); unknown (a write was
    handed to Kafka and never answered: it may be there)."""


@dataclass
class _Pending:
    record: Any
    future: asyncio.Future[ProduceResult]
    size: int
    attempts: int = 0
    started: float = field(default_factory=time.monotonic)
    earlier: list[ProduceFailed] = field(default_factory=list)
    """The answers of its attempts that were retried (`ProduceFailed.earlier`)."""


_STATUS_NAMES = {pb.STATUS_OK: "ok", pb.STATUS_PARTIAL: "partial", pb.STATUS_FAILED: "failed",
                 pb.STATUS_UNKNOWN: "unknown"}


def _result(r: Any) -> ProduceResult:
    return ProduceResult(r.dr_id, r.mode, r.epoch,
                         tuple(Written(w.region, w.partition, w.offset) for w in r.written),
                         r.duplicate, _STATUS_NAMES.get(r.status, "ok"))


class AsyncProducer(Lifecycle):
    def __init__(self, target: str, *, deadline_s: float = 10.0, linger_ms: float = 2.0,
                 max_batch_records: int = 500, max_batch_bytes: int = 1024 * 1024,
                 retries: int = 3, retry_backoff_s: float = 0.1,
                 auto_idempotency: bool = True, max_in_flight_batches: int = 16,
                 max_pending_records: int = 100_000,
                 max_pending_bytes: int = 64 * 1024 * 1024,
                 channel: grpc.aio.Channel | None = None, token: str | None = None,
                 tls: bool = False, root_ca: bytes | str | Path | None = None,
                 client_cert: bytes | str | Path | None = None,
                 client_key: bytes | str | Path | None = None,
                 tls_server_name: str | None = None) -> None:
        self.target = target
        self._conn = Connection(token=token, tls=tls, root_ca=root_ca, client_cert=client_cert,
                                client_key=client_key, tls_server_name=tls_server_name)
        self._metadata = self._conn.metadata
        self.deadline_s = deadline_s
        self.linger_s = linger_ms / 1000
        self.max_batch_records = max_batch_records
        self.max_batch_bytes = max_batch_bytes
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._backoff = retry_backoff(retry_backoff_s)
        self.auto_idempotency = auto_idempotency
        if max_pending_records <= 0 or max_pending_bytes <= 0:
            raise ValueError("max_pending_records and max_pending_bytes must be > 0")
        self.max_pending_records = max_pending_records
        self.max_pending_bytes = max_pending_bytes
        self._pending_records = 0
        self._pending_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._own_channel = channel is None
        self._channel = channel
        self._stub: Any = None
        self._queue: list[_Pending] = []
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight_batches)
        self._flusher: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Open the channel and start the flusher; `Closed` once stopped."""
        if not self._begin_start():
            return
        if self._channel is None:
            self._channel = self._conn.open(self.target)
        self._stub = pb_grpc.ProxyStub(self._channel)  # type: ignore[no-untyped-call]
        self._flusher = asyncio.create_task(self._flush_loop(), name="proxy-client:flusher")

    async def stop(self) -> None:
        """Send what is queued, wait for every answer, close the channel; idempotent.
        A `send()` from here on raises `Closed` (so nothing is queued behind the flush)."""
        if not self._begin_stop():
            return
        self._room.set()  # a send() waiting for room raises: closed
        try:
            await self.flush()
        finally:
            # also when the flush is cut short (the caller's deadline): no flusher task and
            # no channel outlive a stop()
            if self._flusher is not None:
                self._flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._flusher
            if self._own_channel and self._channel is not None:
                await self._channel.close()

    # -- sending ---------------------------------------------------------------------------
    async def send(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                   headers: Sequence[tuple[str, bytes]] = (),
                   idempotency_key: str | None = None) -> asyncio.Future[ProduceResult]:
        """Queue one record; the returned future resolves when the proxy answers for it.
        Waits while `max_pending_records` / `max_pending_bytes` are reached."""
        self._check_open()
        if self._stub is None:
            raise ProxyError("AsyncProducer is not started (use `async with`)")
        size = len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)
        while self._pending_records and (
                self._pending_records >= self.max_pending_records
                or self._pending_bytes + size > self.max_pending_bytes):
            self._room.clear()
            await self._room.wait()
            self._check_open()
        if idempotency_key is None and self.auto_idempotency:
            idempotency_key = str(uuid7())
        rec = pb.Record(topic=topic, key=key, value=value, idempotency_key=idempotency_key or "",
                        headers=[pb.Header(key=k, value=v) for k, v in headers])
        self._pending_records += 1
        self._pending_bytes += size
        fut: asyncio.Future[ProduceResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(rec, fut, size))
        self._queued_bytes += size
        if len(self._queue) >= self.max_batch_records or \
                self._queued_bytes >= self.max_batch_bytes or self.linger_s == 0:
            self._take_batch()
        else:
            self._wake.set()
        return fut

    async def produce(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                      headers: Sequence[tuple[str, bytes]] = (),
                      idempotency_key: str | None = None) -> ProduceResult:
        """Send one record and wait for its result (raises ProduceFailed)."""
        return await (await self.send(topic, value, key=key, headers=headers,
                                      idempotency_key=idempotency_key))

    async def flush(self) -> None:
        """Send everything queued now and wait until every batch has its answer."""
        if self._queue:
            self._take_batch()
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    def _take_batch(self) -> None:
        batch, self._queue = self._queue, []
        self._queued_bytes = 0
        if batch:
            task = asyncio.create_task(self._send_batch(batch), name="proxy-client:batch")
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.linger_s)
            if self._queue:
                self._take_batch()

    async def _send_batch(self, batch: list[_Pending]) -> None:
        try:
            async with self._slots:
                await self._send_with_retries(batch)
        except BaseException as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc if isinstance(exc, Exception)
                                           else ProxyError("cancelled"))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._pending_records -= len(batch)
            self._pending_bytes -= sum(p.size for p in batch)
            self._room.set()

    async def _send_with_retries(self, batch: list[_Pending]) -> None:
        todo = batch
        attempt = 0
        while todo:
            attempt += 1
            retry: list[_Pending] = []
            try:
                resp = await self._stub.ProduceBatch(
                    pb.ProduceBatchRequest(records=[p.record for p in todo]),
                    timeout=self.deadline_s,
                    metadata=self._metadata if attempt == 1
                    else (*self._metadata, ("dr-attempt", str(attempt))))
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in _RETRY_CODES and attempt <= self.retries:
                    retry = todo
                    for p in todo:
                        p.earlier.append(ProduceFailed(code, exc.details() or ""))
                else:
                    for p in todo:
                        p.future.set_exception(ProduceFailed(code, exc.details() or "",
                                                             earlier=p.earlier))
                    return
            else:
                for p, r in zip(todo, resp.results, strict=True):
                    if r.code == 0:
                        p.future.set_result(_result(r))
                        continue
                    code = _code(r.code)
                    if code in _RETRY_CODES and attempt <= self.retries:
                        retry.append(p)
                        p.earlier.append(ProduceFailed(code, r.message, result=_result(r)))
                    else:
                        p.future.set_exception(ProduceFailed(code, r.message, result=_result(r),
                                                             earlier=p.earlier))
            todo = retry
            if todo:
                await asyncio.sleep(self._backoff.pause(attempt))


def _code(number: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == number:
            return c
    return grpc.StatusCode.UNKNOWN


class Producer:
    """Blocking producer: an AsyncProducer on an event loop in a background thread.

        with Producer("127.0.0.1:7000") as p:
            p.produce("orders", b"v", key=b"k")           # waits for the result
            f = p.send("clicks", b"v"); f.result()        # concurrent.futures.Future
    """

    def __init__(self, target: str, **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="crossdc-producer",
                                        daemon=True)
        self._thread.start()
        self._async = AsyncProducer(target, **kw)
        self._closed = False
        self._call(self._async.start())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, topic: str, value: bytes | None, *, key: bytes | None = None,
             headers: Sequence[tuple[str, bytes]] = (),
             idempotency_key: str | None = None) -> concurrent.futures.Future[ProduceResult]:
        async def go() -> ProduceResult:
            return await (await self._async.send(topic, value, key=key, headers=headers,
                                                 idempotency_key=idempotency_key))
        return asyncio.run_coroutine_threadsafe(go(), self._loop)

    def produce(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                headers: Sequence[tuple[str, bytes]] = (),
                idempotency_key: str | None = None,
                timeout: float | None = None) -> ProduceResult:
        return self.send(topic, value, key=key, headers=headers,
                         idempotency_key=idempotency_key).result(timeout)

    def flush(self) -> None:
        self._call(self._async.flush())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._async.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
