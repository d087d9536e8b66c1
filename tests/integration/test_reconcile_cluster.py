"""The reconciliation job, unchanged, on a real Spark standalone cluster (a master and two
workers of 512 MB started from pyspark's own launcher): the same report as local mode on the
same data. Slow (two Spark runs and a cluster): `make test-more`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, produce, unique

from dr.reconcile.cluster import StandaloneCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # Spark local + a standalone cluster

APPEND = {"message.timestamp.type": "LogAppendTime"}


def _headers(dr_id: str, origin: str, mode: str, ts: int) -> list[tuple[str, bytes]]:
    return [("dr-id", dr_id.encode()), ("dr-origin", origin.encode()),
            ("dr-ts", str(ts).encode()), ("dr-mode", mode.encode()), ("dr-epoch", b"1"),
            ("dr-path", origin.encode())]


@pytest.fixture(scope="module")
async def topic(two_regions) -> str:  # type: ignore[no-untyped-def]
    """Two partitions; east is the origin; west lacks one record, holds one twice, one
    altered and two of one key swapped; one headerless record in both; sync records of
    west in both."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    name: str = unique("rcc")
    for boot in (east, west):
        await create_topic(boot, name, partitions=2, configs=APPEND)
    now = int(time.time() * 1000)
    for p in (0, 1):
        recs = [(f"k{i % 4}".encode(), f"v{p}-{i}".encode(),
                 _headers(str(uuid.uuid4()), "east", "ordered", now)) for i in range(40)]
        await produce(east, name, recs, partition=p)
        copy = list(recs)
        if p == 0:
            del copy[5]                                  # missing in west
            copy.insert(10, copy[10])                    # twice in west
            copy[20] = (copy[20][0], b"tampered", copy[20][2])  # altered
            copy[28], copy[32] = copy[32], copy[28]      # same key (k0), swapped
        await produce(west, name, copy, partition=p)
        back = [(b"w", f"w{p}-{i}".encode(), _headers(str(uuid.uuid4()), "west", "sync", now))
                for i in range(5)]
        await produce(west, name, back, partition=p)
        await produce(east, name, back, partition=p)
    plain = [(b"h", b"plain", [("app", b"y")])]
    await produce(east, name, plain, partition=1)
    await produce(west, name, plain, partition=1)
    return name


def _reconcile(two_regions, topic: str, master: str, until: int, out: Path,  # type: ignore[no-untyped-def]
               *extra: str) -> dict[str, Any]:
    """`python -m dr.reconcile` (the spark-submit entry point) in its own process."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", "dr.reconcile", "--topology", str(two_regions.topology_path),
         "--regions", "east,west", "--topics", topic, "--until", str(until),
         "--master", master, "--driver-memory", "512m", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]  # faults found
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_standalone_cluster_gives_the_local_report(two_regions, topic: str,  # type: ignore[no-untyped-def]
                                                   tmp_path: Path) -> None:
    until = int(time.time() * 1000) + 1
    local = _reconcile(two_regions, topic, "local[2]", until, tmp_path / "local")
    with StandaloneCluster(workers=2, memory="512m") as cluster:
        assert cluster.alive_workers() == 2
        remote = _reconcile(two_regions, topic, cluster.master_url, until,
                            tmp_path / "cluster", "--executor-memory", "512m")
        ran_on = cluster.work_dir / "work"
        # the executors ran on the workers (one application folder per run)
        assert any(ran_on.glob("app-*/*/stderr")), list(ran_on.rglob("*"))[:20]
    for r in (local, remote):
        r.pop("generated_at_ms")
        r.pop("duration_s")
    assert local["totals"]["missing"] == 1
    assert local["totals"]["duplicates"] == 1
    assert local["totals"]["altered"] == 1
    assert local["totals"]["order_violations"] == 1
    assert local["totals"]["read"] == {"east": 91, "west": 91}
    assert remote == local
