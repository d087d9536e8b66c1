"""Ask a gRPC server for its `grpc.health.v1` status (the proxy's health, for the controller)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ServingProbe", "check_serving"]

# A server back after an outage is seen within about a second: gRPC's default reconnect
# backoff grows to 120 s, and a channel kept between checks would call a proxy that came
# back unavailable for that long.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


class ServingProbe:
    """Health checks of one server over one channel kept between them: a channel per check
    (two regions probed twice a second) cost about twice the CPU of a check on a kept one
    (1.6 against 0.8 ms, client and server in one process). `close()` it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel: grpc.aio.Channel | None = None

    async def check(self, timeout_s: float) -> tuple[bool, str]:
        """`(serving?, what was seen)` for the server's overall status."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.endpoint,
                                                      options=RECONNECT_OPTIONS)
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""),
                                    timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {exc.details() or ''}".strip()
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return resp.status == health_pb2.HealthCheckResponse.SERVING, status

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()


async def check_serving(endpoint: str, timeout_s: float) -> tuple[bool, str]:
    """One check on a channel of its own: `(serving?, what was seen)`."""
    probe = ServingProbe(endpoint)
    try:
        return await probe.check(timeout_s)
    finally:
        await probe.close()
