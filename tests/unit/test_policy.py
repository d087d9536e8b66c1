"""Routing policies: matching, every validation error with its line and field, the examples,
the schema, `dr policy validate|schema`, and hot reload (PolicyStore)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_helpers import eventually
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from crossdc.errors import ConfigError
from crossdc.topology import Topology, load_topology
from dr.stack.paths import REPO_ROOT
from proxy.policy import (
    ConsumeSettings,
    DefaultRule,
    Policy,
    Rule,
    load_policy,
    parse_policy,
)
from proxy.reload import PolicyStore

POLICIES = REPO_ROOT / "policies"
TOPOLOGY = POLICIES / "topology.local.yaml"
EXAMPLES = ["payments.yaml", "ledger.yaml", "clickstream.yaml", "default.yaml"]


@pytest.fixture(scope="module")
def topo() -> Topology:
    return load_topology(TOPOLOGY)


def issues(text: str, topology: Topology | None = None) -> list[str]:
    """Every problem `dr policy validate` reports (unreadable topics included)."""
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml", topology, consumable=True)
    return [str(i) for i in info.value.issues]


def line_of(text: str, needle: str, nth: int = 1) -> int:
    hits = [i for i, ln in enumerate(text.splitlines(), 1) if needle in ln]
    return hits[nth - 1]


# -- matching ------------------------------------------------------------------------------

MATCHING = """\
rules:
  - topic: orders.eu
    mode: nearest
  - topic: "orders.*"
    sync: true
  - topic: "clicks-?"
    mode: nearest
  - topic: "logs.[ab]*"
    mode: nearest
    require_key: true
default:
  mode: nearest
  max_record_bytes: 100
"""


def test_exact_match_beats_a_later_glob_and_glob_matches_the_rest() -> None:
    p = parse_policy(MATCHING, "p.yaml")
    eu, us = p.rule_for("orders.eu"), p.rule_for("orders.us")
    assert eu is not None
    assert us is not None
    assert (eu.topic, eu.dr_mode, eu.key_required) == ("orders.eu", "nearest", False)
    assert (us.topic, us.dr_mode, us.key_required) == ("orders.*", "sync", True)
    clicks = p.rule_for("clicks-1")
    assert clicks is not None
    assert clicks.topic == "clicks-?"
    logs = p.rule_for("logs.alpha")
    assert logs is not None
    assert logs.topic == "logs.[ab]*"
    assert logs.key_required


@pytest.mark.parametrize(("glob", "why"), [
    ("logs.[ab", "'[' at 6 is never closed"),
    ("logs.[z-a]*", "the range z-a in [z-a] is backwards"),
    ("logs]", "']' at 5 outside a [...] class"),
    ("!logs", "'!' at 1 outside a [...] class"),
])
def test_a_glob_that_can_match_no_topic_is_refused_with_its_line(glob: str, why: str) -> None:
    """fnmatch reads anything, taking an unclosed `[` or a stray `]`/`!` literally (no topic
    name holds them) and a backwards range as a class of nothing: such a rule applied to no
    topic, silently. Refused, naming file, line, field and why (issue 37, bad input)."""
    text = f"rules:\n  - topic: orders\n    mode: nearest\n  - topic: \"{glob}\"\n" \
           "    mode: nearest\n"
    [issue] = issues(text)
    assert issue.startswith("p.yaml:4 rules[1].topic:"), issue
    assert why in issue, issue


def test_globs_that_fnmatch_reads_as_meant_are_kept() -> None:
    from proxy.policy import glob_problem

    for glob in ("orders.*", "logs.[ab]*", "logs.[!ab]?", "x[]]", "x[!]]", "a[0-9]", "*"):
        assert glob_problem(glob) is None, glob
    assert parse_policy(MATCHING, "p.yaml").rules[3].topic == "logs.[ab]*"


def test_a_token_with_an_unusable_glob_is_refused() -> None:
    from pydantic import ValidationError

    from proxy.auth import TokenEntry

    with pytest.raises(ValidationError, match="is never closed"):
        TokenEntry(name="app", sha256="0" * 64, topics=["payments.[ab"])


def test_globs_are_case_sensitive_and_anchored() -> None:
    p = parse_policy(MATCHING, "p.yaml")
    for topic in ("Orders.us", "xorders.us", "clicks-10", "logs.c"):
        rule = p.rule_for(topic)
        assert rule is not None, topic
        assert rule.topic == topic, topic  # fell through to the default


def test_first_match_wins_among_globs() -> None:
    p = Policy(rules=[Rule(topic="a.*", mode="nearest"), Rule(topic="a.b*", sync=True)])
    rule = p.rule_for("a.bc")
    assert rule is not None
    assert rule.topic == "a.*"
    assert rule.dr_mode == "nearest"


def test_default_rule_is_returned_as_a_rule_for_the_topic() -> None:
    p = parse_policy(MATCHING, "p.yaml")
    rule = p.rule_for("misc")
    assert rule == Rule(topic="misc", mode="nearest", max_record_bytes=100)
    assert rule is p.rule_for("misc")  # cached: one lookup per topic
    assert rule.dr_mode == "nearest"
    assert not rule.key_required


def test_unmatched_topic_without_default_or_in_strict_mode_is_refused() -> None:
    assert Policy(rules=[Rule(topic="a")]).rule_for("b") is None
    strict = parse_policy("strict: true\nrules:\n  - topic: a\n", "p.yaml")
    assert strict.rule_for("b") is None
    assert strict.rule_for("a") is not None


def test_mode_defaults() -> None:
    assert Rule(topic="t").dr_mode == "ordered"
    assert Rule(topic="t").key_required
    assert Rule(topic="t", sync=True).dr_mode == "sync"
    assert Rule(topic="t", sync=True).key_required
    assert not Rule(topic="t", mode="nearest").key_required
    assert not Rule(topic="t", require_key=False).key_required
    assert DefaultRule(mode="nearest", require_key=True).key_required
    assert Rule(topic="t").max_record_bytes == 1_048_576


# -- validation: each error names its line and field --------------------------------------


@pytest.mark.parametrize(("text", "needle", "field", "message"), [
    ("rules:\n  - topic: a\n    mode: nearest\n    sync: true\n", "sync: true",
     "rules[0].sync", "sync: true needs mode: ordered (nearest writes one region)"),
    ("rules:\n  - topic: a\n    mode: sync\n", "mode: sync",
     "rules[0].mode", "'sync' is not a mode: write `mode: ordered` and `sync: true`"),
    ("rules:\n  - topic: a\n    mode: fastest\n", "mode: fastest",
     "rules[0].mode", "Input should be 'ordered' or 'nearest'"),
    ("rules:\n  - topic: a\n    quorum: 2\n", "quorum", "rules[0].quorum",
     "quorum is only for sync: true"),
    ("rules:\n  - topic: a\n    sync: true\n    quorum: 0\n", "quorum", "rules[0].quorum",
     "Input should be greater than or equal to 1"),
    ("rules:\n  - topic: a\n    max_record_bytes: 0\n", "max_record_bytes",
     "rules[0].max_record_bytes", "Input should be greater than 0"),
    ("rules:\n  - topic: a\n    prefer: [east]\n", "prefer", "rules[0].prefer",
     "prefer is only for mode: nearest"),
    ("rules:\n  - topic: a\n    mode: nearest\n    prefer: [east, east]\n", "prefer",
     "rules[0].prefer", "each region at most once; repeated: east"),
    ("rules:\n  - topic: a\n    mode: nearest\n    prefer: []\n", "prefer",
     "rules[0].prefer", "List should have at least 1 item after validation, not 0"),
    ("rules:\n  - topic: a\n    require_key: maybe\n", "require_key",
     "rules[0].require_key", "Input should be a valid boolean, unable to interpret input"),
    ("rules:\n  - topic: a b\n", "topic", "rules[0].topic",
     "String should match pattern '^[A-Za-z0-9._\\-*?\\[\\]!]{1,249}$'"),
    ("rules:\n  - mode: nearest\n", "mode", "rules[0].topic", "Field required"),
    ("rules:\n  - topic: a\n    moed: nearest\n", "moed", "rules[0].moed",
     "unknown field (check the spelling)"),
    ("strict: true\ndefault:\n  mode: nearest\n", "mode", "default",
     "strict: true refuses unmatched topics; remove default or strict"),
    ("default:\n  topic: x\n", "topic", "default.topic", "unknown field (check the spelling)"),
    ("default:\n  mode: nearest\n  sync: true\n", "sync", "default.sync",
     "sync: true needs mode: ordered (nearest writes one region)"),
    ("rules:\n  - topic: a\n  - topic: b\n  - topic: a\n", "topic: a", "rules[2].topic",
     "'a' repeats rules[0]; each topic pattern once"),
    ("rules:\n  - topic: 'o.*'\n  - topic: 'o.*'\n", "topic: 'o.*'", "rules[1].topic",
     "'o.*' repeats rules[0]; each topic pattern once"),
    ("rules:\n  - topic: 'o.*'\n  - topic: o.eu\n", "o.eu", "rules[1].topic",
     "never used: rules[0] ('o.*') matches 'o.eu' first; move this rule above it"),
])
def test_each_error_names_line_and_field(text: str, needle: str, field: str,
                                         message: str) -> None:
    # the duplicate's own line: the last occurrence of the needle
    nth = text.count(needle) if "repeats" in message else 1
    assert issues(text) == [f"p.yaml:{line_of(text, needle, nth)} {field}: {message}"]


# -- consume-side settings ------------------------------------------------------------------


def test_consume_settings_default_and_resolve_the_dead_letter_topic() -> None:
    rule = Rule(topic="orders")
    assert rule.consume == ConsumeSettings(ack_deadline_s=30, max_deliveries=5,
                                           dead_letter_topic="dlq.{topic}")
    assert rule.consume.dead_letter_for("orders") == "dlq.orders"
    p = parse_policy("rules:\n  - topic: a\n    consume:\n      ack_deadline_s: 90\n"
                     "      max_deliveries: 2\n      dead_letter_topic: '{topic}-dead'\n"
                     "default:\n  mode: nearest\n  consume: {max_deliveries: 7}\n", "p.yaml")
    a = p.rule_for("a")
    assert a is not None
    assert (a.consume.ack_deadline_s, a.consume.max_deliveries) == (90, 2)
    assert a.consume.dead_letter_for("a") == "a-dead"
    other = p.rule_for("b")  # the default's settings, as a model (not a dict)
    assert other is not None
    assert isinstance(other.consume, ConsumeSettings)
    assert other.consume.max_deliveries == 7


@pytest.mark.parametrize(("text", "needle", "field", "message"), [
    ("rules:\n  - topic: a\n    consume:\n      ack_deadline_s: 0.5\n", "ack_deadline_s",
     "rules[0].consume.ack_deadline_s", "Input should be greater than or equal to 1"),
    ("rules:\n  - topic: a\n    consume:\n      ack_deadline_s: 7200\n", "ack_deadline_s",
     "rules[0].consume.ack_deadline_s", "Input should be less than or equal to 3600"),
    ("rules:\n  - topic: a\n    consume:\n      ack_deadline_s: .nan\n", "ack_deadline_s",
     "rules[0].consume.ack_deadline_s", "Input should be a finite number"),
    ("rules:\n  - topic: a\n    consume:\n      max_deliveries: 0\n", "max_deliveries",
     "rules[0].consume.max_deliveries", "Input should be greater than or equal to 1"),
    ("rules:\n  - topic: a\n    consume:\n      max_deliveries: 1000\n", "max_deliveries",
     "rules[0].consume.max_deliveries", "Input should be less than or equal to 100"),
    ("rules:\n  - topic: a\n    consume:\n      max_deliveries: 2.5\n", "max_deliveries",
     "rules[0].consume.max_deliveries",
     "Input should be a valid integer, got a number with a fractional part"),
    ("rules:\n  - topic: a\n    consume:\n      dead_letter_topic: 'dlq {topic}'\n",
     "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "'dlq {topic}' is not a topic name: letters, digits, '.', '_' and '-', "
     "at most 249"),
    ("rules:\n  - topic: a\n    consume:\n      dead_letter_topic: '{topic}'\n",
     "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "'{topic}' is the topic itself: dead letters would be read again"),
    ("rules:\n  - topic: a\n    consume:\n      dead_letter_topic: 'dlq.{name}'\n",
     "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "'dlq.{name}': the only placeholder is {topic}"),
    ("rules:\n  - topic: a\n    consume:\n      dead_letter_topic: ''\n",
     "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "String should have at least 1 character"),
    ("rules:\n  - topic: a\n    consume:\n      ack_deadline: 10\n", "ack_deadline",
     "rules[0].consume.ack_deadline", "unknown field (check the spelling)"),
    ("default:\n  consume:\n    max_deliveries: -1\n", "max_deliveries",
     "default.consume.max_deliveries", "Input should be greater than or equal to 1"),
    # the checks across rules
    ("rules:\n  - topic: 'orders.*'\n    consume:\n      dead_letter_topic: '{topic}.dlq'\n"
     "default: {}\n", "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "'orders.*.dlq' matches this rule's topic 'orders.*': its consumers would read their "
     "dead letters back; name it outside the rule (the default is 'dlq.{topic}')"),
    ("rules:\n  - topic: orders\n    consume:\n      dead_letter_topic: orders\n",
     "dead_letter_topic", "rules[0].consume.dead_letter_topic",
     "'orders' matches this rule's topic 'orders': its consumers would read their dead "
     "letters back; name it outside the rule (the default is 'dlq.{topic}')"),
    ("strict: true\ndead_letter_rule_required: true\nrules:\n  - topic: orders\n"
     "    consume:\n      max_deliveries: 3\n",
     "max_deliveries", "rules[0].consume.dead_letter_topic",
     "'orders' could not be read through the proxy: its dead-letter topic 'dlq.orders' has "
     "no policy rule (dead_letter_rule_required: true)"),
])
def test_bad_consume_settings_name_line_and_field(text: str, needle: str, field: str,
                                                 message: str) -> None:
    assert issues(text) == [f"p.yaml:{line_of(text, needle)} {field}: {message}"]


def test_dead_letter_checks_apply_only_where_consume_is_written() -> None:
    # a policy written before `consume:` existed stays valid (the proxy checks at open)
    parse_policy("strict: true\nrules:\n  - topic: orders\n", "p.yaml")
    parse_policy("rules:\n  - topic: '*'\n", "p.yaml")
    # a strict policy that names its dead-letter topics passes
    parse_policy("strict: true\nrules:\n  - topic: orders\n    consume:\n"
                 "      max_deliveries: 3\n  - topic: 'dlq.*'\n", "p.yaml")
    # a glob whose dead letters fall outside it
    parse_policy("rules:\n  - topic: 'orders.*'\n    consume: {max_deliveries: 2}\n"
                 "default: {}\n", "p.yaml")


def test_topology_checks_prefer_regions_and_quorum(topo: Topology) -> None:
    text = ("rules:\n  - topic: a\n    mode: nearest\n    prefer: [west, mars]\n"
            "  - topic: b\n    sync: true\n    quorum: 3\n"
            "default:\n  mode: nearest\n  prefer: [moon]\n")
    assert issues(text, topo) == [
        f"p.yaml:{line_of(text, 'prefer: [west')} rules[0].prefer[1]: 'mars' is not a region "
        "(regions: east, west)",
        f"p.yaml:{line_of(text, 'quorum')} rules[1].quorum: 3 is more than the 2 region(s) "
        "of the topology",
        f"p.yaml:{line_of(text, 'moon')} default.prefer[0]: 'moon' is not a region "
        "(regions: east, west)",
    ]
    parse_policy(text, "p.yaml")  # without a topology these are not checked


def test_prefer_accepts_local_once_and_refuses_it_against_a_region_named_local(
        topo: Topology) -> None:
    p = parse_policy("rules:\n  - topic: a\n    mode: nearest\n    prefer: [west, local]\n",
                     "p.yaml", topo)
    assert p.rules[0].prefer == ["west", "local"]
    text = "rules:\n  - topic: a\n    mode: nearest\n    prefer: [local, west, local]\n"
    assert issues(text) == [f"p.yaml:{line_of(text, 'prefer')} rules[0].prefer: "
                            "each region at most once; repeated: local"]
    odd = Topology.model_validate({**topo.model_dump(mode="json"), "regions": [
        {**r.model_dump(mode="json"), "name": "local" if r.name == "west" else r.name}
        for r in topo.regions], "preference": ["east", "local"], "flows": []})
    text = "rules:\n  - topic: a\n    mode: nearest\n    prefer: [local]\n"
    [msg] = issues(text, odd)
    assert "rules[0].prefer[0]: 'local' is ambiguous" in msg


def test_quorum_equal_to_region_count_is_fine(topo: Topology) -> None:
    p = parse_policy("rules:\n  - topic: a\n    sync: true\n    quorum: 2\n", "p.yaml", topo)
    assert p.rules[0].quorum == 2


def test_several_problems_are_all_reported() -> None:
    text = ("rules:\n  - topic: a\n    mode: nearest\n    sync: true\n"
            "  - topic: b\n    max_record_bytes: -1\n")
    assert [m.split(" ")[1] for m in issues(text)] == ["rules[0].sync:",
                                                        "rules[1].max_record_bytes:"]


def test_yaml_errors_and_missing_file(tmp_path: Path) -> None:
    [msg] = issues("rules:\n  - topic: [a\n")
    assert msg.startswith("p.yaml:3: not valid YAML")
    assert issues("") == ["p.yaml:1: the file is empty"]
    assert issues("rules: []\nrules: []\n") == ["p.yaml:2 rules: duplicate key"]
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_policy(tmp_path / "nope.yaml")


def test_equality_ignores_the_lookup_cache() -> None:
    a, b = Policy(rules=[Rule(topic="a")]), Policy(rules=[Rule(topic="a")])
    a.rule_for("x")
    assert a == b
    assert a != Policy(rules=[Rule(topic="b")])


def test_models_are_frozen() -> None:
    rule = Rule(topic="a")
    with pytest.raises(ValueError, match="frozen"):
        rule.mode = "nearest"  # type: ignore[misc]


# -- examples and schema ---------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_validate_against_the_local_topology(name: str, topo: Topology) -> None:
    load_policy(POLICIES / name, topo)


def test_examples_say_what_the_issue_asks() -> None:
    pay = load_policy(POLICIES / "payments.yaml")
    rule = pay.rule_for("payments")
    assert rule is not None
    assert rule.dr_mode == "ordered"
    assert rule.key_required
    assert pay.strict
    assert pay.rule_for("ledger") is None
    ledger = load_policy(POLICIES / "ledger.yaml").rule_for("ledger")
    assert ledger is not None
    assert ledger.dr_mode == "sync"
    assert ledger.quorum == 2
    clicks = load_policy(POLICIES / "clickstream.yaml").rule_for("clickstream.web")
    assert clicks is not None
    assert clicks.dr_mode == "nearest"
    assert clicks.prefer == ["west", "east"]  # the others' order; own region first
    audit = load_policy(POLICIES / "clickstream.yaml").rule_for("clickstream.audit")
    assert audit is not None
    assert audit.prefer == ["west", "local"]
    demo = load_policy(POLICIES / "default.yaml")
    modes = {t: r.dr_mode for t in ("payments", "payments.refunds", "ledger",
                                    "clickstream.app", "anything")
             if (r := demo.rule_for(t)) is not None}
    assert modes == {"payments": "ordered", "payments.refunds": "ordered", "ledger": "sync",
                     "clickstream.app": "nearest", "anything": "ordered"}


def test_committed_schema_matches_the_models() -> None:
    committed = json.loads((POLICIES / "schema.json").read_text())
    assert committed == Policy.model_json_schema(), \
        "regenerate: dr policy schema > policies/schema.json"


# -- the CLI -------------------------------------------------------------------------------


def dr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dr.cli", *args], capture_output=True,
                          text=True, check=False)


def test_cli_validate_bad_file_prints_every_issue_and_exits_65(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    text = ("rules:\n  - topic: a\n    mode: nearest\n    sync: true\n"
            "  - topic: b\n    quorum: 2\n")
    bad.write_text(text)
    proc = dr("policy", "validate", str(bad))
    assert proc.returncode == 65  # a file refused (dr/exits.py)
    assert "Traceback" not in proc.stderr
    assert f"{bad}:4 rules[0].sync: sync: true needs mode: ordered" in proc.stderr
    assert f"{bad}:6 rules[1].quorum: quorum is only for sync: true" in proc.stderr


def test_cli_validate_with_topology(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("rules:\n  - topic: a\n    mode: nearest\n    prefer: [mars]\n")
    assert dr("policy", "validate", str(bad)).returncode == 0
    proc = dr("policy", "validate", str(bad), "--topology", str(TOPOLOGY))
    assert proc.returncode == 65  # a file refused (dr/exits.py)
    assert f"{bad}:4 rules[0].prefer[0]: 'mars' is not a region (regions: east, west)" \
        in proc.stderr


def test_cli_validate_good_file_prints_one_line() -> None:
    proc = dr("policy", "validate", str(POLICIES / "default.yaml"), "-t", str(TOPOLOGY))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        f"{POLICIES / 'default.yaml'}: valid — 5 rule(s), default ordered, checked against "
        f"{TOPOLOGY}"]
    proc = dr("policy", "validate", str(POLICIES / "ledger.yaml"))
    assert proc.returncode == 0
    assert "1 rule(s), strict (unmatched topics refused)" in proc.stdout


def test_cli_validate_missing_file_exits_65(tmp_path: Path) -> None:
    proc = dr("policy", "validate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 65  # a file refused (dr/exits.py)
    assert "nope.yaml: file not found" in proc.stderr


def test_cli_schema_prints_the_models_schema() -> None:
    proc = dr("policy", "schema")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == Policy.model_json_schema()


# -- hot reload ------------------------------------------------------------------------------

GOOD = "rules:\n  - topic: a\n    mode: ordered\ndefault:\n  mode: nearest\n"
GOOD2 = "rules:\n  - topic: a\n    mode: nearest\n  - topic: b\n"
BAD = "rules:\n  - topic: a\n    mode: nearest\n    sync: true\n"


def refused(store: PolicyStore) -> float:
    v = store.registry.get_sample_value("crossdc_proxy_policy_reloads_total",
                                        {"result": "refused"})
    assert v is not None
    return v


def accepted(store: PolicyStore) -> float:
    v = store.registry.get_sample_value("crossdc_proxy_policy_reloads_total",
                                        {"result": "accepted"})
    assert v is not None
    return v


class Changes:
    """An on_change subscriber the test can await."""

    def __init__(self, store: PolicyStore) -> None:
        self.seen: list[Policy] = []
        self._event = asyncio.Event()
        store.on_change.append(self._on_change)

    def _on_change(self, policy: Policy) -> None:
        self.seen.append(policy)
        self._event.set()

    async def next(self, timeout_s: float = 10.0) -> Policy:
        await asyncio.wait_for(self._event.wait(), timeout_s)
        self._event.clear()
        return self.seen[-1]


def write(path: Path, text: str) -> None:
    """Replace the file whole (rename), as config management does: no poll sees it torn."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_good_change_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    store = PolicyStore(path, poll_interval_s=0.01)
    changes = Changes(store)
    with capture_logs() as logs:
        await store.start()
        try:
            assert store.version == 1
            first = store.current.rule_for("a")
            assert first is not None
            assert first.dr_mode == "ordered"
            write(path, GOOD2)
            new = await changes.next()
            assert new is store.current
            assert store.version == 2
            rule = store.current.rule_for("a")
            assert rule is not None
            assert rule.dr_mode == "nearest"
            assert store.current.rule_for("zzz") is None
        finally:
            await store.stop()
    assert store.registry.get_sample_value("crossdc_proxy_policy_version") == 2
    assert accepted(store) == 2
    assert refused(store) == 0
    events = [e for e in logs if e["event"] in ("policy_loaded", "policy_reloaded",
                                                 "policy_refused")]
    assert [e["event"] for e in events] == ["policy_loaded", "policy_reloaded"]
    assert events[1]["version"] == 2
    assert events[1]["rules"] == 2


async def test_bad_change_is_refused_and_the_old_policy_stays(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    with capture_logs() as logs:
        store = PolicyStore(path, poll_interval_s=0.01)
        changes = Changes(store)
        async with store:
            old = store.current
            write(path, BAD)

            async def was_refused() -> bool:
                return refused(store) == 1
            await eventually(was_refused, 10, "the bad file refused")
            assert store.current is old
            assert store.version == 1
            # then a good file is accepted again
            write(path, GOOD2)
            await changes.next()
            assert store.version == 2
    assert refused(store) == 1  # counted once, not once per poll
    [event] = [e for e in logs if e["event"] == "policy_refused"]
    assert event["log_level"] == "warning"
    assert event["version"] == 1
    assert event["issues"] == [f"{path}:4 rules[0].sync: sync: true needs mode: ordered "
                               "(nearest writes one region)"]
    assert changes.seen == [store.current]


async def test_a_file_written_in_place_is_acted_on_only_once_it_settles(tmp_path: Path) -> None:
    """An editor truncates and then writes: the watch loop must neither refuse the empty file
    it may see between the two nor apply a half-written one (this prefix is a valid policy
    with one rule of two), and must still apply the finished file and refuse a bad one."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    half = GOOD2[:GOOD2.index("  - topic: b")]
    assert parse_policy(half, "half.yaml").rules[0].topic == "a"  # valid on its own
    store = PolicyStore(path, poll_interval_s=3600)  # the test runs the watch loop's looks
    changes = Changes(store)
    with capture_logs() as logs:
        async with store:
            with path.open("w") as f:
                await store._check(force=False)          # truncated, nothing written yet
                f.write(half)
                f.flush()
                await store._check(force=False)          # half written
                assert (refused(store), store.version) == (0, 1)
                f.write(GOOD2[len(half):])
            await store._check(force=False)              # written: seen once
            assert store.version == 1
            await store._check(force=False)              # unchanged since: accepted
            assert store.version == 2
            assert [len(p.rules) for p in changes.seen] == [2]
            path.write_text(BAD)                         # a bad file that stays: refused
            await store._check(force=False)
            assert refused(store) == 0
            await store._check(force=False)
            assert refused(store) == 1
            await store._check(force=False)              # and only once
            assert (refused(store), store.version) == (1, 2)
    assert [(e["event"], e.get("result")) for e in logs if e["event"].startswith("policy_")] == [
        ("policy_loaded", None), ("policy_settling", "refused"), ("policy_settling", "accepted"),
        ("policy_settling", "accepted"), ("policy_reloaded", None),
        ("policy_settling", "refused"), ("policy_refused", None)]


async def test_reload_applies_a_change_at_once(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    store = PolicyStore(path, poll_interval_s=3600)  # only reload() can see changes
    changes = Changes(store)
    await store.start()
    try:
        assert store.reload() is False  # same content: nothing new
        assert store.version == 1
        write(path, BAD)
        assert store.reload() is False
        assert refused(store) == 1
        assert store.version == 1
        assert store.reload() is False  # asked again: refused again
        assert refused(store) == 2
        write(path, GOOD2)
        assert store.reload() is True
        assert store.version == 2
        assert changes.seen == [store.current]
        assert store.current.rules[1].topic == "b"
    finally:
        await store.stop()


async def test_atomic_rename_replace_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    store = PolicyStore(path, poll_interval_s=0.01)
    changes = Changes(store)
    async with store:
        tmp = tmp_path / ".p.yaml.tmp"
        write(tmp, GOOD2)
        os.replace(tmp, path)
        await changes.next()
        assert store.version == 2
        assert len(store.current.rules) == 2
        # a bad file renamed in place is refused like any other
        write(tmp, BAD)
        os.replace(tmp, path)

        async def was_refused() -> bool:
            return refused(store) == 1
        await eventually(was_refused, 10, "the renamed bad file refused")
        assert store.version == 2
        assert len(store.current.rules) == 2


async def test_deleted_file_is_refused_once_and_a_new_one_accepted(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    with capture_logs() as logs:
        store = PolicyStore(path, poll_interval_s=0.01)
        changes = Changes(store)
        async with store:
            old = store.current
            path.unlink()

            async def was_refused() -> bool:
                return refused(store) == 1
            await eventually(was_refused, 10, "the missing file refused")
            assert store.current is old
            write(path, GOOD2)
            await changes.next()
            assert store.version == 2
        assert refused(store) == 1
    [event] = [e for e in logs if e["event"] == "policy_refused"]
    assert event["issues"] == [f"{path}: file not found"]


async def test_first_load_of_a_bad_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, BAD)
    store = PolicyStore(path, poll_interval_s=0.01)
    with pytest.raises(ConfigError, match=r"rules\[0\]\.sync"):
        await store.start()
    assert refused(store) == 1
    assert store.version == 0
    with pytest.raises(RuntimeError, match="no policy loaded"):
        _ = store.current
    await store.stop()


async def test_start_and_stop_are_idempotent_and_leave_no_task(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    before = asyncio.all_tasks()
    store = PolicyStore(path, poll_interval_s=0.01)
    await store.stop()  # before start: fine
    store = PolicyStore(path, poll_interval_s=0.01)
    await store.start()
    await store.start()
    assert len(asyncio.all_tasks() - before) == 1
    await store.stop()
    await store.stop()
    assert asyncio.all_tasks() == before
    with pytest.raises(RuntimeError, match="stopped"):
        await store.start()


async def test_a_failing_callback_does_not_stop_the_others(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    store = PolicyStore(path, poll_interval_s=0.01)

    def broken(_: Policy) -> None:
        raise RuntimeError("subscriber bug")

    store.on_change.append(broken)
    changes = Changes(store)
    async with store:
        with capture_logs() as logs:
            write(path, GOOD2)
            await changes.next()
    assert store.version == 2
    assert any(e["event"] == "policy_callback_failed" for e in logs)


async def test_watcher_cancelled_from_outside(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, GOOD)
    store = PolicyStore(path, poll_interval_s=0.01)
    await store.start()
    task = store._task
    assert task is not None
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()  # CancelledError went through, not swallowed
    await store.stop()  # and stop() does not mistake it for its own cancellation


def test_registries_are_private_unless_given() -> None:
    reg = CollectorRegistry()
    a = PolicyStore(Path("x.yaml"), registry=reg)
    b = PolicyStore(Path("x.yaml"))
    assert a.registry is reg
    assert b.registry is not reg
    assert reg.get_sample_value("crossdc_proxy_policy_reloads_total",
                                {"result": "refused"}) == 0
