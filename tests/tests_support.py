"""Shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from crossdc.topology import Topology


def write_topology(topology: Topology, path: Path) -> Path:
    """Write `topology` as the YAML a user would write."""
    path.write_text(yaml.safe_dump(topology.model_dump(mode="json", exclude_none=True),
                                   sort_keys=False), encoding="utf-8")
    return path
