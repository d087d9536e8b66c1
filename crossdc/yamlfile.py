"""Load a YAML file into a pydantic model, with errors that name file, line and field.

The file is composed into YAML nodes (which keep their start marks) and validated; each
pydantic error's `loc` is walked down the node tree to the line it points at, so a user reads
`policies/topology.local.yaml:14 regions[1].consul.datacenter: ...` instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from crossdc.errors import ConfigError, ConfigIssue

__all__ = ["Checks", "format_loc", "load_model", "parse_model"]

M = TypeVar("M", bound=pydantic.BaseModel)

Checks = Callable[[M], Iterable[tuple[Sequence[int | str], str]]]
"""Checks run on a model that validated: each yields `(loc, message)`, located like pydantic's
errors. For rules that span siblings (a repeated name in a list) or need outside context."""


def load_model(model: type[M], path: str | Path, checks: Checks[M] | None = None) -> M:
    """Read `path` and validate it as `model`; raise ConfigError listing every problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue(str(p), None, "", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue(str(p), None, "", f"cannot read: {exc}")]) from exc
    return parse_model(model, text, str(p), checks)


def parse_model(model: type[M], text: str, filename: str,
                checks: Checks[M] | None = None) -> M:
    """Validate YAML `text` as `model`; `filename` is used in error messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(
            [ConfigIssue(filename, line, "", f"not valid YAML: {exc.problem}")]
        ) from None
    if root is None:
        raise ConfigError([ConfigIssue(filename, 1, "", "the file is empty")])
    dupes = list(_duplicate_keys(root, ()))
    if dupes:
        raise ConfigError(
            [ConfigIssue(filename, node.start_mark.line + 1, format_loc(loc), "duplicate key")
             for loc, node in dupes]
        )
    data = yaml.safe_load(text)
    try:
        result = model.model_validate(data)
    except pydantic.ValidationError as exc:
        found = [(tuple(err["loc"]), _message(err)) for err in exc.errors(include_url=False)]
        raise ConfigError(_located(root, filename, found)) from None
    found = [(tuple(loc), msg) for loc, msg in (checks(result) if checks else ())]
    if found:
        raise ConfigError(_located(root, filename, found))
    return result


def _located(root: yaml.Node, filename: str,
             found: list[tuple[tuple[int | str, ...], str]]) -> list[ConfigIssue]:
    issues = []
    for loc, msg in found:
        node = _node_at(root, loc)
        line = node.start_mark.line + 1 if node is not None else None
        issues.append(ConfigIssue(filename, line, format_loc(loc), msg))
    return issues


def format_loc(loc: Sequence[int | str]) -> str:
    """`("regions", 1, "kafka")` → `regions[1].kafka`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _message(err: Any) -> str:
    msg = str(err["msg"])
    # pydantic prefixes errors raised by our validators with "Value error, "; drop the noise.
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling)"
    return msg


def _node_at(root: yaml.Node, loc: tuple[int | str, ...]) -> yaml.Node | None:
    """The deepest node that `loc` reaches; the parent node when the key is missing."""
    node = root
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    child = value
                    break
        elif (isinstance(node, yaml.SequenceNode) and isinstance(part, int)
              and 0 <= part < len(node.value)):
            child = node.value[part]
        if child is None:
            return node
        node = child
    return node


def _duplicate_keys(node: yaml.Node, loc: tuple[int | str, ...]) -> Any:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key)
            if name in seen:
                yield (*loc, name), key
            seen.add(name)
            yield from _duplicate_keys(value, (*loc, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*loc, i))
