"""The generated gRPC code of `proxy/protos/crossdc/v1/proxy.proto`, built when crossdc is
built (see proxy/build_protos.py; in a checkout, rebuilt here if stale). Import protocol
classes from here, never from _proto."""

from __future__ import annotations

from proxy.build_protos import ensure_generated

ensure_generated()

from proxy._proto.crossdc.v1 import proxy_pb2 as pb  # noqa: E402
from proxy._proto.crossdc.v1 import proxy_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Proxy"].full_name
