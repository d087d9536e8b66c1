"""crossdc.clients.rdkafka without a broker: the security settings as librdkafka's, its
errors as the data paths' classes, the writers' client chosen by the config."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
)
from crossdc.clients.rdkafka import rdkafka_config
from crossdc.security import PROXY, KafkaSecurity
from crossdc.topology import Region
from proxy.config import KafkaWriterSettings, ProxyConfig


def _region() -> Region:
    return Region.model_validate({
        "name": "east", "kafka": {"bootstrap_servers": ["127.0.0.1:1"]},
        "consul": {"http_addr": "127.0.0.1:2", "datacenter": "east",
                   "dns_addr": "127.0.0.1:3"},
        "proxy": {"endpoint": "127.0.0.1:4"}})


def _password(tmp_path: Path, name: str) -> Path:
    p = tmp_path / f"{name}.password"
    p.write_text("s3cret\n")
    os.chmod(p, 0o600)
    return p


def test_plaintext_is_only_the_servers() -> None:
    assert rdkafka_config(KafkaConnection.of("a:1,b:2")) == {"bootstrap.servers": "a:1,b:2"}


def test_sasl_ssl_maps_to_librdkafka_settings(tmp_path: Path) -> None:
    _password(tmp_path, PROXY)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    sec = KafkaSecurity(protocol="SASL_SSL", mechanism="SCRAM-SHA-256", ca_file=ca,
                        credentials_dir=tmp_path)
    conn = KafkaConnection(("b:9093",), sec, PROXY)
    assert rdkafka_config(conn) == {
        "bootstrap.servers": "b:9093", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": PROXY, "sasl.password": "s3cret",
        "ssl.endpoint.identification.algorithm": "https", "ssl.ca.location": str(ca)}


def test_sasl_plaintext_with_a_pinned_user_has_no_tls(tmp_path: Path) -> None:
    pw = _password(tmp_path, "ops")
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", username="ops", password_file=pw)
    cfg = rdkafka_config(KafkaConnection(("b:9092",), sec, PROXY))
    assert cfg["sasl.username"] == "ops"
    assert cfg["security.protocol"] == "SASL_PLAINTEXT"
    assert not any(k.startswith("ssl.") for k in cfg)


def test_errors_map_to_the_data_paths_classes() -> None:
    import confluent_kafka as ck  # a core dependency: never skipped

    from crossdc.clients.rdkafka import RdProducerFatal, translate

    KE = ck.KafkaError
    timed_out = translate(KE(KE._MSG_TIMED_OUT))
    assert isinstance(timed_out, KafkaTimeoutError)
    assert not timed_out.retriable  # it may have landed: a second send would duplicate it
    assert isinstance(translate(KE(KE._TRANSPORT)), KafkaConnectionError)
    assert translate(KE(KE._TRANSPORT)).retriable
    assert isinstance(translate(KE(KE.MSG_SIZE_TOO_LARGE)), MessageSizeTooLargeError)
    assert isinstance(translate(KE(KE.OUT_OF_ORDER_SEQUENCE_NUMBER)), OutOfOrderSequenceNumber)
    not_leader = translate(KE(KE.NOT_LEADER_FOR_PARTITION))
    assert not_leader.retriable
    assert type(not_leader).__name__.startswith("NotLeader")
    assert not translate(KE(KE._UNKNOWN_PARTITION)).retriable
    assert isinstance(translate(KE(KE._PURGE_QUEUE)), KafkaTimeoutError)
    assert isinstance(translate(KE(KE._FATAL, fatal=True)), RdProducerFatal)
    for code in (KE._FENCED, KE.PRODUCER_FENCED, KE.INVALID_PRODUCER_EPOCH):
        fenced = translate(KE(code, fatal=True))
        assert isinstance(fenced, ProducerFenced), code  # MirrorWorker: WorkerFenced
        assert not fenced.retriable


async def test_transactions_commit_and_abort_on_librdkafkas_mock_cluster() -> None:
    """RdProducer's transactional calls against librdkafka's own mock cluster (in-process
    brokers with a transaction coordinator): a commit waits for every record's answer, and
    every record of an aborted transaction is answered too (delivered or purged). The mock's
    coordinator does not fence an older epoch (tried): the fence, and the mirror's
    exactly-once, are tested on real Kafka (tests/integration/test_mirror_ops.py,
    test_mirror.py)."""
    from crossdc.clients.rdkafka import RdProducer

    conn = KafkaConnection.of("127.0.0.1:1")  # replaced by the mock cluster's
    mock = {"test.mock.num.brokers": 1, "allow.auto.create.topics": True}
    first = RdProducer(conn, client_id="t1", transactional_id="tx-a", **mock)
    await first.start()
    try:
        await first.begin_transaction()
        sent = first.send_many("t", [(b"k", b"v", None, 0)])
        await first.commit_transaction()
        assert sent.future.done(), "a commit waits for every record's answer"
        assert (await sent.future)[0][1] >= 0
        await first.begin_transaction()
        aborted = first.send_many("t", [(b"k", b"never", None, 0)])
        await first.abort_transaction()
        await asyncio.wait_for(aborted.future, 10)
        assert not first.fenced
    finally:
        await first.stop(5.0)


def test_the_writers_client_is_a_config_choice() -> None:
    from prometheus_client import CollectorRegistry

    from proxy.config import BreakerSettings
    from proxy.metrics import ProxyMetrics
    from proxy.writers import RdRegionWriter, RegionWriter, make_writer

    assert ProxyConfig(region="east").kafka.client in ("aiokafka", "librdkafka")
    assert KafkaWriterSettings(client="librdkafka").client == "librdkafka"
    region = _region()
    metrics = ProxyMetrics(CollectorRegistry())
    for client, cls in (("aiokafka", RegionWriter), ("librdkafka", RdRegionWriter)):
        w = make_writer(region, KafkaConnection.of(region),
                        KafkaWriterSettings(client=client), BreakerSettings(), metrics,
                        client_id="t")
        assert type(w) is cls


class _Metadata:
    """A stand-in RdProducer's metadata: `answers` in turn (False: no answer)."""

    def __init__(self, *answers: int | bool | None) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.closed = False
        self.fatal = False

    async def partition_count(self, topic: str, timeout_s: float) -> int | bool | None:
        self.asked += 1
        return self.answers.pop(0)


async def test_partition_counts_absent_unknown_and_cached() -> None:
    from prometheus_client import CollectorRegistry

    from proxy.config import BreakerSettings
    from proxy.errors import RegionWriteFailed
    from proxy.metrics import ProxyMetrics
    from proxy.writers import RdRegionWriter

    region = _region()
    w = RdRegionWriter(region, KafkaConnection.of(region), KafkaWriterSettings(),
                       BreakerSettings(), ProxyMetrics(CollectorRegistry()), client_id="t")
    md = _Metadata(False, 6, None)
    w._producer = md
    for _ in range(2):  # the look fails, then a call within its second: unknown, not absent
        with pytest.raises(RegionWriteFailed, match="metadata request failed"):
            await w.partition_count("orders", 1.0)
    assert md.asked == 1
    w._counts["orders"] = (None, 0.0)  # the failed look is old: ask again
    assert await w.partition_count("orders", 1.0) == 6
    assert await w.partition_count("orders", 1.0) == 6  # cached
    assert w.known_partition_count("orders") == 6
    assert md.asked == 2
    assert await w.partition_count("gone", 1.0) is None  # the cluster says: no such topic
    w._producer = None


async def test_the_handle_outlives_every_blocking_call_in_a_thread() -> None:
    """A blocking call of the handle in an executor thread (metadata, a transaction's
    commit) whose caller was cancelled still runs: `stop()` destroys the producer only
    after it returned (destroying it under the call would free what the call uses)."""
    import time

    from crossdc.clients.rdkafka import RdProducer

    mock: dict[str, Any] = {"test.mock.num.brokers": 1}
    p = RdProducer(KafkaConnection.of("127.0.0.1:1"), client_id="t3", **mock)
    await p.start()
    ended: list[float] = []

    def slow() -> None:
        time.sleep(1.5)  # longer than the poll thread's join and the close
        ended.append(time.monotonic())

    call = asyncio.ensure_future(p._in_thread(slow))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not ended
    await p.stop(1.0)
    assert ended, "stop() returned while a call was still inside the handle"
    assert p._calls == 0


def test_fenced_writes_follow_the_default_where_the_client_can_write_them() -> None:
    import pydantic

    import proxy.config

    expected = proxy.config.FENCED_BY_DEFAULT  # CROSSDC_TEST_FENCED_WRITES=1 turns it on
    assert KafkaWriterSettings().fenced_writes is expected
    assert KafkaWriterSettings(client="aiokafka", fenced_writes=None).fenced_writes is expected
    assert KafkaWriterSettings(fenced_writes=False).fenced_writes is False
    # librdkafka's writers have no transactions: plain by default, refused when asked for
    assert KafkaWriterSettings(client="librdkafka").fenced_writes is False
    with pytest.raises(pydantic.ValidationError, match="fenced_writes needs client: aiokafka"):
        KafkaWriterSettings(client="librdkafka", fenced_writes=True)
    # from a file's mapping as from keywords
    assert KafkaWriterSettings.model_validate({"client": "librdkafka"}).fenced_writes is False
