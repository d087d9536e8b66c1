"""mirror.rdconsumer without a broker: a consume's records grouped by partition, in order,
with the attributes of aiokafka's ConsumerRecord, checked against a plain per-record loop
over confluent-kafka's own Message objects (hypothesis); consumer errors among them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from confluent_kafka import KafkaError as CKError
from confluent_kafka import KafkaException, Message
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from mirror.rdconsumer import RdMirrorConsumer


def _consumer() -> RdMirrorConsumer:
    return RdMirrorConsumer(KafkaConnection.of("127.0.0.1:1"), client_id="t", group_id="g",
                            read_committed=False, metadata_max_age_ms=1000)


def _oracle(msgs: list[Any]) -> dict[TopicPartition, list[tuple[Any, ...]]]:
    out: dict[TopicPartition, list[tuple[Any, ...]]] = {}
    for m in msgs:
        if m.error() is not None:
            continue
        k, v = m.key(), m.value()
        out.setdefault(TopicPartition(m.topic(), m.partition()), []).append(
            (m.offset(), k, v, m.headers(), m.timestamp()[1],
             -1 if k is None else len(k), -1 if v is None else len(v)))
    return out


_record = st.tuples(
    st.sampled_from([("a", 0), ("a", 1), ("b", 0)]),
    st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.lists(st.tuples(st.sampled_from(["dr-id", "x"]),
                                            st.binary(max_size=4)), min_size=1, max_size=2)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_record, max_size=40))
def test_grouping_matches_a_per_record_loop(records: list[Any]) -> None:
    offsets: dict[tuple[str, int], int] = {}
    msgs = []
    for (topic, part), key, value, headers in records:
        off = offsets[(topic, part)] = offsets.get((topic, part), -1) + 1
        msgs.append(Message(topic=topic, partition=part, offset=off, key=key, value=value,
                            headers=headers, timestamp=(1, 1000 + off)))
    got = _consumer()._group(msgs)
    assert {tp: [tuple(r) for r in recs] for tp, recs in got.items()} == _oracle(msgs)
    for recs in got.values():  # what the copy loop reads, by name
        for r in recs:
            assert r.serialized_value_size == (-1 if r.value is None else len(r.value))
            assert r.timestamp == 1000 + r.offset


def test_a_consumer_error_among_records_is_kept_out_and_raised_by_getmany() -> None:
    c = _consumer()
    msgs = [Message(topic="a", partition=0, offset=0, value=b"x", timestamp=(1, 1)),
            Message(topic="a", partition=0, error=CKError(CKError.TOPIC_AUTHORIZATION_FAILED)),
            Message(topic="a", partition=0, offset=1, value=b"y", timestamp=(1, 2))]
    got = c._group(msgs)
    assert [r.offset for r in got[TopicPartition("a", 0)]] == [0, 1]
    assert isinstance(c._error, KafkaError)  # not retriable: the next getmany raises it


def test_a_retriable_consumer_error_is_only_logged() -> None:
    c = _consumer()
    got = c._group([Message(topic="a", partition=0, error=CKError(CKError._TRANSPORT))])
    assert got == {}
    assert c._error is None


async def test_a_failed_start_leaves_nothing_to_stop() -> None:
    c = RdMirrorConsumer(KafkaConnection.of("127.0.0.1:1"), client_id="t", group_id="g",
                         read_committed=False, metadata_max_age_ms=1000,
                         fetch_max_bytes=-5)  # librdkafka refuses it when the consumer is built
    with pytest.raises(KafkaException, match=r"fetch\.max\.bytes"):
        await c.start()
    async with asyncio.timeout(5):  # before: waited for a thread that never started
        await c.stop()
    assert not c.closed


async def test_calls_after_stop_say_closed() -> None:
    c = _consumer()
    await c.stop()  # never started: nothing to end
    with pytest.raises(KafkaError):
        c.pause(TopicPartition("a", 0))
    with pytest.raises(KafkaError):
        await c.commit({TopicPartition("a", 0): 1})
    assert c.highwater(TopicPartition("a", 0)) is None
