"""Every `dr` command, and every group, answers bad input with one error paragraph and exit 2
(65 for a file it reads that is missing or invalid: dr/exits.py), never a traceback; every
option of every command is walked with values out of its range and values not of its form.

The command tree is read from the typer app itself (and `python -m dr.reconcile`'s one-command
app), so a command or option added later is walked too, and an option of a kind the walk
does not know fails the walk until it is classified here. Per option, by its kind:

- a number: not a number, one below its minimum, one above its maximum, and (a float) nan:
  every number option must declare both bounds (`dr.options`), or the walk fails;
- a choice: a word that is not one of them; a flag: `--flag=maybe` (flags take no value);
- an input file (and the `FILE` arguments): a missing file, a file that is not valid, a named
  pipe (FIFO: refused at once, never waited on) and a folder;
- a folder (reports, state, output): a regular file; an output file: a folder;
- a region: one the topology does not have, and a name no region can have;
- any other string: the malformed values (and over-long ones) listed in `STRINGS`.

Every variant carries exactly one bad input, so none of them may get as far as doing
anything; as a safety net the commands see a topology (`$CROSSDC_TOPOLOGY`) whose ports
nothing listens on, and an empty state and cache folder.

Each variant runs in a process of its own, with its own exit status, stdout and stderr, and a
deadline. Starting hundreds of interpreters that each import the CLI (seconds each on a busy
machine) would be slow, so one driver process (this file run as a script) imports the CLI once
and forks a child per variant, which runs the console-script entry point as `dr` would: what
it raises goes to `sys.excepthook` (a traceback on stderr) exactly as in a fresh interpreter.
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
import typer
import typer.main
from tests_support import write_topology

from dr.cli import app
from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_topology

POLICY = str(REPO_ROOT / "policies" / "default.yaml")
MISSING = "/nonexistent/crossdc-missing.yaml"

# Placeholders the test replaces with paths it makes (a FIFO, a folder, PEM files, ...).
BAD_FILE = "@BAD_FILE@"
"""A file that exists and is neither valid YAML nor PEM nor JSON."""
FIFO = "@FIFO@"
FOLDER = "@FOLDER@"
PLAIN = "@PLAIN@"
"""A regular file (where a folder is needed)."""
CERT, KEY, CA = "@CERT@", "@KEY@", "@CA@"
BAD_YAML = "regions: [unclosed\n  - {: \n"

GOOD = {  # a good value for each option a variant may need beside the bad one
    "--region": "east", "--regions": "east,west", "--from": "east", "--to": "west",
    "--topics": "t.*", "--policy": POLICY, "--group": "g", "--name": "n",
    "--scenario": "primary-outage", "--tls-cert": CERT, "--tls-key": KEY,
    "--tls-client-ca": CA,
}
FLAGS = ("--no-consul",)  # never reach out, should a variant get that far
REGIONS = {"--region": ("mars", "Bad Region!"), "--regions": ("east,mars", "east,Bad!"),
           "--from": ("mars", "Bad Region!"), "--to": ("mars", "Bad Region!")}
INPUT_FILES = ("--topology", "--policy", "--auth", "--thresholds", "--config",
               "--controller-config", "--tls-cert", "--tls-key", "--tls-client-ca", "--rules-file",
               "<file>")
STATE_FILES = ("--state",)
"""Read when they exist, written at the end: a missing one is fine (a first run)."""
FOLDERS = ("--state-dir", "--reports")
OUTPUTS = {("reconcile", "--out"): "folder", ("prometheus config", "--out"): "file",
           ("prometheus rules", "--out"): "file"}
LONG = "x" * 300
STRINGS: dict[str, tuple[str, ...]] = {  # malformed (and over-long) values of string options
    "--topics": ("([",), "--exactly-once": ("([",), "--since": ("yesterday",),
    "--until": ("yesterday",), "--flow": ("east",), "--target": ("bad",),
    "--scenario": ("bogus",), "--worker-id": ("", "a b", LONG), "--group": ("", "a b", LONG),
    "--id": ("", LONG), "--name": ("bad name!",), "--topic": ("bad topic!",),
    "--host": ("bad host!", "a" * 300), "--http-host": ("bad host!",),
    "--metrics-host": ("bad host!",), "--master": ("bogus",), "--driver-memory": ("lots",),
    "--executor-memory": ("lots",), "--reason": ("x" * 2000, "two\nlines"),
    "--principal": ("", "a b", LONG), "--pattern": ("", "a b"), "--token": ("", "a b"),
    "--runbook-base": ("runbooks/", "ftp://x/runbooks"),
}


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


def _bare(p: object) -> object:
    bare = getattr(p, "bare_type", None)
    return bare() if callable(bare) else getattr(getattr(p, "type", None), "name", None)


def _number_type(p: object) -> type | None:
    t = _bare(p)
    if t in (int, "int", "integer", "integer range"):
        return int
    if t in (float, "float", "float range"):
        return float
    return None


def _choices(p: object) -> tuple[object, ...] | None:
    desc = getattr(p, "type_descriptor", None)
    found = getattr(desc, "choices", None)
    if found is None:
        found = getattr(getattr(p, "type", None), "choices", None)
    return tuple(found) if found else None


FILE_REFUSED = {"missing file", "bad file", "a named pipe for a file"}
"""Variants whose one bad input is a file the command reads: exit 65 (dr/exits.py)."""


def _exit_for(r: Result) -> int:
    """65 for a file refused (said as `invalid file:`), 2 for the command line."""
    if r.why in FILE_REFUSED or "invalid file" in r.stderr:
        return 65
    return 2


def _options(cmd: object) -> dict[str, object]:
    out = {}
    for p in getattr(cmd, "params", []):
        if p.param_type_name == "argument":
            out["<file>" if p.name == "file" else f"<{p.name}>"] = p
        else:
            out[p.opts[0]] = p
    return out


def _number_values(p: object, kind: type) -> list[tuple[str, str]]:
    low, high = getattr(p, "min", None), getattr(p, "max", None)
    values = [("twelve", "not a number")]
    values.append((str(low - 1), "below the minimum"))  # type: ignore[operator]
    above = high + 1 if high + 1 != high else high * 2  # type: ignore[operator]
    values.append((str(above), "above the maximum"))
    if kind is float:
        values.append(("nan", "not a number (nan)"))
    return values


def _bad_values(command: str, name: str, p: object) -> list[tuple[str, str, str | None]]:
    """(value, why, what the error must name; None: the option) for one option; [] when the
    walk does not know the option's kind (a test failure)."""
    if name in REGIONS:
        out, malformed = REGIONS[name]
        return [(out, "unknown region", "mars"), (malformed, "not a region name", "Bad")]
    if name in INPUT_FILES:
        return [(MISSING, "missing file", MISSING), (BAD_FILE, "bad file", BAD_FILE),
                (FIFO, "a named pipe for a file", FIFO), (FOLDER, "a folder for a file",
                                                          FOLDER)]
    if name in STATE_FILES:
        return [(BAD_FILE, "bad file", BAD_FILE), (FIFO, "a named pipe for a file", FIFO),
                (FOLDER, "a folder for a file", None)]
    if name in FOLDERS or OUTPUTS.get((command, name)) == "folder":
        return [(PLAIN, "a file for a folder", None)]
    if OUTPUTS.get((command, name)) == "file":
        return [(FOLDER, "a folder for a file", None)]
    if getattr(p, "is_flag", False):
        return [(f"{name}=maybe", "a value for a flag", None)]
    kind = _number_type(p)
    if kind is not None:
        return [(v, f"{why} in {name}", None) for v, why in _number_values(p, kind)]
    if _choices(p):
        return [("bogus", f"not a choice of {name}", None)]
    if name in STRINGS:
        return [(v, f"malformed {name}", None) for v in STRINGS[name]]
    return []


def _variants(entry: tuple[str, ...], path: tuple[str, ...], cmd: object,
              command: str | None = None) -> list[Variant]:
    out = [Variant((*entry, *path, "--bogus"), "unknown option", "--bogus")]
    opts = _options(cmd)
    command = " ".join(path) if command is None else command
    is_group = getattr(cmd, "commands", None) is not None
    unknown_required = [n for n, p in opts.items()
                        if getattr(p, "required", False) and n not in GOOD and n != "<file>"]
    assert not unknown_required, f"{path}: add a good value for {unknown_required} to GOOD"

    def argv(bad: str, value: str) -> tuple[str, ...]:
        args: list[str] = [*entry, *path]
        if is_group:
            return (*args, *([value] if value.startswith(bad + "=") else [bad, value]))
        if "<file>" in opts:
            args.append(value if bad == "<file>" else str(REPO_ROOT / "policies" /
                                                          "topology.local.yaml"))
        for name in opts:
            if name == bad and name != "<file>":
                args += [value] if value.startswith(name + "=") else [name, value]
            elif name in GOOD:
                args += [name, GOOD[name]]
            elif name in FLAGS:
                args.append(name)
        return tuple(args)

    for name, p in opts.items():
        if name.startswith("<") and name != "<file>":
            raise AssertionError(f"dr {command}: argument {name}: classify it in the walk")
        if _number_type(p) is not None and (getattr(p, "min", None) is None
                                            or getattr(p, "max", None) is None):
            raise AssertionError(f"dr {command} {name}: a number option needs both bounds "
                                 "(dr.options: port_option, seconds_option, count_option)")
        values = _bad_values(command, name, p)
        assert values, (f"dr {command} {name}: an option the walk cannot classify: add its "
                        "malformed values to STRINGS (or its kind to the walk)")
        for value, why, must in values:
            out.append(Variant(argv(name, value), f"{why} ({name})",
                               name if must is None else must))
    return out


def _reconcile_app() -> object:
    """`python -m dr.reconcile`'s app, built as its __main__ builds it."""
    from dr.reconcile.cli import reconcile_command
    sub = typer.Typer(add_completion=False)
    sub.command()(reconcile_command)
    return typer.main.get_command(sub)


def _all_variants() -> list[Variant]:
    variants = [v for path, cmd in _walk(typer.main.get_command(app), ())
                for v in _variants(("-m", "dr.cli"), path, cmd)]
    # `python -m dr.reconcile` (spark-submit's entry point) is a second, one-command app.
    variants += _variants(("-m", "dr.reconcile"), (), _reconcile_app(), "reconcile")
    return variants


def test_the_walk_covers_every_command_and_option() -> None:
    variants = _all_variants()
    commands = {" ".join(v.argv[2:]).split(" --")[0] for v in variants}
    for expected in ("status", "reconcile", "proxy serve", "mirror run", "offsets translate",
                     "topology validate", "policy validate", "proxy", "mirror"):
        assert expected in commands
    whys = {v.why for v in variants}
    assert {"unknown region (--region)", "unknown region (--from)", "unknown region (--to)",
            "unknown region (--regions)", "missing file (--topology)", "missing file (<file>)",
            "missing file (--policy)", "bad file (--topology)", "bad file (<file>)",
            "a named pipe for a file (<file>)", "a named pipe for a file (--policy)",
            "not a number in --rate (--rate)", "below the minimum in --duration (--duration)",
            "above the maximum in --port (--port)",
            "above the maximum in --metrics-port (--metrics-port)",
            "below the minimum in --max-rto-s (--max-rto-s)",
            "not a number (nan) in --grace (--grace)",
            "not a choice of --log-level (--log-level)", "a value for a flag (--json)",
            "a file for a folder (--state-dir)", "malformed --host (--host)"} <= whys
    # every option of every command has at least one variant
    for path, cmd in [*_walk(typer.main.get_command(app), ()), ((), _reconcile_app())]:
        for name in _options(cmd):
            assert any(v.why.endswith(f"({name})") and v.argv[2:2 + len(path)] == path
                       for v in variants), f"dr {' '.join(path)} {name}: not walked"


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
    from dr.exits import click_command
    click_command(dr.cli.app)  # built once here, not in each child (dr.exits)
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


def _tls_files(folder: Path) -> dict[str, str]:
    """A self-signed certificate (also the client CA) and its key, PEM."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return {CERT: str(folder / "cert.pem"), KEY: str(folder / "key.pem"),
            CA: str(folder / "cert.pem")}


@pytest.mark.timeout(900)  # ~500 variants; a minute on a quiet machine, more on a busy one
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
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain.txt").write_text("a file\n")
    places = {BAD_FILE: str(bad), FIFO: str(fifo), FOLDER: str(tmp_path / "folder"),
              PLAIN: str(tmp_path / "plain.txt"), **_tls_files(tmp_path)}

    def placed(text: str) -> str:
        for mark, value in places.items():
            text = text.replace(mark, value)
        return text

    variants = [Variant(tuple(placed(a) for a in v.argv), v.why, placed(v.must_name))
                for v in _all_variants()]
    todo = tmp_path / "variants.json"
    todo.write_text(json.dumps([asdict(v) for v in variants]))
    driver = subprocess.run([sys.executable, __file__, str(todo)], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=860, check=False)
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
        elif r.code != (want := _exit_for(r)):
            problems.append(f"{shown} ({r.why}): exit {r.code}, not {want}:\n"
                            f"{r.stderr[-600:]}")
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
