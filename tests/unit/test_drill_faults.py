"""The drill's faults without servers: what each local fault says it would do (--dry-run), the
hook faults with real /bin/sh commands, and the mirror supervisor's bounded backoff."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossdc.topology import Flow, Topology
from dr.drill.errors import DrillError, HookFailed
from dr.drill.faults import SCENARIOS, HookFault, local_fault
from dr.errors import DrError
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.services import Services
from mirror.serve import Restart

TOPOLOGY = REPO_ROOT / "policies" / "topology.local.yaml"
POLICY = REPO_ROOT / "policies" / "default.yaml"


@pytest.fixture
def local(tmp_path: Path) -> tuple[LocalStack, Services]:
    """A local stack and its services as recorded, with nothing running."""
    from crossdc.topology import load_topology
    topo: Topology = load_topology(TOPOLOGY)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    services = Services(topo, TOPOLOGY, paths, policy=POLICY)
    services._write(services._plan(POLICY), POLICY)  # what `up()` records before starting
    return LocalStack(topo, TOPOLOGY, paths=paths), services


def test_the_record_names_every_service_and_its_ports(local: tuple[LocalStack, Services]
                                                      ) -> None:
    _, services = local
    infos = {i.name: i for i in services.info()}
    assert sorted(infos) == ["controller-east", "controller-west", "mirror-east-west",
                             "mirror-west-east", "proxy-east", "proxy-west"]
    assert infos["proxy-east"].address == "127.0.0.1:18700"
    assert infos["proxy-east"].metrics == "127.0.0.1:18701"
    assert infos["mirror-east-west"].region == "west"
    assert infos["mirror-east-west"].address is None
    assert all(i.pid is None for i in infos.values())
    doc = json.loads(services.record_path.read_text())
    argv = {s["name"]: s["argv"] for s in doc["services"]}
    assert argv["mirror-west-east"][-5:-1] == ["--flow", "west:east", "--restart",
                                               "--metrics-port"]
    assert "--auto-failover" in argv["controller-east"]
    # ports chosen once: a second plan keeps them
    again = {s.name: s for s in services._plan(POLICY).values()}
    assert again["controller-west"].address == infos["controller-west"].address


@pytest.mark.parametrize(("scenario", "says"), [
    ("primary-outage", ["kill -9 every Kafka broker of the primary region east",
                        "east kafka broker 1 (pid -, 127.0.0.1:19092)",
                        "proxy and controller stay"]),
    ("proxy-outage", ["kill -9 proxy-east", "not running now"]),
    ("mirror-outage", ["mirror-east-west (not running now)", "mirror-west-east"]),
    ("consul-outage", ["SIGSTOP", "primary region east", "127.0.0.1:18500"]),
    ("controller-outage", ["leading controller", "controller-east (127.0.0.1:",
                           "controller-west"]),
])
def test_describe_says_what_and_where_and_changes_nothing(
        local: tuple[LocalStack, Services], scenario: str, says: list[str]) -> None:
    stack, services = local
    before = services.record_path.read_text()
    lines = local_fault(scenario, stack, services, "east").describe()
    assert len(lines) == 2
    assert lines[1].startswith("heal: ")
    for part in says:
        assert part in lines[0], lines
    assert services.record_path.read_text() == before
    assert not list((stack.paths.state).glob("*/*/pid"))


def test_every_scenario_has_a_local_fault_and_bad_input_is_a_drill_error(
        local: tuple[LocalStack, Services]) -> None:
    stack, services = local
    assert {local_fault(s, stack, services, "west").scenario for s in SCENARIOS} == \
        set(SCENARIOS)
    with pytest.raises(DrillError, match="unknown scenario 'disk-outage'"):
        local_fault("disk-outage", stack, services, "east")
    with pytest.raises(DrillError, match="no region 'mars'"):
        local_fault("proxy-outage", stack, services, "mars")
    assert issubclass(DrillError, DrError)


async def test_a_local_fault_without_its_service_says_so(tmp_path: Path) -> None:
    from crossdc.topology import load_topology
    topo = load_topology(TOPOLOGY)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    stack, services = LocalStack(topo, TOPOLOGY, paths=paths), Services(topo, TOPOLOGY, paths)
    fault = local_fault("proxy-outage", stack, services, "east")
    with pytest.raises(DrillError, match=r"no service proxy-east.*dr up --services"):
        await fault.inject()
    no_mirrors = Services(topo.model_copy(update={"flows": []}), TOPOLOGY, paths)
    with pytest.raises(DrillError, match="no mirror process"):
        await local_fault("mirror-outage", stack, no_mirrors, "east").inject()


# -- hooks ---------------------------------------------------------------------------------
async def test_hook_runs_with_the_drill_environment(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    fault = HookFault("consul-outage",
                      f'echo "$CROSSDC_SCENARIO $CROSSDC_PRIMARY $CROSSDC_REGIONS $EXTRA '
                      f'$CROSSDC_TOPICS" > {seen}',
                      f"echo healed >> {seen}; echo done", {"EXTRA": "x"},
                      primary="west", regions=["east", "west"])
    lines = fault.describe()
    assert "inject: /bin/sh -c" in lines[0]
    assert "CROSSDC_PRIMARY=west" in lines[0]
    assert not seen.exists(), "describe() runs nothing"
    fault.topics = {"ordered": "payments.d1", "sync": "ledger.d1"}  # as the drill sets them
    await fault.inject()
    assert seen.read_text() == ("consul-outage west east,west x "
                                "ordered=payments.d1,sync=ledger.d1\n")
    await fault.heal()
    assert seen.read_text().splitlines()[-1] == "healed"
    assert fault.output["heal"] == "done\n"


async def test_hook_failure_names_the_command_and_its_stderr_tail() -> None:
    cmd = "echo starting; for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo line$i >&2; done; exit 3"
    fault = HookFault("proxy-outage", cmd, "", {})
    with pytest.raises(HookFailed) as info:
        await fault.inject()
    err = info.value
    assert isinstance(err, DrillError)
    assert err.returncode == 3
    assert err.step == "inject"
    msg = str(err)
    assert cmd in msg
    assert "status 3" in msg
    assert "line12" in msg
    assert "line2\n" not in msg, "only the tail"
    await fault.heal()  # an empty heal command heals nothing, and does not fail
    assert fault.describe()[1] == "heal: (no command)"


async def test_hook_past_its_deadline_is_killed_and_fails(tmp_path: Path) -> None:
    marker = tmp_path / "after"
    fault = HookFault("mirror-outage", "true", f"echo slow >&2; sleep 30; touch {marker}", {},
                      timeout_s=0.5)
    await fault.inject()
    with pytest.raises(HookFailed, match="timed out") as info:
        await fault.heal()
    assert info.value.returncode is None
    assert "slow" in info.value.stderr_tail
    assert not marker.exists()


# -- the mirror supervisor's backoff ---------------------------------------------------------
def test_restart_pauses_double_and_stay_bounded() -> None:
    r = Restart(first_s=1.0, max_s=30.0)
    pauses = [r.pause(n) for n in range(1, 12)]
    assert 1.0 <= pauses[0] <= 1.2
    assert 2.0 <= pauses[1] <= 2.2
    assert 4.0 <= pauses[2] <= 4.2
    assert all(p <= 30.0 for p in pauses)
    assert pauses[-1] == 30.0


async def test_the_supervisor_restarts_a_failed_worker_but_never_a_fenced_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Session 19's note: under --restart a worker stopped by WorkerFenced was started again
    # and fenced the other live worker of its id in turn, for as long as both ran.
    import asyncio

    from prometheus_client import CollectorRegistry, Counter

    import mirror.serve
    from crossdc.topology import load_topology
    from mirror import WorkerFenced
    from mirror.metrics import MirrorMetrics
    from mirror.serve import supervise

    ends: list[BaseException] = [RuntimeError("target gone"), WorkerFenced("crossdc-mirror-g-w1")]
    made: list[object] = []

    class Worker:
        async def __aenter__(self) -> Worker:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def wait(self) -> None:
            raise ends[len(made) - 1]

    def worker_for(*args: object, **kwargs: object) -> Worker:
        made.append(args)
        return Worker()

    monkeypatch.setattr(mirror.serve, "worker_for", worker_for)
    topo = load_topology(TOPOLOGY)
    restarts = Counter("restarts", "", ("source", "target"), registry=CollectorRegistry())
    with pytest.raises(WorkerFenced, match="another worker started"):
        await asyncio.wait_for(supervise(topo, topo.flows[0], MirrorMetrics(), restarts,
                                         asyncio.Event(), Restart(first_s=0.01, max_s=0.01)),
                               5.0)
    assert len(made) == 2, "restarted once after the error, never after the fence"
    flow = topo.flows[0]
    assert restarts.labels(flow.source, flow.target)._value.get() == 1


def test_a_fenced_mirror_exits_3_for_its_supervisor(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Other errors exit 1; a supervisor that restarts on exit 1 must be able to tell a fence
    # (restarting would fence the other worker in turn) from a failure.
    import sys

    import dr.cli.mirror
    from dr.cli import app
    from dr.exits import run_app
    from mirror import WorkerFenced

    async def fenced(*args: object, **kwargs: object) -> None:
        raise WorkerFenced("crossdc-mirror-g-w1")

    monkeypatch.setattr(dr.cli.mirror, "serve", fenced)
    monkeypatch.setattr(sys, "argv", ["dr", "mirror", "run", "--topology", str(TOPOLOGY),
                                      "--flow", "east:west", "--exactly-once", "--restart"])
    with pytest.raises(SystemExit) as ended:
        run_app(app)
    assert ended.value.code == 3
    err = capsys.readouterr().err
    assert "fenced" in err
    assert "crossdc-mirror-g-w1" in err


def test_flow_selection_by_name() -> None:
    import typer

    from crossdc.topology import load_topology
    from dr.cli.mirror import _flows
    topo = load_topology(TOPOLOGY)
    [one] = _flows(topo, None, None, None, None, False, False, 10.0, False, None, ["west:east"])
    assert isinstance(one, Flow)
    assert (one.source, one.target, one.discovery_interval_s) == ("west", "east", 2.0)
    assert one.topics == r"(dlq\.)?(payments|ledger|clickstream).*"
    with pytest.raises(typer.BadParameter, match="no flow east:mars"):
        _flows(topo, None, None, None, None, False, False, 10.0, False, None, ["east:mars"])


def test_status_lists_the_services_in_one_short_table(
        local: tuple[LocalStack, Services], capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    from dr.cli.stack import render_services
    _, services = local
    infos = services.info()
    rows = [(replace(infos[0], pid=4242), True), *((i, False) for i in infos[1:])]
    render_services(rows)
    text = capsys.readouterr().out
    assert f"{infos[0].name}" in text
    assert "4242" in text
    assert "not running" in text
    assert len(text.strip().splitlines()) <= len(infos) + 5


async def test_a_restart_waits_for_the_old_ports_then_names_the_holder(
        local: tuple[LocalStack, Services]) -> None:
    """Chaos suite: a mirror restarted right after its stop found its metrics port still held
    for a moment; the restart now waits for the port (bounded), and still refuses a port
    that stays taken."""
    import asyncio
    import socket

    from crossdc.topology import split_hostport
    from dr.errors import PortTaken

    _, services = local
    spec = services._spec("mirror-east-west")
    assert spec.metrics is not None
    port = split_hostport(spec.metrics)[1]
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, held.close)  # the old process's socket goes away after a moment
    await services._ports_released(spec, 5.0)  # returns once it is free
    assert held.fileno() == -1
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    try:
        with pytest.raises(PortTaken, match=str(port)):
            await services._ports_released(spec, 0.3)
    finally:
        held.close()


# -- a Ctrl-C swallowed on the way still stops the drill ---------------------------------

async def test_a_swallowed_cancel_stops_the_drill_at_its_next_step_but_not_its_heal() -> None:
    import asyncio
    import contextlib

    from dr.drill.run import Timeline

    tl = Timeline()
    entered: list[str] = []

    async def drill() -> None:
        # what Python 3.11's wait_for does when the awaited future just completed:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        try:
            with tl.step("warmup"):
                entered.append("warmup")
        finally:
            with tl.step("heal"):
                entered.append("heal")

    task = asyncio.create_task(drill())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert entered == ["heal"]
    assert [s[0] for s in tl.steps] == ["heal"]


async def test_checkpoint_is_silent_without_a_cancel_request() -> None:
    from crossdc.aio import checkpoint

    checkpoint()  # no exception: nobody asked this task to stop


async def test_after_a_proxy_outage_the_drill_waits_for_the_producers_to_come_home() -> None:
    """CI rehearsal, 2026-11-27: the proxy-outage drill stopped its traffic 0.15 s after the
    heal, before east's producer had probed its own proxy again: one move, not two. With
    `home`, the wait after the heal lasts until every producer writes through its own region."""
    import time

    from dr.drill.run import _flowing
    from dr.drill.traffic import TrafficStats

    class Traffic:
        def __init__(self) -> None:
            self.topics = {"ordered": "t"}
            self.proxies = {"east": "127.0.0.1:1", "west": "127.0.0.1:2"}
            self.via = {"east": "west", "west": "west"}

        def stats(self) -> TrafficStats:
            return TrafficStats(acked={}, failed={}, last_error={},
                                last_ack_ms={("ordered", "east"): 10, ("ordered", "west"): 10},
                                in_flight=0, moves={"east": 1, "west": 0}, via=dict(self.via))

    t = Traffic()
    await _flowing(t, 5, ["ordered"], time.monotonic() + 5)  # type: ignore[arg-type]
    with pytest.raises(DrillError, match=r"still away .*: east \(via west\)"):
        await _flowing(t, 5, ["ordered"], time.monotonic() + 0.3,  # type: ignore[arg-type]
                       home=True)
    t.via["east"] = "east@127.0.0.1:3"  # another proxy of its own region counts as home
    await _flowing(t, 5, ["ordered"], time.monotonic() + 5, home=True)  # type: ignore[arg-type]
