"""The machine's toolchain and the two artifacts built from registries, cached once.

- Kafka: an installed distribution when its version fits the pin (same major and minor:
  `installed_kafka`; `$KAFKA_HOME`, a `kafka-server-start.sh` on PATH, `/opt/kafka`), its
  `libs/` the brokers' classpath; else `mvn dependency:copy-dependencies` on
  `compose/local/pom.xml` → `<cache>/kafka-<v>-<h>/libs`.
- Spark's Kafka connector: the same on `dr/reconcile/pom.xml` → `<cache>/spark-kafka-<v>-<h>/jars`.
- Consul: a `consul` already installed on PATH when its version fits the pin (same major and
  minor: `installed_consul`), else its Go module, built with the machine's Go →
  `<cache>/consul-<v>/consul`. Consul's
  go.mod replaces its nested modules (api, sdk, ...) with local folders that the module zip
  does not contain, so `go install module@version` refuses; we copy the module source, drop
  those replace directives (the published nested modules are used) and `go build`.
- Toxiproxy (simulated WAN latency, only for a stack that asks for it): its Go module
  `cmd/server`, built the same way on first use → `<cache>/toxiproxy-<v>/toxiproxy-server`.

Each fetch or build holds a lock in the cache (`<cache>/.<artifact>.lock`, flock), so two
set-ups at once (two clones' CI, `dr up` beside `dr setup`) build it once: the second waits,
says so, and finds it done.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from dr.errors import SetupFailed, ToolchainMissing
from dr.stack.paths import StackPaths

__all__ = [
    "COMPOSE_MODULE",
    "COMPOSE_VERSION",
    "CONSUL_MODULE",
    "CONSUL_VERSION",
    "KAFKA_DIRS",
    "TOXIPROXY_MODULE",
    "TOXIPROXY_VERSION",
    "InstalledKafka",
    "check_kafka_distribution",
    "check_toolchain",
    "compose_binary",
    "consul_binary",
    "describe_kafka",
    "ensure_compose",
    "ensure_consul",
    "ensure_kafka_libs",
    "ensure_spark_kafka_jars",
    "ensure_toxiproxy",
    "installed_consul",
    "installed_kafka",
    "kafka_distributions",
    "kafka_libs",
    "kafka_libs_dir",
    "kafka_version",
    "spark_kafka_jars_dir",
    "toxiproxy_binary",
]

CONSUL_MODULE = "github.com/hashicorp/consul"
CONSUL_VERSION = "v1.22.0"
COMPOSE_MODULE = "github.com/docker/compose/v2"
COMPOSE_VERSION = "v2.29.7"
TOXIPROXY_MODULE = "github.com/Shopify/toxiproxy/v2"
TOXIPROXY_VERSION = "v2.5.0"

log = structlog.get_logger("crossdc.stack")

Progress = Callable[[str], None]

_HOW_TO_GET = {
    "java": "Java 17 or newer runs the Kafka brokers "
            "(Debian: apt-get install openjdk-17-jre-headless)",
    "mvn": "Maven fetches the Kafka jars from Maven Central (Debian: apt-get install maven; "
           "an installed Kafka of the pinned minor in $KAFKA_HOME or /opt/kafka spares it "
           "that fetch)",
    "go": "Go 1.23 or newer builds Consul from its Go module (https://go.dev/doc/install)",
}


def _pom_version(pom: Path, prop: str) -> str:
    m = re.search(rf"<{re.escape(prop)}>([^<]+)</{re.escape(prop)}>",
                  pom.read_text(encoding="utf-8"))
    if not m:
        raise SetupFailed(f"{pom}: no <{prop}> property")
    return m.group(1)


def _pom_dir(cache: Path, name: str, pom: Path, prop: str, leaf: str) -> Path:
    """A cache folder keyed by the pom's hash: a pom change gets a new folder."""
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:10]
    return cache / f"{name}-{_pom_version(pom, prop)}-{digest}" / leaf


def kafka_libs_dir(paths: StackPaths) -> Path:
    """The cached Kafka jar folder for `compose/local/pom.xml` as it is now."""
    return _pom_dir(paths.cache, "kafka", paths.pom, "kafka.version", "libs")


def spark_kafka_jars_dir(paths: StackPaths) -> Path:
    """The cached spark-sql-kafka connector jars for `dr/reconcile/pom.xml` as it is now."""
    return _pom_dir(paths.cache, "spark-kafka", paths.spark_pom, "spark.version", "jars")


def _built_consul(paths: StackPaths) -> Path:
    return paths.cache / f"consul-{CONSUL_VERSION}" / "consul"


def consul_binary(paths: StackPaths, path: str | None = None) -> Path:
    """The Consul the stack runs: the one built into the cache, else an installed `consul`
    whose version fits (`installed_consul`), else the cache's path (`ensure_consul` builds
    it there)."""
    built = _built_consul(paths)
    if built.exists():
        return built
    return installed_consul(path) or built


_VERSION_LINE = re.compile(r"^Consul v(\d+)\.(\d+)\.(\d+)", re.MULTILINE)


def installed_consul(path: str | None = None) -> Path | None:
    """A `consul` on PATH (`path`: instead of $PATH) whose `consul version` has the pin's
    major and minor (v1.22.x for v1.22.0), or None: then it is built."""
    where = shutil.which("consul", path=path)
    if where is None:
        return None
    found = Path(where).resolve()
    try:
        mtime = found.stat().st_mtime_ns
    except OSError:
        return None
    return found if _consul_fits(found, mtime) else None


@functools.lru_cache(maxsize=16)
def _consul_fits(binary: Path, _mtime: int) -> bool:
    try:
        proc = subprocess.run([str(binary), "version"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = _VERSION_LINE.search(proc.stdout)
    pin = _VERSION_LINE.search(f"Consul {CONSUL_VERSION}")
    assert pin is not None
    fits = m is not None and proc.returncode == 0 and m.groups()[:2] == pin.groups()[:2]
    log.info("installed_consul", binary=str(binary), fits=fits,
             version=m.group(0) if m else proc.stdout.strip()[:80])
    return fits


KAFKA_DIRS = (Path("/opt/kafka"),)
"""Where a Kafka distribution is looked for after `$KAFKA_HOME` and PATH."""

# The version of a distribution is its broker's jar: `kafka_<scala>-<v>.jar` (every release),
# `kafka-server-<v>.jar` (Kafka 4 moved the server there); never -test, -sources, -javadoc.
_KAFKA_JARS = (re.compile(r"^kafka_\d+\.\d+-(\d+\.\d+\.\d+)\.jar$"),
               re.compile(r"^kafka-server-(\d+\.\d+\.\d+)\.jar$"))


def kafka_version(paths: StackPaths) -> str:
    """The Kafka version the stack pins (`compose/local/pom.xml`'s `kafka.version`)."""
    return _pom_version(paths.pom, "kafka.version")


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@dataclass(frozen=True)
class InstalledKafka:
    """A Kafka distribution found on the machine, checked against the pinned version."""

    root: Path
    source: str
    """How it was found: `$KAFKA_HOME`, `kafka-server-start.sh on PATH`, `the usual place`
    (`KAFKA_DIRS`: /opt/kafka)."""
    version: str | None
    """From its broker jar; None when `libs/` holds none (or several versions)."""
    pin: str
    problem: str | None = None
    """Why it is not used (None: it fits)."""

    @property
    def libs(self) -> Path:
        return self.root / "libs"

    @property
    def fits(self) -> bool:
        return self.problem is None

    def describe(self) -> str:
        return f"Kafka {self.version}: installed at {self.root} ({self.source})"


def check_kafka_distribution(root: Path, source: str, pin: str) -> InstalledKafka:
    """`root` as a Kafka distribution: its `libs/` broker jar's version has `pin`'s major
    and minor (4.1.x for 4.1.1), or `problem` says why not, naming the path and versions."""
    libs = root / "libs"
    try:
        names = sorted(p.name for p in libs.iterdir())
    except OSError:
        names = []
    versions = sorted({m.group(1) for n in names for rx in _KAFKA_JARS
                       if (m := rx.match(n)) is not None})
    where = f"{root} ({source})"
    if not versions:
        return InstalledKafka(root, source, None, pin, (
            f"{where} is not a Kafka distribution: {libs} holds no kafka_<scala>-<version>.jar "
            f"or kafka-server-<version>.jar; not used"))
    if len(versions) > 1:
        return InstalledKafka(root, source, None, pin, (
            f"{where} holds the jars of several Kafka versions ({', '.join(versions)}) in "
            f"{libs}; not used"))
    [version] = versions
    if _minor(version) != _minor(pin):
        return InstalledKafka(root, source, version, pin, (
            f"Kafka {version} installed at {where} does not fit: the stack needs Kafka "
            f"{_minor(pin)}.x (compose/local/pom.xml pins {pin}); not used"))
    return InstalledKafka(root, source, version, pin)


def kafka_distributions(paths: StackPaths, path: str | None = None,
                        env: Mapping[str, str] | None = None,
                        dirs: Sequence[Path] = KAFKA_DIRS) -> list[InstalledKafka]:
    """Every Kafka distribution on the machine, in the order they are preferred:
    `$KAFKA_HOME` (`env`: instead of os.environ), the root of a `kafka-server-start.sh` on
    PATH (`path`: instead of $PATH; `<root>/bin/kafka-server-start.sh`, symlinks resolved),
    then `dirs` (`/opt/kafka`) when they exist; each checked against the pin."""
    env = os.environ if env is None else env
    pin = kafka_version(paths)
    found: list[tuple[Path, str]] = []
    if env.get("KAFKA_HOME"):
        found.append((Path(env["KAFKA_HOME"]), "$KAFKA_HOME"))
    script = shutil.which("kafka-server-start.sh", path=path)
    if script is not None:
        found.append((Path(script).resolve().parent.parent, "kafka-server-start.sh on PATH"))
    found += [(d, "the usual place") for d in dirs if d.exists()]
    seen: set[Path] = set()
    out: list[InstalledKafka] = []
    for root, source in found:
        key = root.resolve()
        if key in seen:
            continue
        seen.add(key)
        out.append(check_kafka_distribution(key, source, pin))
    return out


def installed_kafka(paths: StackPaths, path: str | None = None,
                    env: Mapping[str, str] | None = None,
                    dirs: Sequence[Path] = KAFKA_DIRS) -> InstalledKafka | None:
    """The first installed Kafka distribution whose version has the pin's major and minor
    (`kafka_distributions`), or None: then its jars are fetched."""
    return next((d for d in kafka_distributions(paths, path, env, dirs) if d.fits), None)


def _fetched_kafka(paths: StackPaths) -> bool:
    return (kafka_libs_dir(paths).parent / ".complete").exists()


def kafka_libs(paths: StackPaths, path: str | None = None,
               env: Mapping[str, str] | None = None) -> Path:
    """The folder the brokers' classpath is (`<libs>/*`): the jars fetched into the cache,
    else an installed distribution's `libs/` whose version fits (`installed_kafka`), else the
    cache's path (`ensure_kafka_libs` fetches them there)."""
    if _fetched_kafka(paths):
        return kafka_libs_dir(paths)
    dist = installed_kafka(paths, path, env)
    return dist.libs if dist is not None else kafka_libs_dir(paths)


def describe_kafka(paths: StackPaths, libs: Path) -> str:
    """What `dr setup` says of the Kafka it uses: `Kafka 4.1.0: installed at /opt/kafka
    ($KAFKA_HOME)` or `Kafka 4.1.1: fetched into the cache (<libs>)`."""
    dist = None if libs == kafka_libs_dir(paths) else installed_kafka(paths)
    if dist is None or dist.libs != libs:
        return f"Kafka {kafka_version(paths)}: fetched into the cache ({libs})"
    return dist.describe()


@contextlib.contextmanager
def cache_lock(cache: Path, name: str, what: str,
               progress: Progress | None = None) -> Iterator[None]:
    """Hold `<cache>/.<name>.lock` (flock: released when the process dies, too) while an
    artifact is fetched or built; a set-up that finds it held says so and waits."""
    cache.mkdir(parents=True, exist_ok=True)
    lock = cache / f".{name}.lock"
    with lock.open("a", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (progress or (lambda _m: None))(
                f"Waiting for another set-up that is getting {what} ({lock})")
            log.info("setup_waits_for_lock", lock=str(lock), what=what)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def check_toolchain(paths: StackPaths, path: str | None = None) -> dict[str, str]:
    """Programs found on PATH for what the stack needs; ToolchainMissing lists all that lack.

    Maven and Go are needed only while their artifact is neither cached nor installed.
    """
    needed = ["java"]
    if (not _fetched_kafka(paths) and installed_kafka(paths, path) is None) or \
            not (spark_kafka_jars_dir(paths).parent / ".complete").exists():
        needed.append("mvn")
    if not consul_binary(paths, path).exists():
        needed.append("go")
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    for tool in needed:
        where = shutil.which(tool, path=path)
        if where:
            found[tool] = where
        else:
            missing[tool] = f"not found on PATH; {_HOW_TO_GET[tool]}"
    if missing:
        raise ToolchainMissing(missing)
    return found


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
         what: str) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise SetupFailed(f"{what}: cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise SetupFailed(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def _maven_copy(pom: Path, dest: Path, *, what: str, expect: str,
                progress: Progress | None) -> Path:
    """`mvn dependency:copy-dependencies` of `pom` into `dest` once (staged, then renamed)."""
    marker = dest.parent / ".complete"
    if marker.exists():
        return dest
    with cache_lock(dest.parent.parent, dest.parent.name, what, progress):
        if marker.exists():  # the set-up we waited for fetched it
            return dest
        return _maven_fetch(pom, dest, marker, what=what, expect=expect, progress=progress)


def _maven_fetch(pom: Path, dest: Path, marker: Path, *, what: str, expect: str,
                 progress: Progress | None) -> Path:
    (progress or (lambda _m: None))(f"Fetching {what} from Maven Central (first run only)")
    log.info("maven_fetch", what=what, pom=str(pom), into=str(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars-", dir=dest.parent))
    _run(["mvn", "-B", "-q", "-f", str(pom), "dependency:copy-dependencies",
          f"-DoutputDirectory={staging}"], what=f"Fetching {what} with Maven")
    if not any(staging.glob(expect)):
        raise SetupFailed(f"Maven finished but {staging} holds no {expect}")
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    marker.write_text(pom.name, encoding="utf-8")
    return dest


def ensure_kafka_libs(paths: StackPaths, progress: Progress | None = None) -> Path:
    """The Kafka jars to run: fetched already or installed (`kafka_libs`), else the pinned
    ones fetched once (an installed distribution that does not fit is said first); return
    the folder to put on the classpath."""
    found = kafka_libs(paths)
    if found != kafka_libs_dir(paths) or _fetched_kafka(paths):
        log.info("kafka_libs", libs=str(found), installed=found != kafka_libs_dir(paths))
        return found
    for dist in kafka_distributions(paths):  # none fits: say why each is not used
        if dist.problem is not None:
            log.info("installed_kafka_not_used", root=str(dist.root), source=dist.source,
                     version=dist.version)
            (progress or (lambda _m: None))(dist.problem)
    version = kafka_version(paths)
    return _maven_copy(paths.pom, kafka_libs_dir(paths), what=f"Apache Kafka {version} jars",
                       expect="kafka_2.13-*.jar", progress=progress)


def ensure_spark_kafka_jars(paths: StackPaths, progress: Progress | None = None) -> Path:
    """Fetch Spark's Kafka connector jars once; return their folder (for `spark.jars`)."""
    version = _pom_version(paths.spark_pom, "spark.version")
    return _maven_copy(paths.spark_pom, spark_kafka_jars_dir(paths),
                       what=f"the spark-sql-kafka {version} connector",
                       expect="spark-sql-kafka-*.jar", progress=progress)


def ensure_consul(paths: StackPaths, progress: Progress | None = None) -> Path:
    """The Consul to run: one already built or installed (`consul_binary`), else the pinned
    one built from its Go module once; return the binary's path."""
    found = consul_binary(paths)
    if found.exists():
        return found
    return _go_build(GoBinary("Consul", CONSUL_MODULE, CONSUL_VERSION, ".",
                              _built_consul(paths), ["version"]), paths, progress)


def compose_binary(paths: StackPaths) -> Path:
    return paths.cache / f"compose-{COMPOSE_VERSION}" / "docker-compose"


def ensure_compose(paths: StackPaths, progress: Progress | None = None) -> Path:
    """Build the pinned Docker Compose v2 from its Go module once (the compose deployment:
    `dr up --docker`; about 2 minutes here); return the binary's path. It runs standalone
    (`docker-compose ...`) and as the `docker compose` plugin (linked into
    ~/.docker/cli-plugins by `dr compose install`)."""
    return _go_build(GoBinary("Docker Compose", COMPOSE_MODULE, COMPOSE_VERSION, "./cmd",
                              compose_binary(paths), ["version"],
                              ldflags=f"-X {COMPOSE_MODULE}/internal.Version={COMPOSE_VERSION}"),
                     paths, progress)


def toxiproxy_binary(paths: StackPaths) -> Path:
    return paths.cache / f"toxiproxy-{TOXIPROXY_VERSION}" / "toxiproxy-server"


def ensure_toxiproxy(paths: StackPaths, progress: Progress | None = None) -> Path:
    """Build the pinned toxiproxy-server from its Go module once (only a stack with
    simulated WAN latency needs it); return the binary's path."""
    return _go_build(GoBinary("Toxiproxy", TOXIPROXY_MODULE, TOXIPROXY_VERSION, "./cmd/server",
                              toxiproxy_binary(paths), ["-version"],
                              ldflags=f"-X {TOXIPROXY_MODULE}.Version="
                                      f"{TOXIPROXY_VERSION.lstrip('v')}"),
                     paths, progress)


@dataclass(frozen=True)
class GoBinary:
    """A program built from a published Go module at a pinned version."""

    what: str
    module: str
    version: str
    package: str
    """The main package inside the module (`.`, `./cmd/server`)."""
    binary: Path
    version_args: list[str]
    """Arguments that make the built program print its version (checked)."""
    ldflags: str = ""


def _go_build(spec: GoBinary, paths: StackPaths, progress: Progress | None) -> Path:
    """Build `spec` with the machine's Go once (module source copied, its local replace
    directives dropped so the published nested modules are used); return the binary."""
    binary = spec.binary
    if binary.exists():
        return binary
    with cache_lock(paths.cache, binary.parent.name, f"{spec.what} {spec.version}", progress):
        if binary.exists():  # the set-up we waited for built it
            return binary
        return _go_build_locked(spec, paths, progress)


def _go_build_locked(spec: GoBinary, paths: StackPaths, progress: Progress | None) -> Path:
    binary = spec.binary
    if shutil.which("go") is None:
        raise ToolchainMissing({"go": f"not found on PATH; Go 1.23 or newer builds "
                                      f"{spec.what} from its Go module (https://go.dev/doc/install)"})
    say = progress or (lambda _m: None)
    say(f"Building {spec.what} {spec.version} from its Go module (first run only, "
        "a few minutes)")
    log.info("go_build", what=spec.what, version=spec.version, into=str(binary))
    env = dict(os.environ)
    env["GOFLAGS"] = "-mod=mod -buildvcs=false"
    # The checksum database is another host that may not answer here; module zips still come
    # from the module proxy, and go.sum pins what the module itself lists.
    env.setdefault("GOSUMDB", "off")
    out = _run(["go", "mod", "download", "-json", f"{spec.module}@{spec.version}"],
               env=env, what=f"Downloading the {spec.what} Go module")
    src_dir = Path(json.loads(out)["Dir"])
    paths.cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{spec.what.lower()}-src-", dir=paths.cache) as tmp:
        work = Path(tmp) / "src"
        shutil.copytree(src_dir, work)
        for p in [work, *work.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
        mod = json.loads(_run(["go", "mod", "edit", "-json"], cwd=work, env=env,
                              what=f"Reading {spec.what}'s go.mod"))
        local = [r["Old"]["Path"] for r in mod.get("Replace") or []
                 if r["New"]["Path"].startswith(".")]
        if local:
            _run(["go", "mod", "edit", *[f"-dropreplace={p}" for p in local]], cwd=work, env=env,
                 what=f"Dropping {spec.what}'s local replace directives")
        say(f"Compiling {spec.what} (go build)")
        staged = Path(tmp) / binary.name
        flags = [f"-ldflags={spec.ldflags}"] if spec.ldflags else []
        _run(["go", "build", "-trimpath", *flags, "-o", str(staged), spec.package], cwd=work,
             env=env, what=f"Building {spec.what} with go build")
        version = _run([str(staged), *spec.version_args], what=f"Checking the built {spec.what}")
        if spec.version.lstrip("v") not in version:
            raise SetupFailed(f"built {spec.what} reports {version.splitlines()[0]!r}, "
                              f"expected {spec.version}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), binary)
    return binary
