"""mirror/rdproducer.py without a broker: acks as aiokafka's batch metadata (every record's
target offset), the first error of a chunk, the client chosen per flow or per process."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from crossdc.clients.errors import KafkaTimeoutError, MessageSizeTooLargeError
from crossdc.clients.rdkafka import Sent
from crossdc.topology import Flow
from mirror.rdproducer import _acked, _Batch


async def test_acks_carry_every_offset_or_the_first_error() -> None:
    loop = asyncio.get_running_loop()
    sent = Sent(loop.create_future(), 3)
    sent.outcomes[:] = [(0, 10), (0, 12), (0, 13)]
    sent.future.set_result(sent.outcomes)
    out: asyncio.Future[Any] = loop.create_future()
    _acked(sent, out)
    md = out.result()
    assert md.offset == 10
    assert md.offsets == [10, 12, 13]

    bad = Sent(loop.create_future(), 2)
    bad.outcomes[:] = [(0, 1), MessageSizeTooLargeError("too large")]
    bad.future.set_result(bad.outcomes)
    out = loop.create_future()
    _acked(bad, out)
    with pytest.raises(MessageSizeTooLargeError):
        out.result()

    closed = Sent(loop.create_future(), 1)
    closed.future.set_exception(KafkaTimeoutError("producer closed"))
    out = loop.create_future()
    _acked(closed, out)
    with pytest.raises(KafkaTimeoutError):
        out.result()


def test_batch_keeps_records_in_order_and_is_never_full() -> None:
    b = _Batch()
    for i in range(3):
        assert b.append(timestamp=i, key=b"k", value=b"v", headers=[]) is b
    assert [r[3] for r in b.records] == [0, 1, 2]
    assert b.records[0][2] is None  # no headers: None, not []


def test_flow_client_defaults_to_aiokafka_and_refuses_others() -> None:
    f = Flow(source="east", target="west", topics="t")
    # aiokafka, unless this run asked for librdkafka everywhere (tests/conftest.py)
    assert f.kafka_client == (os.environ.get("CROSSDC_TEST_KAFKA_CLIENT") or "aiokafka")
    assert Flow(source="east", target="west", topics="t",
                kafka_client="librdkafka").kafka_client == "librdkafka"
    with pytest.raises(ValueError, match="aiokafka"):
        Flow(source="east", target="west", topics="t", kafka_client="kafka-python")


