"""Dead-letter topics in a policy (issue 38): one no rule names follows its source topic's
rule, so a shipped policy that validates is consumable; validation lists every rule whose
topics the proxy would refuse to open (`Policy.dead_letter_problem`, the proxy's own check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from crossdc.errors import ConfigError
from proxy.consume.source import stream_settings
from proxy.policy import (
    DEAD_LETTER_HEADROOM,
    Policy,
    Rule,
    _sample,
    _source_of,
    load_policy,
    parse_policy,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
POLICIES = REPO_ROOT / "policies"
SHIPPED = sorted(p for p in POLICIES.glob("*.yaml")
                 if not p.name.startswith(("topology.", "drill.")))


def issues(text: str) -> list[str]:
    """What `dr policy validate` says of `text` (every topic the proxy could not read)."""
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml", consumable=True)
    return [f"{i.field}: {i.message}" for i in info.value.issues]


def rule(policy: Policy, topic: str) -> Rule:
    r = policy.rule_for(topic)
    assert r is not None, topic
    return r


# -- the default: a dead-letter topic follows its source topic's rule ------------------------

def test_the_shipped_payments_policy_admits_its_dead_letter_topics() -> None:
    pay = load_policy(POLICIES / "payments.yaml")
    assert pay.strict
    for source, dlq in (("payments.refunds", "dlq.payments.refunds"),
                        ("payments", "dlq.payments")):
        src = rule(pay, source)
        dl = rule(pay, dlq)
        assert (dl.topic, dl.dr_mode, dl.prefer, dl.quorum) == (dlq, "ordered", None, None)
        # never refused for what its original was accepted with: a key is optional (records
        # written straight to Kafka may have none), room for the dr-dl-* headers
        assert src.key_required
        assert not dl.key_required
        assert dl.max_record_bytes == src.max_record_bytes + DEAD_LETTER_HEADROOM
        assert pay.dead_letter_problem(source) is None
    assert pay.rule_for("ledger") is None  # strict still refuses other topics
    assert pay.rule_for("dlq.ledger") is None  # ... and dead-letter names of no rule's topic


def test_a_sync_or_nearest_source_gives_its_dead_letters_its_regions() -> None:
    p = parse_policy("strict: true\nrules:\n  - topic: ledger\n    sync: true\n    quorum: 2\n"
                     "  - topic: 'clicks.*'\n    mode: nearest\n    prefer: [west, local]\n",
                     "p.yaml")
    assert (rule(p, "dlq.ledger").dr_mode, rule(p, "dlq.ledger").quorum) == ("sync", 2)
    clicks = rule(p, "dlq.clicks.web")
    assert (clicks.dr_mode, clicks.prefer) == ("nearest", ["west", "local"])


def test_a_rule_that_matches_the_dead_letter_topic_wins() -> None:
    p = parse_policy("strict: true\nrules:\n  - topic: orders\n  - topic: 'dlq.*'\n"
                     "    mode: nearest\n", "p.yaml")
    assert rule(p, "dlq.orders").topic == "dlq.*"
    assert rule(p, "dlq.orders").dr_mode == "nearest"


def test_the_source_rule_comes_before_the_default() -> None:
    # the default is for topics no rule is about; a dead letter stays with its topic's rule
    p = load_policy(POLICIES / "default.yaml")
    assert rule(p, "dlq.clickstream.web").dr_mode == "nearest"
    assert rule(p, "dlq.ledger").dr_mode == "sync"
    assert rule(p, "anything").dr_mode == "ordered"  # the default
    # the default's own dead letters follow the default (a key optional, as it says)
    d = parse_policy("default:\n  mode: nearest\n  consume: {dead_letter_topic: dead}\n", "p")
    assert (rule(d, "dead").dr_mode, rule(d, "dlq.x").dr_mode) == ("nearest", "nearest")


def test_dead_letter_templates_are_inverted_exactly() -> None:
    assert _source_of("dlq.{topic}", "dlq.a.b") == "a.b"
    assert _source_of("{topic}.dead", "a.b.dead") == "a.b"
    assert _source_of("{topic}.{topic}", "ab.ab") == "ab"
    assert _source_of("{topic}.{topic}", "ab.ac") is None
    assert _source_of("dlq.{topic}", "dlq.") is None
    assert _source_of("dead", "dead") is None  # a fixed name: looked up by name
    p = parse_policy("strict: true\nrules:\n  - topic: a\n    mode: nearest\n    consume:\n"
                     "      dead_letter_topic: '{topic}.dead'\n  - topic: b\n    consume:\n"
                     "      dead_letter_topic: all-dead\n  - topic: c\n    mode: nearest\n"
                     "    consume:\n      dead_letter_topic: all-dead\n", "p.yaml")
    assert rule(p, "a.dead").dr_mode == "nearest"
    assert p.rule_for("dlq.a") is None  # not a's dead-letter topic
    assert rule(p, "all-dead").dr_mode == "ordered"  # a fixed name: the first rule saying it
    assert p.dead_letter_problem("c") is None


def test_dead_letters_of_dead_letters_follow_a_few_levels_deep_whatever_was_asked_before(
        ) -> None:
    text = "strict: true\nrules:\n  - topic: p\n"
    deep, deeper = "dlq." * 4 + "p", "dlq." * 5 + "p"
    first = parse_policy(text, "p.yaml")
    assert first.rule_for(deeper) is None
    assert rule(first, deep).dr_mode == "ordered"
    # asked the other way round (the shallow ones cached first): the same answers
    second = parse_policy(text, "p.yaml")
    for t in ("dlq.p", "dlq.dlq.p", deep):
        assert second.rule_for(t) is not None
    assert second.rule_for(deeper) is None
    assert first.dead_letter_problem(deep) == (
        f"its dead-letter topic {deeper!r} has no policy rule")


def test_dead_letter_rule_required_turns_the_following_off() -> None:
    text = "strict: true\ndead_letter_rule_required: true\nrules:\n  - topic: orders\n"
    assert issues(text) == [
        "rules[0].consume.dead_letter_topic: 'orders' could not be read through the proxy: "
        "its dead-letter topic 'dlq.orders' has no policy rule (dead_letter_rule_required: "
        "true)"]
    p = parse_policy(text + "  - topic: 'dlq.*'\n    mode: nearest\n", "p.yaml")
    assert rule(p, "dlq.orders").topic == "dlq.*"
    # with a default, the default writes them
    d = parse_policy("dead_letter_rule_required: true\nrules:\n  - topic: a\n    mode: nearest\n"
                     "default: {require_key: false}\n", "p.yaml")
    assert rule(d, "dlq.a").dr_mode == "ordered"
    assert Policy() != Policy(dead_letter_rule_required=True)


# -- validation lists every topic that could not be read ------------------------------------

def test_validation_lists_every_rule_whose_topics_the_proxy_would_refuse() -> None:
    long = "l" * 246  # its dead-letter topic, dlq.<246>, is 250 characters
    text = ("strict: true\nrules:\n"
            f"  - topic: {long}\n"
            "  - topic: 'clicks.*'\n    mode: nearest\n"           # a key optional ...
            "  - topic: 'dlq.clicks.*'\n    mode: ordered\n"       # ... required here
            "  - topic: big\n    max_record_bytes: 2000000\n"
            "  - topic: dlq.big\n"                                  # 1 MiB: smaller
            "  - topic: small\n    max_record_bytes: 100\n"
            "  - topic: dlq.small\n    max_record_bytes: 100\n")   # as large: fine
    assert issues(text) == [
        f"rules[0].consume.dead_letter_topic: {long!r} could not be read through the proxy: "
        f"its dead-letter topic {'dlq.' + long[:76]!r}... (250 characters) is not a Kafka "
        "topic name (letters, digits, '.', '_' and '-', at most 249)",
        "rules[1].consume.dead_letter_topic: 'clicks.x' (a topic of 'clicks.*') could not be "
        "read through the proxy: its dead-letter topic 'dlq.clicks.x' requires a key (rule "
        "'dlq.clicks.*') and its records may have none: their dead letters would be refused "
        "(set require_key: false on that rule)",
        "rules[3].consume.dead_letter_topic: 'big' could not be read through the proxy: its "
        "dead-letter topic 'dlq.big' takes records of at most 1048576 bytes (rule 'dlq.big'), "
        "its own up to 2000000: a large record's dead letter would be refused",
    ]


def test_each_refusal_names_the_line_of_its_rule() -> None:
    text = ("strict: true\ndead_letter_rule_required: true\nrules:\n  - topic: a\n"
            "    mode: nearest\n  - topic: b\n    consume:\n      max_deliveries: 2\n")
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml", consumable=True)
    assert [(i.line, i.field) for i in info.value.issues] == [
        (4, "rules[0].consume.dead_letter_topic"), (8, "rules[1].consume.dead_letter_topic")]
    # the proxy loads it all the same (it routes writes; such a stream is refused at open)
    assert len(parse_policy(text, "p.yaml").rules) == 2


def test_a_glob_is_tried_with_a_sample_topic_it_takes() -> None:
    assert _sample("payments.*") == "payments.x"
    assert _sample("payments.*", "z0") == "payments.z0"
    assert _sample("logs.[ab]?") == "logs.ax"
    assert _sample("[!x]y") == "0y"
    assert _sample("*") == "x"
    # an earlier rule takes the first sample: the glob is tried with another one
    text = ("strict: true\nrules:\n  - topic: a.x\n  - topic: 'a.*'\n    mode: nearest\n"
            "  - topic: 'dlq.a.*'\n")
    [only] = issues(text)
    assert only.startswith("rules[1].consume.dead_letter_topic: 'a.y' (a topic of 'a.*') "
                           "could not be read through the proxy: its dead-letter topic "
                           "'dlq.a.y' requires a key")


def test_a_self_matching_dead_letter_topic_is_still_refused() -> None:
    assert issues("rules:\n  - topic: 'orders.*'\n    consume:\n"
                  "      dead_letter_topic: 'orders.dead'\n") == [
        "rules[0].consume.dead_letter_topic: 'orders.dead' matches this rule's topic "
        "'orders.*': its consumers would read their dead letters back; name it outside the "
        "rule (the default is 'dlq.{topic}')"]


# -- every shipped policy is consumable ----------------------------------------------------

def test_the_shipped_policies_are_found() -> None:
    assert {p.name for p in SHIPPED} >= {"payments.yaml", "ledger.yaml", "clickstream.yaml",
                                         "default.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_rule_of_a_shipped_policy_can_be_opened_for_consume(path: Path) -> None:
    policy = load_policy(path)
    for i, r in enumerate(policy.rules):
        topic = _sample(r.topic) if r.is_glob else r.topic
        assert topic is not None
        got = policy.rule_for(topic)
        assert got is r, (path.name, i, topic)
        # the checks of the proxy's open (ConsumeService._check), rule by rule
        settings = stream_settings(got.consume, topic)
        assert policy.dead_letter_problem(topic, got) is None, (path.name, topic)
        assert policy.rule_for(settings.dead_letter_topic) is not None


def _dr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dr.cli", *args], capture_output=True,
                          text=True, check=False, cwd=REPO_ROOT)


def test_validate_json_says_where_each_rules_dead_letters_go(tmp_path: Path) -> None:
    proc = _dr("policy", "validate", str(POLICIES / "payments.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["valid"] is True
    assert body["dead_letters"] == [
        {"rule": 0, "topic": "payments", "sample": "payments",
         "dead_letter_topic": "dlq.payments", "written_by": "source", "mode": "ordered",
         "problem": None},
        {"rule": 1, "topic": "payments.*", "sample": "payments.x",
         "dead_letter_topic": "dlq.payments.x", "written_by": "source", "mode": "ordered",
         "problem": None}]
    bad = tmp_path / "p.yaml"
    bad.write_text("strict: true\ndead_letter_rule_required: true\nrules:\n  - topic: a\n"
                   "  - topic: 'b.*'\n")
    proc = _dr("policy", "validate", str(bad), "--json")
    assert proc.returncode == 65
    body = json.loads(proc.stdout)
    assert [(i["line"], i["field"]) for i in body["issues"]] == [
        (4, "rules[0].consume.dead_letter_topic"), (5, "rules[1].consume.dead_letter_topic")]
    proc = _dr("policy", "validate", str(bad))
    assert proc.returncode == 65
    assert f"{bad}:4 rules[0].consume.dead_letter_topic: 'a' could not be read" in proc.stderr
    assert f"{bad}:5 rules[1].consume.dead_letter_topic: 'b.x' (a topic of 'b.*')" \
        in proc.stderr
