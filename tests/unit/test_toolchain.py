"""`dr setup`'s artifacts: an installed Consul used when its version fits, one build at a
time through the cache's lock, plain progress lines without a terminal (issue 37)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dr.errors import ToolchainMissing
from dr.stack.paths import StackPaths
from dr.stack.toolchain import (
    CONSUL_MODULE,
    CONSUL_VERSION,
    GoBinary,
    _go_build,
    cache_lock,
    check_toolchain,
    consul_binary,
    ensure_consul,
    installed_consul,
)


def _real_consul() -> Path:
    built = StackPaths.default().cache / f"consul-{CONSUL_VERSION}" / "consul"
    if not built.exists():
        pytest.skip("no Consul built into the cache yet (`dr setup`)")
    return built


def test_an_installed_consul_of_the_pinned_minor_is_used_instead_of_building(
        tmp_path: Path) -> None:
    real = _real_consul()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "consul").symlink_to(real)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    assert installed_consul(str(bin_dir)) == real.resolve()
    assert consul_binary(paths, str(bin_dir)) == real.resolve()
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(bin_dir))
    assert "go" not in info.value.missing  # nothing to build
    assert "java" in info.value.missing


def test_an_installed_consul_of_another_version_is_not_used(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    old = bin_dir / "consul"  # what `consul version` of 1.18 prints, nothing else
    old.write_text("#!/bin/sh\necho 'Consul v1.18.1'\necho 'Revision 0000000'\n")
    old.chmod(0o755)
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    assert installed_consul(str(bin_dir)) is None
    built = paths.cache / f"consul-{CONSUL_VERSION}" / "consul"
    assert consul_binary(paths, str(bin_dir)) == built
    with pytest.raises(ToolchainMissing) as info:
        check_toolchain(paths, path=str(bin_dir))
    assert "go" in info.value.missing  # it will be built


def test_a_second_setup_waits_for_the_first_and_finds_its_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    binary = paths.cache / f"consul-{CONSUL_VERSION}" / "consul"
    spec = GoBinary("Consul", CONSUL_MODULE, CONSUL_VERSION, ".", binary, ["version"])
    # no Go on PATH: a second set-up that built again instead of waiting would fail
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    waiting, said, got = threading.Event(), [], []
    errors: list[BaseException] = []

    def say(message: str) -> None:
        said.append(message)
        waiting.set()

    def second() -> None:
        try:
            got.append(_go_build(spec, paths, say))
        except BaseException as exc:  # reported below
            errors.append(exc)

    with cache_lock(paths.cache, binary.parent.name, "Consul"):  # the first set-up
        t = threading.Thread(target=second)
        t.start()
        assert waiting.wait(10), "the second set-up did not say it waits"
        assert not got
        assert t.is_alive()
        binary.parent.mkdir(parents=True)
        binary.write_text("built by the first")
    t.join(10)
    assert not errors, errors
    assert got == [binary]
    assert said == [f"Waiting for another set-up that is getting Consul {CONSUL_VERSION} "
                    f"({paths.cache / ('.consul-' + CONSUL_VERSION + '.lock')})"]
    assert ensure_consul(paths) == binary


def test_progress_without_a_terminal_is_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from dr.cli._common import progress

    with progress("setting up") as say:
        say("Fetching the Kafka jars")
        say("Fetching the Kafka jars")  # said once
        say("Compiling Consul")
    lines = capsys.readouterr().err.splitlines()
    assert [line.rsplit(" [", 1)[0] for line in lines] == [
        "setting up: Fetching the Kafka jars", "setting up: Compiling Consul"]
    assert all(line.endswith(" s]") for line in lines)
