"""An installed Kafka distribution is what the stack runs when its version fits (issue 37):
a distribution folder made from the real jars (`libs/` and `bin/`'s script names, as the
Apache tarball lays them out), `$KAFKA_HOME` pointing at it, an empty cache: `dr setup`
fetches nothing and says which Kafka it uses, and a real broker of the stack's `KafkaNode`
starts from the distribution's `libs/*` and takes records (one broker, 384 MB heap)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_helpers import consume, create_topic, produce, unique
from tests_support import write_topology

from crossdc.topology import Topology
from dr.stack.kafka import cluster_id_for
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.toolchain import (
    CONSUL_VERSION,
    describe_kafka,
    ensure_kafka_libs,
    kafka_libs_dir,
    kafka_version,
    spark_kafka_jars_dir,
)

pytestmark = [pytest.mark.timeout(300)]

BIN_SCRIPTS = ["kafka-server-start.sh", "kafka-server-stop.sh", "kafka-storage.sh",
               "kafka-topics.sh", "kafka-run-class.sh"]


@pytest.fixture(scope="module")
def distribution(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`kafka_2.13-<pin>/` from the jars Maven fetched: libs/ (hard links, else copies) and
    bin/ whose start script runs the broker from ../libs the way Kafka's does."""
    cached = ensure_kafka_libs(StackPaths.default())
    pin = kafka_version(StackPaths.default())
    root = tmp_path_factory.mktemp("dist") / f"kafka_2.13-{pin}"
    (root / "libs").mkdir(parents=True)
    for jar in cached.glob("*.jar"):
        try:
            os.link(jar, root / "libs" / jar.name)
        except OSError:
            shutil.copy2(jar, root / "libs" / jar.name)
    (root / "bin").mkdir()
    for name in BIN_SCRIPTS:
        script = root / "bin" / name
        script.write_text('#!/bin/sh\nexec java -cp "$(dirname "$0")/../libs/*" '
                          'kafka.Kafka "$@"\n')
        script.chmod(0o755)
    return root


@pytest.fixture
def kafka_home(distribution: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KAFKA_HOME", str(distribution))
    return distribution


def _cache_without_kafka(root: Path) -> Path:
    """A cache holding what `dr setup` builds besides Kafka (Consul, the Spark connector:
    links to the real cache's), so only Kafka's choice is in question."""
    real = StackPaths.default().cache
    cache = root / "cache"
    cache.mkdir()
    consul = real / f"consul-{CONSUL_VERSION}"
    spark = spark_kafka_jars_dir(StackPaths.default()).parent
    if not (consul / "consul").exists() or not (spark / ".complete").exists():
        pytest.skip("Consul or the Spark connector is not in the cache yet (`dr setup`)")
    for part in (consul, spark):
        (cache / part.name).symlink_to(part)
    return cache


def test_dr_setup_uses_the_installed_kafka_and_fetches_nothing(
        kafka_home: Path, tmp_path: Path) -> None:
    cache = _cache_without_kafka(tmp_path)
    env = {**os.environ, "CROSSDC_CACHE_DIR": str(cache), "KAFKA_HOME": str(kafka_home)}
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "setup"], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    pin = kafka_version(StackPaths.default())
    assert f"Kafka {pin}: installed at {kafka_home} ($KAFKA_HOME)" in proc.stdout
    assert "Maven" not in proc.stderr
    assert not kafka_libs_dir(StackPaths(state=tmp_path, cache=cache)).parent.exists()


async def test_a_broker_runs_from_the_installed_distribution(kafka_home: Path,
                                                             tmp_path: Path) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    said: list[str] = []
    libs = ensure_kafka_libs(paths, said.append)
    assert libs == kafka_home / "libs"
    assert said == []  # nothing fetched
    assert describe_kafka(paths, libs).endswith(f"installed at {kafka_home} ($KAFKA_HOME)")

    data = free_topology(["solo"], witnesses=()).model_dump(mode="json")
    data["regions"][0]["local"]["kafka"]["heap_mb"] = 384
    topo = Topology.model_validate(data)
    stack = LocalStack(topo, write_topology(topo, tmp_path / "topology.yaml"), paths=paths)
    region = topo.region("solo")
    [node] = stack.nodes(region)
    assert node.libs == kafka_home / "libs"  # the stack's classpath choice
    node.check_ports()
    node.write_config()
    try:
        await node.format(cluster_id_for(paths.region_dir("solo"), 1))
        pid = stack.kafka_process(node).start()
        await stack.wait_kafka_ready(region, 120.0)
        argv = (await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)).split(b"\0")
        assert argv[argv.index(b"-cp") + 1] == f"{kafka_home}/libs/*".encode()
        bootstrap = region.kafka.bootstrap
        topic = unique("installed")
        await create_topic(bootstrap, topic)
        await produce(bootstrap, topic, [(b"k", f"v{i}".encode(), []) for i in range(5)])
        got = await consume(bootstrap, topic, 5)
        assert [r.value for r in got] == [f"v{i}".encode() for i in range(5)]
    finally:
        await LocalStack.down(paths)
    assert not stack.kafka_process(node).running()
