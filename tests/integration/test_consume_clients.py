"""The consumer's clients against the real two-region stack: the SDK reading through any
proxy of a region (found in Consul) and moving to another when its proxy is killed, and
`dr consume` printing what was produced (docs/consume.md)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from consume_helpers import module_fixtures
from kafka_helpers import create_topic, eventually, produce, read_all, unique

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consul import ConsulClient
from crossdc.clients.kafka import KafkaAdmin
from proxy.client import AsyncProducer
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.connect import CONSUL_SERVICE, RegionProxies
from proxy.consume.member import kafka_group
from proxy.consumer_client import AsyncConsumer, ConsumedRecord
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "ccli-*"
    mode: ordered
    consume:
      ack_deadline_s: 30
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
"""


_primary_everywhere, policy_file = module_fixtures(POLICY)


def _boot(two_regions: Any, region: str = "east") -> str:
    return str(two_regions.topology.region(region).kafka.bootstrap)


async def _topic(two_regions: Any, partitions: int) -> str:
    name = unique("ccli")
    for r in ("east", "west"):
        await create_topic(_boot(two_regions, r), name, partitions=partitions)
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _passing(two_regions: Any) -> set[str]:
    """The east proxies Consul lists as passing."""
    proxies = RegionProxies.of(two_regions.topology, "east")
    try:
        return set(await proxies.addresses())
    finally:
        await proxies.close()


class _Proc:
    """`dr proxy serve` for east as a process of its own (registered in Consul), so the test
    can kill -9 it."""

    def __init__(self, two_regions: Any, policy: Path, log: Path) -> None:
        self.port, self.metrics_port = _free_port(), _free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "dr.cli", "--log-level", "info", "proxy", "serve",
                     "--topology", str(two_regions.topology_path), "--region", "east",
                     "--policy", str(policy), "--workers", "1", "--grace", "1",
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("wb") as lf:
            self.proc = await asyncio.create_subprocess_exec(*self.args, stdout=lf, stderr=lf)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()

    def died(self) -> str:
        if self.proc is not None and self.proc.returncode is not None:
            return f"dr proxy serve exited {self.proc.returncode}: " \
                   f"{self.log.read_text()[-3000:]}"
        return ""


@pytest.fixture
async def proc_proxy(two_regions: Any, policy_file: Path,
                     tmp_path: Path) -> AsyncIterator[_Proc]:
    p = _Proc(two_regions, policy_file, tmp_path / "proxy.log")
    await p.start()
    try:
        async def listed() -> bool:
            if p.died():
                raise AssertionError(p.died())
            return p.target in await _passing(two_regions)
        await eventually(listed, 60, "the proxy process passing in Consul")
        yield p
    finally:
        await p.stop()
        # its registration stays (a killed process never deregisters): remove it, so the
        # next test's region has only its own proxies
        async with ConsulClient(two_regions.topology.region("east").consul.http_addr) as c:
            for node in await c.health_service(CONSUL_SERVICE):
                if node["Service"]["Port"] == p.port:
                    await c.deregister_service(node["Service"]["ID"])


async def _committed(two_regions: Any, group: str) -> dict[TopicPartition, int]:
    conn = KafkaConnection.of(two_regions.topology.region("east"))
    async with KafkaAdmin(conn) as admin:
        return await admin.group_offsets(kafka_group(group, "primary"))


async def test_the_sdk_moves_to_another_proxy_of_the_region_when_its_proxy_is_killed(
        two_regions: Any, policy_file: Path, proc_proxy: _Proc) -> None:
    """A consumer given the region (not an address) reads through the one proxy Consul
    lists; that proxy is killed -9 mid-stream while a second one serves the region: the
    consumer moves to it and reads every record; the only ones read twice are the ones it
    had not acknowledged (the acknowledged ones were committed)."""
    topic = await _topic(two_regions, 2)
    values = [f"v{i}".encode() for i in range(40)]
    await produce(_boot(two_regions), topic, [(f"k{i}".encode(), v, ())
                                              for i, v in enumerate(values)])
    assert await _passing(two_regions) == {proc_proxy.target}
    group = unique("g")
    seen: list[ConsumedRecord] = []
    second: ProxyServer | None = None
    c = AsyncConsumer(RegionProxies.of(two_regions.topology, "east"), group, [topic],
                      credit=10, reconnect_attempts=30)
    await c.start()
    try:
        assert c.target == proc_proxy.target
        acked: list[ConsumedRecord] = []
        while len(acked) < 10:
            async with asyncio.timeout(30):
                batch = await anext(c)
            await batch.ack()
            acked.extend(batch)

        async def committed() -> bool:
            got = await _committed(two_regions, group)
            return all(got.get(TopicPartition(topic, p), 0) == 1 + max(
                (r.offset for r in acked if r.partition == p), default=-1) for p in (0, 1))
        await eventually(committed, 20, "the acknowledged records committed")
        async with asyncio.timeout(30):
            unacked = list(await anext(c))  # delivered, never acknowledged
        assert unacked
        seen = acked + unacked

        cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                          grace_s=1.0, register_consul=True,
                          kafka=KafkaWriterSettings(probe_interval_s=0.3,
                                                    attempt_timeout_s=2.0),
                          consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5))
        second = ProxyServer(two_regions.topology, cfg, policy_file)
        await second.start()
        other = f"127.0.0.1:{second.port}"

        async def both() -> bool:
            return await _passing(two_regions) == {proc_proxy.target, other}
        await eventually(both, 30, "the second proxy passing in Consul")

        proc_proxy.kill()
        rest: list[ConsumedRecord] = []
        want = set(values)
        while {r.value for r in seen + rest} != want:
            async with asyncio.timeout(60):  # the dead member's Kafka session times out
                batch = await anext(c)
            rest.extend(batch)
            await batch.ack()
        assert c.target == other
        assert c.moves == 1
        assert c.reconnects >= 1
        counts = collections.Counter(r.value for r in seen + rest)
        twice = {v for v, n in counts.items() if n > 1}
        assert twice <= {r.value for r in unacked}
        assert all(r.region == "east" for r in rest)
    finally:
        await c.stop()
        if second is not None:
            await second.stop()


# -- dr consume -----------------------------------------------------------------------------

def _config(**kw: Any) -> ProxyConfig:
    return ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                       grace_s=1.0, kafka=KafkaWriterSettings(probe_interval_s=0.3,
                                                              attempt_timeout_s=2.0),
                       consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5),
                       **kw)


@pytest.fixture
async def east(two_regions: Any, policy_file: Path) -> AsyncIterator[ProxyServer]:
    """An east proxy in this process, registered in Consul (`dr consume --region east`)."""
    server = ProxyServer(two_regions.topology, _config(register_consul=True), policy_file)
    await server.start()
    try:
        target = f"127.0.0.1:{server.port}"

        async def listed() -> bool:
            return await _passing(two_regions) == {target}
        await eventually(listed, 30, "the proxy passing in Consul")
        yield server
    finally:
        await server.stop()


async def _dr_consume(two_regions: Any, *args: str, token: str | None = None,
                      ) -> tuple[int, list[str], str]:
    """`dr consume ARGS` as a process (this loop keeps serving the proxy meanwhile): exit
    status, stdout lines, stderr."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("CROSSDC_PROXY_TOKEN", None)
    if token is not None:
        env["CROSSDC_PROXY_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "consume", "-t", str(two_regions.topology_path),
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(90):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode().splitlines(), err.decode()


async def test_dr_consume_prints_what_was_produced(two_regions: Any,
                                                    east: ProxyServer) -> None:
    """Through the region's proxy (found in Consul), --json: every record, each partition
    in Kafka's order, with its headers; then the group has nothing left."""
    topic = await _topic(two_regions, 3)
    async with AsyncProducer(f"127.0.0.1:{east.port}") as p:
        for i in range(30):
            await p.send(topic, f"v{i}".encode(), key=f"k{i % 7}".encode(),
                         headers=[("app", b"x")])
        await p.flush()
    group = unique("g")
    code, lines, err = await _dr_consume(two_regions, "--region", "east", "--group", group,
                                         "--topic", topic, "--max", "30", "--json")
    assert code == 0, err
    assert "30 record(s)" in err
    docs = [json.loads(line) for line in lines]
    direct = await read_all(_boot(two_regions), topic, 3)
    for part in range(3):
        mine = [(d["offset"], d["key"], d["value"]) for d in docs if d["partition"] == part]
        theirs = [(r.offset, r.key.decode(), r.value.decode()) for r in direct
                  if r.partition == part]
        assert mine == theirs
    assert len(docs) == 30
    assert {d["region"] for d in docs} == {"east"}
    assert all({"key": "app", "value": "x"} in d["headers"] and d["dr_id"] for d in docs)
    assert {d["delivery_attempt"] for d in docs} == {1}

    async def all_committed() -> bool:
        got = await _committed(two_regions, group)
        return sum(got.get(TopicPartition(topic, p), 0) for p in range(3)) == 30
    await eventually(all_committed, 20, "every printed record acknowledged and committed")


async def test_dr_consume_stops_at_max_and_the_group_goes_on_from_there(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, 1)
    await produce(_boot(two_regions), topic, [(f"k{i}".encode(), f"v{i}".encode(), ())
                                              for i in range(20)])
    group = unique("g")
    target = f"127.0.0.1:{east.port}"
    code, first, err = await _dr_consume(two_regions, "--target", target, "--group", group,
                                         "--topic", topic, "--max", "7")
    assert code == 0, err
    assert first == [f"{topic}/0@{i}\teast\tk{i}\tv{i}" for i in range(7)]
    code, rest, err = await _dr_consume(two_regions, "--target", target, "--group", group,
                                        "--topic", topic, "--max", "13")
    assert code == 0, err
    assert rest == [f"{topic}/0@{i}\teast\tk{i}\tv{i}" for i in range(7, 20)]


async def test_dr_consume_stops_cleanly_on_ctrl_c(two_regions: Any,
                                                   east: ProxyServer) -> None:
    """SIGINT: exit 0, and what it printed was acknowledged (the group's commit there)."""
    topic = await _topic(two_regions, 1)
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ())
                                              for i in range(10)])
    group = unique("g")
    env = {**os.environ, "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "consume", "--target", f"127.0.0.1:{east.port}",
        "--group", group, "--topic", topic, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        lines: list[str] = []
        async with asyncio.timeout(60):
            while len(lines) < 10:
                lines.append((await proc.stdout.readline()).decode().rstrip("\n"))
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert rest == b""
    assert lines == [f"{topic}/0@{i}\teast\tk\tv{i}" for i in range(10)]
    assert "10 record(s)" in err.decode()
    assert "Traceback" not in err.decode()

    async def committed() -> bool:
        return (await _committed(two_regions, group)).get(TopicPartition(topic, 0)) == 10
    await eventually(committed, 20, "the printed records acknowledged and committed")


async def test_dr_consume_refusals_are_one_line_and_an_exit_code(
        two_regions: Any, policy_file: Path, tmp_path: Path) -> None:
    from proxy.auth import hash_token, new_token
    reader, other = new_token(), new_token()
    auth = tmp_path / "auth.yaml"
    auth.write_text("tokens:\n"
                    f"  - name: reader\n    sha256: {hash_token(reader)}\n"
                    "    topics: ['ccli-*']\n"
                    f"  - name: other\n    sha256: {hash_token(other)}\n"
                    "    topics: ['elsewhere']\n")
    topic = await _topic(two_regions, 1)
    await produce(_boot(two_regions), topic, [(b"k", b"v", ())])
    async with ProxyServer(two_regions.topology, _config(register_consul=False,
                                                         auth_file=auth),
                           policy_file) as server:
        target = f"127.0.0.1:{server.port}"
        base = ("--target", target, "--group", unique("g"), "--max", "1")
        code, lines, _ = await _dr_consume(two_regions, *base, "--topic", topic,
                                           token=reader)
        assert code == 0
        assert lines == [f"{topic}/0@0\teast\tk\tv"]
        for token, topics, want, exit_code in (
                (reader, unique("ccli"), "NOT_FOUND", 2),  # a rule, but no such topic
                (other, topic, "PERMISSION_DENIED", 1),
                (None, topic, "UNAUTHENTICATED", 1)):
            code, lines, err = await _dr_consume(two_regions, *base, "--topic", topics,
                                                 token=token)
            assert code == exit_code, err
            assert lines == []
            shown = [ln for ln in err.splitlines() if ln.strip()]
            assert len(shown) == 1, err
            assert shown[0].startswith(f"error: reading through {target} failed: {want}: ")
