"""crossdc's mirror workers. Built in the mirror issue; only its errors exist yet."""

from mirror.errors import MirrorError

__all__ = ["MirrorError"]
