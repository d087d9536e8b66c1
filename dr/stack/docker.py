"""The same regions in containers (testcontainers), for machines with a Docker engine.

Decided by asking the engine (`docker.from_env().ping()`), never by looking for the `docker`
client: a client without an engine is common (CI images, this project's dev machines).
testcontainers and docker-py are the `docker` extra: without them there is no engine to
ask (`docker_available()` is False), and `DockerStack.up` says which extra to install.
Containers use host networking, so the topology file and its ports are the same as the
local stack's. `compose/docker-compose.yml` is the equivalent for people.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from crossdc.extras import require
from crossdc.topology import Topology
from dr.errors import StackError, StartTimeout
from dr.stack.consul import ConsulAgent
from dr.stack.kafka import KafkaNode, _new_cluster_id
from dr.status import probe_consul, probe_kafka

__all__ = ["CONSUL_IMAGE", "KAFKA_IMAGE", "DockerStack", "docker_available"]

KAFKA_IMAGE = "apache/kafka:4.1.1"
CONSUL_IMAGE = "hashicorp/consul:1.22"


def docker_available() -> bool:
    """True when a Docker engine answers a ping (not merely when a client is installed)."""
    import gc
    import warnings

    # docker-py leaves the refused socket to the garbage collector; collect it here, where
    # its ResourceWarning is expected, rather than in some unrelated test later.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker

            client = docker.from_env(timeout=3)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:  # docker-py raises several unrelated types when no engine answers
            return False
        finally:
            gc.collect()


def kafka_env(node: KafkaNode, cluster_id: str) -> dict[str, str]:
    """server.properties as the apache/kafka image's KAFKA_* variables."""
    heap = node.region.local.kafka.heap_mb if node.region.local else 512
    env = {"CLUSTER_ID": cluster_id, "KAFKA_HEAP_OPTS": f"-Xms256m -Xmx{heap}m"}
    for key, value in node.properties().items():
        if key == "log.dirs":
            continue
        name = key.replace("-", "___").replace("_", "__").replace(".", "_").upper()
        env[f"KAFKA_{name}"] = value
    return env


class DockerStack:
    """Every region of `topology` in containers: one Kafka container per node, one Consul;
    one Consul container per witness."""

    def __init__(self, topology: Topology, brokers: int = 1) -> None:
        self.topology = topology
        self.brokers = brokers
        self._containers: list[Any] = []

    async def up(self, timeout_s: float = 180.0) -> None:
        require("docker", "the stack in containers")
        from testcontainers.core.container import DockerContainer

        for idx, region in enumerate(self.topology.regions):
            cid = _new_cluster_id()
            for i in range(1, self.brokers + 1):
                node = KafkaNode(region, idx, i, self.brokers, Path("/tmp"), Path("/"), Path("/"))
                c = DockerContainer(KAFKA_IMAGE).with_kwargs(network_mode="host")
                for k, v in kafka_env(node, cid).items():
                    c = c.with_env(k, v)
                self._containers.append(await asyncio.to_thread(c.start))
            await self._consul(ConsulAgent(self.topology, region, idx, Path("/consul"),
                                           Path("consul")))
        for idx, witness in enumerate(self.topology.witnesses):  # Consul only
            await self._consul(ConsulAgent(self.topology, witness, idx, Path("/consul"),
                                           Path("consul")))
        await asyncio.gather(*(self._wait(r.name, timeout_s) for r in self.topology.regions),
                             *(self._wait_witness(w.name, timeout_s)
                               for w in self.topology.witnesses))

    async def _consul(self, agent: ConsulAgent) -> None:
        from testcontainers.core.container import DockerContainer

        cfg = agent.config()
        cfg["data_dir"] = "/consul/data"
        c = (DockerContainer(CONSUL_IMAGE).with_kwargs(network_mode="host")
             .with_env("CONSUL_LOCAL_CONFIG", json.dumps(cfg))
             .with_command("agent"))
        self._containers.append(await asyncio.to_thread(c.start))

    async def _wait_witness(self, name: str, timeout_s: float) -> None:
        witness = next(w for w in self.topology.witnesses if w.name == name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if (await probe_consul(witness, len(self.topology.datacenters), 2.0)).healthy:
                return
            await asyncio.sleep(0.5)
        raise StartTimeout(f"witness {name}: its Consul container did not answer within "
                           f"{timeout_s:.0f}s")

    async def _wait(self, name: str, timeout_s: float) -> None:
        region = self.topology.region(name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            k = await probe_kafka(region, self.brokers, 3.0)
            c = await probe_consul(region, len(self.topology.datacenters), 2.0)
            if k.healthy and c.healthy:
                return
            await asyncio.sleep(0.5)
        raise StartTimeout(f"{name}: containers did not answer within {timeout_s:.0f}s")

    async def down(self) -> None:
        errors = []
        for c in reversed(self._containers):
            try:
                await asyncio.to_thread(c.stop)
            except Exception as exc:  # keep stopping the others; report at the end
                errors.append(str(exc))
        self._containers.clear()
        if errors:
            raise StackError("stopping containers failed: " + "; ".join(errors))
