"""Routing policies: which mode each topic is written in (`policies/*.yaml`).

A policy is a list of rules, each naming a topic exactly or by glob (`orders.*`), tried in
order (first match wins), then a `default` rule for every other topic; without a default,
unmatched topics are refused, and `strict: true` says so explicitly (a default is then an
error). Per rule: `mode` (ordered | nearest), `sync: true` (ordered only: write the primary,
then every other region, before the ack; `quorum` regions suffice), `require_key`,
`max_record_bytes`, `prefer` (nearest only: the order of the regions to try), and `consume`
(reading through the proxy: `ack_deadline_s`, `max_deliveries`, `dead_letter_topic`).

A dead-letter topic no rule matches follows its source topic's rule (`Policy.rule_for`),
before the default: `dlq.payments.refunds` of `payments.*` is written, fenced and read as
`payments.*` says (its mode, sync, quorum and `prefer`), minus what would refuse a dead letter
(a key is optional, the size limit leaves room for the `dr-dl-*` headers). A rule that matches
the dead-letter topic wins; `dead_letter_rule_required: true` turns the following off (each
dead-letter topic then needs a rule, or the default). `Policy.dead_letter_problem` says why a
topic's records could not be dead-lettered: the proxy refuses to open a stream on it, and
validation reports every rule whose topics it would refuse.

Nearest writes stay local: a proxy writes its own region first. `prefer` orders the OTHER
regions (only those it names are tried after the own one); the word `local` in it places the
own region explicitly: `prefer: [west, local]` means west first, then the proxy's own region
(east's proxy: west, east; west's proxy: west). A `prefer` without `local` keeps the own region
first, so a policy can never send every proxy's nearest records to one region by accident.
`local` is a keyword, never a region name: a topology region named `local` cannot be named in
`prefer` (the policy is refused against such a topology).

`load_policy()` reads a file; a bad one raises `ConfigError` naming file, line and field.
This module imports no grpc: `dr policy validate` uses it.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator

from crossdc.topology import Topology
from crossdc.yamlfile import load_model, parse_model, repeated

__all__ = [
    "DEAD_LETTER_HEADROOM",
    "LOCAL",
    "TOPIC_PLACEHOLDER",
    "ConsumeSettings",
    "DefaultRule",
    "Mode",
    "Policy",
    "Rule",
    "default_policy_path",
    "glob_problem",
    "load_policy",
    "parse_policy",
    "validate_policy",
]

Mode = Literal["ordered", "nearest"]
"""What a rule says; "sync" is `mode: ordered` with `sync: true`."""

_GLOB_CHARS = frozenset("*?[")
_SET_CHARS = "*?[]"
_TOPIC_PATTERN = r"^[A-Za-z0-9._\-*?\[\]!]{1,249}$"
_RULE_CACHE_MAX = 10_000
_MAX_OVERLAP_TESTS = 2_000_000
"""Glob tests `Policy.problems` may spend finding exact rules an earlier glob hides (see
`_RuleIndex`); a policy that needs more is refused, so validation stays bounded."""

RegionRef = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")]

LOCAL = "local"
"""In a `prefer` list: the proxy's own region (a keyword, not a region name)."""


def glob_problem(pattern: str) -> str | None:
    """Why `pattern` (a topic name or fnmatch glob) can never mean what it says, or None.
    fnmatch compiles anything, taking what it cannot read for literal characters: an
    unclosed `[` or a `]` or `!` outside a class would then have to appear in the topic's
    name, which Kafka never allows, and a range written backwards (`[z-a]`) matches
    nothing, so such a rule silently applied to no topic."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":  # a `]` first in a class is one of its members
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                return f"'[' at {i + 1} is never closed (a class is written [abc] or [a-z])"
            body = pattern[j:close]
            for k in range(1, len(body) - 1):
                if body[k] == "-" and body[k - 1] > body[k + 1]:
                    return (f"the range {body[k - 1]}-{body[k + 1]} in {pattern[i:close + 1]} "
                            "is backwards: it matches nothing")
            i = close + 1
            continue
        if c in "]!":
            return (f"{c!r} at {i + 1} outside a [...] class: a topic name never holds it "
                    "(a class is written [abc], its negation [!abc])")
        i += 1
    return None


def _is_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


def _literal_ends(pattern: str) -> tuple[str, str]:
    """The text before a glob's first wildcard (`*`, `?`, `[`) and after its last wildcard
    or set bracket: every topic it matches starts with the one and ends with the other."""
    first = min((i for i in (pattern.find(c) for c in "*?[") if i >= 0), default=len(pattern))
    last = max(pattern.rfind(c) for c in _SET_CHARS)
    return pattern[:first], pattern[last + 1:] if last >= 0 else ""


class _RuleIndex:
    """The rules of a policy arranged so that the first rule matching a topic is found
    without trying every rule: exact topics in a dict (the first rule naming each), globs in
    buckets by their literal prefix (`orders.` of `orders.*`), else by their literal suffix
    (`.dlq` of `*.dlq`), else in one bucket of their own (`*`, `*x*`). A lookup probes one
    dict entry per distinct prefix and suffix length and tests only the globs of the buckets
    it hits, in rule order, stopping at the first match or at the best rule found so far.

    `tests` counts glob tests (regular-expression matches) and `probes` dict lookups, so the
    work `Policy.problems` does is measurable (linear for policies whose globs have distinct
    literal ends; bounded by `_MAX_OVERLAP_TESTS` for any other)."""

    __slots__ = ("_by_prefix", "_by_suffix", "_floating", "_prefix_lengths",
                 "_suffix_lengths", "exact", "probes", "tests")

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.exact: dict[str, int] = {}
        self._by_prefix: dict[str, list[tuple[int, re.Pattern[str]]]] = {}
        self._by_suffix: dict[str, list[tuple[int, re.Pattern[str]]]] = {}
        self._floating: list[tuple[int, re.Pattern[str]]] = []
        compiled: dict[str, re.Pattern[str]] = {}
        for i, rule in enumerate(rules):
            topic = rule.topic
            if not _is_glob(topic):
                self.exact.setdefault(topic, i)
                continue
            rx = compiled.get(topic)
            if rx is None:
                rx = compiled[topic] = re.compile(fnmatch.translate(topic))
            prefix, suffix = _literal_ends(topic)
            if prefix:
                self._by_prefix.setdefault(prefix, []).append((i, rx))
            elif suffix:
                self._by_suffix.setdefault(suffix, []).append((i, rx))
            else:
                self._floating.append((i, rx))
        self._prefix_lengths = sorted({len(p) for p in self._by_prefix})
        self._suffix_lengths = sorted({len(x) for x in self._by_suffix})
        self.tests = 0
        self.probes = 0

    def first(self, topic: str) -> int | None:
        """The index of the first rule matching `topic`, or None."""
        best = self.exact.get(topic)
        limit = best if best is not None else sys.maxsize
        n = len(topic)
        buckets: list[list[tuple[int, re.Pattern[str]]]] = []
        for length in self._prefix_lengths:
            if length > n:
                break
            self.probes += 1
            bucket = self._by_prefix.get(topic[:length])
            if bucket is not None:
                buckets.append(bucket)
        for length in self._suffix_lengths:
            if length > n:
                break
            self.probes += 1
            bucket = self._by_suffix.get(topic[n - length:])
            if bucket is not None:
                buckets.append(bucket)
        if self._floating:
            buckets.append(self._floating)
        for bucket in buckets:
            for i, rx in bucket:  # in rule order: the first match is this bucket's best
                if i >= limit:
                    break
                self.tests += 1
                if rx.match(topic) is not None:
                    limit = best = i
                    break
        return best


_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._\-]{1,249}$")
TOPIC_PLACEHOLDER = "{topic}"
"""In a `dead_letter_topic`: the name of the topic the record was read from."""
DEAD_LETTER_HEADROOM = 1024
"""Bytes a dead-letter topic that follows its source's rule accepts beyond the source's
`max_record_bytes`: the `dr-dl-*` headers a dead letter carries (at most ~600 bytes: a
249-character topic, a 200-character group, the record's id)."""
_DEAD_LETTER_DEPTH = 4
"""Dead letters of dead letters follow their source's rule this many levels deep
(`dlq.dlq.dlq.dlq.t`); deeper ones need a rule of their own."""
_NAME_CHARS = 80


def _shown(name: str) -> str:
    """`repr(name)` for a message, cut when long (a topic at open comes from a client)."""
    if len(name) <= _NAME_CHARS:
        return repr(name)
    return f"{name[:_NAME_CHARS]!r}... ({len(name)} characters)"


def _source_of(template: str, topic: str) -> str | None:
    """The topic whose dead letters `template` sends to `topic`, or None: the template's
    literal text is `topic`'s, and `{topic}` stands for one name everywhere it appears."""
    parts = template.split(TOPIC_PLACEHOLDER)
    k = len(parts) - 1
    if k == 0:
        return None
    n, rest = divmod(len(topic) - sum(map(len, parts)), k)
    if rest or n < 1:
        return None
    source = topic[len(parts[0]):len(parts[0]) + n]
    return source if template.replace(TOPIC_PLACEHOLDER, source) == topic else None


_FILLERS = ("x", "y", "z0")
"""What `_sample` puts in for a `*`: the first, then the others if an earlier rule takes it."""


def _sample(glob: str, filler: str = _FILLERS[0]) -> str | None:
    """A topic name `glob` matches, made of its literal text, `filler` for each `*`, its
    first character for each `?` and the first fitting character of it and `x0._-` for each
    class, or None."""
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        if c == "*":
            out.append(filler)
            i += 1
        elif c == "?":
            out.append(filler[0])
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            close = glob.find("]", j)
            if close < 0:
                return None
            cls = glob[i:close + 1]
            pick = next((ch for ch in filler + "x0._-" + cls[1:-1] if ch not in "!]"
                         and fnmatch.fnmatchcase(ch, cls)), None)
            if pick is None:
                return None
            out.append(pick)
            i = close + 1
        else:
            out.append(c)
            i += 1
    sample = "".join(out)
    return sample if _TOPIC_NAME.match(sample) and fnmatch.fnmatchcase(sample, glob) else None


class ConsumeSettings(BaseModel):
    """How the topic's records are read through the proxy (docs/consume.md): a stream may
    ask for a shorter deadline or fewer deliveries, never more."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ack_deadline_s: float = Field(30.0, ge=1, le=3600, allow_inf_nan=False,
                                  description="A record not acked this "
                                  "long after it was sent is delivered again; the proxy holds "
                                  "it (and what follows it in its partition) meanwhile.")
    max_deliveries: int = Field(5, ge=1, le=100, description="Deliveries of one record; one "
                                "more expiry or nack sends it to `dead_letter_topic`.")
    dead_letter_topic: str = Field(f"dlq.{TOPIC_PLACEHOLDER}", min_length=1, max_length=249,
                                   description="Where a record goes after `max_deliveries`: "
                                   "a topic name, `{topic}` standing for the topic it was "
                                   "read from; written like any record, by the rule that "
                                   "matches it, else by this rule (a key optional; see "
                                   "`dead_letter_rule_required`). It must not match this "
                                   "rule (a consumer of these topics would read its dead "
                                   "letters back).")

    @field_validator("dead_letter_topic")
    @classmethod
    def _dead_letter_topic(cls, v: str) -> str:
        rest = v.replace(TOPIC_PLACEHOLDER, "")
        if "{" in rest or "}" in rest:
            raise ValueError(f"{v!r}: the only placeholder is {TOPIC_PLACEHOLDER}")
        if v == TOPIC_PLACEHOLDER:
            raise ValueError(f"{v!r} is the topic itself: dead letters would be read again")
        sample = v.replace(TOPIC_PLACEHOLDER, "t")
        if not _TOPIC_NAME.match(sample) or sample in {".", ".."}:
            raise ValueError(f"{v!r} is not a topic name: letters, digits, '.', '_' and '-', "
                             "at most 249")
        return v

    def dead_letter_for(self, topic: str) -> str:
        """The dead-letter topic of records read from `topic`."""
        return self.dead_letter_topic.replace(TOPIC_PLACEHOLDER, topic)


class _RuleFields(BaseModel):
    """What a rule decides about a record (shared by `Rule` and `DefaultRule`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field("ordered", description="ordered: the primary region only (add `sync: "
                       "true` for dual-write). nearest: this proxy's region, failing over "
                       "to the next healthy one.")
    sync: bool = Field(False, description="Dual-write (ordered only): the primary, then every "
                       "other region at the same partition, acked after all (or `quorum`).")
    quorum: int | None = Field(None, ge=1, description="Sync only: regions that must ack, the "
                               "primary included [default: all regions].")
    require_key: bool | None = Field(None, description="Refuse records without a key "
                                     "[default: true for ordered and sync, false for "
                                     "nearest].")
    max_record_bytes: int = Field(1_048_576, gt=0, description="Largest record accepted: "
                                  "key + value + headers, bytes.")
    prefer: list[RegionRef] | None = Field(None, min_length=1, description="Nearest only: "
                                           "the order of the regions tried after this "
                                           "proxy's own region (only those named are "
                                           "tried); the word `local` places the own region "
                                           "explicitly (`[west, local]`: west first, then "
                                           "the own region); without `local` the own region "
                                           "is always first [default: the own region, then "
                                           "the topology's preference].")
    consume: ConsumeSettings = Field(default_factory=ConsumeSettings, description="Reading "
                                     "through the proxy: ack deadline, deliveries, "
                                     "dead-letter topic.")

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v: Any) -> Any:
        if v == "sync":
            raise ValueError("'sync' is not a mode: write `mode: ordered` and `sync: true`")
        return v

    @field_validator("sync")
    @classmethod
    def _sync(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("mode") == "nearest":
            raise ValueError("sync: true needs mode: ordered (nearest writes one region)")
        return v

    @field_validator("quorum")
    @classmethod
    def _quorum(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("sync", False):
            raise ValueError("quorum is only for sync: true")
        return v

    @field_validator("prefer")
    @classmethod
    def _prefer(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is None:
            return v
        mode = info.data.get("mode")
        if mode is not None and mode != "nearest":
            raise ValueError("prefer is only for mode: nearest")
        dupes = repeated(v)
        if dupes:
            raise ValueError(f"each region at most once; repeated: {', '.join(dupes)}")
        return v

    @property
    def dr_mode(self) -> Literal["ordered", "sync", "nearest"]:
        """The `dr-mode` header value of records written under this rule."""
        if self.sync:
            return "sync"
        return self.mode

    @property
    def key_required(self) -> bool:
        """Whether a record without a key is refused (INVALID_ARGUMENT)."""
        if self.require_key is not None:
            return self.require_key
        return self.mode == "ordered"


class Rule(_RuleFields):
    """One rule: a topic name or glob and how its records are written."""

    topic: str = Field(pattern=_TOPIC_PATTERN, description="Exact topic name, or an fnmatch "
                       "glob (`orders.*`, `clicks-?`, `logs.[ab]*`); case-sensitive.")

    @field_validator("topic")
    @classmethod
    def _glob(cls, v: str) -> str:
        why = glob_problem(v)
        if why:
            raise ValueError(f"{v!r} is not a usable glob: {why}")
        return v

    @property
    def is_glob(self) -> bool:
        """Whether `topic` is a pattern rather than one topic's name."""
        return _is_glob(self.topic)

    def matches(self, topic: str) -> bool:
        """Whether this rule applies to `topic`."""
        if self.is_glob:
            return fnmatch.fnmatchcase(topic, self.topic)
        return topic == self.topic


class DefaultRule(_RuleFields):
    """The rule for topics no rule names."""

    def for_topic(self, topic: str) -> Rule:
        """This default as a `Rule` for `topic`."""
        # No re-validation: the fields are valid, and a topic name is the broker's to judge.
        # The fields as they are (a dump would turn `consume` into a dict).
        return Rule.model_construct(topic=topic, **{name: getattr(self, name)
                                                    for name in type(self).model_fields})


class Policy(BaseModel):
    """A routing policy: rules tried in order, then the default (or refusal when strict)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: list[Rule] = Field(default_factory=list, description="Tried in order; the first "
                              "whose topic matches decides.")
    strict: bool = Field(False, description="Refuse (NOT_FOUND) topics no rule matches, and "
                         "forbid a default: the file says unknown topics are refused.")
    default: DefaultRule | None = Field(None, description="How topics no rule matches are "
                                        "written; without one they are refused (NOT_FOUND).")
    dead_letter_rule_required: bool = Field(False, description="Each dead-letter topic needs "
                                            "a rule (or the default) of its own; by default "
                                            "one no rule matches follows its source topic's "
                                            "rule.")

    _index: _RuleIndex | None = PrivateAttr(default=None)
    _cache: dict[str, Rule | None] = PrivateAttr(default_factory=dict)
    _templates: dict[str, int] = PrivateAttr(default_factory=dict)
    """Each distinct `dead_letter_topic` of the rules, and the first rule that says it."""

    @field_validator("default")
    @classmethod
    def _default(cls, v: DefaultRule | None, info: ValidationInfo) -> DefaultRule | None:
        if v is not None and info.data.get("strict"):
            raise ValueError("strict: true refuses unmatched topics; remove default or strict")
        return v

    def model_post_init(self, context: Any, /) -> None:
        self._index = _RuleIndex(self.rules)
        for i, rule in enumerate(self.rules):
            self._templates.setdefault(rule.consume.dead_letter_topic, i)
        if self.default is not None:
            self._templates.setdefault(self.default.consume.dead_letter_topic, len(self.rules))

    def __eq__(self, other: object) -> bool:
        # Fields only: pydantic would also compare the private lookup cache.
        if not isinstance(other, Policy):
            return NotImplemented
        return (self.rules, self.strict, self.default, self.dead_letter_rule_required) == (
            other.rules, other.strict, other.default, other.dead_letter_rule_required)

    __hash__ = None  # type: ignore[assignment]  # lists inside: never hashable

    def rule_for(self, topic: str) -> Rule | None:
        """The rule for `topic`: the first that matches, else, for a dead-letter topic, the
        rule of its source topic (`_following`; not with `dead_letter_rule_required`), else
        the default (as a Rule with `topic=topic`), else None (the topic is refused)."""
        try:
            return self._cache[topic]
        except KeyError:
            pass
        found = self._match(topic)
        if len(self._cache) >= _RULE_CACHE_MAX:  # bounded: the oldest topic goes
            del self._cache[next(iter(self._cache))]
        self._cache[topic] = found
        return found

    def _match(self, topic: str, depth: int = 0) -> Rule | None:
        assert self._index is not None
        i = self._index.first(topic)
        if i is not None:
            return self.rules[i]
        if not self.dead_letter_rule_required and depth < _DEAD_LETTER_DEPTH:
            # A dead-letter topic no rule names: the rule of the topic whose dead letters
            # go here (before the default: dead letters stay where their topic's records
            # are). Looked up without the cache (whose answers are depth 0's), so the answer
            # never depends on what was asked before.
            for template, j in self._templates.items():
                if TOPIC_PLACEHOLDER not in template:
                    if template == topic:  # a fixed name: the first rule that says it
                        return _following(topic, self._rule_at(j))
                    continue
                source = _source_of(template, topic)
                if source is None:
                    continue
                rule = self._match(source, depth + 1)
                if rule is not None and rule.consume.dead_letter_topic == template:
                    return _following(topic, rule)
        if self.default is not None:
            return self.default.for_topic(topic)
        return None

    def _rule_at(self, j: int) -> Rule:
        """rules[j], or the default's (j = len(rules))."""
        if j < len(self.rules):
            return self.rules[j]
        assert self.default is not None
        return self.default.for_topic(self.default.consume.dead_letter_topic)

    def dead_letter_problem(self, topic: str, rule: Rule | None = None) -> str | None:
        """Why the records of `topic` (under `rule`, its rule when given) could not be
        dead-lettered, or None: the proxy refuses to open a stream on such a topic
        (NOT_FOUND: `proxy.consume.service`), and `problems` reports every rule whose topics
        it would refuse. Refused: no rule for the topic; a dead-letter topic name that is no
        Kafka topic name (too long); one no rule admits; one whose rule would refuse a dead
        letter (a key required where the topic's records may have none, or a smaller size
        limit than the topic's)."""
        if rule is None:
            rule = self.rule_for(topic)
            if rule is None:
                return "no policy rule admits it"
        named = rule.consume.dead_letter_for(topic)
        if not _TOPIC_NAME.match(named):
            return (f"its dead-letter topic {_shown(named)} is not a Kafka topic name "
                    "(letters, digits, '.', '_' and '-', at most 249)")
        dl = self.rule_for(named)
        if dl is None:
            return (f"its dead-letter topic {_shown(named)} has no policy rule"
                    + (" (dead_letter_rule_required: true)" if self.dead_letter_rule_required
                       else ""))
        if dl.key_required and not rule.key_required:
            return (f"its dead-letter topic {_shown(named)} requires a key (rule "
                    f"{_shown(dl.topic)}) and its records may have none: their dead letters "
                    "would be refused (set require_key: false on that rule)")
        if dl.max_record_bytes < rule.max_record_bytes:
            return (f"its dead-letter topic {_shown(named)} takes records of at most "
                    f"{dl.max_record_bytes} bytes (rule {_shown(dl.topic)}), its own up to "
                    f"{rule.max_record_bytes}: a large record's dead letter would be refused")
        return None

    def problems(self, topology: Topology | None = None) -> Iterator[tuple[Sequence[int | str],
                                                                         str]]:
        """Rules that are valid alone but not together, or not in `topology`: a repeated or
        unreachable topic, a `prefer` region that does not exist, a quorum larger than the
        number of regions. Yields `(loc, message)`; `load_policy` raises them as errors.

        Linear in the rules: each exact rule asks the rule index for the first rule matching
        its topic (an earlier one hides it), each glob a dict of the patterns seen. The glob
        tests this takes are bounded (`_MAX_OVERLAP_TESTS`): a policy needing more (thousands
        of globs sharing one literal prefix, tried against thousands of exact topics) is
        refused with that reason rather than validated for minutes."""
        assert self._index is not None
        index = self._index
        budget = index.tests + _MAX_OVERLAP_TESTS
        patterns: dict[str, int] = {}
        hidden: set[int] = set()
        for i, rule in enumerate(self.rules):
            if rule.is_glob:
                j = patterns.setdefault(rule.topic, i)
                if j != i:
                    yield ("rules", i, "topic"), (f"{rule.topic!r} repeats rules[{j}]; "
                                                  "each topic pattern once")
                continue
            first = index.first(rule.topic)
            if index.tests > budget:
                yield ("rules",), (
                    f"too many glob rules to check against the exact ones: finding the rules "
                    f"an earlier glob hides took more than {_MAX_OVERLAP_TESTS:,} glob tests "
                    f"(stopped at rules[{i}]); give globs distinct literal prefixes or "
                    "suffixes (`orders.*`, `*.dlq`) rather than many that share one")
                break
            if first is None or first >= i:
                continue
            j = first
            hidden.add(i)
            if self.rules[j].topic == rule.topic:
                yield ("rules", i, "topic"), (f"{rule.topic!r} repeats rules[{j}]; "
                                              "each topic pattern once")
            else:
                yield ("rules", i, "topic"), (f"never used: rules[{j}] "
                                              f"({self.rules[j].topic!r}) matches "
                                              f"{rule.topic!r} first; move this rule "
                                              "above it")
        yield from self._self_read_dead_letters()
        if topology is None:
            return
        names = [r.name for r in topology.regions]
        known = set(names)
        targets: list[tuple[tuple[str | int, ...], _RuleFields]] = [
            (("rules", i), r) for i, r in enumerate(self.rules)]
        if self.default is not None:
            targets.append((("default",), self.default))
        for loc, r in targets:
            for k, region in enumerate(r.prefer or []):
                if region == LOCAL:
                    if LOCAL in known:
                        yield (*loc, "prefer", k), (
                            f"{LOCAL!r} is ambiguous: it means the proxy's own region, and "
                            f"the topology has a region named {LOCAL!r}; rename that region")
                    continue
                if region not in known:
                    yield (*loc, "prefer", k), (f"{region!r} is not a region (regions: "
                                                f"{', '.join(names)})")
            if r.quorum is not None and r.quorum > len(names):
                yield (*loc, "quorum"), (f"{r.quorum} is more than the {len(names)} "
                                         "region(s) of the topology")


    def _self_read_dead_letters(self) -> Iterator[tuple[Sequence[int | str], str]]:
        """Where `consume:` is written, a rule whose dead-letter topic it matches itself (its
        consumers would read their dead letters back; for a glob, checked with the pattern
        put in for `{topic}`): an error of the file, whatever reads it."""
        for i, r in enumerate(self.rules):
            if "consume" in r.model_fields_set:
                named = r.consume.dead_letter_for(r.topic)
                if fnmatch.fnmatchcase(named, r.topic):
                    yield ("rules", i, "consume", "dead_letter_topic"), (
                        f"{named!r} matches this rule's topic {r.topic!r}: its consumers would "
                        "read their dead letters back; name it outside the rule (the default "
                        f"is 'dlq.{TOPIC_PLACEHOLDER}')")

    def consume_problems(self) -> Iterator[tuple[Sequence[int | str], str]]:
        """Rules whose topics could not be read through the proxy (`dead_letter_problem`, the
        proxy's own check at open, for the rule's topic or, for a glob, a sample topic it
        matches: `_sample`). Not errors of the file for the proxy (it routes writes, and
        refuses such a stream at open: NOT_FOUND); `dr policy validate` reports every one
        (`validate_policy`). Rules hidden by an earlier one and those whose dead letters
        they would read back are reported by `problems` already."""
        assert self._index is not None
        for i, r in enumerate(self.rules):
            loc = ("rules", i, "consume", "dead_letter_topic")
            if "consume" in r.model_fields_set and \
                    fnmatch.fnmatchcase(r.consume.dead_letter_for(r.topic), r.topic):
                continue
            if not r.is_glob:
                first = self._index.first(r.topic)
                if first is not None and first < i:
                    continue
            sample = r.topic if not r.is_glob else self._sample_of(i)
            if sample is None:
                continue  # no one topic to try (earlier rules take the samples)
            why = self.dead_letter_problem(sample, r)
            if why is not None:
                which = repr(sample) if sample == r.topic else \
                    f"{sample!r} (a topic of {r.topic!r})"
                yield loc, f"{which} could not be read through the proxy: {why}"

    def _sample_of(self, i: int) -> str | None:
        """A topic glob rules[i] decides (`_sample`, with each filler until no earlier rule
        takes it), or None."""
        assert self._index is not None
        for filler in _FILLERS:
            sample = _sample(self.rules[i].topic, filler)
            if sample is not None and self._index.first(sample) == i:
                return sample
        return None

    def dead_letters(self) -> list[dict[str, Any]]:
        """Where each rule's dead letters go (`dr policy validate --json`): per rule its
        topic, the topic tried (the rule's, or a sample of its glob; None: no sample), that
        topic's dead-letter topic, the rule that writes it (`rules[j]`, `default`, `source`:
        it follows the rule of its source topic, or None) and in which mode, and why such a
        topic could not be read through the proxy (`dead_letter_problem`, or None)."""
        assert self._index is not None
        out: list[dict[str, Any]] = []
        for i, r in enumerate(self.rules):
            sample = r.topic if not r.is_glob else self._sample_of(i)
            named = r.consume.dead_letter_for(sample) if sample is not None else None
            dl = self.rule_for(named) if named is not None and _TOPIC_NAME.match(named) \
                else None
            j = self._index.first(named) if dl is not None and named is not None else None
            out.append({
                "rule": i, "topic": r.topic, "sample": sample, "dead_letter_topic": named,
                "written_by": (None if dl is None else f"rules[{j}]" if j is not None else
                               "default" if self.default is not None and named is not None
                               and dl == self.default.for_topic(named) else "source"),
                "mode": dl.dr_mode if dl is not None else None,
                "problem": (self.dead_letter_problem(sample, r) if sample is not None
                            else None)})
        return out


def _following(topic: str, source: Rule) -> Rule:
    """The rule of dead-letter topic `topic`, no rule naming it: `source`'s (the rule of the
    topic it holds the dead letters of), except that a dead letter is never refused for
    what its original was accepted with: a key is optional (an ordered topic's records
    written straight to Kafka may have none) and the size limit leaves room for the
    `dr-dl-*` headers."""
    return Rule.model_construct(topic=topic, mode=source.mode, sync=source.sync,
                                quorum=source.quorum, require_key=False,
                                max_record_bytes=source.max_record_bytes + DEAD_LETTER_HEADROOM,
                                prefer=source.prefer, consume=source.consume)


def _checks(topology: Topology | None, consumable: bool) -> Any:
    if consumable:
        return lambda p: itertools.chain(p.problems(topology), p.consume_problems())
    return lambda p: p.problems(topology)


def load_policy(path: str | Path, topology: Topology | None = None, *,
                consumable: bool = False) -> Policy:
    """Read and validate a policy file (against `topology` when given); ConfigError lists
    every problem with file, line and field. `consumable`: every topic that could not be
    read through the proxy is one too (`Policy.consume_problems`; `dr policy validate`)."""
    return load_model(Policy, path, _checks(topology, consumable))


def validate_policy(path: str | Path, topology: Topology | None = None) -> Policy:
    """What `dr policy validate` checks: `load_policy(..., consumable=True)`."""
    return load_policy(path, topology, consumable=True)


def parse_policy(text: str, filename: str, topology: Topology | None = None, *,
                 consumable: bool = False) -> Policy:
    """`load_policy` for text already read (`filename` is used in errors)."""
    return parse_model(Policy, text, filename, _checks(topology, consumable))


def default_policy_path() -> Path | None:
    """The routing policy a proxy (and the controller's ACL fence) runs when none is named:
    `$CROSSDC_POLICY`, else `policies/default.yaml` in the working directory, else the
    source checkout's. None when there is none: the policy is not shipped in the package."""
    env = os.environ.get("CROSSDC_POLICY")
    if env:
        return Path(env)
    rel = Path("policies") / "default.yaml"
    root = Path(__file__).resolve().parents[1]
    checkout = root / rel if (root / "pyproject.toml").is_file() else None
    for cand in (Path.cwd() / rel, checkout):
        if cand is not None and cand.is_file():
            return cand
    return None
