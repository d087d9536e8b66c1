"""Where the local stack keeps its inputs, its cache and its state."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dr.stack.spark_connector import connector_pom

__all__ = ["REPO_ROOT", "StackPaths", "default_cache_dir", "default_state_dir",
           "default_topology_path", "in_checkout", "no_topology_message"]

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_LOCAL = REPO_ROOT / "compose" / "local"


def in_checkout() -> bool:
    """Whether the code runs from a source checkout (an editable install), not from a
    package installed into site-packages."""
    return (REPO_ROOT / "pyproject.toml").is_file()


def default_state_dir() -> Path:
    """`$CROSSDC_STATE_DIR`, else `.crossdc/` at the repository root of a checkout, else
    `$XDG_STATE_HOME/crossdc` (`~/.local/state/crossdc`): never inside site-packages."""
    env = os.environ.get("CROSSDC_STATE_DIR")
    if env:
        return Path(env)
    if in_checkout():
        return REPO_ROOT / ".crossdc"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "crossdc"


def default_topology_path() -> Path:
    """`$CROSSDC_TOPOLOGY`, else `policies/topology.local.yaml` in the working directory,
    else the source checkout's (a package installed from a checkout keeps no such file: the
    path is then the working directory's, and loading it says the file is missing)."""
    env = os.environ.get("CROSSDC_TOPOLOGY")
    if env:
        return Path(env)
    rel = Path("policies") / "topology.local.yaml"
    here = Path.cwd() / rel
    if here.is_file():
        return here
    checkout = REPO_ROOT / rel
    return checkout if in_checkout() and checkout.is_file() else here


def no_topology_message(looked_at: Path) -> str:
    """What a command says when no --topology was given and the default file is absent."""
    return (f"no topology file: pass --topology FILE (or set $CROSSDC_TOPOLOGY); "
            f"{looked_at} does not exist")


def default_cache_dir() -> Path:
    """`$CROSSDC_CACHE_DIR`, else `~/.cache/crossdc` (kept across clones, so CI runs warm)."""
    env = os.environ.get("CROSSDC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "crossdc"


@dataclass(frozen=True)
class StackPaths:
    """The state directory (data, logs, pids) and the cache (jars, consul binary)."""

    state: Path
    cache: Path

    @classmethod
    def default(cls) -> StackPaths:
        return cls(state=default_state_dir(), cache=default_cache_dir())

    @property
    def pom(self) -> Path:
        return COMPOSE_LOCAL / "pom.xml"

    @property
    def spark_pom(self) -> Path:
        """The Kafka connector pom for the installed pyspark's Spark line (dr/reconcile/)."""
        return connector_pom()

    @property
    def log4j_config(self) -> Path:
        return COMPOSE_LOCAL / "log4j2.yaml"

    @property
    def stack_file(self) -> Path:
        """What `dr up` started: topology path, broker count, process ids."""
        return self.state / "stack.json"

    def region_dir(self, region: str) -> Path:
        return self.state / region
