"""Which Spark line the installed pyspark belongs to, and the connector pom for it.

The reconciliation reads Kafka through Spark's spark-sql-kafka connector, a jar built for one
Spark minor line and one Scala binary version. Each supported line has its pom in
`dr/reconcile/` (`dr setup` fetches it with Maven into the cache); the installed pyspark's
major.minor chooses it:

    line  connector  Scala  pom
    3.5   3.5.7      2.12   dr/reconcile/pom-spark-3.5.xml   (EMR 7, Databricks 14.3-16.4 LTS)
    4.2   4.2.0      2.13   dr/reconcile/pom.xml             (the `reconcile` extra's default)

pyspark is never imported here (`dr setup`, `dr up` and `dr --help` stay light): its version
is read from `pyspark/version.py` (in a folder, or in the pyspark.zip that spark-submit puts on
the path) and its Scala binary version from the name of the `spark-core_<scala>-<v>.jar` its
launcher runs (`$SPARK_HOME/jars` when SPARK_HOME is set, as pyspark itself does, else the
package's `jars/`). Refusing an unsupported pyspark is the reconciliation's
(`dr.reconcile.spark_line`); here an unsupported or absent pyspark gets the newest line's pom,
so `dr setup` still fetches what `pip install 'crossdc[reconcile]'` would run.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_LINE", "SPARK_LINES", "InstalledSpark", "SparkLine", "connector_pom",
           "installed_spark", "line_of"]

RECONCILE_DIR = Path(__file__).resolve().parents[1] / "reconcile"


@dataclass(frozen=True)
class SparkLine:
    """One Spark minor line crossdc ships a connector for."""

    line: str
    """major.minor, as `3.5`."""
    connector: str
    """The spark-sql-kafka version fetched for every pyspark of the line (the newest of the
    line on Maven Central)."""
    scala: str
    """Scala binary version of the line's PyPI pyspark and of the connector."""
    pom: Path


SPARK_LINES: dict[str, SparkLine] = {
    "3.5": SparkLine("3.5", "3.5.7", "2.12", RECONCILE_DIR / "pom-spark-3.5.xml"),
    "4.2": SparkLine("4.2", "4.2.0", "2.13", RECONCILE_DIR / "pom.xml"),
}
"""Adding a line: its pom beside pom.xml, a row here, the pyspark pin in pyproject.toml's
`reconcile` extra, and a CI run with it (.ci/spark35.sh is the pattern)."""
DEFAULT_LINE = SPARK_LINES["4.2"]


@dataclass(frozen=True)
class InstalledSpark:
    """The pyspark this interpreter would import, read without importing it."""

    version: str
    home: Path
    """Where its launcher and jars are: $SPARK_HOME, else the package folder."""
    scala: str | None
    """From `jars/spark-core_<scala>-*.jar`; None when no such jar is there."""

    @property
    def line(self) -> str:
        return ".".join(self.version.split(".")[:2])


_VERSION = re.compile(r"""^__version__(?:\s*:\s*str)?\s*=\s*["']([^"']+)["']""", re.MULTILINE)
_SPARK_CORE = re.compile(r"^spark-core_(\d+\.\d+)-.+\.jar$")


def installed_spark() -> InstalledSpark | None:
    """The importable pyspark's version, home and Scala binary version; None without one."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return None
    location = next(iter(spec.submodule_search_locations))
    package = Path(location)
    # Through the package's loader: under spark-submit pyspark is imported from
    # $SPARK_HOME/python/lib/pyspark.zip, where no file system path reads it.
    get_data = getattr(spec.loader, "get_data", None)
    try:
        text = get_data(os.path.join(location, "version.py")) if get_data else \
            (package / "version.py").read_bytes()
        found = _VERSION.search(text.decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    if found is None:
        return None
    home = Path(os.environ["SPARK_HOME"]) if os.environ.get("SPARK_HOME") else package
    scala = None
    try:
        for jar in sorted((home / "jars").iterdir()):
            m = _SPARK_CORE.match(jar.name)
            if m:
                scala = m.group(1)
                break
    except OSError:
        pass
    return InstalledSpark(found.group(1), home, scala)


def line_of(version: str) -> SparkLine | None:
    """The supported line of a pyspark version (`3.5.2` → 3.5), None when unsupported."""
    return SPARK_LINES.get(".".join(version.split(".")[:2]))


def connector_pom() -> Path:
    """The connector pom for the installed pyspark's line (the newest line's when pyspark is
    absent or of a line crossdc has no connector for)."""
    spark = installed_spark()
    line = line_of(spark.version) if spark is not None else None
    return (line or DEFAULT_LINE).pom
