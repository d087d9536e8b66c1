"""Every chart crossdc draws: PNG files written by matplotlib's Agg renderer.

Three functions, no state:

- `drill_timeline`: a failover drill over time (writes/s per series, labelled event lines,
  shaded outage bands);
- `bars`: one or more panels of grouped bars (bench results, reconciliation counts);
- `lines`: y against x, one line per series (bench scaling curves).

matplotlib is imported inside the functions, never at module import, so importing this module
(the reconciliation report does) costs nothing until a chart is drawn. Figures are built with
the object API (`matplotlib.figure.Figure`), not pyplot: no global figure registry, no GUI
backend, safe in any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["drill_timeline"]

DPI = 110
# Tableau 10: distinguishable, colour-blind friendlier than the default cycle's order.
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b",
           "#ff9da6", "#9d755d", "#79706e")
MAX_LABEL_ROWS = 6
MARKER_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#7f7f7f", "#bcbd22", "#ff7f0e")


def _figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, facecolor="white")
    return path


def _style(ax: Axes) -> None:
    ax.grid(True, axis="y", color="#dddddd", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def drill_timeline(path: Path, *, series: Mapping[str, Sequence[tuple[float, float]]],
                   markers: Sequence[tuple[float, str]], title: str,
                   spans: Sequence[tuple[float, float, str]] = (),
                   ylabel: str = "acknowledged writes / s") -> Path:
    """A drill's timeline as PNG: one line per series (e.g. per region, or "east ordered"),
    x = seconds since the drill started, y = writes per second; each marker a labelled vertical
    line (fault, detection, fence, promote, DNS switch, heal, failback...); each span a shaded
    band (e.g. the outage from fault to recovery). Returns path."""
    fig = _figure(12, 5)
    ax = fig.add_subplot()
    _style(ax)

    xs = [x for pts in series.values() for x, _ in pts] + [x for x, _ in markers]
    xs += [v for a, b, _ in spans for v in (a, b)]
    x_lo, x_hi = (min(0.0, *xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    ys = [y for pts in series.values() for _, y in pts]
    y_top = max(ys, default=0.0) or 1.0

    for i, (name, pts) in enumerate(series.items()):
        ordered = sorted(pts)
        ax.plot([x for x, _ in ordered], [y for _, y in ordered], label=name,
                color=PALETTE[i % len(PALETTE)], linewidth=1.8)
    if not ys:
        ax.text(0.5, 0.5, "no writes recorded", transform=ax.transAxes, ha="center",
                va="center", color="#888888", fontsize=12)
    for i, (start, end, label) in enumerate(spans):
        ax.axvspan(start, end, color=("#e45756", "#eeca3b", "#72b7b2")[i % 3], alpha=0.15,
                   label=label, linewidth=0)

    # Marker labels sit in a band at the top of the axes, staggered onto rows so that labels
    # of close events never overlap: each label takes the first row whose last label ends
    # before this one starts (widths estimated from the character count at 8.5 pt). Past
    # MAX_LABEL_ROWS rows, the remaining events are named in the legend instead.
    axes_px = 12 * DPI * 0.86
    char_px = 8.5 / 72 * DPI * 0.62
    span_x = x_hi - x_lo
    row_end: list[float] = []
    placed: list[tuple[float, str, int, bool]] = []
    for x, label in sorted(markers, key=lambda m: m[0]):
        text = f"{label} {x:.1f}".rstrip("0").rstrip(".") + "s"
        width = (len(text) + 2) * char_px / axes_px * span_x
        flip = x + width > x_hi  # near the right edge: the label extends to the left
        left, right = (x - width, x) if flip else (x, x + width)
        row = next((r for r, end in enumerate(row_end) if left > end), len(row_end))
        if row == MAX_LABEL_ROWS:  # a crowd of events: the rest are named in the legend
            placed.append((x, text, -1, flip))
            continue
        if row == len(row_end):
            row_end.append(right)
        else:
            row_end[row] = right
        placed.append((x, text, row, flip))
    rows = max(len(row_end), 1)
    row_h = 0.075  # of the axes height
    band = row_h * rows + 0.03 if markers else 0.0
    ax.set_ylim(0, y_top * 1.05 / (1 - band))
    ax.set_xlim(x_lo, x_hi + span_x * 0.01)

    for i, (x, text, row, flip) in enumerate(placed):
        color = MARKER_COLORS[i % len(MARKER_COLORS)]
        if row < 0:
            ax.axvline(x, color=color, linestyle="--", linewidth=1.2, label=text)
            continue
        ax.axvline(x, color=color, linestyle="--", linewidth=1.2)
        ax.annotate(text, xy=(x, 1 - row_h * (row + 0.5)), xycoords=("data", "axes fraction"),
                    xytext=(-3 if flip else 3, 0), textcoords="offset points",
                    ha="right" if flip else "left", va="center", fontsize=8.5, color=color,
                    fontweight="bold",
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white",
                          "edgecolor": "none", "alpha": 0.85})

    ax.set_title(title, fontsize=12, fontweight="bold", loc="left")
    ax.set_xlabel("seconds since the drill started")
    ax.set_ylabel(ylabel)
    if series or spans or any(row < 0 for _, _, row, _ in placed):
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False)
    return _save(fig, path)

