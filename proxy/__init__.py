"""crossdc's regional routing proxy (gRPC). Built in the proxy issue; only its errors exist yet."""

from proxy.errors import ProxyError

__all__ = ["ProxyError"]
