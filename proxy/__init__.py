"""crossdc's regional routing proxy (gRPC): ordered, sync and nearest writes by policy.

`import proxy` stays light (no grpc): the server and client classes load on first use.

    from proxy import ProxyServer, ProxyConfig, AsyncProducer, Producer
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.errors import ProxyError

if TYPE_CHECKING:
    from proxy.client import AsyncProducer, Producer
    from proxy.config import ProxyConfig
    from proxy.server import ProxyServer

__all__ = ["AsyncProducer", "Producer", "ProxyConfig", "ProxyError", "ProxyServer"]

_LAZY = {"AsyncProducer": "proxy.client", "Producer": "proxy.client",
         "ProxyConfig": "proxy.config", "ProxyServer": "proxy.server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'proxy' has no attribute {name!r}")
