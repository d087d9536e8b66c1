"""Service discovery: every region's brokers in every datacenter's catalog, the primary's
tagged `primary`, and a prepared query `kafka-primary`, so that Consul DNS answers the
current primary's brokers in every datacenter:

    primary.kafka.service.<dc>.consul      tag lookup (A and SRV records)
    region-<name>.kafka.service.<dc>.consul one region's brokers
    kafka-primary.query.consul             prepared query, failing over to the other
                                           datacenters in preference order

Each instance carries a TTL check that the leading controller sets from its health verdict
(passing up, warning degraded, critical down), so DNS drops a lost region's brokers. While
the primary record is fenced no instance is tagged `primary`: DNS answers nothing, which is
the truth (no region takes ordered writes).
"""

from __future__ import annotations

from typing import Literal

import structlog

from crossdc.clients.consul import PreparedQuery
from crossdc.primary import PrimaryRecord
from crossdc.topology import Region, split_hostport
from dr.controller.datacenters import Datacenters, failure_of
from dr.controller.state import RegionHealth

__all__ = ["KAFKA_SERVICE", "PRIMARY_QUERY", "PRIMARY_TAG", "DnsPublisher"]

log = structlog.get_logger("crossdc.controller.dns")

KAFKA_SERVICE = "kafka"
PRIMARY_TAG = "primary"
PRIMARY_QUERY = "kafka-primary"
CHECK_TTL = "30s"
"""Longer than a leader takeover: the checks keep their last verdict while leaders change."""

Status = Literal["passing", "warning", "critical"]
_STATUS: dict[str, Status] = {"up": "passing", "degraded": "warning", "down": "critical",
                              "unknown": "warning"}


def instance_ids(region: Region) -> list[tuple[str, str, int]]:
    """`(service id, host, port)` of each of the region's brokers."""
    out = []
    for i, hostport in enumerate(region.kafka.bootstrap_servers):
        host, port = split_hostport(hostport)
        out.append((f"kafka-{region.name}-{i}", host, port))
    return out


class DnsPublisher:
    """Keeps every reachable datacenter's catalog in step with the primary and health."""

    def __init__(self, dcs: Datacenters) -> None:
        self.dcs = dcs
        self.topology = dcs.topology
        self._published: dict[str, tuple[str | None, int]] = {}
        """datacenter → (primary region tagged there, epoch) last written."""
        self._queries: set[str] = set()

    def _failover_dcs(self, dc: str) -> tuple[str, ...]:
        others = [r for r in self.topology.preference if r != dc]
        return tuple(self.topology.region(r).consul.datacenter for r in others)

    async def publish(self, primary: PrimaryRecord, *, force: bool = False) -> dict[str, str]:
        """Register (or re-tag) every region's brokers in every reachable datacenter and
        make sure the prepared query exists there; region → error for those that failed."""
        results = await self.dcs.each(lambda dc: self._publish_dc(dc, primary, force))
        errors: dict[str, str] = {}
        for dc, res in zip(self.dcs.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                errors[dc] = why
                self._published.pop(dc, None)
        return errors

    async def _publish_dc(self, dc: str, primary: PrimaryRecord, force: bool) -> None:
        want = (primary.writable, primary.epoch)
        if not force and self._published.get(dc) == want and dc in self._queries:
            return
        client = self.dcs.client(dc)
        for region in self.topology.regions:
            tags = [f"region-{region.name}"]
            if primary.writable == region.name:
                tags.append(PRIMARY_TAG)
            for sid, host, port in instance_ids(region):
                await client.register_service(
                    KAFKA_SERVICE, sid, host, port, tags=tags,
                    meta={"region": region.name, "epoch": str(primary.epoch)},
                    check={"CheckID": f"{sid}:health", "Name": f"{region.name} health "
                           "(crossdc controller)", "TTL": CHECK_TTL,
                           "Status": "passing"})
        # a witness's agent answers for the regions too (it has no Kafka of its own)
        datacenter = next(d.consul.datacenter for d in self.topology.datacenters
                          if d.name == dc)
        await client.query_upsert(PreparedQuery(
            # critical (down) instances are always left out; warning (degraded: Kafka
            # answers, the proxy does not) stays in, as in the tag lookups
            name=PRIMARY_QUERY, service=KAFKA_SERVICE, tags=(PRIMARY_TAG,), only_passing=False,
            failover_datacenters=self._failover_dcs(dc), dns_ttl_s=0), dc=datacenter)
        self._queries.add(dc)
        self._published[dc] = want
        log.info("dns_published", dc=dc, primary=primary.writable, epoch=primary.epoch)

    async def health(self, verdicts: dict[str, RegionHealth]) -> None:
        """Set each instance's TTL check from its region's verdict, in every reachable
        datacenter (also the heartbeat that keeps the TTL from running out)."""

        async def one(dc: str) -> None:
            client = self.dcs.client(dc)
            for region in self.topology.regions:
                v = verdicts.get(region.name)
                status = _STATUS[v.status if v else "unknown"]
                note = f"{region.name}: {v.status if v else 'unknown'}"
                if v is not None:
                    note += " — " + ", ".join(f"{k} {'ok' if c.ok else 'FAILED'}"
                                              f"{'' if c.ok else ' (' + c.detail + ')'}"
                                              for k, c in v.checks.items())
                for sid, _, _ in instance_ids(region):
                    await client.check_update(f"{sid}:health", status, note)

        results = await self.dcs.each(one)
        for dc, res in zip(self.dcs.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                # Its catalog may have lost our registrations (agent restarted): re-publish.
                self._published.pop(dc, None)
                log.debug("dns_health_failed", dc=dc, error=why)
