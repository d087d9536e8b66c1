"""dr/charts.py: each chart is a PNG of the expected size, whatever the data's shape."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dr.charts import DPI, BarPanel, bars, drill_timeline, lines
from dr.stack.paths import REPO_ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the IHDR chunk; asserts the file is a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def test_drill_timeline_is_a_12x5_inch_png(tmp_path: Path) -> None:
    east = [(float(t), 0.0 if 30 <= t < 38 else 900.0) for t in range(121)]
    west = [(float(t), 400.0 if t < 38 else 900.0) for t in range(121)]
    out = drill_timeline(
        tmp_path / "sub" / "drill.png", series={"east": east, "west": west},
        markers=[(30.0, "fault"), (31.0, "detection"), (31.5, "fence"), (32.0, "promote"),
                 (38.0, "DNS switch"), (95.0, "heal")],
        spans=[(30.0, 38.0, "outage")], title="east region loss")
    assert out == tmp_path / "sub" / "drill.png"
    assert png_size(out) == (12 * DPI, 5 * DPI)


def test_drill_timeline_draws_each_seconds_count_over_that_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a count per whole second, at its middle: a step over the second, never a slope from
    # the middle of the second before (which drew writes falling ahead of the fault)
    from matplotlib.axes import Axes
    seen: list[str] = []
    plot = Axes.plot

    def spy(self: Axes, *args: object, **kw: object) -> object:
        seen.append(str(kw.get("drawstyle")))
        return plot(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Axes, "plot", spy)
    drill_timeline(tmp_path / "steps.png", series={"east": [(0.5, 9.0), (1.5, 0.0)]},
                   markers=[(1.1, "fault")], title="steps")
    assert seen == ["steps-mid"]


def test_drill_timeline_survives_empty_and_crowded_inputs(tmp_path: Path) -> None:
    # no series at all, a series without points, twenty markers at the same second, a marker
    # at the far right edge, a zero-length span
    crowd = [(50.0, f"event {i}") for i in range(20)] + [(120.0, "the very last one")]
    for name, series in (("none", {}), ("empty", {"east": []}),
                         ("one", {"east": [(3.0, 5.0)]})):
        out = drill_timeline(tmp_path / f"{name}.png", series=series, markers=crowd,
                             spans=[(50.0, 50.0, "blink")], title=name)
        assert png_size(out) == (12 * DPI, 5 * DPI)
    out = drill_timeline(tmp_path / "bare.png", series={}, markers=[], title="nothing")
    assert png_size(out) == (12 * DPI, 5 * DPI)


def test_importing_charts_does_not_load_matplotlib() -> None:
    code = "import sys, dr.charts; assert 'matplotlib' not in sys.modules, 'loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _bench(name: str) -> ModuleType:
    """A bench script as a module (they are scripts, not a package), without running it."""
    path = REPO_ROOT / "bench" / name / "run.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}_run", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_bench_charts_are_pngs(tmp_path: Path) -> None:
    mirror = _bench("mirror").chart(
        {"mm2": {"rps": 60_557, "p99_ms": 223}, "crossdc": {"rps": 94_842, "p99_ms": 38}},
        tmp_path / "mirror.png")
    rows = [{"size": size, "mode": mode, "rps": rps}
            for size in (100, 1024) for mode, rps in (("direct", 59_000), ("batch", 52_000))]
    pace = {"direct": {"rate": 300, "p50_ms": 3.4, "p90_ms": 5.0, "p99_ms": 6.4},
            "proxy": {"rate": 300, "p50_ms": 5.0, "p90_ms": 9.0, "p99_ms": 24.7}}
    caps = {n: {"label": f"{n} worker(s)",
                "steps": [{"rate": r, "p99_ms": r / 20 * n} for r in (400, 500, 625)]}
            for n in (1, 2)}
    proxy_charts = _bench("proxy").charts(rows, pace, caps, tmp_path)
    assert [p.name for p in proxy_charts] == ["proxy.png", "proxy-paced.png",
                                              "proxy-capacity.png"]
    recon = _bench("reconcile").chart(
        [{"records_per_region": n * 1_000_000, "spark_s": 50 + 20 * n, "python_s": 25 * n}
         for n in (1, 2, 3)], tmp_path / "reconcile.png")
    for out in (mirror, *proxy_charts, recon):
        width, height = png_size(out)
        assert width > 600, (out, width)
        assert height > 300, (out, height)


def test_bars_and_lines_handle_gaps_and_nothing(tmp_path: Path) -> None:
    gaps = BarPanel("with a gap", ["a", "b"], {"x": [1.0, None], "y": [None, None]})
    assert png_size(bars(tmp_path / "gaps.png", [gaps], horizontal=True))[0] == 10 * DPI
    assert png_size(bars(tmp_path / "none.png", []))[1] > 0
    assert png_size(lines(tmp_path / "lines.png", series={"a": []}, title="t", xlabel="x",
                          ylabel="y", value_format="{:.0f}")) == (8 * DPI, int(4.5 * DPI))


def test_lines_on_a_log_axis_with_a_limit(tmp_path: Path) -> None:
    """The proxy capacity chart: p99 from 9 ms to 4,434 ms on one axis (linear, the 1-worker
    line was a flat line at zero), with the 50 ms capacity limit drawn."""
    from matplotlib.figure import Figure

    opened: list[Any] = []
    real = Figure.savefig

    def keep(fig: Figure, *a: Any, **kw: Any) -> None:
        opened.append(fig)
        real(fig, *a, **kw)

    Figure.savefig = keep  # type: ignore[method-assign,assignment]
    try:
        path = lines(tmp_path / "cap.png", series={"1": [(400, 9.0), (700, 53.0)],
                                                   "2": [(200, 12.0), (400, 4434.0)]},
                     title="t", xlabel="x", ylabel="y", log_y=True, limit=(50.0, "limit"))
    finally:
        Figure.savefig = real  # type: ignore[method-assign]
    assert png_size(path)[0] > 0
    ax = opened[0].axes[0]
    assert ax.get_yscale() == "log"
    assert any(list(ln.get_ydata()) == [50.0, 50.0] for ln in ax.get_lines())
