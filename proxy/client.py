"""The client SDK's producers, `AsyncProducer` and `Producer`: defined in the crossdc-client
distribution (`crossdc_client.producer`, grpcio and protobuf only, for applications) and
re-exported here, so `from proxy.client import AsyncProducer` and `from proxy import
AsyncProducer` keep working in the full install."""

from __future__ import annotations

from crossdc_client.producer import (
    AsyncProducer,
    Producer,
    ProduceResult,
    Written,
    channel_credentials,
)

__all__ = ["AsyncProducer", "ProduceResult", "Producer", "Written", "channel_credentials"]
