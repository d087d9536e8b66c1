"""The mirror's errors, under the project root `CrossdcError`.

    CrossdcError
    └── MirrorError   anything a mirror worker refuses or fails at
"""

from dr.errors import CrossdcError

__all__ = ["MirrorError"]


class MirrorError(CrossdcError):
    """Root of the mirror's errors."""
