"""dr/charts.py: each chart is a PNG of the expected size, whatever the data's shape."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

from dr.charts import DPI, drill_timeline

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
