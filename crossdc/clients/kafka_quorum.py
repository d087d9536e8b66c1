"""DescribeQuorum (Kafka API 55) for aiokafka, which does not ship it.

In KRaft the DescribeCluster answer names a random broker as "controller"; the real quorum
leader is only known through DescribeQuorum on the `__cluster_metadata` partition. Brokers
forward the request to the controllers, so any broker can be asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)

__all__ = ["QuorumInfo", "describe_quorum"]

_METADATA_TOPIC = "__cluster_metadata"


class _DescribeQuorumResponse_v0(Response):
    API_KEY = 55
    API_VERSION = 0
    SCHEMA = Schema(
        ("error_code", Int16),
        ("topics", CompactArray(
            ("topic_name", CompactString("utf-8")),
            ("partitions", CompactArray(
                ("partition_index", Int32),
                ("error_code", Int16),
                ("leader_id", Int32),
                ("leader_epoch", Int32),
                ("high_watermark", Int64),
                ("current_voters", CompactArray(
                    ("replica_id", Int32), ("log_end_offset", Int64), ("tags", TaggedFields))),
                ("observers", CompactArray(
                    ("replica_id", Int32), ("log_end_offset", Int64), ("tags", TaggedFields))),
                ("tags", TaggedFields),
            )),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


class _DescribeQuorumRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 55
    API_VERSION = 0
    RESPONSE_TYPE = _DescribeQuorumResponse_v0
    SCHEMA = Schema(
        ("topics", CompactArray(
            ("topic_name", CompactString("utf-8")),
            ("partitions", CompactArray(("partition_index", Int32), ("tags", TaggedFields))),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


_Struct: TypeAlias = _DescribeQuorumRequest_v0


class _DescribeQuorumRequest(Request[_Struct]):
    API_KEY = 55

    def build(self, request_struct_class: type[_Struct]) -> _Struct:
        return request_struct_class([(_METADATA_TOPIC, [(0, {})], {})], {})


@dataclass(frozen=True)
class QuorumInfo:
    """The KRaft metadata quorum as the controllers see it."""

    leader_id: int
    leader_epoch: int
    high_watermark: int
    voters: tuple[int, ...]
    observers: tuple[int, ...]


async def describe_quorum(admin: AIOKafkaAdminClient) -> QuorumInfo:
    """Ask any broker for the KRaft quorum state; raises aiokafka errors on failure."""
    from aiokafka.errors import for_code

    response: Any = await admin._send_request(_DescribeQuorumRequest())
    if response.error_code:
        raise for_code(response.error_code)(f"DescribeQuorum failed ({response.error_code})")
    for topic_name, partitions, _ in response.topics:
        if topic_name != _METADATA_TOPIC:
            continue
        for part in partitions:
            index, error_code, leader_id, leader_epoch, hwm, voters, observers, _tags = part
            if index != 0:
                continue
            if error_code:
                raise for_code(error_code)(f"DescribeQuorum partition error ({error_code})")
            return QuorumInfo(
                leader_id=leader_id,
                leader_epoch=leader_epoch,
                high_watermark=hwm,
                voters=tuple(v[0] for v in voters),
                observers=tuple(o[0] for o in observers),
            )
    raise LookupError("DescribeQuorum answer did not include __cluster_metadata-0")
