"""The client distribution against a real proxy: an application's Python, with only
`crossdc-client` (grpcio, protobuf) importable, produces a record through the proxy and reads
it back through the proxy's consumer API; Kafka holds it, stamped.

The application's interpreter is `$CROSSDC_CLIENT_PYTHON`: `.ci/clean-venv.sh` points it at a
fresh venv holding the client wheel alone (and checks there that none of the daemons'
libraries is importable). Unset (`make test`), it is this interpreter, run from a folder
outside the checkout; the script then still proves that the SDK loads nothing of crossdc.
The proxy and the stack run here, from the dev venv."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, read_all, unique
from primary_helpers import agreed_primary

from crossdc.headers import DR_ID, DR_ORIGIN
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "app-*"
    mode: ordered
    consume:
      ack_deadline_s: 10
  - topic: "dlq.*"
    mode: nearest
"""

# The application: the SDK only. It prints what it wrote and what it read, and which
# top-level packages it had loaded by then.
APP = """
import asyncio, json, sys
from crossdc_client import AsyncConsumer, AsyncProducer

target, topic = sys.argv[1], sys.argv[2]

async def main():
    async with AsyncProducer(target) as p:
        wrote = await p.produce(topic, b"from-an-app", key=b"k1", headers=[("h", b"v")])
    async with AsyncConsumer(target, "app-group", [topic], open_timeout_s=30) as c:
        raw = c.raw_batches
        async def first():
            async for batch in c:
                for rec in batch:
                    await batch.ack()
                    return rec
        rec = await asyncio.wait_for(first(), 60)
    import crossdc_client
    print(json.dumps({
        "wrote": {"dr_id": wrote.dr_id, "status": wrote.status, "mode": wrote.mode,
                  "written": [[w.region, w.partition, w.offset] for w in wrote.written]},
        "read": {"dr_id": rec.dr_id, "key": rec.key.decode(), "value": rec.value.decode(),
                 "region": rec.region, "offset": rec.offset,
                 "headers": {k: v.decode() for k, v in rec.headers}},
        "loaded": sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names)),
        "sdk": crossdc_client.__file__,
        "raw_batches": raw,
    }))

asyncio.run(main())
"""


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    await agreed_primary(two_regions.topology)


@pytest.fixture
async def east(two_regions: Any, tmp_path: Path) -> AsyncIterator[ProxyServer]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5,
                                            retry_s=0.3))
    server = ProxyServer(two_regions.topology, cfg, policy)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_an_application_with_the_client_alone_produces_and_consumes_through_a_proxy(
        two_regions: Any, east: ProxyServer, tmp_path: Path) -> None:
    topic = unique("app-orders")
    for r in ("east", "west"):
        await create_topic(str(two_regions.topology.region(r).kafka.bootstrap), topic)
    python = os.environ.get("CROSSDC_CLIENT_PYTHON") or sys.executable
    app_dir = tmp_path / "app"  # outside the checkout: nothing of it on the app's path
    app_dir.mkdir()
    proc = await asyncio.create_subprocess_exec(
        python, "-c", APP, f"127.0.0.1:{east.port}", topic, cwd=app_dir,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)

    wrote, read = got["wrote"], got["read"]
    assert wrote["status"] == "ok"
    assert wrote["mode"] == "ordered"
    assert [w[0] for w in wrote["written"]] == ["east"]
    assert read["dr_id"] == wrote["dr_id"]
    assert (read["key"], read["value"], read["region"]) == ("k1", "from-an-app", "east")
    assert read["offset"] == wrote["written"][0][2]
    assert read["headers"]["h"] == "v"
    # the application loaded the SDK, grpc and protobuf, and nothing of crossdc or its daemons;
    # aiokafka only as the `fast` extra's batch decoder (read pass-through), where installed
    daemons = {"crossdc", "proxy", "dr", "mirror", "aiokafka", "consul", "aiohttp",
               "confluent_kafka", "structlog", "pydantic"}
    assert not set(got["loaded"]) & (daemons - ({"aiokafka"} if got["raw_batches"] else set()))
    if os.environ.get("CROSSDC_CLIENT_PYTHON"):  # the clean venv's own install, not the checkout
        assert "site-packages" in got["sdk"], got["sdk"]
        assert got["raw_batches"] is False  # no `fast` extra there: records, decoded by the proxy

    # Kafka holds it, stamped by the proxy
    recs = await read_all(str(two_regions.topology.region("east").kafka.bootstrap), topic, 1)
    assert [r.value for r in recs] == [b"from-an-app"]
    headers = dict(recs[0].headers)
    assert headers[DR_ID].decode() == wrote["dr_id"]
    assert headers[DR_ORIGIN] == b"east"
