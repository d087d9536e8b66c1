"""The client wrappers: the one place each talks to Consul or Kafka, retried with tenacity
(`RetrySettings`), foreign errors turned into `crossdc.errors.ClientError` at the boundary."""

from crossdc.clients import aiokafka_fixes
from crossdc.clients.consul import ConsulClient, KvEntry, WanMember
from crossdc.clients.primary import read_primary, write_primary

aiokafka_fixes.install()

__all__ = ["ConsulClient", "KvEntry", "WanMember", "read_primary", "write_primary"]
