"""The generator of the proxy API's gRPC stubs: `crossdc_client.build_protos` (the client
distribution builds and carries the stubs; the server imports the same ones through
`proxy.api`), re-exported here. `python -m proxy.build_protos` still rebuilds them in a
checkout (`python -m crossdc_client.build_protos` is the same)."""

from __future__ import annotations

from crossdc_client.build_protos import (
    OUT_DIR,
    PROTO_DIR,
    ensure_generated,
    generate,
    in_checkout,
    is_fresh,
    main,
)

__all__ = ["OUT_DIR", "PROTO_DIR", "ensure_generated", "generate", "in_checkout", "is_fresh"]

if __name__ == "__main__":
    main()
