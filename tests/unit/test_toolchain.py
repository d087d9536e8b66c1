"""`dr setup`'s artifacts: an installed Consul and an installed Kafka distribution used when
their version fits (another refused, saying why), one build at a time through the cache's
lock, plain progress lines without a terminal (issue 37)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dr.errors import SetupFailed, ToolchainMissing
from dr.stack.paths import StackPaths
from dr.stack.toolchain import (
    CONSUL_MODULE,
    CONSUL_VERSION,
    GoBinary,
    _go_build,
    cache_lock,
    check_toolchain,
    consul_binary,
    describe_kafka,
    ensure_consul,
    ensure_kafka_libs,
    installed_consul,
    installed_kafka,
    kafka_distributions,
    kafka_libs,
    kafka_libs_dir,
    kafka_version,
    spark_kafka_jars_dir,
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


# -- an installed Kafka distribution -------------------------------------------------------
def _distribution(root: Path, *jars: str, script: bool = True) -> Path:
    """A Kafka distribution's layout: `libs/` with `jars` (empty files: only names are
    read), `bin/kafka-server-start.sh`."""
    (root / "libs").mkdir(parents=True)
    for jar in jars:
        (root / "libs" / jar).write_bytes(b"")
    if script:
        (root / "bin").mkdir()
        start = root / "bin" / "kafka-server-start.sh"
        start.write_text("#!/bin/sh\nexit 0\n")
        start.chmod(0o755)
    return root


def _kafka_paths(tmp_path: Path) -> tuple[StackPaths, str]:
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "empty-cache")
    return paths, kafka_version(paths)


def _same_minor(pin: str) -> str:
    major, minor = pin.split(".")[:2]
    return f"{major}.{minor}.0"


def test_an_installed_kafka_of_the_pinned_minor_is_used_instead_of_fetching(
        tmp_path: Path) -> None:
    paths, pin = _kafka_paths(tmp_path)
    v = _same_minor(pin)
    home = _distribution(tmp_path / f"kafka_2.13-{v}", f"kafka_2.13-{v}.jar",
                         f"kafka-server-{v}.jar", f"kafka-clients-{v}.jar",
                         f"kafka_2.13-{v}-test.jar")
    env = {"KAFKA_HOME": str(home)}
    found = installed_kafka(paths, path=str(tmp_path / "nothing"), env=env, dirs=())
    assert found is not None
    assert (found.root, found.version, found.source) == (home, v, "$KAFKA_HOME")
    assert found.describe() == f"Kafka {v}: installed at {home} ($KAFKA_HOME)"
    (spark := spark_kafka_jars_dir(paths).parent).mkdir(parents=True)
    (spark / ".complete").write_text("cached")  # only Kafka's fetch is in question here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAFKA_HOME", str(home))
        assert kafka_libs(paths, path=str(tmp_path / "nothing")) == home / "libs"
        with pytest.raises(ToolchainMissing) as info:
            check_toolchain(paths, path=str(tmp_path / "nothing"))
        assert "mvn" not in info.value.missing  # nothing to fetch
        assert "java" in info.value.missing
        said: list[str] = []
        assert ensure_kafka_libs(paths, said.append) == home / "libs"
        assert said == []
        assert not kafka_libs_dir(paths).parent.exists()  # no fetch began
        assert describe_kafka(paths, home / "libs") == found.describe()


def test_a_kafka_server_start_on_path_names_its_distribution(tmp_path: Path) -> None:
    """Kafka 4's server jar alone gives the version; the script's symlink is followed to
    the distribution's root (a package manager's /usr/bin link)."""
    paths, pin = _kafka_paths(tmp_path)
    v = _same_minor(pin)
    root = _distribution(tmp_path / "opt" / "kafka-dist", f"kafka-server-{v}.jar")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kafka-server-start.sh").symlink_to(root / "bin" / "kafka-server-start.sh")
    found = installed_kafka(paths, path=str(bin_dir), env={}, dirs=())
    assert found is not None
    assert (found.root, found.version, found.source) == (
        root.resolve(), v, "kafka-server-start.sh on PATH")
    # /opt/kafka's place in the order: after $KAFKA_HOME and PATH; the same folder once
    [only] = kafka_distributions(paths, path=str(bin_dir), env={"KAFKA_HOME": str(root)},
                                 dirs=(root,))
    assert only.source == "$KAFKA_HOME"
    other = _distribution(tmp_path / "opt-kafka", f"kafka_2.13-{v}.jar", script=False)
    found = installed_kafka(paths, path=str(tmp_path / "nothing"), env={}, dirs=(other,))
    assert found is not None
    assert (found.root, found.source) == (other.resolve(), "the usual place")


def test_an_installed_kafka_of_another_version_is_refused_naming_path_and_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, pin = _kafka_paths(tmp_path)
    major, minor = (int(x) for x in pin.split(".")[:2])
    old = f"{major - 1}.9.1"
    home = _distribution(tmp_path / "kafka-old", f"kafka_2.13-{old}.jar",
                         f"kafka-clients-{old}.jar")
    nothing = str(tmp_path / "nothing")
    [dist] = kafka_distributions(paths, path=nothing, env={"KAFKA_HOME": str(home)}, dirs=())
    assert not dist.fits
    assert dist.version == old
    assert dist.problem == (
        f"Kafka {old} installed at {home} ($KAFKA_HOME) does not fit: the stack needs Kafka "
        f"{major}.{minor}.x (compose/local/pom.xml pins {pin}); not used")
    assert installed_kafka(paths, path=nothing, env={"KAFKA_HOME": str(home)}, dirs=()) is None
    # a set-up says so before it fetches the pinned jars (here: no Maven, so it fails there)
    monkeypatch.setenv("KAFKA_HOME", str(home))
    monkeypatch.setenv("PATH", nothing)
    said: list[str] = []
    with pytest.raises(SetupFailed, match="cannot run mvn"):
        ensure_kafka_libs(paths, said.append)
    assert said == [dist.problem, f"Fetching Apache Kafka {pin} jars from Maven Central "
                                  "(first run only)"]
    assert kafka_libs(paths) == kafka_libs_dir(paths)


@pytest.mark.parametrize(("jars", "why"), [
    ((), "is not a Kafka distribution: {libs} holds no kafka_<scala>-<version>.jar or "
         "kafka-server-<version>.jar; not used"),
    (("kafka_2.13-{v}-sources.jar", "kafka-clients-{v}.jar"),
     "is not a Kafka distribution: {libs} holds no kafka_<scala>-<version>.jar or "
     "kafka-server-<version>.jar; not used"),
    (("kafka_2.13-{v}.jar", "kafka-server-{o}.jar"),
     "holds the jars of several Kafka versions ({o}, {v}) in {libs}; not used"),
])
def test_a_folder_that_is_not_one_kafka_distribution_is_refused(
        tmp_path: Path, jars: tuple[str, ...], why: str) -> None:
    paths, pin = _kafka_paths(tmp_path)
    v, o = _same_minor(pin), "3.9.1"
    home = _distribution(tmp_path / "k", *(j.format(v=v, o=o) for j in jars))
    [dist] = kafka_distributions(paths, path=str(tmp_path / "nothing"),
                                 env={"KAFKA_HOME": str(home)}, dirs=())
    assert dist.problem == f"{home} ($KAFKA_HOME) " + why.format(libs=home / "libs", v=v, o=o)
    assert installed_kafka(paths, path=str(tmp_path / "nothing"),
                           env={"KAFKA_HOME": str(home)}, dirs=()) is None


def test_the_jars_fetched_into_the_cache_are_used_before_an_installed_kafka(
        tmp_path: Path) -> None:
    """As with Consul: what the cache holds is the exact pin."""
    paths, pin = _kafka_paths(tmp_path)
    home = _distribution(tmp_path / "k", f"kafka_2.13-{_same_minor(pin)}.jar")
    libs = kafka_libs_dir(paths)
    libs.mkdir(parents=True)
    (libs.parent / ".complete").write_text("pom.xml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAFKA_HOME", str(home))
        assert kafka_libs(paths) == libs
        assert ensure_kafka_libs(paths) == libs
        assert describe_kafka(paths, libs) == f"Kafka {pin}: fetched into the cache ({libs})"
