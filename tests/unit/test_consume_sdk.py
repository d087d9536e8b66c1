"""The consumer SDK's connection set-up without a proxy: what a region needs, a region whose
Consul does not answer, and the connection settings the producer and consumer share."""

from __future__ import annotations

import socket

import grpc
import pytest

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
