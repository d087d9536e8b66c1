"""`dr demo` (the README's main command) stops every process it started on Ctrl-C, and says
so. The demo itself runs to its end in CI (`.ci/run`: `make demo`)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from stacks import DRILL_TOPICS
from tests_support import write_topology

from crossdc.topology import Flow
from dr.stack.local import LocalStack, stack_processes
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology

# slow: `make test-more` (CI runs it after the demo, which is the same story end to end)
pytestmark = [pytest.mark.timeout(720), pytest.mark.slow]

DR = str(Path(sys.executable).parent / "dr")
ROOT = Path(__file__).resolve().parents[2]
# A Ctrl-C as a terminal gives it: the demo in the foreground, SIGINT at its default. A job
# started in the background of a shell without job control (`cmd &` in a script, as a CI
# rehearsal was) inherits SIGINT *ignored*, and Python keeps it ignored across exec: the
# interrupt this test sends was then never heard and the demo ran to its end (two rehearsals
# on 2026-12-02, taken for a lost cancel). The wrapper puts SIGINT back to its default first.
AS_FOREGROUND = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                 "signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"]


async def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    topo = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=DRILL_TOPICS),
        Flow(source="west", target="east", topics=DRILL_TOPICS)]})
    path = write_topology(topo, tmp_path / "topology.yaml")
    state = tmp_path / "state"
    reports = tmp_path / "reports"
    proc = await asyncio.create_subprocess_exec(
        *AS_FOREGROUND, DR, "demo", "--topology", str(path), "--state-dir", str(state),
        "--reports", str(reports), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"})
    paths = StackPaths(state=state, cache=StackPaths.default().cache)
    try:
        deadline = asyncio.get_running_loop().time() + 240
        # interrupt in the middle of the drill (its report folder exists: every daemon runs)
        while not any(reports.glob("*/acks.jsonl")):
            assert proc.returncode is None, (await proc.communicate())[1].decode()[-3000:]
            assert asyncio.get_running_loop().time() < deadline, "the drill never started"
            await asyncio.sleep(0.5)  # polls the folder the demo writes
        running = [p.name for p in stack_processes(paths) if p.running()]
        proc.send_signal(signal.SIGINT)
        # the drill heals and fails back first: 200 s was not enough in a CI run (the
        # interrupt at 02:20:28, the drill's failback at 02:23:09, the processes stopped at
        # 02:23:47)
        _, err = await asyncio.wait_for(proc.communicate(), 420)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        leftover = await LocalStack.down(paths)  # whatever a failure left behind
    text = " ".join(err.decode().split())
    assert proc.returncode == 130, text[-3000:]
    assert "interrupted: stopped" in text, text[-3000:]
    assert not leftover, "all stopped by the demo itself"
    for name in running:
        assert name in text, f"{name} named as stopped"


# The defect this test found (2026-12-04): after the primary outage the west proxy's writer
# kept a transactional producer that Kafka had refused (OutOfOrderSequenceNumber) and renewed
# its plain one instead, so west's ordered writes were never acknowledged again (fixed in
# proxy/writers.py `_attempt`; failed 2 of 2 runs before, passed 2 of 2 after).
async def test_the_secure_demo_runs_to_one_passing_verdict(tmp_path: Path) -> None:
    """`dr demo --secure`: the whole story with Kafka on SASL/SCRAM over TLS with ACLs and
    Consul on HTTPS with default-deny ACLs, each component with its own token: the drill
    (traffic, a primary outage, the automatic failover and failback) and the reconciliation
    pass and agree. 100 s of traffic: the secure broker's restart makes the heal come about
    a minute after the fault, and the drill wants acknowledgements after the heal."""
    topo = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=DRILL_TOPICS),
        Flow(source="west", target="east", topics=DRILL_TOPICS)]})
    path = write_topology(topo, tmp_path / "topology.yaml")
    state = tmp_path / "state"
    paths = StackPaths(state=state, cache=StackPaths.default().cache)
    proc = await asyncio.create_subprocess_exec(
        DR, "demo", "--secure", "--duration", "100", "--topology", str(path), "--state-dir",
        str(state), "--reports", str(tmp_path / "reports"), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"})
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 660)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        leftover = await LocalStack.down(paths)
    text = " ".join((out + err).decode().split())
    assert proc.returncode == 0, text[-4000:]
    assert "passed: nothing acknowledged was lost" in text, text[-4000:]
    assert not leftover, "the demo stopped what it started"
    secure = (state / "topology.secure.yaml").read_text(encoding="utf-8")
    assert "tokens_dir" in secure
    assert "SASL_SSL" in secure
