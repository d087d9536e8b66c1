"""The Spark line the reconciliation runs on: chosen from the installed pyspark's major.minor,
its connector pom, the `reconcile` extra's pin, and the refusal of anything else.

A pyspark is faked as a folder (`pyspark/version.py`, `jars/spark-core_<scala>-<v>.jar`) put
first on sys.path: that is all `installed_spark` reads (it never imports pyspark).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dr.reconcile.errors import UnsupportedSpark
from dr.reconcile.spark_line import check_spark, supported_lines
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.spark_connector import (
    DEFAULT_LINE,
    SPARK_LINES,
    InstalledSpark,
    connector_pom,
    installed_spark,
    line_of,
)

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _fake_pyspark(root: Path, version: str, scala: str | None, *,
                  annotated: bool = True) -> Path:
    package = root / "pyspark"
    (package / "jars").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    line = f"__version__: str = '{version}'" if annotated else f'__version__ = "{version}"'
    (package / "version.py").write_text(f"{line}\n")
    (package / "jars" / "scala-library-x.jar").write_bytes(b"")
    if scala is not None:
        (package / "jars" / f"spark-core_{scala}-{version}.jar").write_bytes(b"")
    return package


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """fake(version, scala): that pyspark is the one this interpreter finds."""
    monkeypatch.delitem(sys.modules, "pyspark", raising=False)  # find_spec looks there first
    monkeypatch.delenv("SPARK_HOME", raising=False)

    def make(version: str, scala: str | None = "2.12", **kw: bool) -> Path:
        where = tmp_path / version
        package = _fake_pyspark(where, version, scala, **kw)
        monkeypatch.syspath_prepend(str(where))
        return package
    return make


@pytest.mark.parametrize(("version", "line"), [
    ("3.5.0", "3.5"), ("3.5.7", "3.5"), ("3.5.9", "3.5"), ("4.2.0", "4.2"), ("4.2.1", "4.2"),
    ("3.4.4", None), ("4.0.1", None), ("4.1.3", None), ("4.3.0", None), ("3.5", "3.5"),
])
def test_the_line_is_the_major_and_minor(version: str, line: str | None) -> None:
    got = line_of(version)
    assert (got.line if got else None) == line


def test_each_line_has_a_pom_that_fetches_its_connector_for_its_scala() -> None:
    """The table and the poms say the same: spark.version = the connector, the artifacts
    of the line's Scala binary version, and the pom ships in the wheel (package data)."""
    shipped = PYPROJECT["tool"]["setuptools"]["package-data"]["dr.reconcile"]
    for line in SPARK_LINES.values():
        text = line.pom.read_text(encoding="utf-8")
        prop = dict(re.findall(r"<(spark\.version|scala\.binary\.version)>([^<]+)<", text))
        assert prop == {"spark.version": line.connector, "scala.binary.version": line.scala}
        assert line.connector.startswith(f"{line.line}.")
        artifacts = re.findall(r"<artifactId>(spark-[^<]+)</artifactId>", text)
        assert artifacts == ["spark-sql-kafka-0-10_${scala.binary.version}",
                             "spark-token-provider-kafka-0-10_${scala.binary.version}"]
        assert line.pom.name in shipped
    assert sorted(p.name for p in (REPO_ROOT / "dr" / "reconcile").glob("pom*.xml")) == \
        sorted(line.pom.name for line in SPARK_LINES.values())


def test_the_extra_admits_each_line_and_nothing_else() -> None:
    """`pip install 'crossdc[reconcile]'` takes the newest line's pin; 'pyspark==3.5.x' beside
    it resolves; a line without a connector here does not."""
    (spec,) = [Requirement(r).specifier for r in
               PYPROJECT["project"]["optional-dependencies"]["reconcile"]
               if Requirement(r).name == "pyspark"]
    admitted = {v for v in ("3.4.4", "3.5.0", "3.5.2", "3.5.7", "3.5.9", "4.0.0", "4.1.3",
                            "4.2.0", "4.2.1", "4.3.0") if spec.contains(v)}
    assert admitted == {"3.5.0", "3.5.2", "3.5.7", "3.5.9", "4.2.0"}
    assert max(admitted, key=lambda v: tuple(map(int, v.split(".")))) == DEFAULT_LINE.connector
    for line in SPARK_LINES.values():
        assert spec.contains(line.connector)


@pytest.mark.parametrize("annotated", [True, False])
def test_installed_pyspark_is_read_without_importing_it(fake, annotated: bool) -> None:  # type: ignore[no-untyped-def]
    package = fake("3.5.2", "2.12", annotated=annotated)
    got = installed_spark()
    assert got == InstalledSpark("3.5.2", package, "2.12")
    assert got is not None
    assert got.line == "3.5"
    assert "pyspark" not in sys.modules


def test_pyspark_imported_from_spark_submits_zip_is_read_too(  # type: ignore[no-untyped-def]
        fake, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """spark-submit runs the job with $SPARK_HOME/python/lib/pyspark.zip on PYTHONPATH
    (the spark-submit integration test failed on this: no version.py on the file system)."""
    import zipfile
    home = tmp_path / "spark-home"
    (home / "jars").mkdir(parents=True)
    (home / "jars" / "spark-core_2.13-4.2.0.jar").write_bytes(b"")
    archive = home / "python" / "lib" / "pyspark.zip"
    archive.parent.mkdir(parents=True)
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pyspark/__init__.py", "raise ImportError('never imported')\n")
        z.writestr("pyspark/version.py", "__version__: str = '4.2.0'\n")
    monkeypatch.delitem(sys.modules, "pyspark", raising=False)
    monkeypatch.syspath_prepend(str(archive))
    monkeypatch.setenv("SPARK_HOME", str(home))
    assert installed_spark() == InstalledSpark("4.2.0", home, "2.13")
    assert check_spark() is SPARK_LINES["4.2"]


def test_spark_home_is_where_the_jars_are_read(fake, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                               tmp_path: Path) -> None:
    """pyspark's launcher runs $SPARK_HOME's jars when it is set: a Scala 2.13 build of
    Spark 3.5 there would not load the 2.12 connector."""
    fake("3.5.1", "2.12")
    home = tmp_path / "spark-3.5.1-bin-hadoop3-scala2.13"
    (home / "jars").mkdir(parents=True)
    (home / "jars" / "spark-core_2.13-3.5.1.jar").write_bytes(b"")
    monkeypatch.setenv("SPARK_HOME", str(home))
    got = installed_spark()
    assert got == InstalledSpark("3.5.1", home, "2.13")
    with pytest.raises(UnsupportedSpark) as err:
        check_spark()
    assert str(err.value) == (
        f"the Spark 3.5.1 at {home} is built for Scala 2.13, but crossdc's Spark 3.5 "
        "connector is Scala 2.12 (the PyPI pyspark's); unset SPARK_HOME or point it at a "
        "Scala 2.12 build")


def test_the_pom_follows_the_installed_line(fake) -> None:  # type: ignore[no-untyped-def]
    fake("3.5.7")
    assert connector_pom() == SPARK_LINES["3.5"].pom
    assert StackPaths.default().spark_pom.name == "pom-spark-3.5.xml"


def test_no_pyspark_or_an_unsupported_one_gets_the_newest_lines_pom(  # type: ignore[no-untyped-def]
        fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dr setup` still fetches what `pip install 'crossdc[reconcile]'` would run; the
    refusal is the reconciliation's (below)."""
    fake("4.1.3", "2.13")
    assert connector_pom() == DEFAULT_LINE.pom
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyspark" else real(name, *a))
    assert installed_spark() is None
    assert connector_pom() == DEFAULT_LINE.pom == REPO_ROOT / "dr" / "reconcile" / "pom.xml"


def test_an_unsupported_pyspark_is_refused_naming_the_supported_lines(fake) -> None:  # type: ignore[no-untyped-def]
    fake("4.1.3", "2.13")
    with pytest.raises(UnsupportedSpark) as err:
        check_spark()
    assert str(err.value) == (
        "pyspark 4.1.3 is not supported: the reconciliation runs on Spark 3.5 (pyspark 3.5.x, "
        "Scala 2.12, connector 3.5.7) and 4.2 (pyspark 4.2.x, Scala 2.13, connector 4.2.0); "
        "install one: pip install 'crossdc[reconcile]' (pyspark 4.2.0) or pip install "
        "'crossdc[reconcile]' 'pyspark==3.5.7'")
    assert err.value.exit_code == 1


def test_a_patch_release_of_a_line_runs_with_the_lines_connector(fake) -> None:  # type: ignore[no-untyped-def]
    fake("3.5.2", "2.12")
    assert check_spark() is SPARK_LINES["3.5"]
    # a pyspark whose jars folder names no spark-core jar (a thin install): judged by version
    assert check_spark(InstalledSpark("4.2.1", Path("/nowhere"), None)) is SPARK_LINES["4.2"]


def test_a_pyspark_without_a_readable_version_is_refused(fake) -> None:  # type: ignore[no-untyped-def]
    package = fake("3.5.7")
    (package / "version.py").write_text("VERSION = 'who knows'\n")
    assert installed_spark() is None
    with pytest.raises(UnsupportedSpark, match=r"cannot tell the installed pyspark's version"):
        check_spark()


def test_the_pyspark_of_this_venv_is_a_supported_line() -> None:
    """The dev venv (4.2) and .ci/spark35.sh's (3.5): the check passes and the pom fetched
    for the tests is the line's."""
    spark = installed_spark()
    assert spark is not None
    line = check_spark()
    assert line.line == spark.line
    assert spark.scala == line.scala
    assert StackPaths.default().spark_pom == line.pom


def test_supported_lines_reads_as_a_sentence() -> None:
    assert supported_lines() == ("Spark 3.5 (pyspark 3.5.x, Scala 2.12, connector 3.5.7) and "
                                 "4.2 (pyspark 4.2.x, Scala 2.13, connector 4.2.0)")
