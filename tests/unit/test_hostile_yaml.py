"""Hostile topology, policy and auth files: every document gives a valid model or a
ConfigError whose issues name the file, the line and (for a document that parses) the field;
never another exception.

Documents are generated as data (random nested structures, the good files mutated: a field
replaced by a value of another type, removed, an unknown field added, huge numbers and
strings, unicode), dumped to YAML, and sometimes rewritten as text (a key repeated, an
anchor and aliases). test_yaml_limits.py covers random *text* (bytes that are not YAML).
Bounded: a few hundred examples in a few seconds, derandomized so CI sees the same ones.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from crossdc.errors import ConfigError
from crossdc.topology import Topology
from crossdc.yamlfile import parse_model
from dr.stack.paths import REPO_ROOT
from proxy.auth import parse_auth
from proxy.policy import parse_policy

TOPOLOGY = yaml.safe_load((REPO_ROOT / "policies" / "topology.local.yaml").read_text())
POLICY = yaml.safe_load((REPO_ROOT / "policies" / "default.yaml").read_text())
AUTH = {"tokens": [{"name": "payments-api", "sha256": "ab" * 32,
                    "topics": ["payments.*", "orders"]}]}
TOPO_MODEL = Topology.model_validate(TOPOLOGY)


def _parse_topology(text: str, filename: str) -> BaseModel:
    return parse_model(Topology, text, filename)


def _parse_policy(text: str, filename: str) -> BaseModel:
    return parse_policy(text, filename, TOPO_MODEL)


PARSERS: dict[str, tuple[Callable[[str, str], BaseModel], dict[str, Any]]] = {
    "topology": (_parse_topology, TOPOLOGY),
    "policy": (_parse_policy, POLICY),
    "auth": (parse_auth, AUTH),
}

FILE = "hostile/ünïcode file.yaml"

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_SCALARS = (st.none() | st.booleans()
            | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(max_size=12)
            | st.sampled_from(["", "east", "west", "local", "ordered", "nearest", "sync",
                               "127.0.0.1:1", "[::1]:99999", "*", "payments.*", "é" * 300,
                               "x" * 20_000, "\u202e\u0000", "\ud7ff", "0x1F", "1e999",
                               "9" * 400]))
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["name", "regions", "topic", "mode", "tokens", "kafka", "rules"]), inner, max_size=4),
    max_leaves=20)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple[Any, ...], how: str, value: Any,
            extra_key: str = "zzz") -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value if how == "replace" else doc
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if how == "replace":
        parent[last] = value
    elif how == "delete":
        del parent[last]
    elif how == "extra" and isinstance(parent[last], dict):
        parent[last][extra_key] = value
    elif how == "extra":
        parent[last] = {extra_key: value}
    return doc


def check(kind: str, text: str) -> BaseModel | ConfigError:
    """Parse `text` as `kind`; a ConfigError must name the file and a line (within the
    text) in every issue."""
    parse = PARSERS[kind][0]
    outcome: BaseModel | ConfigError
    try:
        outcome = parse(text, FILE)
    except ConfigError as err:
        outcome = err
    if isinstance(outcome, ConfigError):
        assert outcome.issues, "a ConfigError with no issue"
        for issue in outcome.issues:
            assert issue.file == FILE, issue
            assert str(issue).startswith(FILE), issue
            assert issue.line is not None, f"no line: {issue}"
            assert 1 <= issue.line <= text.count("\n") + 1, f"line out of range: {issue}"
    return outcome


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False, width=10_000)


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_mutated_good_files_give_a_model_or_a_located_error(kind: str,
                                                            data: st.DataObject) -> None:
    good = PARSERS[kind][1]
    path = data.draw(st.sampled_from(_paths(good)), label="path")
    how = data.draw(st.sampled_from(["replace", "delete", "extra"]), label="how")
    value = data.draw(_VALUES, label="value")
    extra = data.draw(st.text(min_size=1, max_size=6) | st.just("zzz"), label="extra_key")
    doc = _mutate(good, path, how, value, extra)
    outcome = check(kind, _dump(doc))
    if isinstance(outcome, ConfigError) and path and how != "delete":
        # an error caused by a field that is there names it (or a parent, or a sibling
        # check such as region-name uniqueness, which names the list)
        fields = {i.field for i in outcome.issues}
        assert all(fields), f"an issue without its field: {outcome}"


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SETTINGS
@given(doc=_VALUES)
def test_random_structures_give_a_model_or_a_located_error(kind: str, doc: Any) -> None:
    check(kind, _dump(doc))


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_a_repeated_key_is_refused_naming_its_line(kind: str, data: st.DataObject) -> None:
    text = _dump(PARSERS[kind][1])
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if ":" in line and not line.strip().endswith(":")
             and not line.lstrip().startswith("- ")]
    i = data.draw(st.sampled_from(keyed), label="line")
    lines.insert(i + 1, lines[i])  # the same key again, same indentation
    err = check(kind, "\n".join(lines) + "\n")
    assert isinstance(err, ConfigError)
    assert any(issue.message == "duplicate key" and issue.line == i + 2
               for issue in err.issues), err


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SETTINGS
@given(fanout=st.integers(2, 12), depth=st.integers(1, 12),
       where=st.sampled_from(["top", "nested"]))
def test_alias_bombs_are_refused_quickly(kind: str, fanout: int, depth: int,
                                         where: str) -> None:
    lines = [f"a0: &a0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"a{d}: &a{d} [{', '.join([f'*a{d - 1}'] * fanout)}]" for d in range(1, depth)]
    text = "\n".join(lines) + "\n"
    if where == "nested":
        text = _dump(PARSERS[kind][1]) + "extra:\n" + "".join(f"  {ln}\n" for ln in lines)
    outcome = check(kind, text)
    assert isinstance(outcome, ConfigError)
    if fanout ** depth > 100_000:
        assert any("refused" in i.message for i in outcome.issues), outcome


ODD = ["9" * 5000, "-" + "9" * 5000, "1e400", ".inf", ".nan", "!!binary aGVsbG8=",
       "!!timestamp 2001-02-03", "!!set {a, b}", "!!omap [a: 1]", "2001-02-30", "&x [*x]",
       "'" + "é" * 20_000 + "'", "!!float ''", "!!int ''", "<<: {a: 1}", "{? [1, 2] : 3}",
       "[" * 40 + "]" * 40, "!!python/object:os.system x", "*undefined", "\"\\ud800\""]


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_odd_values_anywhere(kind: str, data: st.DataObject) -> None:
    good = PARSERS[kind][1]
    path = data.draw(st.sampled_from(_paths(good)[1:]), label="path")
    value = data.draw(st.sampled_from(ODD), label="value")
    text = _dump(_mutate(good, path, "replace", "@@HOLE@@")).replace(
        "'@@HOLE@@'", value).replace("@@HOLE@@", value)
    check(kind, text)


@pytest.mark.parametrize(("text", "line", "field", "says"), [
    ("regions:\n  - name: east\n    kafka: 2001-02-30\n", 3, "regions[0].kafka",
     "day is out of range"),
    ("primary: east\npreference: " + "9" * 5000 + "\n", 2, "preference", "5000 digits"),
    ("regions: [{name: !!int ''}]\n", 1, "regions[0].name", "tagged value"),
    ("primary: east\nregions: x\x00\n", 2, "", "control characters"),
])
def test_found_a_bad_scalar_is_located(text: str, line: int, field: str, says: str) -> None:
    """Found by these tests: a scalar its tag cannot hold (a date that does not exist, an
    integer over Python's 4300 digits, `!!int ''`) and a refused character were reported
    with neither line nor field."""
    with pytest.raises(ConfigError) as info:
        parse_model(Topology, text, FILE)
    (issue,) = info.value.issues
    assert (issue.line, issue.field) == (line, field)
    assert says in issue.message
    assert "set_int_max_str_digits" not in issue.message
    assert "<unicode string>" not in issue.message
