"""Every `dr` command, and every group, answers bad input with one error paragraph and exit 2,
never a traceback.

The command tree is read from the typer app itself, so a command added later is walked too:
each command and group gets an unknown option; each command with a region option gets a
region the topology does not have; each command with a file option or argument gets a file
that does not exist and a file that is not valid YAML; each number option gets a value that
is not a number, one below its minimum, and (the `--max-*` limits) a negative one. Only a
variant about a file may say "invalid file". Every variant carries exactly one bad input, so
none of them may get as far as doing anything; as a safety net the commands see a topology
(`$CROSSDC_TOPOLOGY`) whose ports nothing listens on, and an empty state and cache folder.

Each variant runs in a process of its own, with its own exit status, stdout and stderr, and a
deadline. Starting ~130 interpreters that each import the CLI (seconds each on a busy machine)
would be slow, so one driver process (this file run as a script) imports the CLI once and
forks a child per variant, which runs the console-script entry point as `dr` would: what it
raises goes to `sys.excepthook` (a traceback on stderr) exactly as in a fresh interpreter.
Two variants also run as fresh interpreters (`test_bad_region_lists_the_regions`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import typer.main
from tests_support import write_topology  # type: ignore[import-not-found]

from dr.cli import app
from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_topology

POLICY = str(REPO_ROOT / "policies" / "default.yaml")
MISSING = "/nonexistent/crossdc-missing.yaml"

GOOD = {  # a good value for each option a variant may need beside the bad one
    "--region": "east", "--regions": "east,west", "--from": "east", "--to": "west",
    "--topics": "t.*", "--policy": POLICY, "--group": "g", "--name": "n",
    "--scenario": "primary-outage",
}
FLAGS = ("--no-consul",)  # never reach out, should a variant get that far
BAD_REGION = {"--region": "mars", "--regions": "east,mars", "--from": "mars", "--to": "mars"}
FILE_OPTIONS = ("--topology", "--policy", "--auth", "--thresholds", "--config")
BAD_FILE = "@BAD_FILE@"
"""Placeholder for a file that exists and is not valid YAML (the test writes it)."""
BAD_YAML = "regions: [unclosed\n  - {: \n"


@dataclass(frozen=True)
class Variant:
    argv: tuple[str, ...]
    why: str
    must_name: str


def _walk(cmd: object, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], object]]:
    found = [(path, cmd)]
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        found += _walk(sub, (*path, name))
    return found


def _number_type(p: object) -> type | None:
    bare = getattr(p, "bare_type", None)
    t = bare() if callable(bare) else getattr(getattr(p, "type", None), "name", None)
    if t in (int, "integer", "integer range"):
        return int
    if t in (float, "float", "float range"):
        return float
    return None


def _options(cmd: object) -> dict[str, object]:
    out = {}
    for p in getattr(cmd, "params", []):
        if p.param_type_name == "argument":
            out["<file>" if p.name == "file" else f"<{p.name}>"] = p
        else:
            out[p.opts[0]] = p
    return out


def _variants(entry: tuple[str, ...], path: tuple[str, ...], cmd: object) -> list[Variant]:
    out = [Variant((*entry, *path, "--bogus"), "unknown option", "--bogus")]
    if getattr(cmd, "commands", None) is not None:
        return out  # a group: only the unknown option
    opts = _options(cmd)
    unknown_required = [n for n, p in opts.items()
                        if getattr(p, "required", False) and n not in GOOD and n != "<file>"]
    assert not unknown_required, f"{path}: add a good value for {unknown_required} to GOOD"

    def argv(bad: str, value: str) -> tuple[str, ...]:
        args: list[str] = [*entry, *path]
        if "<file>" in opts:
            args.append(value if bad == "<file>" else str(REPO_ROOT / "policies" /
                                                          "topology.local.yaml"))
        for name in opts:
            if name == bad and name != "<file>":
                args += [name, value]
            elif name in GOOD:
                args += [name, GOOD[name]]
            elif name in FLAGS:
                args.append(name)
        return tuple(args)

    for name in opts:
        if name in BAD_REGION:
            out.append(Variant(argv(name, BAD_REGION[name]), f"bad region in {name}", "mars"))
        if name in FILE_OPTIONS or name == "<file>":
            out.append(Variant(argv(name, MISSING), f"missing file in {name}", MISSING))
            out.append(Variant(argv(name, BAD_FILE), f"bad file in {name}", BAD_FILE))
        p = opts[name]
        if name.startswith("--") and _number_type(p) is not None:
            out.append(Variant(argv(name, "twelve"), f"not a number in {name}", name))
            low = getattr(p, "min", None)
            if low is not None:
                out.append(Variant(argv(name, str(low - 1)), f"below the minimum in {name}",
                                   name))
            elif name.startswith("--max-"):
                out.append(Variant(argv(name, "-1"), f"negative limit in {name}", name))
    return out


def _all_variants() -> list[Variant]:
    variants = [v for path, cmd in _walk(typer.main.get_command(app), ())
                for v in _variants(("-m", "dr.cli"), path, cmd)]
    # `python -m dr.reconcile` (spark-submit's entry point) is a second, one-command app.
    variants += [
        Variant(("-m", "dr.reconcile", "--bogus"), "unknown option", "--bogus"),
        Variant(("-m", "dr.reconcile", "--regions", "east,mars", "--topics", "x"),
                "bad region in --regions", "mars"),
        Variant(("-m", "dr.reconcile", "--regions", "east,west", "--topics", "x",
                 "--topology", MISSING), "missing file in --topology", MISSING),
    ]
    return variants


def test_the_walk_covers_every_command() -> None:
    variants = _all_variants()
    commands = {" ".join(v.argv[2:]).split(" --")[0] for v in variants}
    for expected in ("status", "reconcile", "proxy serve", "mirror run", "offsets translate",
                     "topology validate", "policy validate", "proxy", "mirror"):
        assert expected in commands
    whys = {v.why for v in variants}
    assert {"bad region in --region", "bad region in --from", "bad region in --to",
            "bad region in --regions", "missing file in --topology", "missing file in <file>",
            "missing file in --policy", "bad file in --topology", "bad file in <file>",
            "not a number in --rate", "below the minimum in --duration",
            "negative limit in --max-rto-s"} <= whys


@dataclass(frozen=True)
class Result:
    argv: list[str]
    why: str
    must_name: str
    code: int | None
    """Exit status; None: still running at the deadline (killed)."""
    stdout: str
    stderr: str


def _run_forked(variants: list[dict[str, object]], deadline_s: float,
                parallel: int) -> list[Result]:
    """The driver: fork one child per variant (at most `parallel` at once), each running the
    entry point with its argv, stdout and stderr in files; collect status and output."""
    import tempfile

    import dr.cli
    import dr.reconcile.__main__
    with __import__("contextlib").suppress(ImportError):  # what serve imports, loaded once
        import proxy.serve  # noqa: F401
    entries = {"dr.cli": dr.cli.main, "dr.reconcile": dr.reconcile.__main__.main}
    work = Path(tempfile.mkdtemp(prefix="cli-walk-"))
    running: dict[int, tuple[int, float]] = {}
    codes: dict[int, int | None] = {}

    def start(i: int) -> None:
        argv = [str(a) for a in variants[i]["argv"]]  # type: ignore[attr-defined]
        pid = os.fork()
        if pid == 0:  # the child: a `dr` process
            code = 1
            try:
                for fd, name in ((1, "out"), (2, "err")):
                    f = os.open(work / f"{i}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(f, fd)
                    os.close(f)
                sys.argv = ["dr" if argv[1] == "dr.cli" else "python -m dr.reconcile",
                            *argv[2:]]
                try:
                    entries[argv[1]]()
                    code = 0
                except SystemExit as exc:
                    c = exc.code
                    code = c if isinstance(c, int) else (0 if c is None else 1)
                    if not isinstance(c, int | None):
                        print(c, file=sys.stderr)
                except BaseException:
                    sys.excepthook(*sys.exc_info())
                    code = 1
            finally:
                for stream in (sys.stdout, sys.stderr):
                    with __import__("contextlib").suppress(Exception):
                        stream.flush()
                os._exit(code)
        running[pid] = (i, time.monotonic() + deadline_s)

    todo = list(range(len(variants)))
    while todo or running:
        while todo and len(running) < parallel:
            start(todo.pop(0))
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            i, _ = running.pop(pid)
            codes[i] = os.waitstatus_to_exitcode(status)
            continue
        for pid, (i, until) in list(running.items()):
            if time.monotonic() > until:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                running.pop(pid)
                codes[i] = None
        time.sleep(0.01)  # polling child processes (waitpid has no timeout)
    return [Result(argv=[str(a) for a in v["argv"]],  # type: ignore[attr-defined]
                   why=str(v["why"]), must_name=str(v["must_name"]), code=codes[i],
                   stdout=(work / f"{i}.out").read_text(errors="replace"),
                   stderr=(work / f"{i}.err").read_text(errors="replace"))
            for i, v in enumerate(variants)]


@pytest.mark.timeout(600)  # ~130 variants; seconds on a quiet machine, minutes on a busy one
def test_every_command_answers_bad_input_with_one_paragraph(tmp_path: Path) -> None:
    topo = write_topology(free_topology(["east", "west"]), tmp_path / "topology.yaml")
    env = {**os.environ, "CROSSDC_TOPOLOGY": str(topo),
           "CROSSDC_STATE_DIR": str(tmp_path / "state"),
           "CROSSDC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200",
           # the checkout holding this test, and tests/ (tests_support)
           "PYTHONPATH": os.pathsep.join(str(Path(__file__).resolve().parents[i])
                                         for i in (2, 1))}
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    variants = [Variant(tuple(a.replace(BAD_FILE, str(bad)) for a in v.argv), v.why,
                        v.must_name.replace(BAD_FILE, str(bad))) for v in _all_variants()]
    todo = tmp_path / "variants.json"
    todo.write_text(json.dumps([asdict(v) for v in variants]))
    driver = subprocess.run([sys.executable, __file__, str(todo)], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=560, check=False)
    assert driver.returncode == 0, driver.stderr[-2000:]
    results = [Result(**r) for r in json.loads(driver.stdout)]
    assert len(results) == len(_all_variants())
    problems = []
    for r in results:
        shown = " ".join(r.argv[1:])
        paragraphs = [p for p in r.stderr.strip().split("\n\n") if p.strip()]
        if r.code is None:
            problems.append(f"{shown} ({r.why}): still running at the deadline")
        elif "Traceback" in r.stderr + r.stdout:
            problems.append(f"{shown} ({r.why}): a traceback:\n{r.stderr[-600:]}")
        elif r.code != 2:
            problems.append(f"{shown} ({r.why}): exit {r.code}, not 2:\n{r.stderr[-600:]}")
        elif len(paragraphs) != 1:
            problems.append(f"{shown} ({r.why}): {len(paragraphs)} paragraphs on stderr:\n"
                            f"{r.stderr}")
        elif r.must_name not in r.stderr:
            problems.append(f"{shown} ({r.why}): does not name {r.must_name!r}:\n{r.stderr}")
        elif "invalid file" in r.stderr and "file" not in r.why:
            problems.append(f"{shown} ({r.why}): calls an option a file:\n{r.stderr}")
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("option", ["--region", "--regions"])
def test_bad_region_lists_the_regions(option: str) -> None:
    """The line names the value and the choices."""
    cmd = {"--region": ["proxy", "serve", "-r", "mars", "-p", POLICY],
           "--regions": ["reconcile", "--regions", "east,mars", "--topics", "x"]}[option]
    proc = subprocess.run([sys.executable, "-m", "dr.cli", *cmd, "-t",
                           str(REPO_ROOT / "policies" / "topology.local.yaml")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    line = " ".join(proc.stderr.split())
    assert "'mars'" in line
    assert "east, west" in line


if __name__ == "__main__":  # the driver of test_every_command_answers_bad_input_...
    _variants_in = json.loads(Path(sys.argv[1]).read_text())
    _done = _run_forked(_variants_in, deadline_s=90.0, parallel=4)
    sys.stdout.write(json.dumps([asdict(r) for r in _done]))
