"""Every chart crossdc draws: PNG files written by matplotlib's Agg renderer.

Three functions, no state:

- `drill_timeline`: a failover drill over time (writes/s per series, labelled event lines,
  shaded outage bands);
- `bars`: one or more panels of grouped bars (bench results, reconciliation counts);
- `lines`: y against x, one line per series (bench scaling curves).

matplotlib is imported inside the functions, never at module import, so importing this module
(the reconciliation report does) costs nothing until a chart is drawn; it is the `charts`
extra (`pip install 'crossdc[charts]'`), and drawing without it says so (`MissingExtra`).
Figures are built with the object API (`matplotlib.figure.Figure`), not pyplot: no global
figure registry, no GUI backend, safe in any thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from crossdc.extras import require

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["BarPanel", "bars", "drill_timeline", "lines"]

DPI = 110
# Tableau 10: distinguishable, colour-blind friendlier than the default cycle's order.
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b",
           "#ff9da6", "#9d755d", "#79706e")
MAX_LABEL_ROWS = 6
MARKER_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#7f7f7f", "#bcbd22", "#ff7f0e")


def _figure(width_in: float, height_in: float) -> Figure:
    require("charts", "drawing a chart")
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, facecolor="white")
    return path


def _number(v: float, _pos: object = None) -> str:
    """Tick labels: 100,000 rather than 100000 or 1e5; 2.5 stays 2.5."""
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.6g}"


def _format(fmt: str | Callable[[float], str], v: float) -> str:
    return fmt(v) if callable(fmt) else fmt.format(v)


def _style(ax: Axes) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(_number))
    ax.yaxis.set_major_formatter(FuncFormatter(_number))
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
        # Each point is one second's count at that second's middle: drawn as a step over
        # the whole second, so a fall to zero shows at the second it happened (a line
        # between the middles started falling half a second before it, ahead of the fault)
        ax.plot([x for x, _ in ordered], [y for _, y in ordered], label=name,
                color=PALETTE[i % len(PALETTE)], linewidth=1.8, drawstyle="steps-mid")
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



@dataclass(frozen=True)
class BarPanel:
    """One panel of grouped bars: for each group (a tick label) one bar per series (a legend
    entry). A value may be None: no bar (e.g. a contender not run at that size)."""

    title: str
    groups: Sequence[str]
    series: Mapping[str, Sequence[float | None]]
    ylabel: str = ""
    value_format: str | Callable[[float], str] = "{:,.0f}"


def bars(path: Path, panels: Sequence[BarPanel], *, title: str = "",
         horizontal: bool = False, colors: Mapping[str, str] | None = None,
         columns: int = 3) -> Path:
    """Panels of grouped bars as PNG, each bar labelled with its value (`value_format`).

    Vertical bars by default (groups along x), `horizontal` for long group labels (groups
    down the y axis, read top to bottom). Panels fill rows of at most `columns`. A series
    keeps its colour across panels (`colors` by series name, else the palette in order of
    first appearance). Returns path."""
    names = list(dict.fromkeys(n for p in panels for n in p.series))
    color = {n: (colors or {}).get(n, PALETTE[i % len(PALETTE)]) for i, n in enumerate(names)}
    cols = max(1, min(columns, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    if horizontal:
        tallest = max((len(p.groups) * max(len(p.series), 1) for p in panels), default=1)
        cell_h = max(1.6, 0.28 * tallest + 1.0)
    else:
        cell_h = 3.3
    fig = _figure(min(12.0, 4.2 * cols + 1.5) if not horizontal else 10.0, cell_h * rows + 0.4)
    if title:
        fig.suptitle(title, fontsize=12, fontweight="bold", x=0.01, ha="left")
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        _bar_panel(ax, panel, color, horizontal)
    if not panels:
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "nothing to plot", ha="center", va="center", color="#888888")
    return _save(fig, path)


def _bar_panel(ax: Axes, panel: BarPanel, color: Mapping[str, str], horizontal: bool) -> None:
    _style(ax)
    if horizontal:
        ax.grid(True, axis="x", color="#dddddd", linewidth=0.8)
        ax.grid(False, axis="y")
    ax.set_title(panel.title, fontsize=10.5, loc="left")
    n = max(len(panel.series), 1)
    width = 0.8 / n
    top = max((v for vals in panel.series.values() for v in vals if v is not None),
              default=0.0)
    positions = list(range(len(panel.groups)))
    for j, (name, vals) in enumerate(panel.series.items()):
        at = [p - 0.4 + width * (j + 0.5) for p in positions]
        pairs = [(a, v) for a, v in zip(at, vals, strict=False) if v is not None]
        if not pairs:
            continue
        xs, vs = [a for a, _ in pairs], [float(v) for _, v in pairs]
        drawn = (ax.barh(xs, vs, height=width * 0.92, color=color[name], label=name)
                 if horizontal else
                 ax.bar(xs, vs, width=width * 0.92, color=color[name], label=name))
        ax.bar_label(drawn, labels=[_format(panel.value_format, v) for v in vs], padding=2,
                     fontsize=8)
    values = [v for vals in panel.series.values() for v in vals if v is not None]
    if values and all(float(v).is_integer() for v in values):  # counts: no 0.2 ticks
        from matplotlib.ticker import MaxNLocator

        (ax.xaxis if horizontal else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
    legend = len(panel.series) > 1 or (bool(panel.series) and len(panel.groups) <= 1)
    # Headroom above the tallest bar for its value label and for the legend, which sits in
    # one row across the top of the panel, clear of the bars.
    head = 1.15 + (0.12 if legend and not horizontal else 0.0)
    if horizontal:
        ax.set_yticks(positions, list(panel.groups))
        ax.xaxis.set_ticks_position("bottom")
        ax.invert_yaxis()
        ax.set_xlim(0, (top or 1.0) * 1.25)
        ax.set_xlabel(panel.ylabel)
        ax.tick_params(axis="y", length=0)
    else:
        crowded = sum(len(g) + 2 for g in panel.groups) > 60  # ~ characters across a panel
        ax.set_xticks(positions, list(panel.groups), rotation=45 if crowded else 0,
                      ha="right" if crowded else "center")
        ax.set_ylim(0, (top or 1.0) * head)
        ax.set_ylabel(panel.ylabel)
        ax.tick_params(axis="x", length=0)
    if legend:
        wide = sum(len(str(n)) + 4 for n in panel.series) > 60  # ~ characters across
        if horizontal or len(panel.series) > 5 or wide:
            # under the axis: a long bar never runs under it, and more names (or longer
            # ones) than one row holds never run over the bars or the next panel
            ax.legend(fontsize=8, frameon=False, loc="upper center",
                      bbox_to_anchor=(0.5, -0.3 if horizontal else -0.12),
                      ncols=min(len(panel.series), 3))
        else:
            ax.legend(fontsize=8, frameon=False, loc="upper left",
                      ncols=min(len(panel.series), 5), handlelength=1.2, columnspacing=1.0)


def lines(path: Path, *, series: Mapping[str, Sequence[tuple[float, float]]], title: str,
          xlabel: str, ylabel: str, value_format: str | None = None,
          colors: Mapping[str, str] | None = None, log_y: bool = False,
          limit: tuple[float, str] | None = None) -> Path:
    """y against x as PNG (8x4.5 in), one line with point markers per series; with
    `value_format` (e.g. "{:.0f} s") each point is labelled with its y; `log_y` for values
    spanning decades; `limit` (y, label) draws a dashed threshold. Returns path."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    _style(ax)
    ax.grid(True, axis="x", color="#eeeeee", linewidth=0.8)
    for i, (name, pts) in enumerate(series.items()):
        ordered = sorted(pts)
        c = (colors or {}).get(name, PALETTE[i % len(PALETTE)])
        xs, ys = [x for x, _ in ordered], [y for _, y in ordered]
        ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.8, color=c, label=name)
        if value_format:
            for x, y in ordered:
                # above-left of the point (the line arrives from the left, usually below);
                # below-right when another series passes above at the same x
                under = any(y < oy for other, ops in series.items() if other != name
                            for ox, oy in ops if ox == x)
                ax.annotate(value_format.format(y), (x, y), xytext=(5, -6) if under else (-5, 5),
                            ha="left" if under else "right", va="top" if under else "bottom",
                            textcoords="offset points", fontsize=8, color=c,
                            bbox={"boxstyle": "round,pad=0.1", "facecolor": "white",
                                  "edgecolor": "none", "alpha": 0.8})
    ax.set_xlim(left=0)
    if log_y:
        from matplotlib.ticker import FuncFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_number))
    else:
        ax.set_ylim(bottom=0)
    if limit is not None:
        ax.axhline(limit[0], color="#999999", linestyle="--", linewidth=1)
        ax.annotate(limit[1], (0, limit[0]), xytext=(4, 3), textcoords="offset points",
                    fontsize=8, color="#666666", xycoords=("axes fraction", "data"))
    ax.margins(x=0.08, y=0.12)
    ax.set_title(title, fontsize=12, fontweight="bold", loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if series:
        ax.legend(fontsize=9, frameon=False, loc="upper left")
    return _save(fig, path)
