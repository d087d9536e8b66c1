"""The generated gRPC code of `protos/crossdc/v1/proxy.proto` (the proxy's API), built when
the client distribution is built (see build_protos.py; in a checkout, rebuilt here if stale).
Import protocol classes from here (or `proxy.api`, which re-exports these), never from
_proto."""

from __future__ import annotations

from crossdc_client.build_protos import ensure_generated

ensure_generated()

from crossdc_client._proto.crossdc.v1 import proxy_pb2 as pb  # noqa: E402
from crossdc_client._proto.crossdc.v1 import proxy_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Proxy"].full_name
