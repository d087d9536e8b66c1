"""One region's Kafka cluster on loopback: KRaft combined nodes from the cached jars."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from crossdc.security import ADMIN, PRINCIPALS
from crossdc.topology import Region
from dr.errors import SetupFailed, StackError
from dr.stack.process import ManagedProcess, check_port_free, log_tail
from dr.stack.tls import BROKER_CN, StackSecrets

if TYPE_CHECKING:
    from dr.stack.toxiproxy import WanLink

__all__ = ["KafkaNode", "kafka_nodes"]


def _new_cluster_id() -> str:
    # Kafka's Uuid text form: URL-safe base64 of 16 random bytes, no padding. Like Kafka's
    # Uuid.randomUuid(), never one starting with "-": the storage tool would take it for an
    # option ("argument --cluster-id/-t: expected one argument"; seen once in 64 starts).
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


@dataclass
class KafkaNode:
    """Broker+controller `node_id` of `region`'s cluster of `count` nodes."""

    region: Region
    region_index: int
    node_id: int
    count: int
    workdir: Path
    libs: Path
    log4j_config: Path
    wan: WanLink | None = None
    """A `WAN` listener more, advertised at a Toxiproxy port (dr/stack/toxiproxy.py)."""

    @property
    def secrets(self) -> StackSecrets | None:
        """The region's secrets when its topology asks for SASL/SCRAM over TLS."""
        sec = self.region.security
        return None if sec is None else StackSecrets.of(sec)

    @property
    def keystore_name(self) -> str:
        return f"{self.region.name}-kafka-{self.node_id}"

    @property
    def port(self) -> int:
        return self.region.kafka_port + self.node_id - 1

    @property
    def controller_port(self) -> int:
        assert self.region.local is not None
        return self.region.local.kafka.controller_port + self.node_id - 1

    @property
    def name(self) -> str:
        return f"{self.region.name} kafka broker {self.node_id}"

    @property
    def properties_path(self) -> Path:
        return self.workdir / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def voters(self) -> str:
        assert self.region.local is not None
        base = self.region.local.kafka.controller_port
        return ",".join(f"{i}@127.0.0.1:{base + i - 1}" for i in range(1, self.count + 1))

    def properties(self) -> dict[str, str]:
        assert self.region.local is not None
        rf = str(min(3, self.count))
        isr = str(min(2, self.count))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters(),
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "default.replication.factor": rf,
            # Small clusters: internal topics no wider than the cluster, or groups and
            # transactions hang waiting for replicas that do not exist.
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            "group.initial.rebalance.delay.ms": "0",
            # The internal topics' default 50 partitions are made when the first group or
            # transaction asks: seconds of a small broker's time, during which its metadata
            # (topics created meanwhile included) is not published. A cluster of three
            # brokers at most spreads its coordinators over 6 as well.
            "offsets.topic.num.partitions": "6",
            "transaction.state.log.num.partitions": "6",
            "share.coordinator.state.topic.num.partitions": "6",
            # Topics are created on purpose (same partition count in every region), never by
            # a stray produce or fetch.
            "auto.create.topics.enable": "false",
        }
        if self.secrets is not None:
            props.update(self.secure_properties(self.secrets))
        if self.wan is not None:
            props.update(self.wan_properties(props))
        props.update(self.region.local.kafka.extra_properties)
        return props

    def wan_properties(self, props: dict[str, str]) -> dict[str, str]:
        """The `WAN` listener (PLAINTEXT) on its own port, advertised at its Toxiproxy port:
        a client that bootstraps there keeps going through Toxiproxy."""
        assert self.wan is not None
        if self.secrets is not None:
            raise StackError(f"{self.name}: simulated WAN latency needs a PLAINTEXT stack")
        return {
            "listeners": f"{props['listeners']},WAN://127.0.0.1:{self.wan.listener_port}",
            "advertised.listeners": f"{props['advertised.listeners']},"
                                    f"WAN://127.0.0.1:{self.wan.proxy_port}",
            "listener.security.protocol.map":
                f"{props['listener.security.protocol.map']},WAN:PLAINTEXT",
        }

    def secure_properties(self, sec: StackSecrets) -> dict[str, str]:
        """Clients (and brokers between them) on SASL_SSL with SCRAM-SHA-512; the KRaft
        controller listener on mutual TLS (SCRAM users live in the metadata log the
        controllers serve, so SCRAM cannot guard it); ACLs enforced, nothing allowed
        without one. The admin password is in this file: it is written mode 0600."""
        assert self.region.security is not None
        mech = self.region.security.sasl_mechanism or "SCRAM-SHA-512"
        jaas = ("org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{ADMIN}" password="{sec.password(ADMIN)}";')
        return {
            "listeners": f"SASL_SSL://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{self.port}",
            "inter.broker.listener.name": "SASL_SSL",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "sasl.enabled.mechanisms": mech,
            "sasl.mechanism.inter.broker.protocol": mech,
            f"listener.name.sasl_ssl.{mech.lower()}.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(sec.keystore(self.keystore_name)),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(sec.ca_file),
            "listener.name.controller.ssl.client.auth": "required",
            "ssl.principal.mapping.rules": "RULE:^CN=([a-zA-Z0-9.-]+)$/$1/,DEFAULT",
            "authorizer.class.name":
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN};User:{BROKER_CN}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def ports(self) -> list[tuple[int, str, str]]:
        """(port, what, topology field) for the port check before start."""
        i = self.region_index
        return [
            (self.port, f"{self.name} client listener",
             f"regions[{i}].kafka.bootstrap_servers[0] (broker {self.node_id} uses port + "
             f"{self.node_id - 1})"),
            (self.controller_port, f"{self.name} controller listener",
             f"regions[{i}].local.kafka.controller_port"),
        ] + ([] if self.wan is None else [
            (self.wan.listener_port, f"{self.name} WAN listener",
             "<state>/toxiproxy/wan.json")])

    def process(self) -> ManagedProcess:
        assert self.region.local is not None
        heap = self.region.local.kafka.heap_mb
        argv = [
            "java", f"-Xms{min(256, heap)}m", f"-Xmx{heap}m", "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.log4j_config}",
            f"-Dkafka.logs.dir={self.workdir}",
            "-cp", f"{self.libs}/*", "kafka.Kafka", str(self.properties_path),
        ]
        return ManagedProcess(self.name, self.workdir, argv)

    def check_ports(self) -> None:
        for port, what, field in self.ports():
            check_port_free(port, what, field)

    def write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.secrets is not None:
            self.secrets.ensure([self.keystore_name])
        text = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        # owner-only from the start: a secure node's file holds the admin password
        self.properties_path.touch(mode=0o600, exist_ok=True)
        self.properties_path.chmod(0o600)
        self.properties_path.write_text(text, encoding="utf-8")

    def formatted(self) -> bool:
        return (self.data_dir / "meta.properties").exists()

    async def format(self, cluster_id: str) -> None:
        """`kafka-storage.sh format` for this node (static quorum: no --standalone)."""
        out_path = self.workdir / "format.log"
        scram: list[str] = []
        if self.secrets is not None and self.region.security is not None:
            # The SCRAM users exist from the first metadata record (KRaft: no ZooKeeper to
            # add them to before the brokers start). The passwords pass on the formatter's
            # command line (a local, short-lived process of the same user).
            mech = self.region.security.sasl_mechanism or "SCRAM-SHA-512"
            for p in PRINCIPALS:
                scram += ["--add-scram",
                          f"{mech}=[name={p},password={self.secrets.password(p)}]"]
        with out_path.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                "java", "-Xmx256m", f"-Dlog4j2.configurationFile={self.log4j_config}",
                "-cp", f"{self.libs}/*", "kafka.tools.StorageTool", "format",
                "-t", cluster_id, "-c", str(self.properties_path), *scram,
                stdout=out, stderr=asyncio.subprocess.STDOUT, cwd=self.workdir)
            try:
                code = await proc.wait()
            finally:
                if proc.returncode is None:  # cancelled: never leave a formatter behind
                    proc.kill()
                    await proc.wait()
        if code != 0:
            raise SetupFailed(
                f"Formatting the storage of {self.name} failed (exit {code}). "
                f"Last lines of {out_path}:\n{log_tail(out_path)}")


def kafka_nodes(region: Region, region_index: int, count: int, region_dir: Path, libs: Path,
                log4j_config: Path) -> list[KafkaNode]:
    """The `count` nodes of a region's cluster."""
    return [KafkaNode(region, region_index, i, count, region_dir / f"kafka-{i}", libs,
                      log4j_config) for i in range(1, count + 1)]


def cluster_id_for(region_dir: Path, count: int) -> str:
    """The region's cluster id, made once; refuses a data folder formatted for another size."""
    meta = region_dir / "cluster.json"
    if meta.exists():
        saved = json.loads(meta.read_text(encoding="utf-8"))
        if saved["brokers"] != count:
            raise StackError(
                f"{region_dir} holds a {saved['brokers']}-broker cluster but {count} were asked "
                f"for. Run `dr down --purge` to drop the old data, or pass "
                f"--brokers {saved['brokers']}.")
        return str(saved["cluster_id"])
    cid = _new_cluster_id()
    region_dir.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"cluster_id": cid, "brokers": count}), encoding="utf-8")
    return cid
