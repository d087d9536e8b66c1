"""Ask a gRPC server for its `grpc.health.v1` status (the proxy's health, for the controller)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check_serving"]


async def check_serving(endpoint: str, timeout_s: float) -> tuple[bool, str]:
    """`(serving?, what was seen)` for the server's overall status."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""),
                                    timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {exc.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status
