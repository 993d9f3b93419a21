"""``shardnet simulate model|emulate|calibrate|compare|cleanup``: simulating topologies."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from p2p.errors import ConfigError, ShardnetError
from shardnet.errors import fail

Opt = typer.Option

simulate_app = typer.Typer(
    help="Simulate topologies: emulate (real processes, shaped links) or model (virtual time)."
)
TopologyArg = Annotated[Path, typer.Argument(help="Topology TOML file (simulations/topologies/).")]
OutOpt = Annotated[
    Path | None, Opt("--out", help="Report directory (default: sim-reports/<mode>-<name>).")
]
CompareOpt = Annotated[
    Path | None, Opt("--compare", help="Another report directory to put side by side.")
]


def _report_dir(out: Path) -> Path:
    """``out``, created and writable, checked before a run (one line and exit 2 if not)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(ConfigError("out", f"cannot create {out}: {exc.strerror or exc}"))
    if not os.access(out, os.W_OK | os.X_OK):
        fail(ConfigError("out", f"{out} is not writable"))
    return out


def _check_compare(compare: Path | None) -> None:
    """A ``--compare`` report must load before a run spends its time (exit 2 if not)."""
    from simulations import report

    if compare is not None:
        try:
            report.load(compare)
        except report.ReportError as exc:
            fail(ConfigError("compare", str(exc)))


def _interrupted(exc: KeyboardInterrupt) -> NoReturn:
    """An emulation ended by Ctrl-C or SIGTERM (:class:`simulations.emulate.Interrupted`)
    after its cleanup: say so and exit 128 + the signal's number (130, 143)."""
    typer.echo("shardnet: interrupted; processes and namespaces removed", err=True)
    raise typer.Exit(128 + getattr(exc, "signum", signal.SIGINT)) from None


def _sim_finish(summary: dict[str, Any], out: Path, compare: Path | None) -> None:
    from simulations import report

    report.write(summary, out)
    typer.echo(report.markdown(summary).split("\n\n| tier")[0])
    if compare is not None:
        typer.echo(report.compare(compare, out, out))
    typer.echo(f"report: {out}")


@simulate_app.command("model")
def simulate_model(
    topology: TopologyArg,
    out: OutOpt = None,
    seed: Annotated[int | None, Opt(help="RNG seed (default: the topology's).")] = None,
    peers: Annotated[
        int | None, Opt(help="Override the count of the largest peer group (scaling runs).")
    ] = None,
    time_step: Annotated[float | None, Opt(help="Flow-model time step, seconds.")] = None,
    shard_size: Annotated[int | None, Opt(help="Override the shard size, bytes.")] = None,
    scale: Annotated[
        float | None,
        Opt(help="Checkpoint size factor, as emulate --scale (default: 1, the full size)."),
    ] = None,
    commit: Annotated[
        str | None,
        Opt(help="How followers commit a delta version: chain or materialize (costs.commit)."),
    ] = None,
    compare: CompareOpt = None,
) -> None:
    """Model a topology in virtual time (thousands of nodes; the real sans-IO policies)."""
    from shardnet import logs
    from simulations.costs import CommitMode
    from simulations.model import Model
    from simulations.progress import SimProgress
    from simulations.topology import load, scaled, with_overrides

    logs.configure("INFO", False, "simulate")
    modes = [m.value for m in CommitMode]
    if commit is not None and commit not in modes:
        fail(ShardnetError(f"--commit must be {' or '.join(modes)}, not {commit!r}"))
    _check_compare(compare)
    try:
        topo = with_overrides(
            load(topology),
            peers=peers,
            time_step_s=time_step,
            shard_size_bytes=shard_size,
            commit=None if commit is None else CommitMode(commit),
        )
        topo = scaled(topo, 1.0 if scale is None else scale)
        out = _report_dir(out or Path("sim-reports") / f"model-{topo.name}")
        with SimProgress("model") as progress:
            summary = Model(topo, seed=seed).run(progress)
    except ConfigError as exc:  # a TopologyError names a field of the file, not an option
        fail(exc)
    _sim_finish(summary, out, compare)


@simulate_app.command("emulate")
def simulate_emulate(
    topology: TopologyArg,
    out: OutOpt = None,
    scale: Annotated[
        float | None, Opt(help="Checkpoint size factor (default: the topology's).")
    ] = None,
    timeout: Annotated[float | None, Opt(help="Give up after this many seconds.")] = None,
    shaping: Annotated[
        str, Opt(help="auto (namespaces when root), netns (required) or transport.")
    ] = "auto",
    workdir: Annotated[
        Path | None, Opt(help="Keep keys, data and logs here (default: removed).")
    ] = None,
    compare: CompareOpt = None,
) -> None:
    """Run the real node processes of a topology on shaped links on this machine."""
    from shardnet import logs
    from simulations.emulate import EmulateOptions, run
    from simulations.progress import SimProgress
    from simulations.topology import load

    logs.configure("INFO", False, "simulate")
    if shaping not in ("auto", "netns", "transport"):
        fail(ShardnetError(f"--shaping must be auto, netns or transport, not {shaping!r}"))
    _check_compare(compare)
    try:
        opts = EmulateOptions(scale=scale, timeout_s=timeout, shaping=shaping, workdir=workdir)
        topo = load(topology)
        out = _report_dir(out or Path("sim-reports") / f"emulate-{topo.name}")
        with SimProgress("emulate") as progress:
            summary = run(topo, opts, progress)
    except ConfigError as exc:  # the options, or the topology (TopologyError)
        fail(exc)
    except KeyboardInterrupt as exc:
        _interrupted(exc)
    except RuntimeError as exc:
        typer.echo(f"shardnet: error: {exc}", err=True)
        raise typer.Exit(2) from None
    _sim_finish(summary, out, compare)
    if summary["run"].get("failure"):
        typer.echo(f"shardnet: emulation failed: {summary['run']['failure']}", err=True)
        raise typer.Exit(1)


@simulate_app.command("calibrate")
def simulate_calibrate(
    topology: TopologyArg,
    out: Annotated[Path, Opt("--out", help="Report directory.")] = Path("sim-reports/calibrate"),
    scale: Annotated[float | None, Opt(help="Checkpoint size factor.")] = None,
    tolerance: Annotated[float, Opt(help="Allowed |model/emulation - 1|.")] = 0.2,
) -> None:
    """Emulate and model one small topology; fail if the model is off by more than TOLERANCE."""
    import json

    from shardnet import logs
    from simulations.calibrate import calibrate
    from simulations.topology import load

    logs.configure("INFO", False, "simulate")
    try:
        res = calibrate(load(topology), _report_dir(out), scale, tolerance)
    except ConfigError as exc:  # scale, tolerance, or the topology (TopologyError)
        fail(exc)
    except KeyboardInterrupt as exc:
        _interrupted(exc)
    typer.echo(json.dumps(res))
    raise typer.Exit(0 if res["ok"] else 1)


@simulate_app.command("compare")
def simulate_compare(
    a: Annotated[Path, typer.Argument(help="Report directory A.")],
    b: Annotated[Path, typer.Argument(help="Report directory B.")],
    out: Annotated[Path, Opt("--out", help="Where compare.md and the plot go.")] = Path(
        "sim-reports/compare"
    ),
) -> None:
    """Put two simulation reports side by side."""
    from simulations import report

    try:
        text = report.compare(a, b, _report_dir(out))
    except report.ReportError as exc:
        fail(exc)
    typer.echo(text)


@simulate_app.command("cleanup")
def simulate_cleanup() -> None:
    """Remove namespaces, processes and temporary data left by emulations whose owner died
    (e.g. SIGKILL)."""
    from simulations import netns

    removed = netns.cleanup_stale()
    typer.echo(f"removed labs: {', '.join(removed) or 'none'}")
