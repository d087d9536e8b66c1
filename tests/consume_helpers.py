"""What the consume tests share: a proxy of east on the session stack with quick consume
settings, and reading through it (the next batch, at least n records)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.consumer_client import AsyncConsumer, ConsumedBatch, ConsumedRecord
from proxy.server import ProxyServer


def module_fixtures(policy: str) -> tuple[Any, Any]:
    """A consume test module's two fixtures: the primary agreed in every datacenter before
    each test (autouse) and `policy` written once per module (`policy_file`):
        _primary_everywhere, policy_file = module_fixtures(POLICY)"""
    from primary_helpers import agreed_primary

    @pytest.fixture(autouse=True)
    async def _primary_everywhere(two_regions: Any) -> None:
        await agreed_primary(two_regions.topology)

    @pytest.fixture(scope="module")
    def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
        p = tmp_path_factory.mktemp("policy") / "policy.yaml"
        p.write_text(policy)
        return p

    return _primary_everywhere, policy_file


@contextlib.asynccontextmanager
async def east_proxy(two_regions: Any, policy: Path,
                     fetch: Literal["raw", "decoded"] = "raw") -> AsyncIterator[ProxyServer]:
    """A proxy of region east serving `policy`: quick commits, lingering and retries, no
    Consul registration; its members fetch `fetch`."""
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5,
                                            retry_s=0.3, fetch=fetch))
    server = ProxyServer(two_regions.topology, cfg, policy)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def boot(two_regions: Any, region: str = "east") -> str:
    return str(two_regions.topology.region(region).kafka.bootstrap)


def target(server: ProxyServer) -> str:
    return f"127.0.0.1:{server.port}"


async def next_batch(c: AsyncConsumer, timeout_s: float = 20.0) -> ConsumedBatch:
    async with asyncio.timeout(timeout_s):
        return await anext(c)


async def take(c: AsyncConsumer, n: int, *, ack: bool = True,
               timeout_s: float = 30.0) -> list[ConsumedRecord]:
    """At least `n` records (whole batches), each batch acked as it comes unless `ack` is
    False."""
    out: list[ConsumedRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        batch = await next_batch(c, max(0.1, deadline - time.monotonic()))
        out.extend(batch)
        if ack:
            await batch.ack()
    return out


async def group_offsets(two_regions: Any, group: str, region: str = "east") -> dict[Any, int]:
    """The committed offsets of Kafka group `group` in `region`."""
    async with KafkaAdmin(KafkaConnection.of(two_regions.topology.region(region))) as admin:
        return await admin.group_offsets(group)
