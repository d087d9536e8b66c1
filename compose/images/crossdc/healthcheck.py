"""crossdc/crossdc's HEALTHCHECK: asks the daemon what $CROSSDC_HEALTH names.

    grpc://HOST:PORT          the proxy: gRPC health of its service is SERVING
    http://HOST:PORT/PATH     a controller's /health, a mirror's /metrics: answers 200
    (unset or empty)          a one-shot command: healthy

Exit 0 healthy, 1 not (the reason on stderr), as Docker expects.
"""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    target = os.environ.get("CROSSDC_HEALTH", "").strip()
    if not target:
        return 0
    try:
        if target.startswith("grpc://"):
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(target.removeprefix("grpc://")) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=3.0)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                print(f"{target}: {status}", file=sys.stderr)
                return 1
            return 0
        with urllib.request.urlopen(target, timeout=3.0) as reply:
            return 0 if reply.status == 200 else 1
    except Exception as exc:  # any failure to answer is "unhealthy", said in one line
        print(f"{target}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
