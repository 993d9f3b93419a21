"""The ``shardnet`` command line: one subcommand per role, plus the demo.

Every option can also come from the environment (``SHARDNET_<FIELD>``) or a TOML file given
with ``--config``; the command line wins (see :mod:`shardnet.config`). torch is imported only by
the subcommands that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import trio
import typer

from p2p.errors import ConfigError, ShardnetError
from shardnet.options import add_role_command, option_name

if TYPE_CHECKING:
    from shardnet.config import CommonSettings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="shardnet: verified checkpoint broadcast and verified rollouts for decentralized RL.",
)

Opt = typer.Option


def _fail(exc: ShardnetError) -> NoReturn:
    if isinstance(exc, ConfigError) and exc.field.split(".")[0] != "config":
        name = exc.field.split(".")[0]
        msg = str(exc)[len(exc.field) + 2 :]
        typer.echo(f"shardnet: error: {option_name(name)}: {msg}", err=True)
    else:
        typer.echo(f"shardnet: error: {exc}", err=True)
    raise typer.Exit(2)


ROLES: dict[str, tuple[str, str, str]] = {
    "trainer": (
        "TrainerSettings",
        "run_trainer",
        "Run the trainer: publish versions through its origin, verify rollouts, train (GRPO).",
    ),
    "origin": (
        "OriginSettings",
        "run_origin",
        "Run a standalone origin: publish checkpoints written by any trainer (HF layout).\n\n"
        "Its key is the run's trainer key (relays and peers pin its PeerID). Files are "
        "hard-linked into the origin's store, so WATCH is left as it is.",
    ),
    "relay": (
        "RelaySettings",
        "run_relay",
        "Run a relay: fetch each version from upstream, verify every shard, serve it onward.",
    ),
    "peer": (
        "PeerSettings",
        "run_peer",
        "Run an inference peer: download versions, generate rollouts with proofs, submit them.",
    ),
}


def _leaf(exc: BaseException) -> BaseException:
    """The single exception inside (nested) exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _run_role(
    cls: type[CommonSettings], config_file: Path | None, overrides: dict[str, Any]
) -> None:
    """Load a role's settings, check its paths, and run it; exit with the role's code.

    Exit codes (every role): 0 done or stopped by SIGINT/SIGTERM; 1 a runtime failure,
    printed as one line; 2 an operator's mistake (setting, address, port, path), one line.
    """
    import importlib

    from shardnet import logs
    from shardnet.config import load_settings

    runner = getattr(importlib.import_module("shardnet.roles"), ROLES[cls.role][1])
    try:
        settings = load_settings(cls, config_file, overrides)
        settings.preflight()
    except ConfigError as exc:
        _fail(exc)
    logs.configure(settings.log_level, settings.log_json, cls.role)
    try:
        code = trio.run(runner, settings)
    except KeyboardInterrupt:
        code = 0
    except BaseException as exc:  # unwrap nursery groups to report a single error in one line
        leaf = _leaf(exc)
        if isinstance(leaf, ConfigError):
            _fail(leaf)
        if isinstance(leaf, ShardnetError):
            typer.echo(f"shardnet {cls.role}: error: {leaf}", err=True)
            raise typer.Exit(1) from None
        if leaf is not exc and isinstance(leaf, KeyboardInterrupt):
            code = 0
        else:
            raise
    raise typer.Exit(code)


@app.command()
def keygen(key: Annotated[Path, Opt("--key", help="Key file to create (or read).")]) -> None:
    """Create an Ed25519 node key (mode 0600) if missing and print its PeerID."""
    from p2p.identity import Identity

    try:
        typer.echo(Identity.load_or_create(key).peer_id)
    except ShardnetError as exc:
        _fail(exc)


@app.command("sample-config")
def sample_config(
    role: Annotated[str, typer.Argument(help="trainer, origin, relay or peer.")],
) -> None:
    """Print a sample TOML configuration of ROLE listing every setting (configs/ROLE.toml)."""
    import importlib

    from shardnet.samples import sample_toml

    if role not in ROLES:
        _fail(ConfigError("role", f"{role!r} is not one of {', '.join(ROLES)}"))
    typer.echo(
        sample_toml(getattr(importlib.import_module("shardnet.config"), ROLES[role][0])), nl=False
    )


@app.command()
def demo(
    model: Annotated[
        str, Opt("--model", help="tiny (10 steps) or real-1b (2 steps, >= 1 GiB checkpoint).")
    ] = "tiny",
    steps: Annotated[int | None, Opt(help="Optimizer steps (default 10 tiny, 2 real-1b).")] = None,
    report: Annotated[Path | None, Opt(help="Write the JSON report here.")] = None,
    workdir: Annotated[
        Path | None,
        Opt(
            help="Directory for keys, data and logs (default: a "
            "new temporary directory, removed afterwards)."
        ),
    ] = None,
    keep: Annotated[bool, Opt("--keep/--no-keep", help="Keep the work directory.")] = False,
    timeout: Annotated[
        float | None, Opt(help="Give up after this many seconds (default 900 tiny, 1800 real-1b).")
    ] = None,
) -> None:
    """Run the whole loop on this machine: trainer, 2 relays, 3 peers as separate processes."""
    from shardnet import logs
    from shardnet.demo import DemoOptions, run_demo

    logs.configure("INFO", False, "demo")
    try:
        opts = DemoOptions(
            model=model, steps=steps, report=report, workdir=workdir, keep=keep, timeout_s=timeout
        )
        code = trio.run(run_demo, opts)
    except ShardnetError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


checkpoint_app = typer.Typer(help="Generate real-architecture checkpoints for tests/benchmarks.")
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.command("generate")
def checkpoint_generate(
    out: Annotated[Path, Opt("--out", help="Checkpoint directory to create.")],
    preset: Annotated[str, Opt(help="Model preset: tiny, real-1b, real-2b (>= 2 GiB).")] = "tiny",
    seed: Annotated[int, Opt(help="Weight initialisation seed.")] = 0,
    max_shard_bytes: Annotated[int, Opt(help="Safetensors file size cap, bytes.")] = 1 << 30,
) -> None:
    """Write a Llama-architecture checkpoint with seeded random bf16 weights (HF layout)."""
    import torch

    from rollout.model import build_model, build_tokenizer
    from trainer.checkpoint import save_checkpoint

    torch.set_num_threads(2)
    try:
        files = save_checkpoint(build_model(preset, seed), build_tokenizer(), out, max_shard_bytes)
    except ShardnetError as exc:
        _fail(exc)
    typer.echo(f"{out}: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")


@checkpoint_app.command("evolve")
def checkpoint_evolve(
    src: Annotated[Path, typer.Argument(help="Checkpoint of version N.")],
    dst: Annotated[Path, typer.Argument(help="Directory for version N+1 (created).")],
    lr: Annotated[float, Opt(help="Adam learning rate (RL-like: 1e-6 .. 3e-6).")] = 1e-6,
    seed: Annotated[int, Opt(help="Seed of the loss batch.")] = 0,
    max_shard_bytes: Annotated[
        int, Opt(help="Safetensors file size cap; use SRC's to keep the file layout.")
    ] = 1 << 30,
) -> None:
    """Version N+1 from N by one real Adam step on an LM loss (see trainer/evolve.py)."""
    from trainer.evolve import evolve

    try:
        st = evolve(src, dst, lr=lr, seed=seed, max_shard_bytes=max_shard_bytes, threads=2)
    except ShardnetError as exc:
        _fail(exc)
    typer.echo(
        f"{dst}: loss {st.loss:.4f}, {st.changed}/{st.elements} bf16 elements changed "
        f"({100 * st.changed_fraction:.2f} %)"
    )


simulate_app = typer.Typer(
    help="Simulate topologies: emulate (real processes, shaped links) or model (virtual time)."
)
app.add_typer(simulate_app, name="simulate")
TopologyArg = Annotated[Path, typer.Argument(help="Topology TOML file (simulations/topologies/).")]
OutOpt = Annotated[
    Path | None, Opt("--out", help="Report directory (default: sim-reports/<mode>-<name>).")
]
CompareOpt = Annotated[
    Path | None, Opt("--compare", help="Another report directory to put side by side.")
]


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
    compare: CompareOpt = None,
) -> None:
    """Model a topology in virtual time (thousands of nodes; the real sans-IO policies)."""
    from simulations.model import Model
    from simulations.topology import TopologyError, load, with_overrides

    try:
        topo = with_overrides(
            load(topology), peers=peers, time_step_s=time_step, shard_size_bytes=shard_size
        )
        summary = Model(topo, seed=seed).run()
    except TopologyError as exc:
        _fail(exc)
    _sim_finish(summary, out or Path("sim-reports") / f"model-{topo.name}", compare)


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
    from simulations.topology import TopologyError, load

    logs.configure("INFO", False, "simulate")
    if shaping not in ("auto", "netns", "transport"):
        _fail(ShardnetError(f"--shaping must be auto, netns or transport, not {shaping!r}"))
    try:
        topo = load(topology)
        summary = run(
            topo, EmulateOptions(scale=scale, timeout_s=timeout, shaping=shaping, workdir=workdir)
        )
    except TopologyError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        typer.echo("shardnet: interrupted; processes and namespaces removed", err=True)
        raise typer.Exit(130) from None
    except RuntimeError as exc:
        typer.echo(f"shardnet: error: {exc}", err=True)
        raise typer.Exit(2) from None
    _sim_finish(summary, out or Path("sim-reports") / f"emulate-{topo.name}", compare)
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
    from simulations.topology import TopologyError, load

    logs.configure("INFO", False, "simulate")
    try:
        res = calibrate(load(topology), out, scale, tolerance)
    except TopologyError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
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

    typer.echo(report.compare(a, b, out))


@simulate_app.command("cleanup")
def simulate_cleanup() -> None:
    """Remove namespaces and processes left by emulations whose owner died (e.g. SIGKILL)."""
    from simulations import netns

    removed = netns.cleanup_stale()
    typer.echo(f"removed labs: {', '.join(removed) or 'none'}")


def _add_roles() -> None:
    import importlib

    config = importlib.import_module("shardnet.config")
    for name, (cls_name, _, help_text) in ROLES.items():
        add_role_command(app, name, getattr(config, cls_name), _run_role, help_text)


_add_roles()


def main() -> None:
    """Console-script entry point."""
    app(prog_name="shardnet")


if __name__ == "__main__":
    main()
