"""Calibration: the model's time to last peer against emulation's, on one topology.

:func:`calibrate` runs the emulation (real processes, shaped links) and the model (same
topology, same checkpoint size) and returns both times and their ratio; ``shardnet simulate
calibrate TOPOLOGY`` prints them and exits non-zero when the model is more than
``tolerance`` (default 20 %) away. The model stands in for topologies too large to emulate, so
this is the check that keeps it honest; run it on topologies small enough to emulate
(``simulations/topologies/calibration.toml``: 1 origin, 2 relays, 6 peers at 50-100 Mb/s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from p2p.errors import ConfigError
from simulations import report
from simulations.emulate import EmulateOptions
from simulations.emulate import run as run_emulation
from simulations.model import Model
from simulations.topology import Topology, scaled


def calibrate(
    topo: Topology, out: Path, scale: float | None = None, tolerance: float = 0.2
) -> dict[str, Any]:
    """Emulate and model ``topo`` (checkpoint scaled by ``scale``); reports go under ``out``.

    Returns:
        ``{"emulate_s", "model_s", "ratio", "bound_s", "emulate_vs_bound", "ok"}`` where the
        times are the time to the last honest peer of version 0, seconds, ``ratio`` is model /
        emulation, and ``ok`` says ``|ratio - 1| <= tolerance`` and the emulation finished.

    Raises:
        ConfigError: ``scale`` or ``tolerance`` not > 0 (before anything runs).
    """
    if not tolerance > 0:
        raise ConfigError("tolerance", f"must be > 0, not {tolerance:g}")
    s = scale if scale is not None else topo.spec.emulation.scale
    em = run_emulation(topo, EmulateOptions(scale=s))
    report.write(em, out / "emulate")
    mo = Model(scaled(topo, s)).run()
    report.write(mo, out / "model")
    report.compare(out / "emulate", out / "model", out)
    e = em["run"]["time_to_last_peer_s"].get("0")
    m = mo["run"]["time_to_last_peer_s"].get("0")
    ratio = m / e if e and m else None
    bound = em["run"]["bound_s"]
    return {
        "emulate_s": e,
        "model_s": m,
        "ratio": ratio,
        "bound_s": bound,
        "emulate_vs_bound": e / bound if e else None,
        "failure": em["run"].get("failure"),
        "ok": ratio is not None and abs(ratio - 1) <= tolerance and not em["run"].get("failure"),
    }
