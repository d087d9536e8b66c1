"""The consumer SDK's connection set-up without a proxy: what a region needs, a region whose
Consul does not answer, and the connection settings the producer and consumer share."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest

from proxy.api import pb, pb_grpc
from proxy.connect import Connection, RegionProxies, retry_backoff
from proxy.consumer_client import AsyncConsumer
from proxy.errors import ConsumeFailed

pytestmark = pytest.mark.unit


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_region_and_a_channel_do_not_go_together() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="one proxy"):
            AsyncConsumer(RegionProxies("east", "127.0.0.1:1"), "g", ["t"], channel=channel)
    finally:
        await channel.close()


async def test_a_region_whose_consul_does_not_answer_fails_unavailable_naming_it() -> None:
    consul = f"127.0.0.1:{_closed_port()}"
    c = AsyncConsumer(RegionProxies("east", consul), "g", ["t"], reconnect_attempts=1,
                      retry_backoff_s=0.01)
    with pytest.raises(ConsumeFailed) as ei:
        await c.start()
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    assert "2 attempts" in str(ei.value)
    assert consul in str(ei.value)
    assert c.target == ""  # no proxy was ever picked
    await c.stop()


def test_the_connection_carries_the_token_and_tls_options() -> None:
    plain = Connection()
    assert plain.metadata == ()
    assert plain.credentials is None
    assert plain.options == []
    conn = Connection(token="cdc_secret", tls=True, tls_server_name="proxy.east",
                      options=[("grpc.max_receive_message_length", 1024)])
    assert conn.metadata == (("authorization", "Bearer cdc_secret"),)
    assert conn.credentials is not None
    assert conn.options == [("grpc.max_receive_message_length", 1024),
                            ("grpc.ssl_target_name_override", "proxy.east")]
    with pytest.raises(ValueError, match="go together"):
        Connection(client_cert=b"x")


def test_the_retry_pause_doubles_to_two_seconds() -> None:
    b = retry_backoff(0.1)
    assert 0.1 <= b.pause(1) <= 0.12
    assert 0.2 <= b.pause(2) <= 0.22
    assert 2.0 <= b.pause(10) <= 2.02


class _EndsFirstStream(pb_grpc.ProxyServicer):
    """A proxy whose first Consume stream delivers one record then ends with `code` and
    `details`; every later stream delivers one record and stays open."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        self.opened = 0

    async def Consume(self, requests: Any, context: Any) -> Any:
        await requests.__anext__()  # the open
        self.opened += 1
        n = self.opened
        yield pb.ConsumeResponse(control=pb.ConsumeControl(
            kind=pb.ConsumeControl.OPENED, stream_id=f"s{n}", ack_deadline_s=30))
        yield pb.ConsumeResponse(batch=pb.RecordBatch(records=[pb.ConsumedRecord(
            topic="t", partition=0, offset=n, region="east", value=b"v", ack_deadline_s=30)]))
        if n == 1:
            await context.abort(self.code, self.details)
        await asyncio.Event().wait()  # open until the client goes


async def _stream_after(code: grpc.StatusCode, details: str) -> tuple[list[int], int, Any]:
    server = grpc.aio.server()
    servicer = _EndsFirstStream(code, details)
    pb_grpc.add_ProxyServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    got: list[int] = []
    c = AsyncConsumer(f"127.0.0.1:{port}", "g", ["t"], retry_backoff_s=0.01)
    error = None
    try:
        await c.start()
        async with asyncio.timeout(10):
            async for batch in c:
                got += [r.offset for r in batch]
                if len(got) == 2:
                    break
    except ConsumeFailed as exc:
        error = exc
    finally:
        await c.stop()
        await server.stop(0)
    return got, servicer.opened, error


async def test_a_stream_ended_by_grpcios_own_internal_error_is_opened_again() -> None:
    """grpcio's asyncio client reports INTERNAL "Internal error from Core" when it writes (an
    ack) on a stream its proxy has ended (grpc/grpc#36066): the nemesis's reader gave up
    there, its proxy restarted. That INTERNAL is a broken stream (reopened, as UNAVAILABLE);
    an INTERNAL the proxy itself sends is not."""
    got, opened, error = await _stream_after(grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert error is None
    assert (got, opened) == ([1, 2], 2)
    got, opened, error = await _stream_after(grpc.StatusCode.UNAVAILABLE, "proxy stopping")
    assert (got, opened, error) == ([1, 2], 2, None)
    got, opened, error = await _stream_after(grpc.StatusCode.INTERNAL, "a bug in the proxy")
    assert isinstance(error, ConsumeFailed)
    assert error.code == grpc.StatusCode.INTERNAL
    assert (got, opened) == ([1], 1)


def test_byte_credit_defaults_and_bounds() -> None:
    from crossdc_client.consumer import DEFAULT_CREDIT, DEFAULT_CREDIT_BYTES
    from dr.cli import consume as cli
    # the CLI's copies, without grpc
    assert (cli.DEFAULT_CREDIT, cli.DEFAULT_CREDIT_BYTES) == (DEFAULT_CREDIT,
                                                              DEFAULT_CREDIT_BYTES)
    c = AsyncConsumer("127.0.0.1:1", "g", ["t"])
    assert (c.window, c.window_bytes) == (DEFAULT_CREDIT, DEFAULT_CREDIT_BYTES)
    with pytest.raises(ValueError, match="credit_bytes"):
        AsyncConsumer("127.0.0.1:1", "g", ["t"], credit_bytes=-1)


def test_a_lot_gives_each_records_credit_back_once() -> None:
    """The records of one message settle whole or one by one: the byte credit they spent
    comes back in shares that add up to it, and no record frees anything twice."""
    from crossdc_client.consumer import ConsumedRecord, _Lot

    recs = tuple(ConsumedRecord("t", 0, o, "east", None, b"v", (), 0, 1, 10.0)
                 for o in range(7))
    lot = _Lot(1, recs, 100.0, 1003, None)
    assert sum(lot.share(i) for i in range(7)) == 1003
    assert lot.rest() == (7, 1003)
    n, b = lot.settle([("t", 0, "east", 0), ("t", 0, "east", 3), ("t", 0, "west", 4)])
    assert (n, b) == (2, lot.share(0) + lot.share(3))  # west's offset 4 is another record
    assert lot.settle([("t", 0, "east", 3)]) == (0, 0)
    assert lot.rest() == (5, 1003 - b)
    assert [r.offset for r in lot.open_records()] == [1, 2, 4, 5, 6]
    assert lot.partitions() == {("t", 0)}
