"""Load a YAML file into a pydantic model, with errors that name file, line and field.

The file is composed into YAML nodes (which keep their start marks) and validated; each
pydantic error's `loc` is walked down the node tree to the line it points at, so a user reads
`policies/topology.local.yaml:14 regions[1].consul.datacenter: ...` instead of a traceback.

Loading is bounded (`Limits`), so a hostile or broken file is refused quickly instead of
eating minutes and memory: a size limit, a nesting depth limit, a budget of nodes counted
with every alias expanded (a "billion laughs" file is a few hundred bytes), a time limit,
and at most `max_issues` issues listed (the rest counted in `ConfigError.more`). Every walk
over the node graph remembers the nodes it has seen, since aliases share them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_text, too_big

__all__ = ["LIMITS", "Checks", "Limits", "format_loc", "load_model", "parse_model", "repeated"]

M = TypeVar("M", bound=pydantic.BaseModel)

Checks = Callable[[M], Iterable[tuple[Sequence[int | str], str]]]
"""Checks run on a model that validated: each yields `(loc, message)`, located like pydantic's
errors. For rules that span siblings (a repeated name in a list) or need outside context."""


@dataclass(frozen=True)
class Limits:
    """What loading one file may cost before it is refused."""

    max_bytes: int = 1024 * 1024
    max_depth: int = 64
    """Nesting of mappings and sequences."""
    max_nodes: int = 100_000
    """Nodes of the document with every alias expanded."""
    max_s: float = 10.0
    """Time to read the file (`crossdc.files`), and to read the YAML into nodes."""
    max_issues: int = 50
    """Issues listed in one ConfigError; the rest are only counted."""


LIMITS = Limits()


class _Refused(Exception):
    def __init__(self, message: str, node_or_mark: Any = None) -> None:
        super().__init__(message)
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.line: int | None = mark.line + 1 if mark is not None else None


if yaml.__with_libyaml__:
    from yaml._yaml import CParser as _Parser
else:  # pragma: no cover - PyYAML built without libyaml: the pure-Python reader and parser
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)


class _BadValue(Exception):
    """A scalar its tag or type cannot hold (`2001-02-30`, a 5000-digit integer, `!!int ''`),
    with the node it came from (for the line and the field)."""

    def __init__(self, message: str, node: yaml.Node) -> None:
        super().__init__(message)
        self.node = node


def _value_message(exc: Exception) -> str:
    if isinstance(exc, (IndexError, TypeError, KeyError, AttributeError)):
        # PyYAML's constructors fail this way on an explicit tag they cannot build from
        # the scalar given (`!!int ` with nothing after it): bad input, not our bug.
        return "a tagged value (like !!int) that cannot be built from its text"
    msg = str(exc).split(";")[0]  # drop Python's advice (sys.set_int_max_str_digits)
    return msg or exc.__class__.__name__


class _BoundedLoader(_Parser, Composer, SafeConstructor, Resolver):
    """libyaml's parser (fast) under PyYAML's composer (which can be bounded: depth, time)
    and safe constructor."""

    get_single_node = Composer.get_single_node
    compose_document = Composer.compose_document

    def __init__(self, text: str, limits: Limits) -> None:
        _Parser.__init__(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._limits = limits
        self._depth = 0
        self._composed = 0
        self._deadline = time.monotonic() + limits.max_s

    def _mark(self) -> Any:
        return getattr(self.peek_event(), "start_mark", None)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return SafeConstructor.construct_object(self, node, deep)
        except (_BadValue, yaml.MarkedYAMLError):
            raise
        except (ValueError, OverflowError, IndexError, TypeError, KeyError,
                AttributeError) as exc:
            raise _BadValue(_value_message(exc), node) from None

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._composed += 1
        if self._composed > self._limits.max_nodes:
            raise _Refused(f"more than {self._limits.max_nodes} nodes", self._mark())
        if self._composed % 512 == 0 and time.monotonic() > self._deadline:
            raise _Refused(f"reading it took longer than {self._limits.max_s:g}s",
                           self._mark())
        self._depth += 1
        try:
            if self._depth > self._limits.max_depth:
                raise _Refused(f"nested deeper than {self._limits.max_depth} levels",
                               self._mark())
            return Composer.compose_node(self, parent, index)
        finally:
            self._depth -= 1


def load_model(model: type[M], path: str | Path, checks: Checks[M] | None = None, *,
               limits: Limits = LIMITS) -> M:
    """Read `path` and validate it as `model`; raise ConfigError listing every problem.
    The file is read by `crossdc.files.read_user_text`: a regular file only, refused by its
    size before reading, within `limits.max_s`."""
    text = read_user_text(path, max_bytes=limits.max_bytes, timeout_s=limits.max_s)
    return parse_model(model, text, str(path), checks, limits=limits)


def parse_model(model: type[M], text: str, filename: str,
                checks: Checks[M] | None = None, *, limits: Limits = LIMITS) -> M:
    """Validate YAML `text` as `model`; `filename` is used in error messages."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise ConfigError([ConfigIssue(filename, None, "", too_big(size, limits.max_bytes))])
    loader: _BoundedLoader | None = None
    root: yaml.Node | None = None
    try:
        loader = _BoundedLoader(text, limits)  # the reader checks the characters here
        root = loader.get_single_node()
        if root is None:
            raise ConfigError([ConfigIssue(filename, 1, "", "the file is empty")])
        _check_size(root, limits)
        dupes = _duplicate_keys(root)
        if dupes:
            _raise_capped([ConfigIssue(filename, node.start_mark.line + 1, format_loc(loc),
                                       "duplicate key") for loc, node in dupes], limits)
        data = loader.construct_document(root)
    except _Refused as exc:
        raise ConfigError([ConfigIssue(filename, exc.line, "", f"refused: {exc}")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark is not None else None
        if "maximum nesting depth" in (exc.problem or ""):
            # libyaml's own limit (1,000 levels, enforced since PyYAML 6.0.4's wheels) can
            # fire before the composer's lower one: the same refusal, said the same way
            raise ConfigError([ConfigIssue(
                filename, line, "", f"refused: nested deeper than {limits.max_depth} levels"
            )]) from None
        raise ConfigError(
            [ConfigIssue(filename, line, "", f"not valid YAML: {exc.problem}")]
        ) from None
    except yaml.YAMLError as exc:  # e.g. a control character the reader refuses
        line = None
        position = getattr(exc, "position", None)  # a ReaderError: a character offset
        if isinstance(position, int):
            line = text[:position].count("\n") + 1
        what = str(exc).split("\n")[0]  # not the reader's `in "<unicode string>"` line
        raise ConfigError([ConfigIssue(filename, line, "", f"not valid YAML: {what}")]
                          ) from None
    except _BadValue as exc:  # a scalar its type cannot hold: located like the others
        loc = _loc_of(root, exc.node) if root is not None else ()
        raise ConfigError([ConfigIssue(filename, exc.node.start_mark.line + 1,
                                       format_loc(loc), f"bad value: {exc}")]) from None
    except (ValueError, OverflowError) as exc:  # outside any node (should not happen)
        raise ConfigError([ConfigIssue(filename, None, "", f"bad value: {exc}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    assert root is not None
    try:
        result = model.model_validate(data)
    except pydantic.ValidationError as exc:
        found = [(tuple(err["loc"]), _message(err)) for err in exc.errors(include_url=False)]
        _raise_capped(_located(root, filename, found[:limits.max_issues]), limits,
                      total=len(found))
    found = [(tuple(loc), msg) for loc, msg in (checks(result) if checks else ())]
    if found:
        _raise_capped(_located(root, filename, found[:limits.max_issues]), limits,
                      total=len(found))
    return result


def _raise_capped(issues: list[ConfigIssue], limits: Limits, total: int | None = None) -> Any:
    total = len(issues) if total is None else total
    shown = issues[:limits.max_issues]
    raise ConfigError(shown, more=total - len(shown))


def _check_size(root: yaml.Node, limits: Limits) -> None:
    """Refuse a document larger than `max_nodes` once its aliases are expanded, or one that
    contains itself. Each node's expanded size is computed once (aliases share nodes)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise _Refused("an alias refers to a node that contains it", node)
        open_.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > limits.max_nodes:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > limits.max_nodes:
                    break
        if total > limits.max_nodes:
            raise _Refused(f"more than {limits.max_nodes} nodes once its aliases are "
                           f"expanded", node)
        open_.discard(key)
        sizes[key] = total
        return total

    size(root)


def _located(root: yaml.Node, filename: str,
             found: list[tuple[tuple[int | str, ...], str]]) -> list[ConfigIssue]:
    issues = []
    for loc, msg in found:
        node = _node_at(root, loc)
        line = node.start_mark.line + 1 if node is not None else None
        issues.append(ConfigIssue(filename, line, format_loc(loc), msg))
    return issues


def repeated(values: Iterable[Hashable]) -> list[str]:
    """The values that occur more than once, as sorted strings: for validators that refuse
    repeats, in linear time (a list's `count` per item would be quadratic in a long list)."""
    return sorted(str(v) for v, n in Counter(values).items() if n > 1)


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


def _loc_of(root: yaml.Node, target: yaml.Node) -> tuple[int | str, ...]:
    """The first path from `root` to `target` (a key node: its mapping's path and name);
    () when not found. Aliased nodes are walked once."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[int | str, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if node is target:
            return loc
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                if key is target:
                    return (*loc, _key_name(key))
                stack.append((value, (*loc, _key_name(key))))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*loc, i)) for i, item in reversed(list(enumerate(node.value))))
    return ()


def _key_name(key: yaml.Node) -> str:
    return key.value if isinstance(key, yaml.ScalarNode) else f"<{key.tag}>"


def _duplicate_keys(root: yaml.Node) -> list[tuple[tuple[int | str, ...], yaml.Node]]:
    """Every repeated key of every mapping, located by the first path that reaches it; a
    node reached again through an alias is not walked again."""
    out: list[tuple[tuple[int | str, ...], yaml.Node]] = []
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[int | str, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            names: set[str] = set()
            for key, value in node.value:
                name = _key_name(key)
                if name in names:
                    out.append(((*loc, name), key))
                names.add(name)
                stack.append((value, (*loc, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*loc, i)) for i, item in enumerate(node.value))
    out.sort(key=lambda d: (d[1].start_mark.line, d[1].start_mark.column))
    return out
