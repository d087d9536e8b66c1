"""Kafka ACLs: what each crossdc principal may do, and the fence in Kafka itself.

With SASL/SCRAM on (a region's `security:` in the topology), each component connects as its
own principal (crossdc.security.PRINCIPALS) and the brokers enforce ACLs
(StandardAuthorizer, `allow.everyone.if.no.acl.found=false`). `component_acls()` is what
each may do; `dr up` grants it as the brokers' super user. Every ACL names the principal the
region's brokers see the component as (`KafkaSecurity.kafka_principal`: a certificate's
subject, a token's `sub`, by default the component's own name), so the fence denies whoever
the proxies really are there.

The fence, in Kafka: the proxies' principal may write the ordered topics of a region only
while that region is the writable primary. `KafkaFence.reconcile(primary)` makes every
secure region's ACLs say so: DENY WRITE for the proxies' principal (User:crossdc-proxy by
default) on each ordered topic of a
region that is not the writable primary (a fenced record: of every region), none on the
primary's. The mirror's principal is not named by a deny, so it keeps carrying records
in. The failover's fence step denies the old primary at once; its promote step lifts the
target's deny before naming it; the leading controller reconciles every second, so a region
that was unreachable at the fence gets its deny as soon as it answers again (and before any
promote of it: a promote names only a region its engine lifted the deny of, after the fenced
state was applied), and topics created later are covered within a round.

Ordered means: the routing policy's rule for the topic is `ordered` without `sync`. Sync
topics are written by the proxies into every region (dual-write), so they cannot be denied
in standbys; `nearest` topics are the proxies' own region's. Without a policy file every
topic counts as ordered (the policy's default mode). Internal topics (`_` prefix) are left
alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import AclBinding, KafkaAdmin
from crossdc.errors import ConfigError, ConfigIssue, CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.security import ADMIN, CONTROLLER, MIRROR, PROXY, RECONCILE, KafkaSecurity
from crossdc.settings import RetrySettings
from crossdc.topology import Region, Topology
from proxy.fenced import WRITE_TXN_PREFIX
from proxy.policy import default_policy_path
from proxy.replaytxn import REPLAY_TXN_PREFIX

__all__ = ["KafkaFence", "component_acls", "grant_component_acls", "proxy_deny"]

log = structlog.get_logger("crossdc.controller.acl")

PROXY_INTERNAL_PREFIX = "_crossdc.proxy."
"""Topics the proxies keep for themselves (created, read and written by them)."""


def _user(principal: str, security: KafkaSecurity | None) -> str:
    """The ACL principal of component `principal` in a region secured by `security`."""
    name = principal if security is None else security.kafka_principal(principal)
    return f"User:{name}"


def component_acls(security: KafkaSecurity | None = None) -> list[AclBinding]:
    """ALLOW bindings for every component principal (all topics: `*`), each named as the
    brokers of a region secured by `security` see it."""
    out: list[AclBinding] = []

    def allow(principal: str, resource: str, ops: list[str]) -> None:
        name = "kafka-cluster" if resource == "cluster" else "*"
        out.extend(AclBinding(resource, name, _user(principal, security),  # type: ignore[arg-type]
                              op) for op in ops)

    proxy = _user(PROXY, security)

    # proxy: produce (idempotent) to any topic, and read any for the clients that consume
    # through it (`Consume`, docs/consume.md: the token's topic patterns decide who reads
    # what; the mirror's offset maps, for the handover when the primary moves)
    allow(PROXY, "topic", ["WRITE", "DESCRIBE", "READ"])
    allow(PROXY, "cluster", ["IDEMPOTENT_WRITE"])
    # ... and its own internal topics (the shared idempotency store, proxy/idempotency.py)
    out.extend(AclBinding("topic", PROXY_INTERNAL_PREFIX, proxy, op, pattern="PREFIXED")
               for op in ("CREATE", "READ", "DESCRIBE_CONFIGS"))
    # ... and its consumer groups: the hints' replay (proxy/hints.py) and the members reading
    # for its clients (`_crossdc.proxy.consume.<group>.<scope>`)
    out.append(AclBinding("group", PROXY_INTERNAL_PREFIX, proxy, "READ",
                          pattern="PREFIXED"))
    # ... and the hints replay's transactions (proxy/replaytxn.py) and the fenced writes'
    # (proxy/fenced.py)
    out.extend(AclBinding("transactional_id", prefix, proxy, op, pattern="PREFIXED")
               for prefix in (REPLAY_TXN_PREFIX, WRITE_TXN_PREFIX) for op in ("WRITE", "DESCRIBE"))
    # mirror: read sources, write/create targets, its groups, offset syncs, transactions
    allow(MIRROR, "topic", ["ALL"])
    allow(MIRROR, "group", ["ALL"])
    allow(MIRROR, "transactional_id", ["ALL"])
    allow(MIRROR, "cluster", ["IDEMPOTENT_WRITE", "DESCRIBE", "DESCRIBE_CONFIGS"])
    # controller: health canaries, consumer group offsets, tails, and the ACLs of the fence
    allow(CONTROLLER, "topic", ["ALL"])
    allow(CONTROLLER, "group", ["ALL"])
    allow(CONTROLLER, "transactional_id", ["ALL"])
    allow(CONTROLLER, "cluster", ["ALL"])
    # reconciliation: read only
    allow(RECONCILE, "topic", ["READ", "DESCRIBE", "DESCRIBE_CONFIGS"])
    allow(RECONCILE, "group", ["READ", "DESCRIBE"])
    return out


def proxy_deny(topic: str, security: KafkaSecurity | None = None) -> AclBinding:
    """The fence on one topic: the proxies' principal (as the brokers of a region secured
    by `security` see it) may not write it."""
    return AclBinding("topic", topic, _user(PROXY, security), "WRITE", permission="DENY")


async def grant_component_acls(region: Region, retry: RetrySettings | None = None) -> None:
    """Grant `component_acls()` in the region's cluster, as the super user."""
    # generous: right after start-up the quorum may still be slow to commit
    retry = retry or RetrySettings(attempts=5, total_s=90.0, call_timeout_s=30.0)
    async with KafkaAdmin(KafkaConnection.of(region, principal=ADMIN), retry) as admin:
        await admin.create_acls(acls := component_acls(region.security))
    log.info("component_acls_granted", region=region.name, acls=len(acls))


class KafkaFence:
    """The proxies' write fence in Kafka for the secure regions of a topology, set as
    `principal` (the controller's, or the operator's: `NoKafkaPrincipal` at once when a
    secure region needs one and none is named)."""

    def __init__(self, topology: Topology, policy_path: Path | None = None, *,
                 timeout_s: float = 3.0, principal: str | None = None,
                 guard: Callable[[], None] = lambda: None) -> None:
        self.topology = topology
        self.guard = guard
        """Raises (NotLeader) once this process may no longer act: checked right before a
        deny is lifted, the side effect a deposed leader must never have (issue 36)."""
        self.regions = [r for r in topology.regions if r.security is not None]
        self.security: dict[str, KafkaSecurity] = {}
        """Per region, its security: whom its brokers see the proxies as."""
        for i, r in enumerate(topology.regions):
            if r.security is None:
                continue
            # a deny that names nobody the proxies are, or the mirror too, is no fence:
            # refused when built (a pinned username shared by every component gets here)
            why = r.security.fence_conflict()
            if why:
                raise ConfigError([ConfigIssue("topology", None, f"regions[{i}].security",
                                               f"region {r.name}: {why}")])
            self.security[r.name] = r.security
        self.kafka = {r.name: KafkaConnection.of(r, principal=principal) for r in self.regions}
        for conn in self.kafka.values():
            conn.user()  # fail closed here, not in a step that logs "pending"
        self.policy_path = policy_path if policy_path is not None or not self.regions \
            else default_policy_path()
        self.timeout_s = timeout_s
        # one try, bounded: a region that does not answer is tried again next round
        self.retry = RetrySettings(attempts=1, total_s=timeout_s * 2, call_timeout_s=timeout_s)
        self.interval_s = 3.0
        """Between two reconciliations of an unchanged primary record (each opens a SASL
        connection per region); a changed record is acted on at once."""
        self._last: tuple[PrimaryRecord, float] | None = None
        self.denied: dict[str, set[str]] = {}
        """Per region, the topics this process last denied (for reports only: every
        decision reads Kafka's ACLs)."""

    @property
    def enabled(self) -> bool:
        return bool(self.regions)

    def _ordered(self, topics: list[str]) -> list[str]:
        topics = [t for t in topics if not t.startswith("_")]
        if self.policy_path is None or not self.policy_path.is_file():
            return topics
        from proxy.policy import load_policy
        policy = load_policy(self.policy_path, self.topology)
        out = []
        for t in topics:
            rule = policy.rule_for(t)
            if rule is not None and rule.dr_mode == "ordered":
                out.append(t)
        return out

    async def deny(self, region: str) -> list[str]:
        """Deny the proxies WRITE on every ordered topic of `region` (idempotent); the
        topics newly denied. ClientError when the region does not answer."""
        if region not in self.kafka:  # PLAINTEXT: no ACLs
            return []
        async with KafkaAdmin(self.kafka[region], self.retry) as admin:
            topics = self._ordered(await admin.list_topics())
            # Kafka is asked every time, never a cache: a fence that another process (an
            # earlier leader) began must still deny every topic here.
            sec = self.security[region]
            have = await asyncio.gather(*(admin.has_acl(proxy_deny(t, sec)) for t in topics))
            new = [t for t, there in zip(topics, have, strict=True) if not there]
            if new:
                await admin.create_acls([proxy_deny(t, sec) for t in new])
        self.denied[region] = set(topics)
        if new:
            log.warning("kafka_fence_denied", target_region=region, topics=new,
                        principal=_user(PROXY, self.security[region]))
        return new

    async def allow(self, region: str) -> int:
        """Lift the proxies' denies in `region` (every topic's); how many were lifted."""
        if region not in self.kafka:  # PLAINTEXT: no ACLs
            return 0
        async with KafkaAdmin(self.kafka[region], self.retry) as admin:
            topics = await admin.list_topics()
            # Kafka's ACLs are not in Consul's transaction: the closest check to the delete
            # is whether this process still leads (its beats reach a majority)
            self.guard()
            n = await admin.delete_acls([proxy_deny(t, self.security[region])
                                         for t in topics])
        self.denied[region] = set()
        if n:
            log.warning("kafka_fence_lifted", target_region=region, acls=n)
        return n

    async def on_fence(self, region: str, *, reachable: bool = True) -> str:
        """The failover's fence step: deny the old primary now if it answers (else the
        leader's next rounds do, as soon as it does); a note for the step's detail."""
        if not self.enabled or self.topology.region(region).security is None:
            return ""
        if reachable:
            try:
                denied = await self.deny(region)
                return f"; Kafka: proxies denied writes in {region} ({len(denied)} topic(s))"
            except (CrossdcError, OSError, TimeoutError) as exc:
                log.warning("kafka_fence_pending", target_region=region, error=str(exc))
        return f"; Kafka deny in {region} pending (applied when it answers)"

    async def on_promote(self, region: str) -> str:
        """The promote step, once `region` is named in a majority (a leader-bound write: a
        deposed leader's is refused, so it never gets here): lift its deny (best effort:
        else the leader's next round does)."""
        if not self.enabled or self.topology.region(region).security is None:
            return ""
        try:
            await self.allow(region)
            return f"; Kafka: proxies may write {region} again"
        except (CrossdcError, OSError, TimeoutError) as exc:
            log.warning("kafka_unfence_pending", target_region=region, error=str(exc))
            return f"; Kafka deny in {region} still there (lifted when it answers)"

    async def reconcile(self, primary: PrimaryRecord, skip: set[str] | None = None
                        ) -> dict[str, str]:
        """Every secure region's denies as `primary` says (the writable primary: none;
        every other region: its ordered topics). Regions in `skip` (judged down) and those
        that do not answer are left for a later round; the errors, by region."""
        errors: dict[str, str] = {}
        now = time.monotonic()
        if self._last is not None and self._last[0] == primary and \
                now - self._last[1] < self.interval_s:
            return errors
        self._last = (primary, now)

        async def one(region: Region) -> None:
            if skip and region.name in skip:
                return
            try:
                if primary.fenced or primary.region != region.name:
                    await self.deny(region.name)
                else:
                    await self.allow(region.name)  # idempotent: whatever Kafka holds
            except (CrossdcError, OSError, TimeoutError) as exc:
                errors[region.name] = str(exc)

        await asyncio.gather(*(one(r) for r in self.regions))
        return errors
