"""Reading compressed topics through the proxy: records that producers wrote with lz4, zstd or
snappy come out of the SDK's `AsyncConsumer` as written. aiokafka decodes these codecs only
with cramjam, a runtime dependency of crossdc for that reason (pyproject.toml)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, produce, unique
from primary_helpers import agreed_primary

from proxy.config import ConsumeConfig, ProxyConfig
from proxy.consumer_client import AsyncConsumer
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "codec-*"
    mode: ordered
    consume:
      ack_deadline_s: 30
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
"""


@pytest.fixture
async def east(two_regions: Any, tmp_path: Path) -> AsyncIterator[ProxyServer]:
    await agreed_primary(two_regions.topology)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False,
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5))
    server = ProxyServer(two_regions.topology, cfg, policy)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.mark.parametrize("codec", ["lz4", "zstd", "snappy"])
async def test_the_proxy_reads_a_compressed_topic(two_regions: Any, east: ProxyServer,
                                                  codec: str) -> None:
    topic = unique(f"codec-{codec}")
    for region in ("east", "west"):
        await create_topic(str(two_regions.topology.region(region).kafka.bootstrap), topic,
                           partitions=2)
    # values that compress, in batches of many records (what a codec is for)
    sent = {(b"k%d" % i, b"value %05d " % i + b"abc" * 100) for i in range(200)}
    await produce(str(two_regions.topology.region("east").kafka.bootstrap), topic,
                  [(k, v, ()) for k, v in sorted(sent)], compression_type=codec,
                  linger_ms=20)
    got: set[tuple[bytes | None, bytes | None]] = set()
    async with AsyncConsumer(f"127.0.0.1:{east.port}", unique("g"), [topic]) as c:
        async with asyncio.timeout(30):
            while len(got) < len(sent):
                batch = await anext(c)
                got |= {(r.key, r.value) for r in batch}
                await batch.ack()
    assert got == sent
