"""The public surface: exported names, the committed schema, the import contracts' premise."""

from __future__ import annotations

import json
import subprocess
import sys

import crossdc
import crossdc.clients
import dr
import mirror
import proxy
from crossdc.topology import Topology
from dr.stack.paths import REPO_ROOT


def test_exported_names() -> None:
    assert sorted(crossdc.__all__) == sorted(
        ["ConfigError", "ConfigIssue", "CrossdcError", "Region", "Topology", "load_topology"])
    assert sorted(crossdc.clients.__all__) == sorted(
        ["ConsulClient", "KvEntry", "WanMember", "read_primary", "write_primary"])
    assert dr.__all__ == ["DrError"]
    assert sorted(proxy.__all__) == ["AsyncProducer", "Producer", "ProxyConfig", "ProxyError",
                                     "ProxyServer"]
    assert all(getattr(proxy, name) for name in proxy.__all__)
    assert sorted(mirror.__all__) == sorted(
        ["MirrorError", "MirrorMetrics", "MirrorWorker", "OffsetsError", "PartitionMismatch",
         "RecordTooLarge", "WorkerFenced", "translate_group"])
    assert issubclass(proxy.ProxyError, crossdc.CrossdcError)
    assert issubclass(mirror.MirrorError, crossdc.CrossdcError)


def test_committed_schema_matches_the_models() -> None:
    committed = json.loads((REPO_ROOT / "policies" / "topology.schema.json").read_text())
    assert committed == Topology.model_json_schema(), \
        "regenerate: dr topology schema > policies/topology.schema.json"


def test_importing_dr_does_not_load_pyspark_or_grpc() -> None:
    code = ("import sys, dr, dr.cli; dr.cli.app; "  # every command module (built lazily)
            "print(sorted(m for m in ('pyspark', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_topology_validate_cli_bad_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "t.yaml"
    text = (REPO_ROOT / "policies" / "topology.local.yaml").read_text()
    bad.write_text(text.replace("primary: east", "primary: mars"))
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "topology", "validate", str(bad)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 65  # a file refused (dr/exits.py)
    assert "Traceback" not in proc.stderr
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("primary:"))
    assert f"{bad}:{line} primary: 'mars' is not a region (regions: east, west)" in proc.stderr


def test_topology_validate_cli_good_file() -> None:
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "topology", "validate",
                           str(REPO_ROOT / "policies" / "topology.local.yaml")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout
