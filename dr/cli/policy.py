"""`dr policy`: routing policy files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from crossdc.topology import load_topology
from dr.cli._common import out, print_validation

__all__ = ["policy_app"]

policy_app = typer.Typer(help="Routing policy files: how the proxy writes each topic.",
                         no_args_is_help=True)


@policy_app.command("validate")
def policy_validate(
    file: Annotated[Path, typer.Argument(help="The policy YAML file.")],
    topology: Annotated[Path | None, typer.Option(
        "--topology", "-t", help="Also check `prefer` regions and quorums against this "
        "topology file.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object: valid, the "
                                          "rules' count and where each rule's dead letters "
                                          "go, or every issue with file, line and "
                                          "field.")] = False,
) -> None:
    """Check a routing policy file; print every problem with file, line and field (a topic
    that could not be read through the proxy, e.g. its dead letters could not be written,
    is one)."""
    from proxy.policy import validate_policy  # lazily: keeps `import dr.cli` light
    if as_json:
        def check() -> dict[str, object]:
            topo = load_topology(topology) if topology is not None else None
            pol = validate_policy(file, topo)
            return {"rules": len(pol.rules), "strict": pol.strict,
                    "default_mode": pol.default.dr_mode if pol.default else None,
                    "topology": str(topology) if topology is not None else None,
                    "dead_letters": pol.dead_letters()}
        print_validation(file, check)
        return
    topo = load_topology(topology) if topology is not None else None
    pol = validate_policy(file, topo)
    fallback = ("strict (unmatched topics refused)" if pol.strict else
                f"default {pol.default.dr_mode}" if pol.default else
                "no default (unmatched topics refused)")
    checked = f", checked against {topology}" if topology is not None else ""
    out.print(f"[green]{escape(str(file))}: valid[/] — {len(pol.rules)} rule(s), {fallback}"
              f"{escape(checked)}", highlight=False, soft_wrap=True)


@policy_app.command("schema")
def policy_schema() -> None:
    """Print the policy file's JSON schema (committed as policies/schema.json)."""
    from proxy.policy import Policy
    sys.stdout.write(json.dumps(Policy.model_json_schema(), indent=2) + "\n")
