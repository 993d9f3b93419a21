"""Reports stay readable: bounded Markdown, percentile bands capped at 1, plots written."""

from __future__ import annotations

from pathlib import Path

from simulations import report
from simulations.model import Model
from simulations.summary import progress_bands
from simulations.topology import parse
from tests.sim.test_model import _small


def test_progress_bands_are_ordered_and_never_above_one() -> None:
    # peer a: 4 shards, one verified twice (resumed); peer b: 2 of 4
    bands = progress_bands([[1.0, 2.0, 3.0, 3.5, 4.0], [2.0, 6.0], []], 0.0, 4)
    assert bands["peers"] == 2
    q = bands["quantiles"]
    assert len(q["50"]) == len(bands["t_s"]) == 101
    assert bands["t_s"][-1] == 6.0
    for k in range(len(bands["t_s"])):
        assert 0.0 <= q["0"][k] <= q["10"][k] <= q["50"][k] <= q["90"][k] <= q["100"][k] <= 1.0
    assert q["100"][-1] == 1.0
    assert q["0"][-1] == 0.5
    assert progress_bands([[], []], 0.0, 4) == {}


def test_markdown_is_bounded_and_plots_are_written(tmp_path: Path) -> None:
    data = _small()
    data["nodes"][2]["count"] = 60
    s = Model(parse(data)).run()
    md = report.markdown(s)
    assert len(md.splitlines()) < 50
    assert "| version | peers committed | median s | p90 s | p99 s |" in md
    assert "| 0 | 60/60 |" in md
    assert "Slowest 10 (peer, version) of 60 honest peers:" in md
    pct = s["run"]["peer_percentiles_s"]["0"]
    assert pct["p50"] <= pct["p90"] <= pct["p99"] <= pct["max"]
    assert pct["max"] == s["run"]["time_to_last_peer_s"]["0"]
    assert s["progress"]["peers"] == 60
    report.write(s, tmp_path)
    for png in ("cdf.png", "bytes_per_tier.png", "timeline.png"):
        assert (tmp_path / png).stat().st_size > 1000
