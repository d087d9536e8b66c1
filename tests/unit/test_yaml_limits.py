"""Loading a YAML file is bounded: size, nesting, aliases, time and the number of issues listed.

Each refusal is a ConfigError that names the file (and the line, where there is one), never
a hang, a memory blow-up or another exception."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from crossdc.errors import ConfigError
from crossdc.topology import Topology, load_topology
from crossdc.yamlfile import LIMITS, Limits, parse_model
from dr.stack.paths import REPO_ROOT

GOOD = (REPO_ROOT / "policies" / "topology.local.yaml").read_text()

LAUGHS = "\n".join(
    [f'a: &a [{",".join(["lol"] * 9)}]']
    + [f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi",
                                                                 strict=True)]) + "\n"


def refusal(text: str, limits: Limits = LIMITS) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_model(Topology, text, "topo.yaml", limits=limits)
    assert info.value.issues
    assert all(i.file == "topo.yaml" for i in info.value.issues)
    return info.value


@pytest.mark.timeout(5)  # only a hang guard: before the fix this ran for minutes
def test_billion_laughs_is_refused() -> None:
    assert len(LAUGHS) < 400
    err = refusal(LAUGHS)
    [issue] = err.issues
    assert "nodes once its aliases are expanded" in issue.message
    assert issue.line is not None
    assert 1 <= issue.line <= 9


@pytest.mark.timeout(5)
def test_billion_laughs_file_is_refused_by_dr_loader(tmp_path: Path) -> None:
    f = tmp_path / "laughs.yaml"
    f.write_text(LAUGHS)
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    assert str(f) in str(info.value)


def test_aliases_within_budget_still_load() -> None:
    text = GOOD.replace("preference: [east, west]", "preference: &p [east, west]\nx: *p")
    assert "unknown field" in str(refusal(text))  # x is not a field, but it was walked
    assert parse_model(Topology, GOOD, "topo.yaml").primary == "east"


@pytest.mark.timeout(20)
def test_big_file_is_refused_by_size_before_reading(tmp_path: Path) -> None:
    f = tmp_path / "big.yaml"
    f.write_text("regions:\n" + "  - {name: x}\n" * 300_000)  # ~4 MB
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    [issue] = info.value.issues
    assert issue.file == str(f)
    assert re.search(r"the limit is 1048576 bytes \(1 MiB\)", issue.message)


def test_text_over_the_limit_is_refused() -> None:
    err = refusal("x: " + "y" * 2000, Limits(max_bytes=1000))
    assert "the limit is 1000 bytes" in err.issues[0].message


def test_many_errors_are_capped_with_a_count_of_the_rest() -> None:
    regions = "".join(f"  - {{name: r{i}, bad_field: 1}}\n" for i in range(200))
    err = refusal(f"regions:\n{regions}preference: []\nprimary: r0\n")
    assert len(err.issues) == LIMITS.max_issues == 50
    assert err.more > 150
    assert str(err).endswith(f"... and {err.more} more issue(s)")


def test_duplicate_keys_are_capped_too() -> None:
    err = refusal("a: 1\n" * 120)
    assert len(err.issues) == 50
    assert err.more == 69
    assert (err.issues[0].line, err.issues[0].field) == (2, "a")


@pytest.mark.parametrize("depth", [65, 100, 5000])
def test_deep_nesting_is_refused_with_its_line(depth: int) -> None:
    # 5000 passes libyaml's own limit (1,000, in PyYAML >= 6.0.4's parser) too: the
    # refusal reads the same whichever limit fires first
    err = refusal("regions:\n  x: " + "[" * depth + "]" * depth + "\n")
    [issue] = err.issues
    assert issue.message == "refused: nested deeper than 64 levels"
    assert issue.line == 2


class Nested(BaseModel):
    regions: dict[str, Any]


def test_nesting_just_under_the_limit_is_read() -> None:
    got = parse_model(Nested, "regions:\n  x: " + "[" * 62 + "]" * 62 + "\n", "t.yaml")
    depth, value = 0, got.regions["x"]
    while isinstance(value, list) and value:
        depth, value = depth + 1, value[0]
    assert depth == 61  # the innermost [] is the empty list `value` stopped at


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    err = refusal("regions: &r [*r]\n")
    assert "contains it" in err.issues[0].message


@pytest.mark.parametrize("text", ["a: \x00\n", "primary: 2001-02-30\n", "n: 1" + "1" * 5000,
                                  "--- a\n--- b\n", "{[1]: 2}\n", "a: !!python/object x"])
def test_odd_inputs_are_config_errors(text: str) -> None:
    refusal(text)


def test_the_time_limit_refuses_slow_reads() -> None:
    err = refusal("regions:\n" + "  - [1, 2, 3]\n" * 2000, Limits(max_s=0.0))
    assert "took longer than 0s" in err.issues[0].message


_TOKENS = st.sampled_from([
    "regions", "name", "east", "kafka", "consul", "preference", "primary", "flows", ":", ": ",
    "- ", "\n", "\n  ", "\n    ", "[", "]", "{", "}", ",", "&a ", "*a", "&b ", "*b", "<<: ",
    "'", '"', "#", "!!str ", "!!int ", "? ", "|", ">", "---", "...", "%YAML 1.1\n", "1", "-1",
    "0x1F", "1e3", "null", "true", "2001-02-03", "\t", "\\", "\x85", "\ufeff", "\x07", "é"])


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(_TOKENS | st.text(max_size=4), max_size=60),
       where=st.integers(min_value=0, max_value=len(GOOD)), whole=st.booleans())
def test_any_text_gives_a_model_or_a_config_error_naming_the_file(
        parts: list[str], where: int, whole: bool) -> None:
    noise = "".join(parts)
    text = noise if whole else GOOD[:where] + noise + GOOD[where:]
    outcome: Topology | ConfigError
    try:
        outcome = parse_model(Topology, text, "topo.yaml")
    except ConfigError as err:
        outcome = err
    if isinstance(outcome, ConfigError):
        assert outcome.issues
        assert {i.file for i in outcome.issues} == {"topo.yaml"}
    else:
        assert isinstance(outcome, Topology)


def test_a_tag_that_cannot_be_built_is_a_config_error(tmp_path: Path) -> None:
    """Found by the property test: `!!int ` with no digits made PyYAML raise IndexError."""
    from crossdc.errors import ConfigError
    from crossdc.topology import load_topology
    for text in ("!!int ", "regions: !!float ''\n"):
        bad = tmp_path / "t.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_topology(bad)
        assert str(bad) in str(exc.value)
