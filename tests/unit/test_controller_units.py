"""The controller's pure logic: hysteresis, the primary record's fence/promote rules, the
failover record's step bookkeeping, settings validation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, ClassVar

import pytest

if TYPE_CHECKING:
    from dr.controller.leader import LeaderLock
from pydantic import ValidationError

from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from dr.controller.config import ControllerSettings, LeaderSettings
from dr.controller.failover import Behind
from dr.controller.health import Hysteresis, Round
from dr.controller.ops import ControllerView
from dr.controller.state import STEPS, CheckResult, FailoverRecord, GateRecord, LeaderRecord


def rnd(ok: bool, at_ms: int, proxy_ok: bool = True) -> Round:
    return Round({"kafka": CheckResult(ok=ok), "canary": CheckResult(ok=ok),
                  "proxy": CheckResult(ok=proxy_ok)}, at_ms=at_ms)


def test_hysteresis_needs_n_failures_to_go_down_and_m_successes_to_come_back() -> None:
    h = Hysteresis("east", failures_to_down=3, successes_to_up=2)
    assert h.observe(rnd(True, 0))
    assert h.status == "up"
    assert not h.observe(rnd(False, 100))
    assert h.status == "up"
    assert not h.observe(rnd(False, 200))
    assert h.status == "up"
    assert h.observe(rnd(False, 300))
    assert h.status == "down"
    assert h.first_failure_ms == 100, "the fault began at the first failed round of the run"
    assert h.since_ms == 300
    assert not h.observe(rnd(True, 400))
    assert h.status == "down", "one good round is not enough"
    assert h.observe(rnd(True, 500))
    assert h.status == "up"
    assert h.first_failure_ms is None


def test_hysteresis_forgets_what_a_cut_off_controller_saw() -> None:
    """A controller that reaches no majority judges nothing: a region it saw down is
    `unknown` again, and only fresh failures down it after the heal (a three-way split had
    the first leader after the heal fail a healthy primary over on stale failures)."""
    h = Hysteresis("east", failures_to_down=2, successes_to_up=2)
    h.observe(rnd(False, 0))
    h.observe(rnd(False, 100))
    assert h.status == "down"
    assert h.forget(200) is True
    assert h.status == "unknown"
    assert h.since_ms == 200
    assert h.forget(300) is False  # nothing more to forget
    h.observe(rnd(False, 400))
    assert h.status == "unknown", "one failure after the heal is not two in a row"
    h.observe(rnd(False, 500))
    assert h.status == "down"


def test_hysteresis_a_single_blip_resets() -> None:
    h = Hysteresis("east", failures_to_down=2, successes_to_up=1)
    h.observe(rnd(True, 0))
    h.observe(rnd(False, 1))
    h.observe(rnd(True, 2))
    h.observe(rnd(False, 3))
    assert h.status == "up", "failures must be consecutive"


def test_a_failing_proxy_degrades_a_region_but_never_downs_it() -> None:
    h = Hysteresis("east", failures_to_down=1, successes_to_up=1)
    h.observe(rnd(True, 0, proxy_ok=False))
    assert h.status == "degraded"
    h.observe(rnd(True, 1, proxy_ok=False))
    assert h.status == "degraded"
    h.observe(rnd(True, 2))
    assert h.status == "up"


def test_a_failing_canary_with_kafka_answering_downs_a_region_only_after_the_grace() -> None:
    # One broker of three killed: metadata answers, acks=all writes stall until Kafka fences
    # it. Seen in the chaos suite as a false failover before the grace existed.
    h = Hysteresis("east", failures_to_down=3, successes_to_up=1, canary_grace_ms=15_000)
    h.observe(rnd(True, 0))

    def canary_failed(at_ms: int) -> Round:
        return Round({"kafka": CheckResult(ok=True), "canary": CheckResult(ok=False)},
                     at_ms=at_ms)

    for t in range(500, 14_001, 500):
        h.observe(canary_failed(t))
        assert h.status == "degraded", t
    assert h.observe(canary_failed(15_500))
    assert h.status == "down", "a canary still failing after the grace downs the region"
    assert h.first_failure_ms == 500
    # Kafka itself gone after canary-only rounds: N rounds of Kafka failing, no grace
    g = Hysteresis("east", failures_to_down=3, successes_to_up=1, canary_grace_ms=15_000)
    g.observe(rnd(True, 0))
    g.observe(canary_failed(500))
    g.observe(rnd(False, 1000))
    g.observe(rnd(False, 1500))
    assert g.status == "degraded", "two Kafka failures are not three"
    g.observe(rnd(False, 2000))
    assert g.status == "down"
    # leader-kill (chaos, third run): a metadata answer lost to the dying broker now and then
    # in the middle of a canary-only run is no reason to skip the grace
    j = Hysteresis("east", failures_to_down=3, successes_to_up=1, canary_grace_ms=15_000)
    j.observe(rnd(True, 0))
    for t in range(500, 14_001, 500):
        j.observe(rnd(False, t) if t % 1500 == 0 else canary_failed(t))
        assert j.status == "degraded", t
    j.observe(rnd(True, 14_500))
    assert j.status == "up"
    # and the cluster healing within the grace brings it straight back
    k = Hysteresis("east", failures_to_down=3, successes_to_up=1, canary_grace_ms=15_000)
    k.observe(rnd(True, 0))
    for t in (500, 1000, 1500, 2000):
        k.observe(canary_failed(t))
    k.observe(rnd(True, 2500))
    assert k.status == "up"
    assert k.first_failure_ms is None


def test_fence_then_promote_keeps_one_primary_per_epoch() -> None:
    cur = PrimaryRecord(region="east", epoch=4)
    fenced = cur.fence("c1")
    assert (fenced.epoch, fenced.fenced, fenced.writable) == (5, True, None)
    promoted = fenced.promote("west", "c1")
    assert (promoted.epoch, promoted.writable) == (5, "west")
    with pytest.raises(ValueError, match="fenced"):
        promoted.promote("east", "c1")
    assert fenced.supersedes(cur)
    assert promoted.supersedes(fenced)
    assert not cur.supersedes(promoted), "an older epoch never wins"
    assert not fenced.supersedes(promoted), "a fence never undoes its own promotion"


def test_old_records_without_the_fenced_field_still_decode() -> None:
    rec = PrimaryRecord.decode(b'{"region": "east", "epoch": 3, "updated_ms": 1, "by": "x"}')
    assert rec.writable == "east"
    assert not rec.fenced


def test_failover_record_resumes_at_the_first_step_not_done() -> None:
    rec = FailoverRecord(source="east", target="west", started_ms=1000)
    assert [s.name for s in rec.steps] == list(STEPS)
    assert rec.next_step() == "fence"
    rec = rec.with_step("fence", status="done", started_ms=1000, ended_ms=1100)
    rec = rec.with_step("lease_wait", status="done", started_ms=1100, ended_ms=6600)
    rec = rec.with_step("drain", status="skipped")
    assert rec.next_step() == "offsets"
    assert rec.step("fence").seconds == pytest.approx(0.1)
    assert rec.rto_s is None
    rec = rec.with_step("promote", status="done", started_ms=6600, ended_ms=7000)
    assert rec.rto_s == pytest.approx(6.0), "from the start when no fault time is known"
    rec = rec.model_copy(update={"fault_ms": 0})
    assert rec.rto_s == pytest.approx(7.0), "from the fault when it is known"
    again = FailoverRecord.model_validate_json(rec.model_dump_json())
    assert again == rec, "the record survives its trip through Consul KV"


def test_settings_refuse_a_heartbeat_slower_than_its_ttl() -> None:
    with pytest.raises(ValidationError, match="check_ttl_s"):
        ControllerSettings(region="east", leader=LeaderSettings(check_ttl_s=0.4))
    with pytest.raises(ValidationError, match="extra"):
        ControllerSettings.model_validate({"region": "east", "bogus": 1})


def _topology() -> Topology:
    from dr.stack.ports import free_topology
    topo: Topology = free_topology(["east", "west"])
    return topo


async def test_automatic_failover_waits_out_the_wait_period_and_the_gate() -> None:
    """The leader's decision alone (no servers: the engine is never reached when a rule
    holds the failover back)."""
    from dr.controller import Controller
    from dr.controller.config import FailoverSettings
    from dr.controller.state import GateRecord, now_ms

    topo = _topology()
    ctl = Controller(topo, ControllerSettings(
        region="east", failover=FailoverSettings(auto=True, wait_period_s=60)))
    called: list[str] = []

    async def check(source: str, target: str, force: bool) -> None:
        called.append(target)
        raise AssertionError("a held-back failover must not be checked")

    ctl.engine.check = check  # type: ignore[method-assign, assignment]
    for i in range(3):
        ctl.hysteresis["east"].observe(rnd(False, i))
        ctl.hysteresis["west"].observe(rnd(True, i))
    assert ctl.hysteresis["east"].status == "down"

    recent = PrimaryRecord(region="east", epoch=3, updated_ms=now_ms())
    await ctl._maybe_auto(recent)
    assert ctl.metrics.auto_blocked.labels(reason="wait_period")._value.get() == 1
    # #21 defect 6: another host's wall clock (a record written "two minutes ago") does not
    # shorten the wait: it counts from when this process first saw the record.
    old = PrimaryRecord(region="east", epoch=3, updated_ms=now_ms() - 120_000)
    await ctl._maybe_auto(old)
    assert ctl.metrics.auto_blocked.labels(reason="wait_period")._value.get() == 2
    assert "wait period" in ctl.why_no_auto

    ctl._primary_seen = ((3, "east", False), time.monotonic() - 120)
    ctl.gate = GateRecord(closed=True, by="test", reason="maintenance")
    await ctl._maybe_auto(old)
    assert ctl.metrics.auto_blocked.labels(reason="gate_closed")._value.get() == 1
    assert called == []
    await ctl.dcs.close()


async def test_a_change_of_a_regions_status_wakes_the_leaders_work() -> None:
    """The lead round runs on a schedule; a region judged down must not wait for it (the
    wait was up to a whole lead interval between detection and the fence)."""
    from dr.controller import Controller

    ctl = Controller(_topology(), ControllerSettings(region="east"))
    east_ok = True

    class Prober:
        def __init__(self, region: str) -> None:
            self.region = region

        async def probe(self) -> Round:
            return rnd(east_ok or self.region != "east", 0)

        async def stop(self) -> None:
            pass

    ctl.probers = {r: Prober(r) for r in ctl.probers}  # type: ignore[misc]
    await ctl._health_round()  # unknown -> up: a change
    assert ctl._judged.is_set()
    ctl._judged.clear()
    east_ok = False
    for _ in range(ctl.settings.health.failures_to_down - 1):
        await ctl._health_round()
        assert not ctl._judged.is_set(), "a failed round that changes nothing wakes nobody"
    await ctl._health_round()
    assert ctl.hysteresis["east"].status == "down"
    assert ctl._judged.is_set()
    await ctl.dcs.close()


async def test_a_region_whose_probe_hangs_never_holds_back_another_regions_judgement() -> None:
    """Each region is probed in a loop of its own: west's probe hanging (a slow canary on a
    loaded machine) must not space out east's rounds (one round for both waited for the
    slower: 2.8 s to judge a dead primary down under load)."""
    import asyncio

    from dr.controller import Controller
    from dr.controller.config import HealthSettings

    ctl = Controller(_topology(), ControllerSettings(
        region="east", health=HealthSettings(interval_s=0.01)))
    hung = asyncio.Event()  # never set
    probed = {"east": 0, "west": 0}

    class Prober:
        def __init__(self, region: str) -> None:
            self.region = region

        async def probe(self) -> Round:
            probed[self.region] += 1
            if self.region == "west":
                await hung.wait()
            return rnd(False, probed[self.region])

        async def stop(self) -> None:
            pass

    class Lock:
        leading = False
        reaches_majority = True
        why_not = "test"

        async def run(self, stop: asyncio.Event) -> None:
            await stop.wait()

    ctl.probers = {r: Prober(r) for r in ctl.probers}  # type: ignore[misc]
    ctl.lock = Lock()  # type: ignore[assignment]
    ctl._last_observe = time.monotonic() + 3600  # no Consul reads while following
    task = asyncio.create_task(ctl.run())
    try:
        await asyncio.wait_for(ctl._judged.wait(), 10)
        assert ctl.hysteresis["east"].status == "down"
        assert probed == {"east": ctl.settings.health.failures_to_down, "west": 1}
        assert ctl.hysteresis["west"].status == "unknown"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ctl.dcs.close()


class _Consul:
    """A datacenter's Consul as the leader lock sees it: one lock key, sessions, reachable
    or cut off (a stand-in: the lock against real Consul is tests/integration/test_controller)."""

    def __init__(self, lock_delay: bool = False) -> None:
        self.reachable = True
        self.holder: str | None = None
        self.sessions: dict[str, str] = {}  # session -> controller
        self.lock_delay = lock_delay
        """Consul's lock-delay, as a flag: a lock whose session was destroyed cannot be
        taken again until `delay_over()` (the test says when the delay ran out)."""
        self.delayed = False

    def delay_over(self) -> None:
        self.delayed = False

    def _up(self) -> None:
        from crossdc.errors import ClientError
        if not self.reachable:
            raise ClientError("unreachable")

    async def register_service(self, *a: object, **kw: object) -> None:
        self._up()

    async def check_pass(self, *a: object) -> None:
        self._up()

    async def session_create(self, name: str, **kw: object) -> str:
        self._up()
        sid = f"s{len(self.sessions)}"
        self.sessions[sid] = name
        return sid

    async def session_renew(self, sid: str) -> bool:
        self._up()
        return sid in self.sessions

    async def session_destroy(self, sid: str) -> None:
        self._up()
        self.sessions.pop(sid, None)
        if self.holder == sid:
            self.holder = None
            self.delayed = self.lock_delay

    async def kv_get(self, key: str, **kw: object) -> tuple[int, object]:
        self._up()
        from types import SimpleNamespace
        return 0, (SimpleNamespace(session=self.holder) if self.holder else None)

    async def kv_acquire(self, key: str, sid: str, value: bytes) -> bool:
        self._up()
        if self.delayed and self.holder is None:
            return False
        if self.holder in (None, sid):
            self.holder = sid
            return True
        return False


class _Side:
    """One controller's view of a datacenter's Consul: cut off from this side or not."""

    def __init__(self, consul: _Consul, cut: set[str], name: str) -> None:
        self.consul, self.cut, self.name = consul, cut, name

    def __getattr__(self, attr: str) -> object:
        if self.name in self.cut:
            from crossdc.errors import ClientError

            async def unreachable(*a: object, **kw: object) -> None:
                raise ClientError("cut off")
            return unreachable
        return getattr(self.consul, attr)


def _with_witness(topo: Topology) -> Topology:
    from crossdc.topology import ConsulSettings, Witness
    if topo.witnesses:
        return topo
    w = Witness(name="witness", consul=ConsulSettings(
        http_addr="127.0.0.1:1", datacenter="witness", dns_addr="127.0.0.1:2"))
    return topo.model_copy(update={"witnesses": [w]})


def _locks(topo: Topology, consuls: dict[str, _Consul], clock: list[float] | None = None
           ) -> dict[str, tuple[LeaderLock, set[str]]]:
    from dr.controller.leader import LeaderLock
    from dr.controller.state import LeaderRecord
    out: dict[str, tuple[LeaderLock, set[str]]] = {}
    for region in [r.name for r in topo.regions]:
        cut: set[str] = set()

        class Dcs:
            topology = topo
            majority = topo.majority
            clients: ClassVar[dict[str, _Side]] = {
                d.name: _Side(consuls[d.name], cut, d.name) for d in topo.datacenters}

            def client(self, dc: str) -> object:
                return self.clients[dc]

        lock = LeaderLock(Dcs(), LeaderSettings(), LeaderRecord(  # type: ignore[arg-type]
            controller_id=f"c-{region}", region=region, since_ms=0),
            clock=(lambda: clock[0]) if clock is not None else time.monotonic)
        out[region] = (lock, cut)
    return out


async def test_only_a_majority_side_leads_and_a_cut_off_leader_stops() -> None:
    # #21 defect 1: the lock was taken per datacenter, so each side of a partition elected
    # its own leader. Now leading needs the lock in a majority of datacenters.
    topo = _with_witness(_topology())
    consuls = {d.name: _Consul() for d in topo.datacenters}
    locks = _locks(topo, consuls)
    (east, east_cut), (west, west_cut) = locks["east"], locks["west"]
    await east.round()
    await west.round()
    assert east.leading
    assert not west.leading
    # East cut off with its own datacenter: it reaches 1 of 3.
    east_cut.update({"west", "witness"})
    west_cut.add("east")
    await east.round()
    assert not east.leading, "a controller on a minority side never leads"
    assert "a majority is 2" in east.why_not
    await west.round()
    assert not west.leading, "east's sessions still hold west's and the witness's locks"
    # Their checks went critical (east stopped beating there): Consul releases the locks.
    consuls["west"].holder = consuls["witness"].holder = None
    await west.round()
    assert west.leading, "the majority side leads"
    assert sorted(west.sessions) == ["west", "witness"]


async def test_a_contender_leaves_a_free_lock_to_the_leader_after_a_partition() -> None:
    """After a flapping partition: the leader (east) holds east's and the witness's locks,
    the other controller still west's. West must give west's lock up and not take it again
    (each take-and-release restarted Consul's lock-delay, so the leader could never hold
    west's lock and never correct the record west kept: the stack stayed split)."""
    topo = _with_witness(_topology())
    consuls = {d.name: _Consul(lock_delay=True) for d in topo.datacenters}
    locks = _locks(topo, consuls)
    (east, east_cut), (west, west_cut) = locks["east"], locks["west"]
    await west.round()  # west led first: every lock
    assert west.leading
    # West cut off: its checks go critical in east and the witness, whose locks Consul
    # releases; east takes them and leads. West's own datacenter keeps west's session.
    west_cut.update({"east", "witness"})
    east_cut.add("west")
    consuls["east"].holder = consuls["witness"].holder = None
    await west.round()
    await east.round()
    assert east.leading, "east holds east and the witness: a majority"
    west_cut.clear()  # the heal
    east_cut.clear()
    for c in consuls.values():
        c.delay_over()
    await west.round()  # takes west's lock back while alone?
    for _ in range(3):  # west's round first each time, then east's, then the delay runs out
        await west.round()
        assert not west.leading
        await east.round()
        for c in consuls.values():
            c.delay_over()
    assert east.leading
    assert sorted(east.sessions) == ["east", "west", "witness"], \
        "the leader holds every datacenter's lock (and can correct them all)"


async def test_a_lock_in_its_lock_delay_is_waited_for_not_a_reason_to_give_up() -> None:
    """The primary (west) cut off: east's datacenter lock is still in Consul's lock-delay
    (nobody holds it). East keeps the witness's lock and takes its own once the delay ran
    out. Giving the witness's back started a delay there too, and each round found the other
    delayed: east never led and nobody failed over (split-brain suite, primary cut off)."""
    topo = _with_witness(_topology())
    consuls = {d.name: _Consul(lock_delay=True) for d in topo.datacenters}
    locks = _locks(topo, consuls)
    east, east_cut = locks["east"]
    east_cut.add("west")
    consuls["east"].delayed = True  # a session there ended a moment ago
    await east.round()
    assert not east.leading
    assert "holds 1 of the 2" in east.why_not
    consuls["east"].delay_over()  # only east's delay ran out
    await east.round()
    assert east.leading, "east and the witness: a majority"


async def test_two_regions_without_a_witness_cut_apart_have_no_leader() -> None:
    topo = _topology().model_copy(update={"witnesses": []})
    consuls = {d.name: _Consul() for d in topo.datacenters}
    locks = _locks(topo, consuls)
    (east, east_cut), (west, west_cut) = locks["east"], locks["west"]
    await east.round()
    assert east.leading
    east_cut.add("west")
    west_cut.add("east")
    consuls["west"].holder = None
    await east.round()
    await west.round()
    assert not east.leading
    assert not west.leading


async def test_a_leader_stops_leading_on_its_own_clock_before_another_can_take_over() -> None:
    # The locks of a leader that stops beating (paused, cut off) are released check_ttl_s
    # after its last beat at the earliest; `leading` turns false before that, rounds or not.
    topo = _with_witness(_topology())
    consuls = {d.name: _Consul() for d in topo.datacenters}
    clock = [100.0]
    east, _ = _locks(topo, consuls, clock)["east"]
    await east.round()
    assert east.leading
    clock[0] += LeaderSettings().check_ttl_s - 1.5
    assert east.leading
    clock[0] += 1.0  # past check_ttl_s - margin: no majority confirmed any more
    assert not east.leading
    assert east.sessions == {}
    assert east.changed.is_set()


async def test_the_metadata_check_asks_other_brokers_when_one_is_dead() -> None:
    # aiokafka sends each admin request to a random known broker: with one of three dead,
    # a third of the rounds failed and three in a row downed the region (chaos: leader-kill).
    # The prober's KafkaAdmin tries each call once and raises ours (ClientError).
    from crossdc.errors import ClientError
    from dr.controller.health import RegionProber

    class Admin:
        def __init__(self, dead_picks: int) -> None:
            self.dead_picks, self.asked = dead_picks, 0

        async def describe_cluster(self) -> dict[str, object]:
            self.asked += 1
            if self.asked <= self.dead_picks:
                raise ClientError("describe cluster failed: NodeNotReadyError: node 1")
            return {"brokers": [2, 3], "controller_id": 2}

    meta = await RegionProber._ask_any_broker(Admin(dead_picks=2))  # type: ignore[arg-type]
    assert meta["brokers"] == [2, 3]
    with pytest.raises(ClientError):
        await RegionProber._ask_any_broker(Admin(dead_picks=99))  # type: ignore[arg-type]


def test_the_prober_bootstraps_again_from_every_broker_it_has_seen() -> None:
    # The chaos suite's leader-kill: a 3-broker region whose topology named its first broker
    # only; that broker died, the prober renewed its clients after failed canary rounds and
    # could bootstrap from nothing else, so the controller failed the region over.
    from dr.controller.config import HealthSettings
    from dr.controller.health import RegionProber

    region = _topology().region("east")
    prober = RegionProber(region, HealthSettings(), "c1")
    first = region.kafka.bootstrap_servers[0]
    assert prober.bootstrap_servers() == [first]
    prober.learn({"brokers": [{"node_id": 1, "host": "127.0.0.1", "port": 1},
                              {"node_id": 2, "host": "127.0.0.1", "port": 2},
                              {"node_id": 3, "host": "127.0.0.1", "port": 3}]})
    assert prober.bootstrap_servers() == [first, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    prober.learn({"brokers": []})  # an answer naming nobody forgets nothing
    assert len(prober.bootstrap_servers()) == 4
    prober.learn({"brokers": [{"node_id": 2, "host": "127.0.0.1", "port": 2}]})
    assert prober.bootstrap_servers() == [first, "127.0.0.1:2"]


async def test_the_clients_renewed_after_failed_rounds_list_topics_from_any_broker() -> None:
    # leader-kill, second re-run: after failed canary rounds the prober renewed its clients;
    # listing topics went to the dead broker, the set-up failed, the region was called down.
    from crossdc.errors import ClientError
    from dr.controller.health import _any_broker

    asked = 0

    async def list_topics() -> list[str]:
        nonlocal asked
        asked += 1
        if asked <= 2:
            raise ClientError("list topics failed: NodeNotReadyError: node 1")
        return ["_crossdc.canary"]

    assert await _any_broker(list_topics) == ["_crossdc.canary"]
    assert asked == 3


async def test_a_canary_topic_not_made_in_time_is_the_canarys_failure_under_its_grace() -> None:
    # CI, chaos suite: the leader's first three probes of a primary just started, on a loaded
    # machine, timed out creating the canary topic. That was counted as Kafka failing (the
    # metadata answered), three hard failures downed the region, and a healthy primary
    # was failed over before the drill began.
    from crossdc.errors import ClientError
    from dr.controller.config import HealthSettings
    from dr.controller.health import Hysteresis, RegionProber

    class Admin:
        created = 0

        async def describe_cluster(self) -> dict[str, object]:
            return {"brokers": [{"node_id": 1, "host": "127.0.0.1", "port": 1}],
                    "controller_id": 1}

        async def list_topics(self) -> list[str]:
            return []

        async def create_topics(self, specs: object, unchecked: bool = False) -> None:
            self.created += 1
            raise ClientError("create topics ['_crossdc.canary'] failed: RequestTimedOutError")

        async def stop(self) -> None:
            return None

    prober = RegionProber(_topology().region("east"), HealthSettings(proxy=False), "c1")
    admin = Admin()
    prober._admin = admin  # type: ignore[assignment]
    judge = Hysteresis("east", failures_to_down=3, successes_to_up=3, canary_grace_ms=15_000)
    for _ in range(3):
        rnd = await prober.probe()
        assert rnd.checks["kafka"].ok, rnd.checks
        assert not rnd.checks["canary"].ok
        assert "canary setup" in rnd.checks["canary"].detail
        assert rnd.canary_only
        judge.observe(rnd)
    assert admin.created == 3, "each round tries to make the canary again"
    assert prober._admin is admin, "the admin client that answered is kept"
    assert judge.status != "down", "a region that answers metadata is not down before the grace"
    await prober.stop()


async def test_a_canary_stuck_on_a_dead_cluster_ends_its_round_as_a_kafka_failure() -> None:
    # CI, the primary-outage drill: the brokers were killed while the round's canary waited
    # for its record; the round ended 2 s later (the canary's deadline) as a canary-only
    # failure, which does not count towards `failures_to_down`, and detection took 3.2 s.
    from crossdc.errors import ClientError
    from dr.controller.config import HealthSettings
    from dr.controller.health import RegionProber

    class Admin:
        dead = False

        async def describe_cluster(self) -> dict[str, object]:
            if self.dead:
                raise ClientError("describe cluster failed: KafkaConnectionError")
            return {"brokers": [{"node_id": 1, "host": "127.0.0.1", "port": 1}],
                    "controller_id": 1}

        async def stop(self) -> None:
            return None

    settings = HealthSettings(proxy=False, interval_s=0.1, timeout_s=1.0)
    prober = RegionProber(_topology().region("east"), settings, "c1")
    admin = Admin()
    prober._admin = admin  # type: ignore[assignment]
    in_flight, canaries = asyncio.Event(), []

    async def stuck_canary() -> CheckResult:  # a producer retrying a broker that died
        canaries.append(1)
        in_flight.set()
        await asyncio.sleep(3600)
        raise AssertionError("never answered")

    prober._canary_round = stuck_canary  # type: ignore[method-assign]
    probe = asyncio.create_task(prober.probe())
    await in_flight.wait()
    admin.dead = True  # the cluster dies while the canary waits
    t0 = time.monotonic()
    rnd = await asyncio.wait_for(probe, 2.0)
    assert time.monotonic() - t0 < 0.5, "the round ends once the metadata fails, not at 2 s"
    assert not rnd.checks["kafka"].ok
    assert "metadata" in rnd.checks["kafka"].detail
    assert not rnd.checks["canary"].ok
    assert not rnd.canary_only, "a hard failure"
    judge = Hysteresis("east", failures_to_down=3, successes_to_up=3, canary_grace_ms=15_000)
    judge.observe(rnd)
    assert judge.hard_failures == 1
    admin.dead = False  # metadata answers again: the next round waits for the same canary
    nxt = asyncio.create_task(prober.probe())
    await asyncio.sleep(0.35)
    assert not nxt.done(), "it waits for the canary that is out"
    assert canaries == [1], "no second canary while the first is out"
    task = prober._canary_task
    assert task is not None
    await prober.stop()  # the canary's task is cancelled and awaited: none left behind
    assert task.cancelled()
    nxt.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await nxt


# -- issue 21: the failover path's defects, each with the test that fails on the old code ---
def _engine(topo: Topology, **kw: object) -> tuple[object, list[FailoverRecord]]:
    from dr.controller.config import FailoverSettings
    from dr.controller.datacenters import Datacenters
    from dr.controller.failover import FailoverEngine
    saved: list[FailoverRecord] = []

    async def persist(rec: FailoverRecord) -> FailoverRecord:
        rec = rec.model_copy(update={"seq": rec.seq + 1})
        saved.append(rec)
        return rec

    settings = ControllerSettings(region="east", failover=FailoverSettings(
        primary_lease_s=5.0, primary_write_s=2.0, lease_margin_s=0.5))
    engine = FailoverEngine(topo, settings, Datacenters(topo), persist,
                            **kw)  # type: ignore[arg-type]
    return engine, saved


async def test_an_error_inside_a_step_fails_the_step_and_never_escapes() -> None:
    # Defect 5: a raw KafkaConnectionError from the offset map escaped the lead round and
    # ended the controller process.
    from aiokafka.errors import KafkaConnectionError
    engine, saved = _engine(_topology())
    done = {"status": "done", "started_ms": 1, "ended_ms": 2}
    rec = FailoverRecord(source="east", target="west", epoch=4, from_epoch=3)
    for name in ("fence", "lease_wait", "drain"):
        rec = rec.with_step(name, **done)

    async def offsets(r: FailoverRecord) -> FailoverRecord:
        raise KafkaConnectionError("broker gone mid-call")

    engine._offsets = offsets  # type: ignore[attr-defined]
    final = await engine.execute(rec)  # type: ignore[attr-defined]
    assert final.state == "failed"
    assert final.step("offsets").status == "failed"
    assert "KafkaConnectionError" in final.error
    assert "offsets" in final.error
    assert [r.seq for r in saved] == sorted(r.seq for r in saved), "ordered by sequence"
    await engine.dcs.close()  # type: ignore[attr-defined]


async def test_the_drain_asks_no_region_for_hints_toward_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hints toward a region are never stored in it (proxy.hints): with the source down and
    the target the only other region, the drain has nobody to ask, and asks nobody."""
    import dr.controller.failover as failover_mod

    asked: list[tuple[str, tuple[str, ...]]] = []

    async def pending_hints(conn: object, region: str, targets: list[str],
                            timeout_s: float = 5.0) -> dict[str, int]:
        asked.append((region, tuple(targets)))
        return {t: 0 for t in targets}

    monkeypatch.setattr(failover_mod, "pending_hints", pending_hints)
    engine, _ = _engine(_topology(), is_down=lambda r: r == "east")
    rec = FailoverRecord(source="east", target="west", epoch=4, from_epoch=3)
    out = await engine._drain(rec)  # type: ignore[attr-defined]
    assert asked == []
    assert out.step("drain").status == "skipped"
    assert "hints toward west: 0 replayed, 0 left" in out.step("drain").detail
    # the source answering: it is asked for its hints toward the target, the target never
    engine2, _ = _engine(_topology())

    async def behind(*a: object, **kw: object) -> Behind:
        return Behind(0, 0.0)

    monkeypatch.setattr(failover_mod, "behind", behind)
    out = await engine2._drain(rec)  # type: ignore[attr-defined]
    assert asked == [("east", ("west",))]
    assert out.step("drain").detail.startswith("0 record(s) copied, 0 left")
    await engine.dcs.close()  # type: ignore[attr-defined]
    await engine2.dcs.close()  # type: ignore[attr-defined]


async def test_a_step_that_hangs_fails_at_its_time_limit() -> None:
    import asyncio

    from dr.controller.config import FailoverSettings
    engine, _ = _engine(_topology())
    engine.settings = ControllerSettings(  # type: ignore[attr-defined]
        region="east", failover=FailoverSettings(step_timeout_s=0.05))
    rec = FailoverRecord(source="east", target="west", epoch=4, from_epoch=3)
    for name in ("fence", "lease_wait", "drain", "offsets"):
        rec = rec.with_step(name, status="done")

    async def promote(r: FailoverRecord) -> FailoverRecord:
        await asyncio.Event().wait()  # a Consul call that never answers
        return r

    engine._promote = promote  # type: ignore[attr-defined]
    final = await engine.execute(rec)  # type: ignore[attr-defined]
    assert final.state == "failed"
    assert "not done within" in final.error
    await engine.dcs.close()  # type: ignore[attr-defined]


async def test_a_lag_figure_from_a_long_gone_leader_is_refused_and_says_so() -> None:
    # Defect 3: a controller that led days ago trusted a days-old "0 behind".
    from dr.controller.errors import FailoverRefused
    from dr.controller.failover import Behind
    from dr.controller.state import now_ms
    old = Behind(0, 1.0, at_ms=now_ms() - 3 * 86_400_000, measured=True)
    engine, _ = _engine(_topology(), last_behind=lambda s, t: old,
                        is_down=lambda r: r == "east")
    with pytest.raises(FailoverRefused) as info:
        await engine.check("east", "west", force=False)  # type: ignore[attr-defined]
    assert info.value.rule == "lag-too-old"
    assert "lag_max_age_s" in str(info.value)
    fresh = Behind(0, 1.0, at_ms=now_ms() - 1000)
    engine.last_behind = lambda s, t: fresh  # type: ignore[attr-defined]
    lag = await engine.check("east", "west", force=False)  # type: ignore[attr-defined]
    assert lag.records == 0
    assert not lag.measured
    await engine.dcs.close()  # type: ignore[attr-defined]


async def test_a_resumed_lease_wait_waits_the_whole_lease_on_its_own_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Defect 6: the wait was computed from `ended_ms`, another host's wall clock: a fence
    # stamped "long ago" by a clock ahead of ours skipped the wait altogether.
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr("dr.controller.failover.asyncio.sleep", sleep)
    clock = [1000.0]
    engine, _ = _engine(_topology(), clock=lambda: clock[0])
    rec = FailoverRecord(source="east", target="west", epoch=4, from_epoch=3).with_step(
        "fence", status="done", started_ms=1, ended_ms=2)  # "fenced in 1970"
    await engine._lease_wait(rec)  # type: ignore[attr-defined]
    assert slept == [pytest.approx(7.5)], "5 s lease + 2 s longest write + 0.5 s margin"
    # fenced by this process 3 s ago (its monotonic clock): the rest of the wait
    engine._fenced_at[rec.id] = clock[0] - 3.0  # type: ignore[attr-defined]
    await engine._lease_wait(rec)  # type: ignore[attr-defined]
    assert slept[-1] == pytest.approx(4.5)
    await engine.dcs.close()  # type: ignore[attr-defined]


def test_failover_records_are_ordered_by_epoch_and_sequence_not_wall_clock() -> None:
    # Defect 2 (last part) and 6: the newest record was chosen by `updated_ms`.
    from dr.controller.state import newest_failover_of
    done = FailoverRecord(source="east", target="west", from_epoch=3, epoch=4, seq=9,
                          state="done", updated_ms=5_000)
    stale = FailoverRecord(source="east", target="west", from_epoch=3, epoch=None, seq=2,
                           updated_ms=9_999_999_999)  # a deposed leader's clock ahead
    newer = FailoverRecord(source="west", target="east", from_epoch=4, seq=1, updated_ms=1)
    assert newest_failover_of([stale, done]) is done
    assert newest_failover_of([done, stale, newer]) is newer


async def test_the_sync_does_nothing_while_a_failover_record_is_open() -> None:
    # Defect 10: the sync checked "no failover running" and missed a failed, still fenced one.
    from dr.controller import Controller
    from dr.controller.datacenters import PrimaryView
    from dr.controller.sync import SyncContext
    topo = _topology()
    ctl = Controller(topo, ControllerSettings(region="east"))
    cur = PrimaryRecord(region="east", epoch=3)
    ctl.view = PrimaryView({"east": cur}, {"east": 1}, {}, {}, cur)
    assert SyncContext.of(ctl).primary == "east"
    ctl.last_failover = FailoverRecord(source="east", target="west", from_epoch=3, epoch=4,
                                       state="failed")
    assert SyncContext.of(ctl).primary is None
    assert SyncContext.of(ctl).still_primary is not None, "asked again before committing"
    await ctl.dcs.close()


def test_a_same_epoch_conflict_counts_as_fenced() -> None:
    from dr.controller.datacenters import newest_primary
    a = PrimaryRecord(region="east", epoch=5)
    b = PrimaryRecord(region="west", epoch=5)
    cur, conflict = newest_primary([a, b, PrimaryRecord(region="east", epoch=4)],
                                   PrimaryRecord(region="east", epoch=0))
    assert conflict == ("east", "west")
    assert cur.fenced
    assert cur.epoch == 5
    assert cur.writable is None
    cur, conflict = newest_primary([a, a], PrimaryRecord(region="east", epoch=0))
    assert cur == a
    assert conflict == ()


def test_why_no_automatic_failover_names_the_majority_then_the_leader_then_the_gate() -> None:
    """What `dr drill` appends when no failover came: the first thing in the records that
    stops an automatic one."""
    rec = PrimaryRecord(region="east", epoch=3, by="test")
    base = ControllerView(primary={"east": rec, "west": rec, "witness": rec}, unreachable={},
                          current=rec, stale=[], leader=LeaderRecord(controller_id="c",
                                                                     region="west"),
                          gate=GateRecord(), health={}, failover=None, datacenters=3,
                          majority=2)
    assert base.why_no_automatic_failover() == ""
    cut = base.model_copy(update={"primary": {"east": rec}, "unreachable": {
        "west": "no answer", "witness": "no answer"}})
    assert cut.why_no_automatic_failover().startswith(
        "only 1 of 3 datacenters answer (a majority is 2)")
    no_leader = base.model_copy(update={"leader": None})
    assert no_leader.why_no_automatic_failover() == "no controller holds the leader lock"
    gate = GateRecord(closed=True, by="ops", reason="maintenance")
    assert base.model_copy(update={"gate": gate}).why_no_automatic_failover() == (
        "the gate is closed by ops: maintenance")


# -- issue 36, defect 1: a forced record never overrides one a majority held -------------------
def test_a_forced_record_never_supersedes_an_unforced_one_whatever_its_epoch() -> None:
    """The standby cut off alone, an operator there forced a failover (west@1, forced); the
    majority kept east@0. At the heal east@0 stays the routing truth (before: west@1 won,
    and east's acknowledged ordered records became a quarantined 'divergent tail')."""
    from dr.controller.datacenters import newest_primary
    east0 = PrimaryRecord(region="east", epoch=0, by="topology")
    fence = east0.fence("operator", forced=True)
    west1 = fence.promote("west", "operator")
    assert fence.forced
    assert west1.forced, "the promote keeps the fence's forced mark"
    assert not west1.supersedes(east0)
    assert east0.supersedes(west1)
    assert west1.supersedes(fence), "within the forced side, the usual order"
    cur, conflict = newest_primary([east0, east0, west1], PrimaryRecord.initial(_topology()))
    assert (cur, conflict) == (east0, ())
    # an unforced record at a LOWER epoch than a forced one still wins; so does a failover
    # the majority made meanwhile
    east2 = PrimaryRecord(region="east", epoch=2, fenced=True).promote("east", "ctl")
    cur, _ = newest_primary([west1, east2, None], PrimaryRecord.initial(_topology()))
    assert cur == east2
    # a forced record at the epoch of an unforced one naming another region is no conflict
    west0_forced = PrimaryRecord(region="west", epoch=0, forced=True)
    assert newest_primary([east0, west0_forced], east0) == (east0, ())


def test_a_forced_record_is_the_newest_only_where_every_datacenter_holds_one() -> None:
    """What the leader adopts: every answering datacenter holds a forced record (the lost
    ones removed from the topology). A datacenter without the key stands for the topology's
    record: found by the integration test, whose majority side had never written the key
    and adopted the minority's forced record."""
    from dr.controller.datacenters import newest_primary
    west1 = PrimaryRecord(region="east", epoch=1, fenced=True, forced=True
                          ).promote("west", "operator")
    initial = PrimaryRecord.initial(_topology())
    cur, _ = newest_primary([None, west1, None], initial)
    assert cur == initial, "absent keys are the topology's (unforced) record"
    cur, _ = newest_primary([west1, west1], initial)
    assert cur == west1
    adopted = cur.adopted("controller:x")
    assert not adopted.forced
    assert (adopted.region, adopted.epoch, adopted.fenced) == ("west", 1, False)
    assert adopted.supersedes(west1), "the adoption replaces the forced copy"
    assert newest_primary([adopted, west1], initial)[0] == adopted
    assert newest_primary([], initial)[0] == initial


def test_the_forced_flag_is_written_only_when_true() -> None:
    """Readers from before the flag forbid unknown fields: every record a majority writes
    must stay readable by them."""
    import json
    plain = PrimaryRecord(region="east", epoch=3)
    assert "forced" not in json.loads(plain.encode())
    forced = PrimaryRecord(region="west", epoch=4, forced=True)
    assert json.loads(forced.encode())["forced"] is True
    assert PrimaryRecord.decode(forced.encode()) == forced
    assert PrimaryRecord.decode(plain.encode()) == plain


def test_the_lease_wait_is_the_longer_of_the_proxies_record_and_the_controllers() -> None:
    """Defect 4: the fencer waited its own primary_lease_s while the proxies held the lease
    the previous fencer wrote into the record (e.g. the CLI's defaults against a record
    written with longer settings)."""
    from dr.controller.config import FailoverSettings
    from dr.controller.failover import FailoverEngine

    class _Dcs:
        majority = 2

    settings = ControllerSettings(region="east", failover=FailoverSettings(
        primary_lease_s=2.0, primary_write_s=0.5, lease_margin_s=0.25))
    engine = FailoverEngine(_topology(), settings, _Dcs(), None)  # type: ignore[arg-type]
    assert engine.lease_wait_for(None) == pytest.approx(2.75)
    held = PrimaryRecord(region="east", epoch=3, lease_s=9.0, write_s=1.5)
    assert engine.lease_wait_for(held) == pytest.approx(9.0 + 1.5 + 0.25)
    shorter = PrimaryRecord(region="east", epoch=3, lease_s=1.0, write_s=0.1)
    assert engine.lease_wait_for(shorter) == pytest.approx(2.75)
    rec = FailoverRecord(source="east", target="west", prior_lease_s=9.0, prior_write_s=1.5)
    assert engine.step_limit_s("lease_wait", rec) > 9.0 + 1.5 + 0.25
