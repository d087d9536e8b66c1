"""The systemd units of deploy/systemd/ and the deployment guide docs/deploy.md: every unit
parses, its ExecStart (expanded as systemd expands it with the example environment file) is a
real `dr` command whose options take their values, its stop timeout covers the daemon's
drain, `systemd-analyze verify` finds nothing to say, and every `dr` command of the guide
exists."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from cli_support import check_dr_command, dr_commands, parse_dr
from systemd_units import DEPLOY, INSTALLED_DR, UNITS, Unit, read_unit

from dr.controller.controller import Controller
from dr.exits import EXIT_INVALID_FILE, EXIT_USAGE, EXIT_VERDICT
from mirror import worker
from proxy.config import ProxyConfig

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = "/etc/crossdc/crossdc.env"
EXAMPLE_ENV = (DEPLOY / "crossdc.env.example").read_text(encoding="utf-8")
MINIMAL_ENV = "CROSSDC_REGION=west\nCROSSDC_HOST_ADDR=10.10.2.11\n"
"""A host that sets only what has no default."""

FLOW = "east:west"
"""The instance the mirror template is checked with."""

COMMANDS = {"crossdc-proxy.service": ["proxy", "serve"],
            "crossdc-mirror@.service": ["mirror", "run"],
            "crossdc-controller.service": ["controller", "run"]}

UNIT_FILES = sorted(UNITS.glob("*.service"))


def _unit(name: str) -> Unit:
    return read_unit(UNITS / name)


def _argv(unit: Unit, env_text: str) -> list[str]:
    instance = FLOW if unit.template else ""
    env = unit.environment(instance, files={ENV_FILE: env_text})
    return unit.command(instance=instance, env=env)


def test_the_units_shipped_are_the_three_daemons() -> None:
    assert sorted(p.name for p in UNIT_FILES) == sorted(COMMANDS)


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_each_unit_parses_and_runs_hardened_as_its_own_user(path: Path) -> None:
    unit = read_unit(path)
    assert unit.sections() == ["Unit", "Service", "Install"]
    svc = {k: unit.value("Service", k) for k in (
        "User", "Group", "Restart", "StateDirectory", "ReadWritePaths", "ProtectSystem",
        "NoNewPrivileges", "PrivateTmp", "ProtectHome", "KillSignal", "KillMode",
        "CapabilityBoundingSet")}
    assert svc["User"] == svc["Group"] == "crossdc"
    assert svc["Restart"] == "on-failure"
    assert svc["ProtectSystem"] == "strict"
    assert svc["NoNewPrivileges"] == svc["PrivateTmp"] == svc["ProtectHome"] == "yes"
    # the one writable place is the state directory systemd makes for the unit's user
    assert svc["ReadWritePaths"] == f"/var/lib/{svc['StateDirectory']}"
    assert unit.environment(FLOW)["CROSSDC_STATE_DIR"] == svc["ReadWritePaths"]
    assert svc["KillSignal"] == "SIGTERM"
    assert svc["KillMode"] == "mixed"  # the main process drains; its children go with it
    assert svc["CapabilityBoundingSet"] == ""
    assert unit.value("Install", "WantedBy") == "multi-user.target"
    # restarting cannot fix a bad command line or a refused file
    assert {EXIT_USAGE, EXIT_INVALID_FILE} <= {
        int(c) for c in unit.value("Service", "RestartPreventExitStatus").split()}


def test_the_sysusers_file_makes_the_units_user() -> None:
    lines = [ln.split() for ln in (DEPLOY / "sysusers.d" / "crossdc.conf").read_text(
        encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]
    users = {w[1] for w in lines if w[0] == "u"}
    assert users == {read_unit(p).value("Service", "User") for p in UNIT_FILES}


@pytest.mark.parametrize("env_text", [EXAMPLE_ENV, MINIMAL_ENV], ids=["example", "minimal"])
@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_each_exec_start_is_a_dr_command_whose_options_take_their_values(
        path: Path, env_text: str) -> None:
    unit = read_unit(path)
    env = unit.environment(FLOW, files={ENV_FILE: env_text})
    missing = unit.variables() - set(env)
    assert not missing, f"{unit.name}: ExecStart uses {missing}, set neither here nor in " \
                        "the environment file"
    argv = _argv(unit, env_text)
    assert argv[0] == INSTALLED_DR
    assert check_dr_command(argv[1:], unit.name) == COMMANDS[unit.name]
    params = parse_dr(argv[1:])  # click's own parse: types, ranges, required options
    assert params["topology"] == Path("/etc/crossdc/topology.yaml")
    if unit.template:
        assert params["flow"] == [FLOW]
        assert params["restart"] is True
    else:
        assert params["region"] == env["CROSSDC_REGION"]


def _controller_with(tmp_path: Path, http_port: str) -> list[str]:
    """The controller unit's command line with its `--http-port ...` replaced."""
    text = (UNITS / "crossdc-controller.service").read_text(encoding="utf-8")
    copy = tmp_path / "crossdc-controller.service"
    copy.write_text(text.replace("--http-port ${CROSSDC_CONTROLLER_HTTP_PORT}", http_port),
                    encoding="utf-8")
    return _argv(read_unit(copy), MINIMAL_ENV)[1:]


def test_the_checks_refuse_what_the_cli_refuses(tmp_path: Path) -> None:
    """A unit whose command line the CLI would refuse fails these checks: an option it does
    not have, a value out of range."""
    misspelt = _controller_with(tmp_path, "--http-prot 9700")
    with pytest.raises(AssertionError, match="has no option"):
        check_dr_command(misspelt, "crossdc-controller.service")
    out_of_range = _controller_with(tmp_path, "--http-port 99999")
    check_dr_command(out_of_range, "crossdc-controller.service")  # the name is right
    with pytest.raises(typer.BadParameter):
        parse_dr(out_of_range)


def test_the_example_host_settings_reach_the_command_lines() -> None:
    proxy = parse_dr(_argv(_unit("crossdc-proxy.service"), EXAMPLE_ENV)[1:])
    assert proxy["workers"] == 2
    assert proxy["auth"] == Path("/etc/crossdc/auth.yaml")
    controller = parse_dr(_argv(_unit("crossdc-controller.service"), EXAMPLE_ENV)[1:])
    assert controller["auto_failover"] is True
    assert controller["http_host"] == "10.10.1.11"
    minimal = parse_dr(_argv(_unit("crossdc-controller.service"), MINIMAL_ENV)[1:])
    assert minimal["auto_failover"] is None  # the command's default: off
    mirror = parse_dr(_argv(_unit("crossdc-mirror@.service"), MINIMAL_ENV)[1:])
    assert mirror["metrics_host"] == "10.10.2.11"


def test_a_mirror_instance_reads_its_own_optional_environment_file() -> None:
    unit = _unit("crossdc-mirror@.service")
    own = f"/etc/crossdc/mirror-{FLOW}.env"
    env = unit.environment(FLOW, files={ENV_FILE: MINIMAL_ENV,
                                        own: "CROSSDC_MIRROR_METRICS_PORT=9405\n"})
    params = parse_dr(unit.command(instance=FLOW, env=env)[1:])
    assert params["metrics_port"] == 9405


def _seconds(unit: Unit, key: str) -> float:
    return float(unit.value("Service", key).removesuffix("s"))


def test_stop_timeouts_cover_each_daemons_drain() -> None:
    """systemd SIGKILLs what still runs TimeoutStopSec after SIGTERM: each unit waits at
    least as long as its daemon's bounded drain."""
    proxy = _unit("crossdc-proxy.service")
    grace = float(proxy.environment()["CROSSDC_PROXY_GRACE_S"])
    close = ProxyConfig.model_fields["close_timeout_s"].default
    # the workers' supervisor kills a worker still draining after grace + close + 5 s
    assert _seconds(proxy, "TimeoutStopSec") >= grace + close + 5.0
    mirror = _unit("crossdc-mirror@.service")
    assert _seconds(mirror, "TimeoutStopSec") > worker._STOP_S  # one flow per process
    controller = _unit("crossdc-controller.service")
    stop = inspect.signature(Controller.stop).parameters["timeout_s"].default
    assert _seconds(controller, "TimeoutStopSec") > stop


def test_reload_and_restart_follow_the_daemons() -> None:
    assert _unit("crossdc-proxy.service").value("Service", "ExecReload") == \
        "/bin/kill -HUP $MAINPID"  # the policy and the auth file are re-read on SIGHUP
    mirror = _unit("crossdc-mirror@.service")
    # a worker fenced by a newer one with its transactional id must not come back
    assert EXIT_VERDICT in {int(c) for c in
                            mirror.value("Service", "RestartPreventExitStatus").split()}
    assert mirror.value("Unit", "StartLimitIntervalSec") == "0"


def _verify_skip() -> str | None:
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze is not installed here (Debian: the systemd package)"
    return None


@pytest.mark.skipif(_verify_skip() is not None, reason=str(_verify_skip()))
@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_systemd_analyze_verify_is_clean(path: Path, tmp_path: Path) -> None:
    """`systemd-analyze verify` (a template: as an instance of its own) says nothing about
    the unit. It insists the command exists, so the copy verified runs this venv's `dr`
    where a host has /opt/crossdc/bin/dr."""
    dr = Path(sys.executable).parent / "dr"
    copy = tmp_path / path.name
    copy.write_text(path.read_text(encoding="utf-8").replace(INSTALLED_DR, str(dr)),
                    encoding="utf-8")
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                          text=True, timeout=60, check=False)
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "crossdc" in ln]
    assert proc.returncode == 0, proc.stderr
    assert not said, "\n".join(said)


DEPLOY_MD = ROOT / "docs" / "deploy.md"
GUIDE_COMMANDS = dr_commands(DEPLOY_MD.read_text(encoding="utf-8"))


def test_the_guide_names_every_unit_and_the_environment_file() -> None:
    text = DEPLOY_MD.read_text(encoding="utf-8")
    for path in [*UNIT_FILES, DEPLOY / "crossdc.env.example",
                 DEPLOY / "sysusers.d" / "crossdc.conf"]:
        assert str(path.relative_to(ROOT)) in text, path.name
    assert len(GUIDE_COMMANDS) >= 10


@pytest.mark.parametrize("words", GUIDE_COMMANDS, ids=[" ".join(w)[:60] for w in GUIDE_COMMANDS])
def test_each_dr_command_of_the_guide_exists_with_its_options(words: list[str]) -> None:
    check_dr_command(words, "docs/deploy.md")


@pytest.mark.parametrize("book", sorted((ROOT / "runbooks").glob("*.md")), ids=lambda p: p.name)
def test_runbooks_run_from_a_checkout_also_say_how_on_a_host(book: Path) -> None:
    text = book.read_text(encoding="utf-8")
    if ".venv/bin/dr" not in text:
        return
    assert "../docs/deploy.md" in text, f"{book.name}: .venv/bin/dr without the host's way"
    assert not re.search(r"from the repository root\.", text), book.name
