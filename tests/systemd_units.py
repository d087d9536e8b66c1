"""The systemd units shipped in deploy/systemd/, read as systemd reads them, as far as the
tests need: sections and repeated keys, `Environment=` then `EnvironmentFile=` (a later one
overrides, a `-` one may be missing), the `%i` specifier, and ExecStart split into words with
`${VAR}` (one word) and `$VAR` (split on whitespace, nothing when empty) expanded
(systemd.service(5) "Command lines", systemd.exec(5) "Environment").

The unit tests check these command lines against the CLI; the deployment proof
(tests/integration/test_deploy_hosts.py) runs exactly them, so nothing restates a unit."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEPLOY", "INSTALLED_DR", "UNITS", "Unit", "read_env_file", "read_unit"]

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
UNITS = DEPLOY / "systemd"
INSTALLED_DR = "/opt/crossdc/bin/dr"
"""Where the units expect the install (`python3 -m venv /opt/crossdc`)."""

_SECTION = re.compile(r"^\[(?P<name>[A-Za-z]+)\]$")
_ENTRY = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9]*)=(?P<value>.*)$")
_VAR = re.compile(r"\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}")
_BARE = re.compile(r"^\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True)
class Entry:
    section: str
    key: str
    value: str
    line: int


@dataclass(frozen=True)
class Unit:
    path: Path
    entries: tuple[Entry, ...]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def template(self) -> bool:
        return self.name.endswith("@.service")

    def instance_name(self, instance: str) -> str:
        """`crossdc-mirror@.service` + `east:west` → `crossdc-mirror@east:west.service`."""
        return self.name.replace("@.", f"@{instance}.") if self.template else self.name

    def sections(self) -> list[str]:
        return list(dict.fromkeys(e.section for e in self.entries))

    def values(self, section: str, key: str) -> list[str]:
        """Every value of `key` in `section`, in order (systemd keys repeat)."""
        return [e.value for e in self.entries if e.section == section and e.key == key]

    def value(self, section: str, key: str) -> str:
        """The one value of `key` (the last, as systemd keeps for single-valued keys)."""
        found = self.values(section, key)
        assert found, f"{self.name}: no {key}= in [{section}]"
        return found[-1]

    def _specifiers(self, text: str, instance: str) -> str:
        names = {"i": instance, "I": instance, "n": self.instance_name(instance), "%": "%"}
        return re.sub(r"%(.)", lambda m: names.get(m.group(1), m.group(0)), text)

    def environment(self, instance: str = "", *, files: dict[str, str] | None = None
                    ) -> dict[str, str]:
        """The service's environment: `Environment=` assignments, then each
        `EnvironmentFile=` in order overriding them. `files`: the text of each file by its
        path (as the unit names it, `%i` resolved), standing in for the host's /etc; a
        required file absent from it is an AssertionError, a `-` one is skipped. Without
        `files`: the unit's own defaults only."""
        env: dict[str, str] = {}
        for assignments in self.values("Service", "Environment"):
            for word in shlex.split(self._specifiers(assignments, instance)):
                key, sep, val = word.partition("=")
                assert sep, f"{self.name}: Environment={assignments!r} is not KEY=VALUE"
                env[key] = val
        for ref in self.values("Service", "EnvironmentFile") if files is not None else ():
            optional = ref.startswith("-")
            path = self._specifiers(ref.removeprefix("-"), instance)
            text = (files or {}).get(path)
            if text is None:
                assert optional, f"{self.name}: EnvironmentFile={path} is required"
                continue
            env.update(read_env_file(text))
        return env

    def command(self, key: str = "ExecStart", instance: str = "", *,
                env: dict[str, str]) -> list[str]:
        """The command line of `key` as systemd runs it: specifiers, then words, then
        variables from `env`."""
        raw = self._specifiers(self.value("Service", key), instance).lstrip("-@:+!")
        argv: list[str] = []
        for word in shlex.split(raw):
            bare = _BARE.match(word)
            if bare:
                argv += env.get(bare.group("name"), "").split()
                continue
            argv.append(_VAR.sub(lambda m: env.get(m.group("braced"), ""), word))
        return argv

    def variables(self, key: str = "ExecStart") -> set[str]:
        """The names of the variables a command line uses."""
        raw = self.value("Service", key)
        return ({m.group("braced") for m in _VAR.finditer(raw)}
                | {m.group("name") for w in raw.split() if (m := _BARE.match(w))})


def read_unit(path: Path) -> Unit:
    """Parse a unit file: `[Section]` headers, `Key=value` lines (a trailing backslash joins
    the next line), `#`/`;` comments. A line that is none of these is an AssertionError
    naming file and line (systemd would ignore it, with a warning)."""
    entries: list[Entry] = []
    section = ""
    pending = ""
    start = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if pending:
            line = pending + " " + line.strip()
        else:
            start = number
            line = line.strip()
            if not line or line[0] in "#;":
                continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = ""
        head = _SECTION.match(line)
        if head:
            section = head.group("name")
            continue
        entry = _ENTRY.match(line)
        assert entry, f"{path}:{start}: not a section, key=value or comment: {line!r}"
        assert section, f"{path}:{start}: {entry.group('key')}= before any [Section]"
        entries.append(Entry(section, entry.group("key"), entry.group("value").strip(), start))
    assert not pending, f"{path}: ends inside a continued line"
    return Unit(path, tuple(entries))


def read_env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile's assignments: `KEY=VALUE` lines, `#`/`;` comments, quotes around
    a value removed."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, val = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"not a variable name: {line!r}"
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        env[key] = val
    return env
