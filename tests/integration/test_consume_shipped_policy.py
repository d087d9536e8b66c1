"""A shipped policy that validates is consumable (issue 38): a proxy running
policies/payments.yaml as it ships (strict, no rule for `dlq.*`) opens streams on
`payments.*` for `dr consume` and the SDK, and a record past its deliveries lands in its
dead-letter topic, written as `payments.*` says (ordered: the primary), a keyless one too
(the dead-letter topic follows its source's rule but never asks for a key). East is the
primary throughout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kafka_helpers import create_topic, end_offsets, eventually, produce, read_all, unique
from primary_helpers import agreed_primary

from crossdc.headers import DR_DL_DELIVERIES, DR_DL_OFFSET, DR_DL_TOPIC, DR_MODE
from dr.stack.paths import REPO_ROOT
from proxy.client import AsyncProducer
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.consumer_client import AsyncConsumer
from proxy.server import ProxyServer

PAYMENTS = REPO_ROOT / "policies" / "payments.yaml"


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    await agreed_primary(two_regions.topology)


@pytest.fixture
async def east(two_regions: Any) -> AsyncIterator[ProxyServer]:
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5,
                                            retry_s=0.3))
    server = ProxyServer(two_regions.topology, cfg, PAYMENTS)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_payments_yaml_as_shipped_reads_and_dead_letters_payments_topics(
        two_regions: Any, east: ProxyServer) -> None:
    topo = two_regions.topology
    boot = {r: str(topo.region(r).kafka.bootstrap) for r in ("east", "west")}
    topic = unique("payments.refunds")  # payments.refunds-<id>: the rule `payments.*`
    dlq = f"dlq.{topic}"
    for r in boot:  # ordered writes need the topic, same partitions, in every region
        await create_topic(boot[r], topic, partitions=1)
        await create_topic(boot[r], dlq, partitions=1)
    target = f"127.0.0.1:{east.port}"
    async with AsyncProducer(target) as p:
        await p.produce(topic, b"refund-1", key=b"acct-1")
    # one straight to Kafka, without a key (the rule requires one of Produce, not of Kafka)
    await produce(boot["east"], topic, [(None, b"refund-2", ())])

    # `dr consume` opens the stream (it was refused NOT_FOUND: no rule for dlq.payments.*)
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("CROSSDC_PROXY_TOKEN", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "consume", "--target", target, "--group",
        unique("g"), "--topic", topic, "--max", "2", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    async with asyncio.timeout(90):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert sorted(json.loads(line)["value"] for line in out.decode().splitlines()) == [
        "refund-1", "refund-2"]

    # the SDK: two deliveries each, then both go to the dead-letter topic
    group = unique("g")
    async with AsyncConsumer(target, group, [topic], credit=10, max_deliveries=2) as c:
        seen: dict[bytes | None, list[int]] = {b"refund-1": [], b"refund-2": []}
        offsets: dict[bytes | None, int] = {}
        while any(len(attempts) < 2 for attempts in seen.values()):
            async with asyncio.timeout(15):
                batch = await anext(c)
            for rec in batch:
                seen[rec.value].append(rec.delivery_attempt)
                offsets[rec.value] = rec.offset
            await batch.nack()
        assert seen == {b"refund-1": [1, 2], b"refund-2": [1, 2]}

        async def dead() -> bool:  # (offsets count the writers' transaction markers)
            return len(await read_all(boot["east"], dlq, 1)) == 2
        await eventually(dead, 20, "both records in the dead-letter topic")
    letters = await read_all(boot["east"], dlq, 1)
    assert [(m.key, m.value) for m in letters] == [(b"acct-1", b"refund-1"),
                                                    (None, b"refund-2")]
    for m in letters:
        h = dict(m.headers)
        assert (h[DR_DL_TOPIC], h[DR_DL_OFFSET], h[DR_DL_DELIVERIES]) == (
            topic.encode(), str(offsets[m.value]).encode(), b"2")
        assert h[DR_MODE] == b"ordered"  # `payments.*`'s mode: written to the primary
    assert await end_offsets(boot["west"], dlq) == {0: 0}  # ordered: no mirror runs here
