"""`dr topology`: topology files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from crossdc.topology import Topology, load_topology
from dr.cli._common import out, print_validation

__all__ = ["topology_app"]

topology_app = typer.Typer(help="Topology files: regions and where they answer.",
                           no_args_is_help=True)


@topology_app.command("validate")
def topology_validate(file: Annotated[Path, typer.Argument(help="The topology YAML file.")],
                      as_json: Annotated[bool, typer.Option(
                          "--json", help="One JSON object: valid, the regions, witnesses "
                          "and primary, or every issue with file, line and field.")] = False,
                      ) -> None:
    """Check a topology file; print every problem with file, line and field."""
    if as_json:
        def check() -> dict[str, object]:
            topo = load_topology(file)
            return {"regions": [r.name for r in topo.regions],
                    "witnesses": [w.name for w in topo.witnesses], "primary": topo.primary}
        print_validation(file, check)
        return
    topo = load_topology(file)
    out.print(f"[green]{file}: valid[/] — {len(topo.regions)} region(s) "
              f"({', '.join(r.name for r in topo.regions)}), primary {topo.primary}")


@topology_app.command("schema")
def topology_schema() -> None:
    """Print the topology file's JSON schema (committed as policies/topology.schema.json)."""
    sys.stdout.write(json.dumps(Topology.model_json_schema(), indent=2) + "\n")
