"""The proxy's outcome journal against real Kafka: every record a client wrote through the
proxy has one entry in the own region's `_crossdc.proxy.outcomes`, saying what its client
was told and where Kafka put it (issue 23)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, read_all, unique
from primary_helpers import agreed_primary

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.outcomes import ACKED, FAILED, JOURNAL_TOPIC, Entry, decode
from proxy.api import pb, pb_grpc
from proxy.config import JournalSettings, KafkaWriterSettings, ProxyConfig
from proxy.server import ProxyServer

pytestmark = pytest.mark.timeout(180)

POLICY = """\
strict: true
rules:
  - topic: "jo-*"
    mode: ordered
  - topic: "jn-*"
    mode: nearest
"""


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    await agreed_primary(two_regions.topology)


@pytest.fixture
async def proxy(two_regions: Any, tmp_path: Path) -> AsyncIterator[tuple[ProxyServer, Any]]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    cfg = ProxyConfig(region="east", register_consul=False, primary_wait_s=5.0, grace_s=2.0,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      journal=JournalSettings(enabled=True))
    async with ProxyServer(two_regions.topology, cfg, policy) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield server, pb_grpc.ProxyStub(ch)


async def _entries(bootstrap: str, topics: set[str]) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = {}
    async with KafkaAdmin(KafkaConnection.of(bootstrap)) as admin:
        if JOURNAL_TOPIC not in await admin.list_topics():
            return out
    for rec in await read_all(bootstrap, JOURNAL_TOPIC, 1):
        for e in decode(rec.value):
            if e.topic in topics:
                out.setdefault(e.dr_id, []).append(e)
    return out


async def test_every_write_is_journaled_with_what_its_client_was_told(
        two_regions: Any, proxy: tuple[ProxyServer, Any]) -> None:
    server, stub = proxy
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    ordered, nearest, gone = unique("jo"), unique("jn"), unique("jo")
    for bootstrap in (east, west):
        await create_topic(bootstrap, ordered, partitions=2)
        await create_topic(bootstrap, nearest, partitions=1)
    # `gone` matches the ordered rule but exists in no region: the write fails in Kafka
    resp = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
        *(pb.Record(topic=ordered, key=f"k{i}".encode(), value=b"v") for i in range(5)),
        *(pb.Record(topic=nearest, value=b"n") for _ in range(3)),
        pb.Record(topic=gone, key=b"k", value=b"x")]))
    ok = [r for r in resp.results if r.status == pb.STATUS_OK]
    failed = [r for r in resp.results if r.status != pb.STATUS_OK]
    assert (len(ok), len(failed)) == (8, 1), resp
    assert server.journal is not None
    assert await server.journal.flushed(30.0)

    got = await _entries(east, {ordered, nearest, gone})
    assert set(got) == {r.dr_id for r in resp.results}, "one entry per record written"
    for r in ok:
        [e] = got[r.dr_id]
        assert e.status == ACKED
        assert e.written == ",".join(f"{w.region}:{w.partition}:{w.offset}"
                                     for w in r.written)
        assert int(e.ts_ms) > 0
    [e] = got[failed[0].dr_id]
    assert (e.topic, e.status, e.written) == (gone, FAILED, "")
    # the journal is the own region's: west's holds none of these
    assert not await _entries(west, {ordered, nearest, gone})
    assert server.registry.get_sample_value("crossdc_proxy_journal_appended_total") == 9
    assert server.registry.get_sample_value("crossdc_proxy_journal_pending") == 0
