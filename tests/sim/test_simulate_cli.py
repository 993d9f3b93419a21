"""``shardnet simulate``: an unusable option is one line and exit 2, before any run (a fresh
user's trial found tracebacks after a whole model run for an ``--out`` that was a file, a
traceback for a missing ``compare`` directory, and ``emulate --scale 0`` or ``-1`` run)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardnet.cli import app

TOPOLOGIES = Path(__file__).parents[2] / "simulations" / "topologies"


def _invoke(args: list[str]) -> tuple[int, str]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:  # the command points the root logger at the runner's stream, closed afterwards
        result = CliRunner().invoke(app, args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["emulate", "calibration.toml", "--scale", "0"], "--scale: must be > 0, not 0"),
        (["emulate", "calibration.toml", "--scale", "-1"], "--scale: must be > 0, not -1"),
        (["emulate", "calibration.toml", "--timeout", "0"], "--timeout: must be > 0, not 0"),
        (["calibrate", "calibration.toml", "--scale", "0"], "--scale: must be > 0, not 0"),
        (["model", "bound.toml", "--out", "{file}"], "--out: cannot create {file}"),
        (["model", "bound.toml", "--compare", "{missing}"], "--compare: {missing} is not a"),
        (["compare", "{missing}", "{missing}"], "{missing} is not a simulation report"),
        (["model", "bound.toml", "--commit", "copy"], "--commit must be chain or materialize"),
        # model's overrides are named as options (--peers 0 read "nodes[2].count: bound.toml")
        (["model", "bound.toml", "--peers", "0"], "--peers: must be > 0, not 0"),
        (["model", "bound.toml", "--time-step", "-1"], "--time-step: must be > 0, not -1"),
        (["model", "bound.toml", "--shard-size", "0"], "--shard-size: must be > 0, not 0"),
        (["model", "bound.toml", "--scale", "0"], "--scale: must be > 0, not 0"),
        # a topology's field is named by its path in the file, not as an option (it read
        # "--nodes[1]: typo.toml: Extra inputs are not permitted")
        (["model", "{typo}"], "error: nodes[1].up_mbsp: {typo}: Extra inputs are not permitted"),
    ],
)
def test_an_unusable_option_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], says: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    typo = tmp_path / "typo.toml"
    typo.write_text(
        'name = "typo"\n[checkpoint]\nsize_bytes = 1000000\n'
        '[[nodes]]\nname = "o"\nrole = "origin"\nup_mbps = 100\n'
        '[[nodes]]\nname = "p"\nrole = "peer"\nup_mbsp = 100\nupstreams = ["o"]\n'
    )
    names = {"file": str(afile), "missing": str(tmp_path / "nonexist"), "typo": str(typo)}
    argv = ["simulate"] + [
        str(TOPOLOGIES / a) if a.endswith(".toml") else a.format(**names) for a in args
    ]
    code, output = _invoke(argv)
    assert code == 2, output
    assert says.format(**names) in output, output
    assert "Traceback" not in output


def test_model_scale_shrinks_the_checkpoint_as_emulate_does(tmp_path: Path) -> None:
    """``simulate model --scale`` runs the topology ``emulate --scale`` would (the same
    :func:`simulations.topology.scaled`), so the two line up, and the report says so."""
    import json

    out = tmp_path / "report"
    topology = str(TOPOLOGIES / "calibration.toml")
    code, output = _invoke(["simulate", "model", topology, "--scale", "0.25", "--out", str(out)])
    assert code == 0, output
    ck = json.loads((out / "summary.json").read_text())["checkpoint"]
    assert ck["scale"] == 0.25
    assert ck["size_bytes"] == 1_073_741_824 // 4


@pytest.mark.parametrize(("signum", "code"), [(15, 143), (2, 130)])
def test_interrupted_emulation_or_calibration_exits_128_plus_signal(signum: int, code: int) -> None:
    """``emulate`` and ``calibrate`` both end an interrupted emulation the same way (calibrate
    exited 130 for SIGTERM too)."""
    import typer

    from shardnet.simulate_cli import _interrupted
    from simulations.emulate import Interrupted

    with pytest.raises(typer.Exit) as info:
        _interrupted(Interrupted(signum) if signum != 2 else KeyboardInterrupt())
    assert info.value.exit_code == code
