"""The same regions in containers (testcontainers), from the images built here.

Decided by asking the engine (`docker.from_env().ping()`), never by looking for the `docker`
client: a client without an engine is common (CI images, this project's dev machines).
testcontainers and docker-py are the `docker` extra: without them there is no engine to
ask (`docker_available()` is False), and `DockerStack.up` says which extra to install.

The containers are those of `dr.stack.containers.deployment_specs` (the compose deployment's):
crossdc/kafka, crossdc/consul and crossdc/crossdc, built by `dr images build` (no registry is
asked; a missing image is named with the command that builds it). They use host networking,
so the topology file and its ports are the same as the local stack's. testcontainers' reaper
container (Ryuk, an image from Docker Hub) is not used: `down()` removes every container the
stack started, and each carries the label `io.crossdc.stack=<tag>` for a manual clean-up
(`docker rm -f $(docker ps -aq --filter label=io.crossdc.stack)`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any

from crossdc.extras import require
from crossdc.topology import Topology
from dr.errors import ProcessDied, StackError, StartTimeout
from dr.stack.containers import ContainerSpec, deployment_specs, kafka_env
from dr.stack.images import CONSUL_IMAGE, CROSSDC_IMAGE, KAFKA_IMAGE
from dr.stack.kafka import _new_cluster_id
from dr.status import probe_consul, probe_kafka

__all__ = ["CONSUL_IMAGE", "CROSSDC_IMAGE", "KAFKA_IMAGE", "STACK_LABEL", "DockerStack",
           "docker_available", "kafka_env"]

STACK_LABEL = "io.crossdc.stack"


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


def missing_images(images: list[str]) -> list[str]:
    """Those of `images` the engine does not hold."""
    import docker
    from docker.errors import ImageNotFound

    client = docker.from_env(timeout=10)
    try:
        gone = []
        for image in images:
            try:
                client.images.get(image)
            except ImageNotFound:
                gone.append(image)
        return gone
    finally:
        client.close()


class DockerStack:
    """Every region of `topology` in containers: one Kafka container per node, one Consul
    per datacenter (regions and witnesses); with `services_up()`, a proxy and a controller
    per region and a mirror per flow, each a crossdc/crossdc container."""

    def __init__(self, topology: Topology, topology_path: Path | None = None,
                 brokers: int = 1) -> None:
        self.topology = topology
        self.topology_path = None if topology_path is None else topology_path.resolve()
        """Mounted into the crossdc containers (needed by `services_up`)."""
        self.brokers = brokers
        self.tag = secrets.token_hex(3)
        self.cluster_ids = {r.name: _new_cluster_id() for r in topology.regions}
        self._containers: dict[str, Any] = {}
        self._specs: dict[str, ContainerSpec] = {}

    # -- start ---------------------------------------------------------------------------
    def _prepare(self, images: list[str]) -> None:
        require("docker", "the stack in containers")
        if not docker_available():
            host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
            raise StackError(f"no Docker engine answers at {host} (compose/docker/engine.sh "
                             "starts one)")
        gone = missing_images(images)
        if gone:
            raise StackError(f"image(s) {', '.join(gone)} not built on this engine: run "
                             "`dr images build` (no registry is asked for them)")
        from testcontainers.core.config import testcontainers_config
        testcontainers_config.ryuk_disabled = True  # its image is on Docker Hub

    def container_name(self, name: str) -> str:
        return f"crossdc-{self.tag}-{name}"

    async def _start(self, spec: ContainerSpec) -> None:
        from testcontainers.core.container import DockerContainer

        c = (DockerContainer(spec.image).with_name(self.container_name(spec.name))
             .with_kwargs(network_mode="host", labels={STACK_LABEL: self.tag}))
        if spec.command:
            c = c.with_command(list(spec.command))
        for k, v in spec.env.items():
            c = c.with_env(k, v)
        for src, dst in spec.volumes.items():
            c = c.with_volume_mapping(src, dst, "ro")
        self._specs[spec.name] = spec
        self._containers[spec.name] = await asyncio.to_thread(c.start)

    async def up(self, timeout_s: float = 180.0) -> None:
        """Start every region's Kafka and Consul and every witness's Consul; wait until all
        answer (brokers and quorum, Consul leader and WAN pool)."""
        self._prepare([KAFKA_IMAGE, CONSUL_IMAGE])
        specs = deployment_specs(self.topology, "", brokers=self.brokers, services=False,
                                 cluster_ids=self.cluster_ids)
        try:
            for spec in specs:
                await self._start(spec)
            await asyncio.gather(*(self._wait(r.name, timeout_s) for r in self.topology.regions),
                                 *(self._wait_witness(w.name, timeout_s)
                                   for w in self.topology.witnesses))
        except BaseException:
            await self.down()
            raise

    async def services_up(self, *, auto_failover: bool = False,
                          service_ports: dict[str, int] | None = None,
                          timeout_s: float = 120.0) -> list[ContainerSpec]:
        """Start the daemons (proxies, mirrors, controllers) in crossdc/crossdc containers
        and wait until each one's health check passes; the specs started."""
        if self.topology_path is None:
            raise StackError("DockerStack.services_up needs the topology file (topology_path) "
                             "to mount into the crossdc containers")
        self._prepare([CROSSDC_IMAGE])
        specs = [s for s in deployment_specs(self.topology, str(self.topology_path),
                                             brokers=self.brokers, auto_failover=auto_failover,
                                             service_ports=service_ports)
                 if s.image == CROSSDC_IMAGE]
        for spec in specs:
            if spec.name not in self._containers:
                await self._start(spec)
        await asyncio.gather(*(self.wait_healthy(s.name, timeout_s) for s in specs))
        return specs

    # -- waiting ---------------------------------------------------------------------------
    def _state(self, name: str) -> dict[str, Any]:
        wrapped = self._containers[name].get_wrapped_container()
        wrapped.reload()
        state: dict[str, Any] = wrapped.attrs["State"]
        return state

    def logs(self, name: str, lines: int = 30) -> str:
        """The last `lines` lines a container wrote."""
        raw = self._containers[name].get_wrapped_container().logs(tail=lines)
        return bytes(raw).decode("utf-8", errors="replace")

    async def wait_healthy(self, name: str, timeout_s: float = 120.0) -> None:
        """Until the container's image health check says healthy; ProcessDied with its log
        tail as soon as it exits, StartTimeout at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await asyncio.to_thread(self._state, name)
            if not state.get("Running"):
                cname = self.container_name(name)
                raise ProcessDied(f"container {cname}", state.get("ExitCode"),
                                  f"`docker logs {cname}`", self.logs(name))
            health = (state.get("Health") or {}).get("Status")
            if health == "healthy":
                return
            if time.monotonic() > deadline:
                raise StartTimeout(f"container {self.container_name(name)} not healthy within "
                                   f"{timeout_s:.0f}s (health: {health}); its last lines:\n"
                                   f"{self.logs(name)}")
            await asyncio.sleep(0.5)  # Docker runs the check on its own interval

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

    # -- parts on and off (failure tests) -----------------------------------------------------
    def kafka_names(self, region: str) -> list[str]:
        return [n for n, s in self._specs.items() if s.kind == "kafka" and s.region == region]

    async def stop_kafka(self, region: str, *, kill: bool = False) -> None:
        """Stop (or SIGKILL) every broker container of a region; their data stays."""
        for name in self.kafka_names(region):
            wrapped = self._containers[name].get_wrapped_container()
            await asyncio.to_thread(wrapped.kill if kill else wrapped.stop)

    async def start_kafka(self, region: str, timeout_s: float = 120.0) -> None:
        """Start the region's stopped broker containers and wait until the cluster answers."""
        for name in self.kafka_names(region):
            await asyncio.to_thread(self._containers[name].get_wrapped_container().start)
        await self._wait(region, timeout_s)

    # -- stop ------------------------------------------------------------------------------
    async def down(self) -> None:
        """Remove every container this stack started (the daemons first)."""
        errors = []
        for name in reversed(list(self._containers)):
            try:
                await asyncio.to_thread(self._containers[name].stop)
            except Exception as exc:  # keep removing the others; report at the end
                errors.append(f"{self.container_name(name)}: {exc}")
        self._containers.clear()
        if errors:
            raise StackError("removing containers failed: " + "; ".join(errors))
