"""The errors the proxy and the mirror both raise are one kernel error each, built the same
way, so a caller catching `crossdc.errors.PartitionMismatch` or `RecordTooLarge` gets both."""

from __future__ import annotations

import inspect

import pytest

from crossdc import errors
from mirror import errors as mirror_errors
from proxy import errors as proxy_errors


@pytest.mark.parametrize("name", ["PartitionMismatch", "RecordTooLarge"])
def test_both_components_subclass_the_kernel_error_with_one_signature(name: str) -> None:
    base = getattr(errors, name)
    proxy_cls, mirror_cls = getattr(proxy_errors, name), getattr(mirror_errors, name)
    assert issubclass(proxy_cls, base)
    assert issubclass(mirror_cls, base)
    proxy_params = list(inspect.signature(proxy_cls).parameters)
    mirror_params = list(inspect.signature(mirror_cls).parameters)
    shared = [p for p in proxy_params if p in mirror_params]
    assert shared[:2] == proxy_params[:2] == mirror_params[:2]  # positional: same two


def test_partition_mismatch_carries_the_counts_the_same_way() -> None:
    p = proxy_errors.PartitionMismatch("t", {"east": 2, "west": 3})
    m = mirror_errors.PartitionMismatch("t", {"east": 2, "west": 3})
    assert (p.topic, p.counts) == (m.topic, m.counts) == ("t", {"east": 2, "west": 3})
    assert "has 2 partitions in east but 3 in west" in str(m)
    assert m.source_n == 2


def test_record_too_large_carries_what_each_side_knows() -> None:
    p = proxy_errors.RecordTooLarge("t", 10, limit=5)
    m = mirror_errors.RecordTooLarge("t", 10, partition=1, offset=7)
    assert (p.topic, p.size, p.limit, p.partition) == ("t", 10, 5, None)
    assert (m.topic, m.size, m.limit, m.partition, m.offset) == ("t", 10, None, 1, 7)
    with pytest.raises(errors.RecordTooLarge):
        raise m
