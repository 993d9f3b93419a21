"""Calibration: the model's time to last peer is within 20 % of emulation's (slow: real
processes moving a quarter of a GiB over shaped links in network namespaces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations import netns
from simulations.calibrate import calibrate
from simulations.topology import load

TOPOS = Path(__file__).parents[2] / "simulations" / "topologies"
OK, WHY = netns.available()


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_model_within_20_percent_of_emulation(tmp_path: Path) -> None:
    res = calibrate(load(TOPOS / "calibration.toml"), tmp_path, scale=0.25)
    assert res["failure"] is None
    assert res["ok"], res
    assert (tmp_path / "compare.md").exists()
