"""Read a file a user named, within bounds: the one way crossdc reads what it is handed.

Defined in the client distribution (`crossdc_client.files`: the SDK reads its TLS files the
same way) and re-exported here; see that module for what `read_user_file` refuses and why.
"""

from __future__ import annotations

from crossdc_client.files import CHUNK_BYTES, read_user_file, read_user_text, too_big

__all__ = ["CHUNK_BYTES", "read_user_file", "read_user_text", "too_big"]
