"""crossdc's client SDK: produce and consume through a crossdc proxy (gRPC).

    pip install crossdc-client       # grpcio and protobuf, nothing of the daemons

    from crossdc_client import AsyncProducer, Producer, AsyncConsumer

`import crossdc_client` (and `crossdc_client.errors`, which `crossdc.errors` builds on) stays
light: no grpc until a client class is used. The full `crossdc` install depends on this
distribution and re-exports the same objects (`proxy.client`, `proxy.consumer_client`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crossdc_client.connect import Connection, Proxies
    from crossdc_client.consumer import AsyncConsumer, ConsumedBatch, ConsumedRecord
    from crossdc_client.errors import (
        ConsumeFailed,
        CrossdcError,
        InvalidRequest,
        NotAssigned,
        NotAuthorized,
        ProduceFailed,
        ProxyError,
        ProxyUnavailable,
        TopicNotFound,
    )
    from crossdc_client.lifecycle import Closed
    from crossdc_client.producer import AsyncProducer, Producer, ProduceResult, Written

__all__ = [
    "AsyncConsumer",
    "AsyncProducer",
    "Closed",
    "Connection",
    "ConsumeFailed",
    "ConsumedBatch",
    "ConsumedRecord",
    "CrossdcError",
    "InvalidRequest",
    "NotAssigned",
    "NotAuthorized",
    "ProduceFailed",
    "ProduceResult",
    "Producer",
    "Proxies",
    "ProxyError",
    "ProxyUnavailable",
    "TopicNotFound",
    "Written",
]

_LAZY = {"AsyncConsumer": "consumer", "ConsumedBatch": "consumer", "ConsumedRecord": "consumer",
         "AsyncProducer": "producer", "Producer": "producer", "ProduceResult": "producer",
         "Written": "producer", "Connection": "connect", "Proxies": "connect",
         "Closed": "lifecycle", "ConsumeFailed": "errors", "CrossdcError": "errors",
         "ProduceFailed": "errors", "ProxyError": "errors", "InvalidRequest": "errors",
         "NotAssigned": "errors", "NotAuthorized": "errors", "ProxyUnavailable": "errors",
         "TopicNotFound": "errors"}

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"crossdc_client.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'crossdc_client' has no attribute {name!r}")
