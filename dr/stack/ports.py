"""Topologies with free loopback ports, for tests and extra regions (`dr up` of a third one)."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence

from crossdc.topology import Topology
from dr.errors import PortTaken, StackError
from dr.stack.process import check_port_free

__all__ = ["BLOCK", "free_port", "free_topology"]

# Ports of one region, as offsets into its block: up to 9 brokers and 9 controllers.
_KAFKA, _CONTROLLER, _HTTP, _DNS, _SERVER, _LAN, _WAN, _PROXY, _METRICS = 0, 9, 18, 19, 20, 21, \
    22, 23, 24
BLOCK = 25


def _region(name: str, base: int) -> dict[str, object]:
    return {
        "name": name,
        "kafka": {"bootstrap_servers": [f"127.0.0.1:{base + _KAFKA}"]},
        "consul": {"http_addr": f"127.0.0.1:{base + _HTTP}", "datacenter": name,
                   "dns_addr": f"127.0.0.1:{base + _DNS}"},
        "proxy": {"endpoint": f"127.0.0.1:{base + _PROXY}", "metrics_port": base + _METRICS},
        "local": {
            "kafka": {"controller_port": base + _CONTROLLER, "heap_mb": 512},
            "consul": {"server_port": base + _SERVER, "serf_lan_port": base + _LAN,
                       "serf_wan_port": base + _WAN},
        },
    }


def _witness(name: str, base: int) -> dict[str, object]:
    """A witness in a region's block: only its Consul ports are used."""
    return {
        "name": name,
        "consul": {"http_addr": f"127.0.0.1:{base + _HTTP}", "datacenter": name,
                   "dns_addr": f"127.0.0.1:{base + _DNS}"},
        "local": {"consul": {"server_port": base + _SERVER, "serf_lan_port": base + _LAN,
                             "serf_wan_port": base + _WAN}},
    }


def _block_free(base: int) -> bool:
    try:
        for off in range(BLOCK):
            check_port_free(base + off, "probe", "", udp=off in (_DNS, _LAN, _WAN))
    except PortTaken:
        return False
    return True


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands out to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


SLICE_ENV = "CROSSDC_PORT_SLICE"
"""`i/n` (e.g. `1/2`): pick ports from the i-th of n equal slices of each range only. Test
processes that run side by side (pytest-xdist workers) take one slice each, so a port one of
them found free (a region's, while a drill has its Kafka down) is never picked by the other."""


def _slice(low: int, high: int) -> tuple[int, int]:
    value = os.environ.get(SLICE_ENV, "")
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        return low, high
    if not 0 <= i < n:
        return low, high
    width = (high - low) // n
    return low + i * width, low + (i + 1) * width


def free_topology(names: list[str], *, primary: str | None = None, seed: int | None = None,
                  low: int = 20000, high: int | None = None,
                  witnesses: Sequence[str] = ("witness",)) -> Topology:
    """A topology for `names`, plus the witness datacenters `witnesses` (one, `witness`, by
    default: two regions and a witness make a majority of three; `witnesses=()` for none),
    whose every port is free now (blocks of `BLOCK` ports, one per region or witness).

    Below the kernel's ephemeral range by default: a port free when checked there can be
    taken by any outgoing connection before the server binds it (seen: a 3-broker stack's
    controller port, taken while six brokers were connecting to each other)."""
    if high is None:
        high = max(low + 40 * BLOCK, min(60000, _ephemeral_low()))
    low, high = _slice(low, high)
    rng = random.Random(seed)
    used: set[int] = set()

    def block(what: str) -> int:
        for _ in range(200):
            base = rng.randrange(low, high - BLOCK) // BLOCK * BLOCK
            if base not in used and _block_free(base):
                used.add(base)
                return base
        raise StackError(f"no free block of {BLOCK} loopback ports found for {what}")

    regions = [_region(name, block(f"region {name}")) for name in names]
    extra = [_witness(name, block(f"witness {name}")) for name in witnesses]
    return Topology.model_validate(
        {"regions": regions, "preference": list(names), "primary": primary or names[0],
         "witnesses": extra})


# Single ports (a service's address or metrics, a test's proxy) come from below the region
# blocks, which start at 20000: both stay out of the kernel's ephemeral range.
_SINGLE_LOW, _SINGLE_HIGH = 10000, 20000


def free_port(taken: set[int] | None = None, *, host: str = "127.0.0.1") -> int:
    """A port nothing holds on `host` now, outside the kernel's ephemeral range.

    Binding port 0 would hand out an ephemeral port: free when checked, yet any outgoing
    connection may take it before the server binds it, or while a killed service is down
    and about to be restarted on the same port (seen: a mirror's metrics port, taken between
    a drill's kill and its heal). `taken` holds ports already promised; the new one is added."""
    taken = taken if taken is not None else set()
    rng = random.Random()
    low, high = _slice(_SINGLE_LOW, _SINGLE_HIGH)
    for _ in range(500):
        port = rng.randrange(low, high)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise StackError(f"no free port found on {host} between {_SINGLE_LOW} and {_SINGLE_HIGH}")
