"""The drill client's history of writes told failed (dr/drill/traffic.py `ToldFailed`): what
the client SDK keeps of every attempt (proxy/client.py `ProduceFailed.earlier`), which
outcomes are unknown and which are a refusal before anything was written, and the log."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from dr.drill.traffic import (
    Ack,
    ToldFailed,
    _Sent,
    _told_failed,
    failed_log_of,
    read_ack_log,
    read_failed_log,
)
from dr.errors import DrError
from proxy.api import pb
from proxy.client import AsyncProducer, ProduceResult, Written
from proxy.errors import ProduceFailed, ProxyError

U = grpc.StatusCode.UNAVAILABLE
SENT = _Sent("run-east-1", "east-1", 1000)


def answer(code: grpc.StatusCode, *, epoch: int = 0,
           written: Sequence[tuple[str, int, int]] = ()) -> ProduceFailed:
    """A per-record answer with `code`."""
    r = ProduceResult("run-east-1", "sync", epoch, tuple(Written(*w) for w in written))
    return ProduceFailed(code, "why", result=r)


def told(exc: BaseException, mode: str = "sync") -> ToldFailed:
    return _told_failed(exc, SENT, mode, "ledger.x", "east")


@pytest.mark.parametrize(("exc", "mode", "unknown"), [
    (answer(U), "sync", False),                              # lease refused: no epoch yet
    (answer(U), "nearest", True),                            # nearest has no epoch at all
    (answer(U, epoch=3), "ordered", True),                   # after the grant: Kafka timeout
    (answer(U, epoch=3, written=[("east", 0, 5)]), "sync", True),   # PARTIAL
    (answer(grpc.StatusCode.DEADLINE_EXCEEDED), "sync", True),
    (answer(grpc.StatusCode.INVALID_ARGUMENT), "nearest", False),
    (answer(grpc.StatusCode.FAILED_PRECONDITION, epoch=3), "ordered", False),
    (ProduceFailed(U, "connection lost"), "sync", True),     # the whole call
    (ProduceFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "big"), "sync", True),
    (ProduceFailed(grpc.StatusCode.UNAUTHENTICATED, "no token"), "sync", False),
    (ProxyError("cancelled"), "sync", True),                 # the stop's bound
])
def test_only_a_refusal_before_any_write_is_definite(exc: BaseException, mode: str,
                                                     unknown: bool) -> None:
    assert told(exc, mode).unknown is unknown


def test_a_refusal_after_an_attempt_that_may_have_written_is_unknown() -> None:
    """The first attempt timed out in Kafka after the grant (it may land), the retry was
    refused by the lease: the last answer alone would say nothing was written."""
    last = answer(U)
    assert told(last).unknown is False
    retried = ProduceFailed(U, "why", result=last.result, earlier=[answer(U, epoch=3)])
    t = told(retried)
    assert t.unknown is True
    assert t.attempts == 2


def test_what_the_answer_said_is_kept() -> None:
    t = told(answer(U, epoch=4, written=[("east", 1, 9)]))
    assert (t.code, t.status, t.written, t.epoch) == ("UNAVAILABLE", "PARTIAL",
                                                       (("east", 1, 9),), 4)
    assert (t.dr_id, t.key, t.sent_ms, t.via, t.mode) == ("run-east-1", "east-1", 1000,
                                                          "east", "sync")
    assert t.t_ms >= t.sent_ms
    assert "why" in t.message
    assert told(answer(U)).status == "FAILED"
    assert told(ProduceFailed(U, "gone")).status == ""
    assert told(ProxyError("cancelled")).code == "CANCELLED"


def test_the_failed_log_round_trips_beside_the_ack_log(tmp_path: Path) -> None:
    acks = tmp_path / "acks-east.jsonl"
    log = failed_log_of(acks)
    assert log.name == "acks-east.failed.jsonl"
    assert read_failed_log(log) == []  # none written: none failed
    a, b = told(answer(U, epoch=4, written=[("east", 1, 9)])), told(answer(U))
    log.write_text(a.to_json() + "\n" + b.to_json() + "\n" + '{"dr_id": "cut')
    assert read_failed_log(log) == [a, b]
    log.write_text("bad\n" + a.to_json() + "\n")
    with pytest.raises(DrError, match="not a told-failed write"):
        read_failed_log(log)


def test_an_ack_keeps_its_key_and_sent_time_and_old_lines_still_read(tmp_path: Path) -> None:
    a = Ack("x-east-1", "ordered", "t", "east", (("east", 0, 1),), 50, epoch=2, key="east-1",
            sent_ms=40)
    log = tmp_path / "acks.jsonl"
    old = ('{"dr_id":"x-east-2","mode":"ordered","topic":"t","via":"east",'
           '"written":[["east",0,2]],"t_ms":60}')
    log.write_text(a.to_json() + "\n" + old + "\n")
    got = read_ack_log(log)
    assert got[0] == a
    assert (got[1].key, got[1].sent_ms) == (None, None)


class _Channel:
    """Answers ProduceBatch with one scripted status per call (every record alike)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.calls = 0

    def unary_unary(self, path: str, **_: Any) -> Any:
        async def call(request: Any, **__: Any) -> Any:
            self.calls += 1
            a = self.answers.pop(0)
            return pb.ProduceBatchResponse(results=[
                pb.RecordResult(dr_id=r.idempotency_key, **a) for r in request.records])
        return call

    stream_stream = stream_unary = unary_stream = unary_unary


async def test_the_client_keeps_the_answers_of_its_retried_attempts() -> None:
    after_grant = {"status": pb.STATUS_FAILED, "code": U.value[0], "message": "no ack",
                   "mode": "sync", "epoch": 3}
    lease = {"status": pb.STATUS_FAILED, "code": U.value[0], "message": "lease",
             "mode": "sync"}
    channel = _Channel([after_grant, lease, lease])
    async with AsyncProducer("fake", channel=channel, retries=2,
                             retry_backoff_s=0.001, linger_ms=0) as p:
        with pytest.raises(ProduceFailed) as got:
            await p.produce("ledger.x", b"v", key=b"k", idempotency_key="run-east-1")
    assert channel.calls == 3
    exc = got.value
    assert [e.result.epoch for e in exc.earlier] == [3, 0]
    assert "lease" in str(exc)
    assert told(exc).unknown is True       # the first attempt may have written
    assert told(exc).attempts == 3
