"""The client SDK's `AsyncConsumer` (docs/consume.md): defined in the crossdc-client
distribution (`crossdc_client.consumer`) and re-exported here with the full install's
directory of a region's proxies, `RegionProxies` (Consul: `proxy.connect`)."""

from __future__ import annotations

from crossdc_client.consumer import (
    AsyncConsumer,
    ConsumedBatch,
    ConsumedRecord,
    offset_ranges,
    reconnects,
)
from crossdc_client.consumer import _partition_ranges as _partition_ranges  # the unit tests'
from proxy.connect import RegionProxies

__all__ = ["AsyncConsumer", "ConsumedBatch", "ConsumedRecord", "RegionProxies",
           "offset_ranges", "reconnects"]
