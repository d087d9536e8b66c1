"""The lean install: the run-time dependencies are what the proxy, mirror, controller and CLI
import; Spark, charts, Docker and the stub generator are extras, and a command that needs one
says which; the gRPC stubs are built at build time (`.ci/clean-venv.sh` installs the wheel
into fresh venvs and runs the commands)."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from crossdc import extras
from crossdc.errors import MissingExtra
from crossdc_client import build_protos
from crossdc_client.errors import StubsMissing
from dr.stack.paths import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CLIENT = tomllib.loads((REPO_ROOT / "client" / "pyproject.toml").read_text(encoding="utf-8"))


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_runtime_set_leaves_spark_charts_docker_and_protoc_to_extras() -> None:
    runtime = _names(PYPROJECT["project"]["dependencies"])
    assert not runtime & {"pyspark", "matplotlib", "testcontainers", "docker", "grpcio-tools",
                          "pytest", "dnspython"}
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert "pyspark" in _names(optional["reconcile"])
    assert "matplotlib" in _names(optional["charts"])
    assert "testcontainers" in _names(optional["docker"])
    assert "grpcio-tools" in _names(optional["protos"])
    assert set(extras.EXTRAS) <= set(optional)
    # the dev venv (`make setup`: pip install -e ".[dev]") has every extra
    assert "crossdc[reconcile,charts,docker,protos,tracing]" in optional["dev"]
    # the stubs are built by the client distribution's build backend, with grpcio-tools as a
    # build requirement; crossdc depends on that distribution, which needs nothing else
    assert "grpcio-tools" in _names(CLIENT["build-system"]["requires"])
    assert "crossdc-client" in runtime
    assert _names(CLIENT["project"]["dependencies"]) == {"grpcio", "protobuf"}
    assert f"crossdc-client=={CLIENT['project']['version']}" in PYPROJECT["project"][
        "dependencies"]


def test_a_missing_extra_is_one_error_naming_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr("crossdc.extras.importlib.util.find_spec",
                        lambda name, *a: None if name == "pyspark" else real(name, *a))
    assert extras.missing("reconcile") == ["pyspark"]
    with pytest.raises(MissingExtra) as info:
        extras.require("reconcile", "dr reconcile")
    assert str(info.value) == ("dr reconcile needs pyspark, which this install does not "
                               "have: pip install 'crossdc[reconcile]'")
    assert info.value.exit_code == 1
    extras.require("charts", "a chart")  # installed here: nothing to say


def test_stubs_are_generated_into_a_build_folder(tmp_path: Path) -> None:
    out = tmp_path / "crossdc_client" / "_proto"
    written = build_protos.generate(out)
    assert {p.name for p in written} >= {"proxy_pb2.py", "proxy_pb2_grpc.py"}
    assert (out / "__init__.py").is_file()
    assert build_protos.is_fresh(out)
    grpc_code = (out / "crossdc" / "v1" / "proxy_pb2_grpc.py").read_text()
    assert "from crossdc_client._proto.crossdc.v1 import proxy_pb2" in grpc_code


def test_an_install_without_stubs_never_builds_them_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_protos, "is_fresh", lambda *a: False)
    monkeypatch.setattr(build_protos, "in_checkout", lambda: False)
    monkeypatch.setattr(build_protos, "generate", lambda *a: pytest.fail("generated"))
    with pytest.raises(StubsMissing, match=re.escape("pip install --force-reinstall "
                                                     "crossdc-client")):
        build_protos.ensure_generated()
    monkeypatch.setattr(build_protos, "in_checkout", lambda: True)
    monkeypatch.setattr(build_protos, "_has_tools", lambda: False)
    with pytest.raises(StubsMissing, match=re.escape("pip install 'crossdc[protos]'")):
        build_protos.ensure_generated()
