"""Defect 8: `dr status` shows the primary Consul KV holds in each datacenter, not the
topology file's, flags datacenters that disagree, and falls back to the topology (with a
note) only when no datacenter holds the key. Real Consul, real `dr status --json`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from stacks import StackInfo

from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.primary import PRIMARY_KEY, PrimaryRecord


@pytest.fixture
async def consuls(two_regions: StackInfo) -> AsyncIterator[dict[str, ConsulClient]]:
    """A client per datacenter; whatever the key held before the test is put back after."""
    clients = {d.name: ConsulClient(d.consul.http_addr)
               for d in two_regions.topology.datacenters}
    saved = {name: (await c.kv_get(PRIMARY_KEY))[1] for name, c in clients.items()}
    try:
        yield clients
    finally:
        for name, c in clients.items():
            entry = saved[name]
            if entry is None:
                await c.kv_delete(PRIMARY_KEY)
            else:
                await c.kv_put(PRIMARY_KEY, entry.value)
            await c.close()


async def put(client: ConsulClient, record: PrimaryRecord) -> None:
    """Compare-and-set over whatever is there now."""
    _, index = await read_primary(client)
    assert await write_primary(client, record, index)


def status_json(two_regions: StackInfo, tmp_path: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "dr.cli", "status", "--json", "--topology",
         str(two_regions.topology_path), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


async def test_status_shows_the_primary_consul_holds(
        two_regions: StackInfo, consuls: dict[str, ConsulClient], tmp_path: Path) -> None:
    assert two_regions.topology.primary == "east"
    record = PrimaryRecord(region="west", epoch=7, by="test")
    for c in consuls.values():
        await put(c, record)
    doc = status_json(two_regions, tmp_path)
    assert doc["primary"] == {"region": "west", "epoch": 7, "fenced": False,
                              "source": "consul", "agree": True, "note": None}
    by_region = {r["region"]: r for r in doc["regions"]}
    assert by_region["west"]["primary"] is True
    assert by_region["east"]["primary"] is False
    for r in by_region.values():
        assert r["primary_record"]["state"] == "set"
        assert (r["primary_record"]["region"], r["primary_record"]["epoch"]) == ("west", 7)


async def test_status_flags_datacenters_that_disagree(
        two_regions: StackInfo, consuls: dict[str, ConsulClient], tmp_path: Path) -> None:
    for w in two_regions.topology.witnesses:  # earlier tests may have left a newer epoch
        await consuls[w.name].kv_delete(PRIMARY_KEY)
    await put(consuls["east"], PrimaryRecord(region="east", epoch=8, by="test"))
    await put(consuls["west"], PrimaryRecord(region="west", epoch=9, by="test"))
    doc = status_json(two_regions, tmp_path)
    p = doc["primary"]
    assert (p["region"], p["epoch"], p["source"], p["agree"]) == ("west", 9, "consul", False)
    assert "east holds east (epoch 8)" in p["note"]
    assert "west holds west (epoch 9)" in p["note"]
    by_region = {r["region"]: r["primary_record"] for r in doc["regions"]}
    assert (by_region["east"]["region"], by_region["east"]["epoch"]) == ("east", 8)
    assert (by_region["west"]["region"], by_region["west"]["epoch"]) == ("west", 9)


async def test_status_falls_back_to_the_topology_when_the_key_is_absent(
        two_regions: StackInfo, consuls: dict[str, ConsulClient], tmp_path: Path) -> None:
    for c in consuls.values():
        await c.kv_delete(PRIMARY_KEY)
    doc = status_json(two_regions, tmp_path)
    p = doc["primary"]
    assert (p["region"], p["epoch"], p["source"], p["agree"]) == ("east", 0, "topology", True)
    assert "not set in any reachable datacenter" in p["note"]
    assert all(r["primary_record"]["state"] == "absent" for r in doc["regions"])
