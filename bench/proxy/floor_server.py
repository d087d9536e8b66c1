"""The floor under the proxy's batch, stream and unary paths: the least a Python grpc.aio
proxy that writes every record through librdkafka and answers every record must do.

It serves the proxy's own `Produce`, `ProduceBatch` and `ProduceStream` (the same proto, so
the bench's clients drive it unchanged) and per call: the records decoded (by grpc, as the proxy's
are), each given the six dr-* headers the proxy writes (dr-id from its idempotency key),
produced with `crossdc.clients.rdkafka.RdProducer` (the proxy's librdkafka bridge, same
producer settings; librdkafka partitions the keys), the acks awaited, and one `RecordResult`
per record (its dr-id, region, partition, offset) sent back. What it leaves out is what the
proxy adds on top: the policy and routing, the lease, the idempotency window and its shared
log, the outcome journal, the in-flight budget, metrics, auth. bench/proxy/run.py
`--compare-clients` runs it beside the proxy and the direct producers: CPU per record of
this process is the floor under the proxy's; the proxy's minus it is the proxy's own work.

    .venv/bin/python bench/proxy/floor_server.py --bootstrap HOST:PORT --port N
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.rdkafka import RdProducer
from crossdc.errors import CrossdcError
from crossdc.gctune import tune_gc
from proxy.api import pb, pb_grpc
from proxy.config import KafkaWriterSettings
from proxy.headers import dr_headers

REGION = "east"
OK = pb.STATUS_OK


class Floor(pb_grpc.ProxyServicer):
    def __init__(self, producer: RdProducer) -> None:
        self.producer = producer

    async def _write(self, request: Any) -> Any:
        records = request.records
        topic = records[0].topic if records else ""
        if any(r.topic != topic for r in records):
            raise ValueError("the floor server takes one topic per call")
        common = dr_headers(origin=REGION, ts_ms=int(time.time() * 1000), mode="ordered",
                            epoch=1, path=[REGION])
        ids = [r.idempotency_key or uuid.uuid4().hex for r in records]
        items = [(r.key if r.HasField("key") else None,
                  r.value if r.HasField("value") else None,
                  [*((h.key, h.value) for h in r.headers), ("dr-id", i.encode()), *common],
                  None) for r, i in zip(records, ids, strict=True)]
        sent = await self.producer.send_many_async(topic, items)
        outcomes = await sent.future
        resp = pb.ProduceBatchResponse()
        add = resp.results.add
        for dr_id, o in zip(ids, outcomes, strict=True):
            if isinstance(o, tuple):
                r = add(dr_id=dr_id, mode="ordered", epoch=1, status=OK)
                r.written.add(region=REGION, partition=o[0], offset=o[1])
            else:
                add(dr_id=dr_id, status=pb.STATUS_FAILED, message=str(o))
        return resp

    async def ProduceBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._write(request)

    async def Produce(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # one record: the same work as a batch of one, answered as the proxy's Produce is
        r = request.record
        dr_id = r.idempotency_key or uuid.uuid4().hex
        headers = [*((h.key, h.value) for h in r.headers), ("dr-id", dr_id.encode()),
                   *dr_headers(origin=REGION, ts_ms=int(time.time() * 1000), mode="ordered",
                               epoch=1, path=[REGION])]
        sent = await self.producer.send_many_async(r.topic, [(
            r.key if r.HasField("key") else None, r.value if r.HasField("value") else None,
            headers, None)])
        [o] = await sent.future
        if not isinstance(o, tuple):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(o))
        resp = pb.ProduceResponse()
        res = resp.result
        res.dr_id, res.mode, res.epoch, res.status = dr_id, "ordered", 1, OK
        res.written.add(region=REGION, partition=o[0], offset=o[1])
        return resp

    async def ProduceStream(self, request_iterator: AsyncIterator[Any],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # as the proxy: batches written as they arrive, answered in request order
        queue: asyncio.Queue[asyncio.Task[Any] | None] = asyncio.Queue(maxsize=16)

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    await queue.put(asyncio.create_task(self._write(req)))
            finally:
                await queue.put(None)

        rt = asyncio.create_task(reader())
        try:
            while (task := await queue.get()) is not None:
                yield await task
            await rt
        finally:
            rt.cancel()


async def serve(bootstrap: str, port: int) -> None:
    s = KafkaWriterSettings()
    producer = RdProducer(KafkaConnection.of(bootstrap), client_id="floor",
                          linger_ms=s.linger_ms, batch_bytes=s.max_batch_bytes,
                          max_request_bytes=s.max_request_bytes,
                          request_timeout_ms=s.request_timeout_ms,
                          delivery_timeout_ms=s.request_timeout_ms)
    await producer.start()
    server = grpc.aio.server()
    pb_grpc.add_ProxyServicer_to_server(Floor(producer), server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    tune_gc()  # as `dr proxy serve` does
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print(f"floor serving on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop(1.0)
    await producer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    # librdkafka's connection warnings (one per retry) would bury the one error that matters
    logging.getLogger("crossdc.rdkafka").setLevel(logging.CRITICAL)
    try:
        asyncio.run(serve(a.bootstrap, a.port))
    except (CrossdcError, KafkaError, OSError, RuntimeError) as exc:  # no broker, port taken
        raise SystemExit(f"floor server: {exc}") from None


if __name__ == "__main__":
    main()
