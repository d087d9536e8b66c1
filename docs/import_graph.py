"""Draw crossdc's import graph by layer: `python docs/import_graph.py` writes
docs/import-graph.dot and, where Graphviz's `dot` is installed, docs/import-graph.svg/.png.

Nodes are the layers' units (the kernel, the clients, each component, each part of the roof);
an arrow A → B means some module of A imports some module of B. Every arrow must point down
(the import-linter layers contract in pyproject.toml enforces it; this is the picture of it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

HERE = Path(__file__).resolve().parent

# (unit, layer) from the top of the house down; the first prefix that matches wins.
UNITS: list[tuple[str, str, int]] = [
    ("dr.cli", "dr.cli (the dr command)", 0),
    ("dr.controller", "dr.controller", 0),
    ("dr.reconcile", "dr.reconcile (Spark job)", 0),
    ("dr.stack", "dr.stack (local stack)", 0),
    ("dr.status", "dr.status", 0),
    ("dr.exits", "dr.exits", 0),
    ("dr", "dr (errors)", 0),
    ("proxy", "proxy", 1),
    ("mirror", "mirror", 1),
    ("crossdc.clients", "crossdc.clients", 2),
    ("crossdc", "crossdc (kernel)", 3),
]
LAYER_NAMES = ["roof: dr", "components", "clients", "kernel"]


def unit_of(module: str) -> tuple[str, int] | None:
    for prefix, label, layer in UNITS:
        if module == prefix or module.startswith(prefix + "."):
            return label, layer
    return None


def edges() -> set[tuple[str, str]]:
    graph = grimp.build_graph("crossdc", "dr", "proxy", "mirror")
    out: set[tuple[str, str]] = set()
    for module in graph.modules:
        src = unit_of(module)
        if src is None:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            dst = unit_of(imported)
            if dst is not None and dst[0] != src[0]:
                out.add((src[0], dst[0]))
    return out


def layer(label: str) -> int:
    return next(lay for _, lab, lay in UNITS if lab == label)


def to_dot(es: set[tuple[str, str]]) -> str:
    lines = ["digraph crossdc {", '  rankdir=TB; node [shape=box, fontname="Helvetica"];',
             '  edge [color="#555555"];']
    for i, name in enumerate(LAYER_NAMES):
        labels = sorted({lab for _, lab, lay in UNITS if lay == i})
        lines.append(f'  subgraph cluster_{i} {{ label="{name}"; style=rounded; color="#999999";')
        lines.extend(f'    "{lab}";' for lab in labels)
        lines.append("  }")
    for a, b in sorted(es):
        up = layer(b) < layer(a)
        colour = ' [color=red, penwidth=2, label="UP"]' if up else ""
        lines.append(f'  "{a}" -> "{b}"{colour};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    es = edges()
    dot_file = HERE / "import-graph.dot"
    dot_file.write_text(to_dot(es), encoding="utf-8")
    upward = [(a, b) for a, b in es if layer(b) < layer(a)]
    for a, b in sorted(upward):
        print(f"upward arrow: {a} -> {b}", file=sys.stderr)
    dot = shutil.which("dot")
    if dot:
        for fmt in ("svg", "png"):
            subprocess.run([dot, f"-T{fmt}", "-Gdpi=110", str(dot_file), "-o",
                            str(HERE / f"import-graph.{fmt}")], check=True)
    print(f"{len(es)} arrows between {len(UNITS)} units, {len(upward)} upward; "
          f"written {dot_file}" + (" (+ .svg, .png)" if dot else " (no Graphviz: .dot only)"))
    return 1 if upward else 0


if __name__ == "__main__":
    raise SystemExit(main())
