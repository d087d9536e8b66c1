"""The proxy's errors, under the project root `CrossdcError`.

    CrossdcError
    └── ProxyError    anything the proxy refuses or fails at
"""

from dr.errors import CrossdcError

__all__ = ["ProxyError"]


class ProxyError(CrossdcError):
    """Root of the proxy's errors."""
