"""What the controller tests and bench/failover share: controller processes, the leader killed
with SIGKILL and the time until another takes over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kafka_helpers import eventually

from dr.controller.datacenters import Datacenters
from dr.controller.ops import leader_of

__all__ = ["kill_the_leader", "start_controllers", "stop_processes"]


def start_controllers(topology: Path, folder: Path, config: Callable[[str], str],
                      regions: tuple[str, ...] = ("east", "west"),
                      ) -> dict[str, subprocess.Popen[bytes]]:
    """`dr controller run` per region, each in a process group of its own, with the config
    file `config(region)` and its log in `folder` (stop them with `stop_processes`)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for region in regions:
        cfg = folder / f"controller-{region}.yaml"
        cfg.write_text(config(region))
        with (folder / f"controller-{region}.log").open("wb") as log:
            procs[region] = subprocess.Popen(
                [sys.executable, "-m", "dr.cli", "controller", "run", "--region", region,
                 "--topology", str(topology), "--config", str(cfg)],
                stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    return procs


async def kill_the_leader(dcs: Datacenters, procs: Mapping[str, subprocess.Popen[bytes]],
                          timeout_s: float) -> float:
    """SIGKILL the process group of the controller that leads (`procs`: region → process);
    the seconds until another controller holds the lock."""
    first = await leader_of(dcs)
    assert first is not None, "nobody leads"
    victim = procs[first.region]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(10)
    t0 = time.monotonic()

    async def taken_over() -> bool:
        now = await leader_of(dcs)
        return now is not None and now.controller_id != first.controller_id
    await eventually(taken_over, timeout_s, "the other controller takes over")
    return time.monotonic() - t0


def stop_processes(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process group still running (SIGKILL after 20 s)."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
