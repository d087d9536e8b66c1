"""Secrets never appear in logs, reports or `dr status`: a real `dr proxy serve` with an auth
file (debug logs, JSON) is called with a good token, a good token on a topic it may not
write, an unknown token, a malformed authorization and a token sent as a record header;
then `dr status` runs against the stack. Every byte captured (the proxy's log, its metrics
page, the commands' stdout and stderr) is searched for every token value."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, unique, until_serving

from dr.stack.ports import free_port
from proxy.api import pb, pb_grpc
from proxy.auth import hash_token, new_token

# the first test of a file waits for the session stack (minutes on a busy machine)
# slow: a real `dr proxy serve` of its own; CI runs it in `make test-more`
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

WRITER, OTHER, UNKNOWN = new_token(), new_token(), new_token()
MALFORMED = "Basic " + new_token()


async def test_tokens_never_reach_logs_metrics_or_status(two_regions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topic = unique("sec-ok")
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, topic, partitions=1)
    policy = tmp_path / "policy.yaml"
    policy.write_text('rules:\n  - topic: "sec-*"\n    mode: ordered\n')
    auth = tmp_path / "auth.yaml"
    auth.write_text(f"tokens:\n  - name: writer\n    sha256: {hash_token(WRITER)}\n"
                    f"    topics: ['sec-ok-*']\n  - name: other\n    sha256: "
                    f"{hash_token(OTHER)}\n    topics: [elsewhere]\n")
    port, mport = free_port(), free_port()
    log = tmp_path / "proxy.log"
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dr.cli", "--log-format", "json", "--log-level", "debug",
            "proxy", "serve", "--topology", str(two_regions.topology_path), "--region",
            "east", "--policy", str(policy), "--auth", str(auth), "--port", str(port),
            "--metrics-port", str(mport), "--no-consul", "--grace", "1", "--workers", "1",
            stdout=f, stderr=f)
    captured: list[str] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await until_serving(ch, proc, log)
            stub = pb_grpc.ProxyStub(ch)

            async def produce(authorization: str, topic_: str,
                              headers: list[Any] | None = None) -> grpc.StatusCode:
                try:
                    await stub.Produce(pb.ProduceRequest(record=pb.Record(
                        topic=topic_, key=b"k", value=b"v", headers=headers or [])),
                        metadata=(("authorization", authorization),), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    captured.append(exc.details() or "")
                    return exc.code()
                return grpc.StatusCode.OK

            assert await produce(f"Bearer {WRITER}", topic) == grpc.StatusCode.OK
            assert await produce(f"Bearer {WRITER}", "sec-denied") == \
                grpc.StatusCode.PERMISSION_DENIED
            assert await produce(f"Bearer {OTHER}", topic) == \
                grpc.StatusCode.PERMISSION_DENIED
            assert await produce(f"Bearer {UNKNOWN}", topic) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert await produce(MALFORMED, topic) == grpc.StatusCode.UNAUTHENTICATED
            assert await produce(f"Bearer {WRITER}", topic, [pb.Header(
                key="dr-token", value=WRITER.encode())]) == grpc.StatusCode.INVALID_ARGUMENT
        captured.append(await asyncio.to_thread(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()))
        status = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "dr.cli", "status", "--topology",
                             str(two_regions.topology_path)],
            capture_output=True, text=True, timeout=120, check=False)
        captured += [status.stdout, status.stderr]
        assert "east" in status.stdout, status.stderr[-2000:]
        token_cmd = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "dr.cli", "--log-level", "debug", "proxy",
                             "token", "--name", "x"],
            capture_output=True, text=True, timeout=120, check=False)
        printed = token_cmd.stdout.split("token: ", 1)[1].split()[0]
        assert token_cmd.stdout.count(printed) == 1  # printed once, on purpose, nowhere else
        captured.append(token_cmd.stderr)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
    captured.append(log.read_text(errors="replace"))
    everything = "\n".join(captured)
    assert "auth_call_refused" in everything  # the refusals were logged...
    assert "auth_topic_denied" in everything
    for name, secret in (("WRITER", WRITER), ("OTHER", OTHER), ("UNKNOWN", UNKNOWN),
                         ("MALFORMED", MALFORMED.split()[1]), ("printed", printed)):
        assert secret not in everything, f"the {name} token appears in the output"
        assert secret[4:20] not in everything, f"part of the {name} token appears"
