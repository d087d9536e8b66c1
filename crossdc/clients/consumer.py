"""aiokafka's consumer, with a stop() that always closes its client.

aiokafka 0.14's `AIOKafkaConsumer.stop()` closes the coordinator, then the fetcher, then the
client. The fetcher's `close()` cancels its pending fetch requests and awaits each one without
catching the `CancelledError` it caused (`for x in self._pending_tasks: x.cancel(); await x`),
so when a fetch was in flight (a broker that died under it) stop() raises that error before
the client is closed: the client's metadata task (`AIOKafkaClient._md_synchronizer`) and its
connections then live on for good. Seen as the one leak the guard found in
tests/integration/test_controller_auto.py (a `crossdc-flow-newest` consumer of the
controller's lag round, the primary's broker killed)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer

from crossdc.aio import cancelled_from_outside
from crossdc.clients.rawfetch import RawFetcher

__all__ = ["Consumer"]


class Consumer(AIOKafkaConsumer):  # type: ignore[misc]
    """`AIOKafkaConsumer` whose `stop()` closes the client whatever the fetcher raised."""

    async def stop(self) -> None:
        try:
            await super().stop()
        except asyncio.CancelledError:
            if cancelled_from_outside():
                await asyncio.shield(self._client.close())
                raise
            # the fetcher's own cancelled request, re-raised by aiokafka: not a stop of ours
        except BaseException:
            await asyncio.shield(self._client.close())
            raise
        await self._client.close()  # idempotent: what stop() left open when it ended early

    def raw_fetcher(self, **kw: Any) -> RawFetcher:
        """A `RawFetcher` over this consumer's client (its connections, metadata and
        security): batches fetched undecoded while the group, positions and commits stay
        with the consumer (docs/consume.md, pass-through). Not closed with the fetcher."""
        return RawFetcher(self._client, **kw)
