"""`dr reconcile` from its image (crossdc/reconcile, `dr images build`): the Spark job in a
container on the host's network, against the session's two real regions, finds the one
record a region lacks and exits 3, its report written to a mounted folder.

Skipped, saying why, where no Docker engine answers or the image is not built (CI builds
every image before `make test-more`). Slow (Spark's start in a container): `make test-more`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from kafka_helpers import create_topic, produce, unique

from dr.stack.docker import docker_available
from dr.stack.images import RECONCILE_IMAGE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _skip_reason() -> str | None:
    if not docker_available():
        return ("no Docker engine answers (docker.from_env().ping()); "
                "`bash compose/docker/engine.sh` starts one")
    from dr.stack.docker import missing_images
    if missing_images([RECONCILE_IMAGE]):
        return f"image not built: {RECONCILE_IMAGE} (`dr images build --image reconcile`)"
    return None


def _headers(dr_id: str, ts: int) -> list[tuple[str, bytes]]:
    return [("dr-id", dr_id.encode()), ("dr-origin", b"east"), ("dr-ts", str(ts).encode()),
            ("dr-mode", b"sync"), ("dr-epoch", b"1"), ("dr-path", b"east")]


def _mounts(tmp_path: Path, topology: Path) -> tuple[Path, Path]:
    """The topology (readable) and the report folder (writable) for the image's user
    (crossdc, uid 10003)."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    tmp_path.chmod(0o755)
    mounted = tmp_path / "topology.yaml"
    mounted.write_text(topology.read_text())
    mounted.chmod(0o644)
    return mounted, out


async def test_reconcile_in_its_container_names_the_missing_record(  # type: ignore[no-untyped-def]
        two_regions, tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import docker

    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("rc-docker")
    for boot in (east, west):
        await create_topic(boot, topic, partitions=2,
                           configs={"message.timestamp.type": "LogAppendTime"})
    now = int(time.time() * 1000)
    ids = [uuid.uuid4().hex for _ in range(20)]
    recs = [(f"k{i}".encode(), f"v{i}".encode(), _headers(i_d, now))
            for i, i_d in enumerate(ids)]
    await produce(east, topic, recs, partition=0)
    await produce(west, topic, recs[:-1], partition=0)  # west lacks the last one

    mounted, out = _mounts(tmp_path, two_regions.topology_path)
    client = docker.from_env()
    container = client.containers.run(
        RECONCILE_IMAGE, detach=True, network_mode="host",
        volumes={str(mounted): {"bind": "/work/topology.yaml", "mode": "ro"},
                 str(out): {"bind": "/out", "mode": "rw"}},
        command=["reconcile", "--topology", "/work/topology.yaml", "--regions", "east,west",
                 "--topics", topic, "--grace", "0", "--until", str(int(time.time() * 1000)),
                 "--driver-memory", "512m", "--out", "/out"])
    try:
        status = await asyncio.to_thread(container.wait, timeout=420)
        logs = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    assert status["StatusCode"] == 3, logs[-3000:]  # ThresholdsPassed: a missing record
    report = json.loads((out / "report.json").read_text())
    missing = [(m["dr_id"], m["region"]) for m in report["missing"]]
    assert missing == [(ids[-1], "west")], report["missing"]
    assert report["totals"]["read"] == {"east": 20, "west": 19}, report["totals"]
    assert report["totals"]["compared"] == 20, report["totals"]
    assert (out / "report.html").is_file()
