"""The container images crossdc runs in, built on this machine (no image registry needed).

    crossdc/debian:bookworm   the base: `debootstrap --variant=minbase bookworm` from Debian's
                              archive, `docker import`ed (the root file system's tarball is
                              cached under <cache>/images/, so it is made once)
    crossdc/kafka:<v>         Kafka (KRaft) from the jars `dr setup` fetches (compose/local/pom.xml)
    crossdc/consul:<v>        the Consul binary `dr setup` builds from its Go module
    crossdc/crossdc:<v>       the `dr` entry point: proxy, mirror, controller, the CLI
    crossdc/prometheus:<suite>  Debian's prometheus package (the compose deployment's)

Each image but the base is a Dockerfile under `compose/images/<name>/`, built with
`docker build --network host` (the engine does no NAT here: compose/docker/engine.sh) from a
build context assembled under <cache>/images/context-<name>/: the Dockerfile's folder, plus
the cached jars, the cached Consul binary, or the package's sources. The inputs are hashed
(every file of the context, the base image's id) and the hash is stored on the image as the
label `io.crossdc.inputs`: `build_images` rebuilds an image only when that hash changed (or
with `force`), so a second `dr images build` costs a few hashes.

The engine is asked through the `docker` client program (`docker build`, `docker import`,
`docker image inspect`), which honours $DOCKER_HOST like docker-py does; whether an engine
answers is decided by `docker_available()` (an engine ping), never by finding the client.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from dr.errors import SetupFailed, StackError
from dr.stack.paths import COMPOSE_LOCAL, REPO_ROOT, StackPaths, in_checkout
from dr.stack.toolchain import CONSUL_VERSION, _pom_version

__all__ = ["BASE_IMAGE", "CONSUL_IMAGE", "CROSSDC_IMAGE", "IMAGES", "INPUTS_LABEL",
           "KAFKA_IMAGE", "PROMETHEUS_IMAGE", "RECONCILE_IMAGE", "BuildResult", "ImageState",
           "build_images", "image_states", "require_engine"]

log = structlog.get_logger("crossdc.stack.images")

Progress = Callable[[str], None]

IMAGES_DIR = REPO_ROOT / "compose" / "images"
INPUTS_LABEL = "io.crossdc.inputs"
"""The label holding the hash of an image's inputs (what decides a rebuild)."""

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
_SOURCES_LIST = (f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE} main\n"
                 f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE}-updates main\n"
                 f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main\n")
_DPKG_SLIM = ("# crossdc images: no documentation, manual pages or translations (copyrights kept)\n"
              "path-exclude=/usr/share/doc/*\npath-include=/usr/share/doc/*/copyright\n"
              "path-exclude=/usr/share/man/*\npath-exclude=/usr/share/info/*\n"
              "path-exclude=/usr/share/locale/*\n")
_APT_CLEAN = ("DPkg::Post-Invoke { \"rm -f /var/cache/apt/archives/*.deb "
              "/var/cache/apt/*.bin || true\"; };\n"
              "Dir::Cache::pkgcache \"\"; Dir::Cache::srcpkgcache \"\";\n")
_BASE_RECIPE = (f"debootstrap --variant=minbase {DEBIAN_SUITE} {DEBIAN_MIRROR}\n"
                f"sources.list:\n{_SOURCES_LIST}dpkg.cfg.d/crossdc-slim:\n{_DPKG_SLIM}"
                f"apt.conf.d/crossdc-clean:\n{_APT_CLEAN}"
                "removed: apt lists and caches, docs (but copyrights), man, info, locale\n")

BASE_IMAGE = f"crossdc/debian:{DEBIAN_SUITE}"
KAFKA_IMAGE = f"crossdc/kafka:{_pom_version(COMPOSE_LOCAL / 'pom.xml', 'kafka.version')}"
CONSUL_IMAGE = f"crossdc/consul:{CONSUL_VERSION.lstrip('v')}"
CROSSDC_VERSION = "0.1.0"
"""= pyproject.toml's version (a unit test holds them together)."""
CROSSDC_IMAGE = f"crossdc/crossdc:{CROSSDC_VERSION}"
RECONCILE_IMAGE = f"crossdc/reconcile:{CROSSDC_VERSION}"
"""`dr reconcile` (pyspark, a Java runtime, the Kafka connector jars): an image of its own."""
PROMETHEUS_IMAGE = f"crossdc/prometheus:{DEBIAN_SUITE}"
"""Debian's prometheus package: its version is the suite's."""

IMAGES = {"base": BASE_IMAGE, "kafka": KAFKA_IMAGE, "consul": CONSUL_IMAGE,
          "crossdc": CROSSDC_IMAGE, "prometheus": PROMETHEUS_IMAGE,
          "reconcile": RECONCILE_IMAGE}
"""Every image by its short name, in build order (the base first)."""

_PACKAGE_SOURCES = ["pyproject.toml", "README.md", "client", "crossdc", "dr", "proxy",
                    "mirror", "observability", "policies"]
"""What of the checkout the crossdc image's build context holds (as `src/`)."""


@dataclass(frozen=True)
class BuildResult:
    """One image after `build_images`: built now (and how long it took) or already current."""

    name: str
    tag: str
    built: bool
    seconds: float
    size_bytes: int
    inputs: str


@dataclass(frozen=True)
class ImageState:
    """One image as the engine holds it now (`dr images list`)."""

    name: str
    tag: str
    present: bool
    size_bytes: int
    inputs: str | None


# -- the engine, through the docker client -------------------------------------------------
def _docker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DOCKER_BUILDKIT"] = "0"  # the classic builder: Debian's engine has no buildx here
    return env


def _docker(*args: str, what: str, log_file: Path | None = None,
            stdin: Path | None = None) -> str:
    """Run `docker ARGS`; SetupFailed names `what` and ends with the output's last lines."""
    exe = shutil.which("docker")
    if exe is None:
        raise StackError("the `docker` client is not on PATH (Debian: apt-get install "
                         "docker.io; or run `bash compose/docker/engine.sh` as root)")
    cmd = [exe, *args]
    try:
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            with log_file.open("w", encoding="utf-8") as out:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                      env=_docker_env(), check=False)
            output = log_file.read_text(encoding="utf-8", errors="replace")
        else:
            with (stdin.open("rb") if stdin is not None else open(os.devnull, "rb")) as inp:
                done = subprocess.run(cmd, stdin=inp, capture_output=True, env=_docker_env(),
                                      check=False)
            proc = subprocess.CompletedProcess(cmd, done.returncode)
            output = (done.stdout + done.stderr).decode("utf-8", errors="replace")
    except OSError as exc:
        raise SetupFailed(f"{what}: cannot run docker: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-25:])
        where = f" (whole output: {log_file})" if log_file is not None else ""
        raise SetupFailed(f"{what} failed (exit {proc.returncode}){where}: "
                          f"docker {' '.join(args)}\n{tail}")
    return output


def _inspect(tag: str) -> tuple[str, str | None, int] | None:
    """(image id, inputs label, size in bytes) of `tag`, or None when the engine has none."""
    exe = shutil.which("docker")
    if exe is None:
        return None
    fmt = f'{{{{.Id}}}}|{{{{index .Config.Labels "{INPUTS_LABEL}"}}}}|{{{{.Size}}}}'
    proc = subprocess.run([exe, "image", "inspect", "--format", fmt, tag], capture_output=True,
                          text=True, env=_docker_env(), check=False)
    if proc.returncode != 0:
        return None
    image_id, label, size = proc.stdout.strip().split("|")
    return image_id, (label if label and label != "<no value>" else None), int(size)


def require_engine() -> None:
    """StackError unless a Docker engine answers (an engine ping, not the client's presence)."""
    from dr.stack.docker import docker_available
    if not docker_available():
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise StackError(f"no Docker engine answers at {host}: start one with "
                         "`bash compose/docker/engine.sh` (as root; it installs Debian's "
                         "docker.io when missing), or point $DOCKER_HOST at a running one")


# -- inputs ----------------------------------------------------------------------------------
def _hash_tree(root: Path, extra: str) -> str:
    """sha256 of every file under `root` (path, executable bit, bytes; symlinks by target)
    and of `extra`."""
    h = hashlib.sha256(extra.encode())
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            h.update(f"L {rel} -> {os.readlink(p)}\n".encode())
        elif p.is_file():
            h.update(f"F {rel} {bool(p.stat().st_mode & 0o111)}\n".encode())
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def _copy_sources(dest: Path) -> None:
    """The package's sources (and policies/) from the checkout, without build leftovers."""
    if not in_checkout():
        raise StackError(f"the crossdc image is built from a source checkout; {REPO_ROOT} is "
                         "an installed package (clone the repository and run it there)")

    def skip(folder: str, names: list[str]) -> set[str]:
        gone = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
        if Path(folder).resolve() == (REPO_ROOT / "client" / "src" / "crossdc_client").resolve():
            gone.add("_proto")  # generated into the client's wheel by its build
        if Path(folder).resolve() == (REPO_ROOT / "client").resolve():
            gone |= {"build", "dist"} & set(names)  # an earlier local build's leftovers
        return gone

    dest.mkdir(parents=True)
    for name in _PACKAGE_SOURCES:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(src, dest / name)


def _copy_ca_bundle(dest: Path) -> None:
    """The CA bundle this machine trusts ($SSL_CERT_FILE, else Debian's), for pip in the
    builder stage (a TLS-intercepting proxy's CA included); an empty file when none."""
    for cand in (os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if cand and Path(cand).is_file():
            shutil.copyfile(cand, dest)
            return
    dest.write_bytes(b"")


def _strip_copy(binary: Path, dest: Path) -> None:
    """`binary` without its debug symbols (`strip`), or as is where binutils are missing."""
    shutil.copy2(binary, dest)
    strip = shutil.which("strip")
    if strip is not None:
        subprocess.run([strip, str(dest)], check=True, capture_output=True)


def _context(name: str, paths: StackPaths, say: Progress) -> Path:
    """The build context of image `name`, assembled afresh under <cache>/images/."""
    from dr.stack.toolchain import ensure_consul, ensure_kafka_libs
    ctx = paths.cache / "images" / f"context-{name}"
    if ctx.exists():
        shutil.rmtree(ctx)
    shutil.copytree(IMAGES_DIR / name, ctx)
    if name == "kafka":
        shutil.copytree(ensure_kafka_libs(paths, say), ctx / "libs")
        shutil.copy2(paths.log4j_config, ctx / "log4j2.yaml")
    elif name == "consul":
        _strip_copy(ensure_consul(paths, say), ctx / "consul")
    elif name in ("crossdc", "reconcile"):
        _copy_sources(ctx / "src")
        _copy_ca_bundle(ctx / "build-ca.crt")
    if name == "reconcile":  # the connector jars, where `dr reconcile` looks for them
        from dr.stack.toolchain import ensure_spark_kafka_jars
        jars = ensure_spark_kafka_jars(paths, say).parent  # <cache>/spark-kafka-<v>-<hash>
        shutil.copytree(jars, ctx / "cache" / jars.name)
        for f in (ctx / "cache").rglob("*"):  # Maven's folder is 0700: the image's user reads
            f.chmod(0o755 if f.is_dir() else 0o644)
        (ctx / "extra-requirements.txt").write_text("\n".join(_extra("reconcile")) + "\n")
    return ctx


def _extra(name: str) -> list[str]:
    """The requirements of the package's extra `name`, as pyproject.toml lists them."""
    import tomllib
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [r for r in project["optional-dependencies"][name] if not r.startswith("crossdc")]


# -- the base --------------------------------------------------------------------------------
def base_rootfs(paths: StackPaths) -> Path:
    """The base's root file system tarball; its name carries the recipe's hash, so a changed
    recipe makes a new one."""
    recipe = hashlib.sha256(_BASE_RECIPE.encode()).hexdigest()[:10]
    return paths.cache / "images" / f"debian-{DEBIAN_SUITE}-minbase-{recipe}.tar"


def _slim(root: Path) -> None:
    """The debootstrapped tree made an image's base: the full sources.list, no docs (their
    copyrights kept), manual pages, translations or apt caches, now or after later installs
    (dpkg path-excludes, an apt hook)."""
    (root / "etc" / "apt" / "sources.list").write_text(_SOURCES_LIST, encoding="utf-8")
    (root / "etc" / "dpkg" / "dpkg.cfg.d" / "crossdc-slim").write_text(_DPKG_SLIM,
                                                                        encoding="utf-8")
    (root / "etc" / "apt" / "apt.conf.d" / "99crossdc-clean").write_text(_APT_CLEAN,
                                                                          encoding="utf-8")
    usr_share = root / "usr" / "share"
    for p in [*(root / "var" / "cache" / "apt").rglob("*"),
              *(root / "var" / "lib" / "apt" / "lists").glob("*"),
              *(usr_share / "doc").rglob("*"), *(usr_share / "man").rglob("*"),
              *(usr_share / "info").rglob("*"), *(usr_share / "locale").rglob("*")]:
        if (p.is_file() or p.is_symlink()) and p.name != "copyright":
            p.unlink()


def ensure_base_rootfs(paths: StackPaths, say: Progress) -> tuple[Path, str]:
    """The base's root file system as a tarball (made once with debootstrap) and its sha256."""
    tar = base_rootfs(paths)
    digest_file = tar.with_name(tar.name + ".sha256")
    if tar.exists() and digest_file.exists():
        return tar, digest_file.read_text(encoding="utf-8").strip()
    debootstrap = shutil.which("debootstrap") or (
        "/usr/sbin/debootstrap" if Path("/usr/sbin/debootstrap").exists() else None)
    if debootstrap is None:
        raise StackError("the base image is made with debootstrap, which is not installed "
                         "(Debian: apt-get install debootstrap; compose/docker/engine.sh "
                         "installs it)")
    if os.geteuid() != 0:
        raise StackError("debootstrap (the base image's root file system) needs root")
    tar.parent.mkdir(parents=True, exist_ok=True)
    say(f"Making the Debian {DEBIAN_SUITE} base with debootstrap (first run only, about a "
        "minute)")
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=tar.parent) as tmp:
        root = Path(tmp) / "rootfs"
        out = Path(tmp) / "debootstrap.log"
        with out.open("w", encoding="utf-8") as f:
            code = subprocess.run([debootstrap, "--variant=minbase", DEBIAN_SUITE, str(root),
                                   DEBIAN_MIRROR], stdout=f, stderr=subprocess.STDOUT,
                                  check=False).returncode
        if code != 0:
            tail = "\n".join(out.read_text(errors="replace").splitlines()[-20:])
            raise SetupFailed(f"debootstrap --variant=minbase {DEBIAN_SUITE} failed (exit "
                              f"{code}):\n{tail}")
        _slim(root)
        staged = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(staged), "."],
                       check=True, capture_output=True)
        h = hashlib.sha256()
        with staged.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        staged.replace(tar)
    digest_file.write_text(h.hexdigest() + "\n", encoding="utf-8")
    return tar, h.hexdigest()


def _build_base(paths: StackPaths, force: bool, say: Progress) -> BuildResult:
    t0 = time.monotonic()
    tar, digest = ensure_base_rootfs(paths, say)
    inputs = hashlib.sha256(f"{_BASE_RECIPE}{digest}".encode()).hexdigest()
    have = _inspect(BASE_IMAGE)
    if have is not None and have[1] == inputs and not force:
        return BuildResult("base", BASE_IMAGE, False, 0.0, have[2], inputs)
    say(f"Importing {BASE_IMAGE}")
    _docker("import", "--change", f"LABEL {INPUTS_LABEL}={inputs}",
            "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["bash"]', "-", BASE_IMAGE,
            what=f"docker import of {tar}", stdin=tar)
    now = _inspect(BASE_IMAGE)
    return BuildResult("base", BASE_IMAGE, True, time.monotonic() - t0,
                       now[2] if now else 0, inputs)


def _build(name: str, paths: StackPaths, base_id: str, force: bool,
           say: Progress) -> BuildResult:
    tag = IMAGES[name]
    t0 = time.monotonic()
    ctx = _context(name, paths, say)
    inputs = _hash_tree(ctx, f"{tag}\nbase {base_id}\n")
    have = _inspect(tag)
    if have is not None and have[1] == inputs and not force:
        return BuildResult(name, tag, False, 0.0, have[2], inputs)
    log_file = paths.cache / "images" / f"build-{name}.log"
    say(f"Building {tag} (docker build --network host; log {log_file})")
    log.info("image_build", image=tag, context=str(ctx), log=str(log_file))
    _docker("build", "--network", "host", "--force-rm", "--build-arg", f"BASE={BASE_IMAGE}",
            "--label", f"{INPUTS_LABEL}={inputs}", "-t", tag, str(ctx),
            what=f"Building {tag}", log_file=log_file)
    now = _inspect(tag)
    return BuildResult(name, tag, True, time.monotonic() - t0, now[2] if now else 0, inputs)


def build_images(paths: StackPaths, names: list[str] | None = None, *, force: bool = False,
                 progress: Progress | None = None) -> list[BuildResult]:
    """Build the images named (default all; the base always comes first, as every other one
    is built on it); an image whose inputs are unchanged is kept. StackError when no engine
    answers."""
    say = progress or (lambda _m: None)
    unknown = sorted(set(names or []) - set(IMAGES))
    if unknown:
        raise StackError(f"no image {', '.join(unknown)}; images: {', '.join(IMAGES)}")
    require_engine()
    wanted = [n for n in IMAGES if names is None or n in names]
    results = [_build_base(paths, force and "base" in wanted, say)]
    base = _inspect(BASE_IMAGE)
    if base is None:
        raise SetupFailed(f"{BASE_IMAGE} is not in the engine after its import")
    for name in wanted:
        if name != "base":
            results.append(_build(name, paths, base[0], force, say))
    return [r for r in results if r.name in wanted]


def image_states() -> list[ImageState]:
    """Every crossdc image as the engine holds it now."""
    states = []
    for name, tag in IMAGES.items():
        have = _inspect(tag)
        states.append(ImageState(name, tag, have is not None, have[2] if have else 0,
                                 have[1] if have else None))
    return states
