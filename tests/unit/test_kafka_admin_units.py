"""KafkaAdmin's retry settings without a cluster: ONCE, per-call retry, the error mapping."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import NodeNotReadyError, TopicAuthorizationFailedError

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.errors import ClientError, ClientRefused
from crossdc.settings import RetrySettings

FAST = RetrySettings(attempts=3, total_s=5, call_timeout_s=1, backoff_initial_s=0.001,
                     backoff_max_s=0.002)


def _failing(exc: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    async def fn() -> None:
        calls.append(1)
        raise exc

    return calls, fn


async def test_once_tries_a_call_once_and_maps_its_error() -> None:
    admin = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), ONCE)
    calls, fn = _failing(NodeNotReadyError("node 1"))
    with pytest.raises(ClientError, match="NodeNotReadyError") as info:
        await admin._call("describe cluster", fn)  # type: ignore[arg-type]
    assert info.value.retriable
    assert isinstance(info.value.__cause__, NodeNotReadyError)
    assert len(calls) == 1
    calls, fn = _failing(OSError("connection refused"))
    with pytest.raises(ClientError, match="OSError"):
        await admin._call("list topics", fn)  # type: ignore[arg-type]
    assert len(calls) == 1


async def test_retry_settings_retry_the_retriable_and_a_call_may_bring_its_own() -> None:
    admin = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), FAST)
    calls, fn = _failing(NodeNotReadyError("node 1"))
    with pytest.raises(ClientError):
        await admin._call("describe cluster", fn)  # type: ignore[arg-type]
    assert len(calls) == 3
    calls, fn = _failing(TopicAuthorizationFailedError("no"))
    with pytest.raises(ClientRefused):
        await admin._call("create topics", fn)  # type: ignore[arg-type]
    assert len(calls) == 1, "a refusal is not retried"
    calls, fn = _failing(NodeNotReadyError("node 1"))
    with pytest.raises(ClientError):
        await admin._call("describe group", fn, ONCE)  # type: ignore[arg-type]
    assert len(calls) == 1, "the call's own setting wins"
    once = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), ONCE)
    calls, fn = _failing(NodeNotReadyError("node 1"))
    with pytest.raises(ClientError):
        await once._call("commit offsets", fn, FAST)  # type: ignore[arg-type]
    assert len(calls) == 3


async def test_a_failed_start_leaves_the_admin_as_new() -> None:
    admin = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), ONCE, request_timeout_ms=200)
    with pytest.raises(ClientError):
        await admin.start()
    assert not admin.started
    assert not admin.closed
    await admin.stop()


class _Fetcher:
    """aiokafka's fetcher closing with a fetch request in flight: it awaits the request it
    cancelled and re-raises its CancelledError."""

    async def close(self) -> None:
        raise asyncio.CancelledError


class _Client:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


async def test_a_consumer_stop_closes_its_client_whatever_the_fetcher_raises() -> None:
    from crossdc.clients.consumer import Consumer
    c = Consumer(bootstrap_servers="127.0.0.1:1")
    real = c._client
    client = c._client = _Client()
    c._fetcher = _Fetcher()
    await c.stop()  # not a cancel of ours: swallowed, the client closed
    assert client.closed >= 1
    await real.close()


def test_last_queued_batch_is_the_last_builder_queued_or_none() -> None:
    """Sharing batches degrades to a batch per call when aiokafka keeps no such queue (the
    real producer's queue: tests/integration/test_proxy.py, concurrent batches)."""
    from types import SimpleNamespace

    from aiokafka import TopicPartition

    from crossdc.clients.kafka import last_queued_batch

    assert last_queued_batch(object(), "t", 0) is None
    first, last = object(), object()
    producer = SimpleNamespace(_message_accumulator=SimpleNamespace(_batches={
        TopicPartition("t", 0): [SimpleNamespace(_builder=first),
                                 SimpleNamespace(_builder=last)],
        TopicPartition("t", 1): []}))
    assert last_queued_batch(producer, "t", 0) is last
    assert last_queued_batch(producer, "t", 1) is None
    assert last_queued_batch(producer, "u", 0) is None


async def test_start_or_close_closes_a_consumer_whose_start_ran_out_of_time() -> None:
    """A broker that accepts and never answers: the start ends at its deadline, and the
    consumer it began is closed (no connection or task left behind)."""
    from aiokafka import AIOKafkaConsumer

    from crossdc.clients.kafka import start_or_close
    connected = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()
        writer.close()
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    consumer = AIOKafkaConsumer(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=30_000)
    try:
        with pytest.raises(TimeoutError):
            await start_or_close(consumer, 0.5)
        assert connected.is_set()
        assert consumer._closed
    finally:
        server.close()
        await server.wait_closed()
