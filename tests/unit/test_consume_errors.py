"""The consumer's typed errors (crossdc_client.errors): one class per failure a user handles
differently, every one a `ConsumeFailed` (so `except ConsumeFailed` still catches them)."""

from __future__ import annotations

import grpc
import pytest

from crossdc_client.errors import (
    ConsumeFailed,
    InvalidRequest,
    NotAssigned,
    NotAuthorized,
    ProxyError,
    ProxyUnavailable,
    TopicNotFound,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("code", "cls"), [
    (grpc.StatusCode.NOT_FOUND, TopicNotFound),
    (grpc.StatusCode.PERMISSION_DENIED, NotAuthorized),
    (grpc.StatusCode.UNAUTHENTICATED, NotAuthorized),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    (grpc.StatusCode.UNAVAILABLE, ProxyUnavailable),
    (grpc.StatusCode.INTERNAL, ConsumeFailed),
])
def test_each_code_has_its_class_and_all_are_consume_failed(code: grpc.StatusCode,
                                                            cls: type) -> None:
    exc = ConsumeFailed.for_code(code, "why")
    assert type(exc) is cls
    assert isinstance(exc, ConsumeFailed)
    assert exc.code == code
    assert exc.details == "why"
    assert str(exc) == f"{code.name}: why"
    assert exc.retriable == (code == grpc.StatusCode.UNAVAILABLE)


def test_not_assigned_names_the_partitions_and_is_not_a_stream_failure() -> None:
    exc = NotAssigned([("orders", 3), ("orders", 4)], "not assigned to this consumer")
    assert exc.partitions == (("orders", 3), ("orders", 4))
    assert str(exc) == "orders/3, orders/4: not assigned to this consumer"
    assert isinstance(exc, ProxyError)
    assert not isinstance(exc, ConsumeFailed)
