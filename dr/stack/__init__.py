"""The local stack: real Kafka (KRaft) and Consul per region, started as processes."""

from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths

__all__ = ["LocalStack", "StackPaths"]
