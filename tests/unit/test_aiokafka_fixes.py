"""A start cancelled by its caller's deadline leaves no socket open
(`crossdc.clients.aiokafka_fixes`): against a server that answers Kafka's handshake
(ApiVersions) and then nothing, as a broker starting, overloaded or cut off mid-call does.
Without the fix the bootstrap connection stays open until the garbage collector finds it
(the CI of 2026-11-27 failed on it: `test left 1 client(s) unclosed`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol import admin as protocol
from kafka_helpers import eventually

from crossdc.clients import aiokafka_fixes
from dr.stack.ports import free_topology
from dr.status import probe_kafka

API_VERSIONS = 18


class HandshakeOnly:
    """A TCP server that answers ApiVersions and never any other request; counts the
    connections open and the requests it left unanswered."""

    def __init__(self) -> None:
        self.open = 0
        self.unanswered: list[int] = []
        self._server: asyncio.Server | None = None

    @property
    def bootstrap(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while True:
                (size,) = struct.unpack(">i", await reader.readexactly(4))
                body = await reader.readexactly(size)
                key, version, correlation = struct.unpack(">hhi", body[:8])
                if key != API_VERSIONS:
                    self.unanswered.append(key)
                    continue
                kw: dict[str, Any] = {"error_code": 0,
                                      "api_versions": [(3, 0, 1), (API_VERSIONS, 0, 2)]}
                if version >= 1:
                    kw["throttle_time_ms"] = 0
                answer = getattr(protocol, f"ApiVersionResponse_v{version}")(**kw).encode()
                frame = struct.pack(">i", correlation) + answer
                writer.write(struct.pack(">i", len(frame)) + frame)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HandshakeOnly]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self._server.close()
            # 3.11's Server.wait_closed() does not wait for the handlers: close() above
            # stops accepting; the handlers end on their own once the clients close
            await self._server.wait_closed()


@pytest.fixture
async def broker() -> AsyncIterator[HandshakeOnly]:
    async with HandshakeOnly().running() as server:
        yield server


def _unclosed_after_collection() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def _cancelled_start(broker: HandshakeOnly, start: Callable[[], Awaitable[Any]],
                           close: Callable[[], Awaitable[Any]]) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await start()
    await close()
    assert broker.unanswered, "the start was cancelled waiting for the metadata it asked"

    async def closed() -> bool:  # no collection here: the fix closes, not the collector
        return broker.open == 0
    await eventually(closed, 5.0, "every connection of the cancelled start closed")
    assert _unclosed_after_collection() == []


@pytest.mark.parametrize("client", ["admin", "producer", "consumer"])
async def test_an_aiokafka_start_cancelled_mid_bootstrap_leaves_no_socket_open(
        broker: HandshakeOnly, client: str) -> None:
    make = {"admin": AIOKafkaAdminClient, "producer": AIOKafkaProducer,
            "consumer": AIOKafkaConsumer}[client]
    c = make(bootstrap_servers=broker.bootstrap, request_timeout_ms=10_000)
    await _cancelled_start(broker, c.start, c.close if client == "admin" else c.stop)


async def test_dr_status_probe_of_a_broker_that_stops_answering_leaves_no_socket_open(
        broker: HandshakeOnly) -> None:
    """`dr status`'s probe (and the compose deployment's wait for readiness) bounds the
    admin's start with its own deadline."""
    east = free_topology(["east", "west"]).region("east")
    region = east.model_copy(update={"kafka": east.kafka.model_copy(
        update={"bootstrap_servers": [broker.bootstrap]})})
    status = await probe_kafka(region, 1, 0.5)
    assert status.error, status
    assert "Timeout" in status.error, status
    assert broker.unanswered

    async def closed() -> bool:
        return broker.open == 0
    await eventually(closed, 5.0, "the probe's connection closed")
    assert _unclosed_after_collection() == []


def test_install_is_idempotent() -> None:
    import aiokafka.client as client

    before = client.AIOKafkaClient.bootstrap
    aiokafka_fixes.install()
    assert client.AIOKafkaClient.bootstrap is before
    assert getattr(before, "_crossdc_closes_on_failure", False)
