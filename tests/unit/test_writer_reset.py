"""A dropped producer's connections are reset, not closed (issue 36, "abandoned requests still
land"): what the kernel still queues for the broker is discarded instead of delivered later.

Real TCP sockets on loopback: a server that reads nothing until the client gives up, then
reads what arrives. With a plain close the server still receives every byte the client
wrote (what a cut's heal does with an abandoned produce request); with `reset_connections`
it receives less, and a reset."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from proxy.writers import reset_connections

PAYLOAD = 8 * 1024 * 1024  # far more than the socket buffers hold: the rest stays queued


async def _received(reset: bool) -> tuple[int, bool]:
    """Bytes the server got, and whether the connection ended in a reset."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
        loop.create_future()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result((reader, writer))

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        reader, theirs = await accepted
        writer.write(b"x" * PAYLOAD)  # the server reads nothing yet: the kernel queues it
        # the shape reset_connections reads: an aiokafka client's connections
        client = SimpleNamespace(_conns={0: SimpleNamespace(_writer=writer)})
        if reset:
            assert reset_connections(client) == 1
        else:
            writer.close()
        got, was_reset = 0, False
        try:
            async with asyncio.timeout(30):
                while chunk := await reader.read(1 << 16):
                    got += len(chunk)
        except ConnectionResetError:
            was_reset = True
        theirs.close()
        return got, was_reset
    finally:
        server.close()
        await server.wait_closed()


async def test_a_closed_connection_delivers_what_was_queued() -> None:
    got, was_reset = await _received(reset=False)
    assert (got, was_reset) == (PAYLOAD, False)


async def test_a_reset_connection_delivers_nothing_more() -> None:
    got, was_reset = await _received(reset=True)
    assert was_reset
    assert got < PAYLOAD


def test_a_client_without_connections_resets_none() -> None:
    assert reset_connections(SimpleNamespace(_conns={})) == 0
    assert reset_connections(SimpleNamespace()) == 0
