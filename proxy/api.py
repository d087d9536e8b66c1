"""The generated gRPC code of the proxy's API (`client/src/crossdc_client/protos/crossdc/v1/
proxy.proto`): built with the crossdc-client distribution, which the server shares with the
SDK (one set of stubs in a process: protobuf's descriptor pool takes a .proto once).
Import protocol classes from here or `crossdc_client.api`, never from _proto."""

from __future__ import annotations

from crossdc_client.api import SERVICE_NAME, pb, pb_grpc

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]
