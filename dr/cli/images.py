"""`dr images`: the container images crossdc builds here (dr/stack/images.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from dr.cli._common import Exit, err, out, paths_for

__all__ = ["compose_app", "images_app"]



class ImageName(StrEnum):
    """= dr.stack.images.IMAGES' names (a unit test holds them together)."""

    base = "base"
    kafka = "kafka"
    consul = "consul"
    crossdc = "crossdc"
    prometheus = "prometheus"
    reconcile = "reconcile"

images_app = typer.Typer(help="Container images built here: the Debian base, Kafka, Consul, "
                         "crossdc (no image registry needed).", no_args_is_help=True)


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


@images_app.command("build")
def images_build(
    names: Annotated[list[ImageName] | None, typer.Option(
        "--image", "-i", help="An image to build (repeatable) [default: all]; the base is "
        "made first whenever it is missing.", show_default=False)] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Rebuild even when the inputs are unchanged.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Build the images (cached: an image is rebuilt only when its inputs changed, their hash
    being the label io.crossdc.inputs). Needs a Docker engine: compose/docker/engine.sh."""
    from dr.stack.images import build_images
    paths = paths_for(None)
    with err.status("building images") as status:
        results = build_images(paths, [n.value for n in names] if names else None, force=force,
                               progress=status.update)
    if as_json:
        sys.stdout.write(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        return
    t = Table(title="images", title_justify="left", header_style="bold")
    for col in ("image", "tag", "", "seconds", "size"):
        t.add_column(col)
    for r in results:
        t.add_row(r.name, r.tag, "[green]built[/]" if r.built else "unchanged",
                  f"{r.seconds:.1f}" if r.built else "-", _mb(r.size_bytes))
    out.print(t)


@images_app.command("list")
def images_list(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The crossdc images the engine holds, their size and inputs hash."""
    from dr.stack.images import image_states, require_engine
    require_engine()
    states = image_states()
    if as_json:
        sys.stdout.write(json.dumps([asdict(s) for s in states], indent=2) + "\n")
        return
    t = Table(title="images", title_justify="left", header_style="bold")
    for col in ("image", "tag", "present", "size", "inputs"):
        t.add_column(col)
    for s in states:
        t.add_row(s.name, s.tag, "[green]yes[/]" if s.present else "[red]no[/]",
                  _mb(s.size_bytes) if s.present else "-", (s.inputs or "-")[:12])
    out.print(t)


compose_app = typer.Typer(help="The compose deployment's files (dr/stack/compose.py).",
                          no_args_is_help=True)


@compose_app.command("write")
def compose_write(
    check: Annotated[bool, typer.Option(
        "--check", help="Only say whether the committed files are current (exit 1 if not).")
                     ] = False,
) -> None:
    """Write compose/docker-compose.yml, compose/prometheus.docker.yml and each datacenter's
    topology view (compose/topology.docker.<dc>.yaml) from policies/topology.docker.yaml
    (paths relative to compose/)."""
    from crossdc.topology import load_topology
    from dr.stack.compose import COMPOSE_FILE, DOCKER_TOPOLOGY, committed_compose_files
    files = {COMPOSE_FILE.with_name(name): text for name, text in
             committed_compose_files(load_topology(DOCKER_TOPOLOGY)).items()}
    stale = [p for p, text in files.items()
             if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if check:
        if stale:
            err.print(f"[red]not current[/]: {', '.join(str(p) for p in stale)} (run `dr "
                      "compose write`)")
            raise Exit(1)
        out.print("current")
        return
    for p, text in files.items():
        p.write_text(text, encoding="utf-8")
    out.print(f"wrote {', '.join(str(p) for p in files)}")
