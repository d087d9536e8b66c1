"""The drill file users copy (policies/drill.yaml) and the drill's plan checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossdc.errors import ConfigError
from dr.drill.run import DrillConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_drill_file_loads_with_its_thresholds() -> None:
    cfg = load_config(ROOT / "policies" / "drill.yaml")
    assert cfg.thresholds.max_rto_s == 15
    assert cfg.thresholds.max_rpo_records == 0
    assert cfg.failback


def test_a_hook_for_an_unknown_scenario_is_refused_naming_file_and_field(
        tmp_path: Path) -> None:
    f = tmp_path / "drill.yaml"
    f.write_text("thresholds:\n  max_rto_s: 10\nhooks:\n  datacenter-fire:\n"
                 "    inject: 'true'\n    heal: 'true'\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    text = str(info.value)
    assert "drill.yaml:" in text
    assert "hooks.datacenter-fire" in text
    assert "primary-outage" in text


def test_a_negative_threshold_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "drill.yaml"
    f.write_text("thresholds:\n  max_rto_s: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert "max_rto_s" in str(info.value)


def test_defaults_without_a_file() -> None:
    assert load_config(None) == DrillConfig()
