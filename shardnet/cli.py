"""The ``shardnet`` command line: one subcommand per role, plus the demo.

Every option can also come from the environment (``SHARDNET_<FIELD>``) or a TOML file given
with ``--config``; the command line wins (see :mod:`shardnet.config`). torch is imported only by
the subcommands that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import trio
import typer

from p2p.errors import ShardnetError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="shardnet: verified checkpoint broadcast and verified rollouts for decentralized RL.",
)

Opt = typer.Option


def _overrides(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None and v != []}


def _fail(exc: ShardnetError) -> None:
    typer.echo(f"shardnet: error: {exc}", err=True)
    raise typer.Exit(2)


ConfigOpt = Annotated[Path | None, Opt("--config", help="TOML file with the role's settings.")]
DataDirOpt = Annotated[Path | None, Opt("--data-dir", help="Directory for versions, key, state.")]
KeyOpt = Annotated[
    Path | None,
    Opt("--key", help="Ed25519 key file (created 0600 if missing; default DATA_DIR/node.key)."),
]
RunOpt = Annotated[str | None, Opt("--run-id", help="Run identifier (same on every node).")]
ListenOpt = Annotated[
    list[str] | None,
    Opt("--listen", help="libp2p listen multiaddr (repeatable; default /ip4/127.0.0.1/tcp/0)."),
]
HttpHostOpt = Annotated[str | None, Opt("--http-host", help="Address of the HTTP bulk lane.")]
HttpPortOpt = Annotated[
    int | None, Opt("--http-port", help="Port of the HTTP bulk lane (0: any free port).")
]
UploadOpt = Annotated[float | None, Opt("--upload-limit", help="Cap on HTTP lane upload, bytes/s.")]
KeepOpt = Annotated[int | None, Opt("--keep-last", help="Committed versions kept on disk.")]
ReportOpt = Annotated[Path | None, Opt("--report", help="Write a JSON report here on exit.")]
ReadyOpt = Annotated[
    Path | None, Opt("--ready-file", help="Write the node's addresses (JSON) here once it listens.")
]
LevelOpt = Annotated[str | None, Opt("--log-level", help="DEBUG, INFO, WARNING or ERROR.")]
JsonOpt = Annotated[bool | None, Opt("--log-json/--no-log-json", help="Log JSON lines.")]
TrainerIdOpt = Annotated[
    str | None,
    Opt(
        "--trainer-id", help="The trainer's PeerID (pinned: only its signed versions are accepted)."
    ),
]
AllowRelayOpt = Annotated[
    list[str] | None, Opt("--allow-relay", help="Only download from this PeerID (repeatable).")
]
PollOpt = Annotated[
    float | None, Opt("--poll-interval", help="Seconds between upstream info polls.")
]


def _common(
    data_dir: Path | None,
    key: Path | None,
    run_id: str | None,
    listen: list[str] | None,
    http_host: str | None,
    http_port: int | None,
    upload_limit: float | None,
    keep_last: int | None,
    report: Path | None,
    ready_file: Path | None,
    log_level: str | None,
    log_json: bool | None,
) -> dict[str, Any]:
    return _overrides(
        data_dir=data_dir,
        key_file=key,
        run_id=run_id,
        listen=listen,
        http_host=http_host,
        http_port=http_port,
        upload_limit_bytes_per_s=upload_limit,
        keep_last=keep_last,
        report=report,
        ready_file=ready_file,
        log_level=log_level,
        log_json=log_json,
    )


def _run(fn: Any, settings: Any, name: str) -> None:
    from shardnet import logs

    logs.configure(settings.log_level, settings.log_json, name)
    try:
        code = trio.run(fn, settings)
    except ShardnetError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


@app.command()
def keygen(key: Annotated[Path, Opt("--key", help="Key file to create (or read).")]) -> None:
    """Create an Ed25519 node key (mode 0600) if missing and print its PeerID."""
    from p2p.identity import Identity

    try:
        typer.echo(Identity.load_or_create(key).peer_id)
    except ShardnetError as exc:
        _fail(exc)


@app.command()
def trainer(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    key: KeyOpt = None,
    run_id: RunOpt = None,
    listen: ListenOpt = None,
    http_host: HttpHostOpt = None,
    http_port: HttpPortOpt = None,
    upload_limit: UploadOpt = None,
    keep_last: KeepOpt = None,
    report: ReportOpt = None,
    ready_file: ReadyOpt = None,
    log_level: LevelOpt = None,
    log_json: JsonOpt = None,
    steps: Annotated[
        int | None, Opt(help="Optimizer steps; versions 0..STEPS are published.")
    ] = None,
    preset: Annotated[str | None, Opt(help="Model preset: tiny or real-1b.")] = None,
    seed: Annotated[int | None, Opt(help="Model initialisation seed.")] = None,
    lr: Annotated[float | None, Opt(help="Learning rate.")] = None,
    optimizer: Annotated[
        str | None, Opt(help="adamw or sgd (sgd keeps no optimizer state).")
    ] = None,
    async_level: Annotated[int | None, Opt(help="How many versions a rollout may lag.")] = None,
    n_prompts: Annotated[int | None, Opt(help="Prompts per peer per step.")] = None,
    group_size: Annotated[int | None, Opt(help="Samples per prompt (GRPO group).")] = None,
    max_new_tokens: Annotated[int | None, Opt(help="Completion length cap, tokens.")] = None,
    temperature: Annotated[float | None, Opt(help="Sampling temperature.")] = None,
    min_batches: Annotated[int | None, Opt(help="Verified batches to wait for per step.")] = None,
    step_timeout: Annotated[float | None, Opt(help="Longest wait for them, seconds.")] = None,
    shard_size: Annotated[int | None, Opt(help="Shard size of published versions, bytes.")] = None,
    shards_per_part: Annotated[
        int | None, Opt(help="Shards per signed manifest part (smaller: earlier first bytes).")
    ] = None,
    anchor_every: Annotated[
        int | None, Opt(help="Publish a full version (no delta base) every N steps.")
    ] = None,
    deltas: Annotated[
        bool | None,
        Opt("--deltas/--no-deltas", help="Offer xor-zstd deltas against the previous version."),
    ] = None,
    zstd: Annotated[
        bool | None, Opt("--zstd/--no-zstd", help="Also offer zstd of every shard (slow links).")
    ] = None,
    serve_once: Annotated[
        float | None,
        Opt(
            help="Origin super-seeding window, seconds: a shard goes to one relay, the others "
            "get it from that relay."
        ),
    ] = None,
    max_shard_bytes: Annotated[int | None, Opt(help="Safetensors file size cap, bytes.")] = None,
    allow_peer: Annotated[
        list[str] | None,
        Opt(help="Accept rollouts only from this PeerID (repeatable; default: anyone)."),
    ] = None,
    expect_peer: Annotated[
        list[str] | None,
        Opt(help="PeerID whose commit reports define the broadcast time (repeatable)."),
    ] = None,
    final_wait: Annotated[float | None, Opt(help="Seconds to wait for the last broadcast.")] = None,
    start_wait: Annotated[
        float | None, Opt(help="Seconds to wait for every expected peer to join before version 0.")
    ] = None,
    torch_threads: Annotated[int | None, Opt(help="CPU threads for torch.")] = None,
    check_model: Annotated[
        bool | None, Opt("--check-model/--no-check-model", help="Run TOPLOC and sampling checks.")
    ] = None,
) -> None:
    """Run the trainer: publish versions through its origin, verify rollouts, train (GRPO)."""
    from shardnet.config import TrainerSettings, load_settings
    from shardnet.roles import run_trainer

    try:
        s = load_settings(
            TrainerSettings,
            config,
            {
                **_common(
                    data_dir,
                    key,
                    run_id,
                    listen,
                    http_host,
                    http_port,
                    upload_limit,
                    keep_last,
                    report,
                    ready_file,
                    log_level,
                    log_json,
                ),
                **_overrides(
                    steps=steps,
                    preset=preset,
                    seed=seed,
                    lr=lr,
                    optimizer=optimizer,
                    async_level=async_level,
                    n_prompts=n_prompts,
                    group_size=group_size,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    min_batches=min_batches,
                    step_timeout_s=step_timeout,
                    shard_size_bytes=shard_size,
                    shards_per_part=shards_per_part,
                    anchor_every=anchor_every,
                    deltas=deltas,
                    zstd=zstd,
                    serve_once_s=serve_once,
                    max_shard_bytes=max_shard_bytes,
                    allow_peers=allow_peer,
                    expect_peers=expect_peer,
                    final_wait_s=final_wait,
                    start_wait_s=start_wait,
                    torch_threads=torch_threads,
                    check_model=check_model,
                ),
            },
        )
    except ShardnetError as exc:
        _fail(exc)
    _run(run_trainer, s, "trainer")


@app.command()
def origin(
    watch: Annotated[
        Path | None,
        Opt(
            help="Directory whose step-<N>/ checkpoint subdirectories (HF layout) "
            "are published once they contain the ready marker."
        ),
    ] = None,
    ready_marker: Annotated[str | None, Opt(help="Marker file name (default DONE).")] = None,
    shard_size: Annotated[int | None, Opt(help="Shard size, bytes.")] = None,
    shards_per_part: Annotated[int | None, Opt(help="Shards per signed manifest part.")] = None,
    anchor_every: Annotated[int | None, Opt(help="A full version every N steps.")] = None,
    deltas: Annotated[
        bool | None, Opt("--deltas/--no-deltas", help="Offer xor-zstd deltas.")
    ] = None,
    zstd: Annotated[bool | None, Opt("--zstd/--no-zstd", help="Also offer zstd shards.")] = None,
    serve_once: Annotated[float | None, Opt(help="Super-seeding window, seconds.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    key: KeyOpt = None,
    run_id: RunOpt = None,
    listen: ListenOpt = None,
    http_host: HttpHostOpt = None,
    http_port: HttpPortOpt = None,
    upload_limit: UploadOpt = None,
    keep_last: KeepOpt = None,
    report: ReportOpt = None,
    ready_file: ReadyOpt = None,
    log_level: LevelOpt = None,
    log_json: JsonOpt = None,
) -> None:
    """Run a standalone origin: publish checkpoints written by any trainer (HF layout).

    Its key is the run's trainer key (relays and peers pin its PeerID). Files are hard-linked
    into the origin's store, so WATCH is left as it is.
    """
    from shardnet.config import OriginSettings, load_settings
    from shardnet.roles import run_origin

    try:
        s = load_settings(
            OriginSettings,
            config,
            {
                **_common(
                    data_dir,
                    key,
                    run_id,
                    listen,
                    http_host,
                    http_port,
                    upload_limit,
                    keep_last,
                    report,
                    ready_file,
                    log_level,
                    log_json,
                ),
                **_overrides(
                    watch=watch,
                    ready_marker=ready_marker,
                    shard_size_bytes=shard_size,
                    shards_per_part=shards_per_part,
                    anchor_every=anchor_every,
                    deltas=deltas,
                    zstd=zstd,
                    serve_once_s=serve_once,
                ),
            },
        )
    except ShardnetError as exc:
        _fail(exc)
    _run(run_origin, s, "origin")


@app.command()
def relay(
    upstream: Annotated[
        list[str] | None,
        Opt(
            help="Multiaddr of the origin or of an upstream relay, with /p2p/<PeerID> (repeatable)."
        ),
    ] = None,
    trainer_id: TrainerIdOpt = None,
    allow_relay: AllowRelayOpt = None,
    poll_interval: PollOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    key: KeyOpt = None,
    run_id: RunOpt = None,
    listen: ListenOpt = None,
    http_host: HttpHostOpt = None,
    http_port: HttpPortOpt = None,
    upload_limit: UploadOpt = None,
    keep_last: KeepOpt = None,
    report: ReportOpt = None,
    ready_file: ReadyOpt = None,
    log_level: LevelOpt = None,
    log_json: JsonOpt = None,
) -> None:
    """Run a relay: fetch each version from upstream, verify every shard, serve it onward."""
    from shardnet.config import RelaySettings, load_settings
    from shardnet.roles import run_relay

    try:
        s = load_settings(
            RelaySettings,
            config,
            {
                **_common(
                    data_dir,
                    key,
                    run_id,
                    listen,
                    http_host,
                    http_port,
                    upload_limit,
                    keep_last,
                    report,
                    ready_file,
                    log_level,
                    log_json,
                ),
                **_overrides(
                    upstream=upstream,
                    trainer_id=trainer_id,
                    allow_relays=allow_relay,
                    poll_interval_s=poll_interval,
                ),
            },
        )
    except ShardnetError as exc:
        _fail(exc)
    _run(run_relay, s, "relay")


@app.command()
def peer(
    bootstrap: Annotated[
        list[str] | None,
        Opt(help="Multiaddr of a relay to download from, with /p2p/<PeerID> (repeatable)."),
    ] = None,
    trainer_id: TrainerIdOpt = None,
    allow_relay: AllowRelayOpt = None,
    poll_interval: PollOpt = None,
    n_prompts: Annotated[int | None, Opt(help="Prompts per step (must match the trainer).")] = None,
    group_size: Annotated[int | None, Opt(help="Samples per prompt (must match).")] = None,
    max_new_tokens: Annotated[int | None, Opt(help="Completion cap (must match).")] = None,
    temperature: Annotated[float | None, Opt(help="Sampling temperature (must match).")] = None,
    torch_threads: Annotated[int | None, Opt(help="CPU threads for inference.")] = None,
    max_versions: Annotated[int | None, Opt(help="Stop generating after N versions.")] = None,
    engine: Annotated[
        str | None,
        Opt(help="Inference engine: transformers (default) or vllm (needs the vllm extra)."),
    ] = None,
    trainer_addr: Annotated[
        list[str] | None,
        Opt(
            help="Trainer multiaddr, to join before the "
            "first version (repeatable; otherwise "
            "learnt from announcements)."
        ),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    key: KeyOpt = None,
    run_id: RunOpt = None,
    listen: ListenOpt = None,
    http_host: HttpHostOpt = None,
    http_port: HttpPortOpt = None,
    upload_limit: UploadOpt = None,
    keep_last: KeepOpt = None,
    report: ReportOpt = None,
    ready_file: ReadyOpt = None,
    log_level: LevelOpt = None,
    log_json: JsonOpt = None,
) -> None:
    """Run an inference peer: download versions, generate rollouts with proofs, submit them."""
    from shardnet.config import PeerSettings, load_settings
    from shardnet.roles import run_peer

    try:
        s = load_settings(
            PeerSettings,
            config,
            {
                **_common(
                    data_dir,
                    key,
                    run_id,
                    listen,
                    http_host,
                    http_port,
                    upload_limit,
                    keep_last,
                    report,
                    ready_file,
                    log_level,
                    log_json,
                ),
                **_overrides(
                    bootstrap=bootstrap,
                    trainer_id=trainer_id,
                    allow_relays=allow_relay,
                    poll_interval_s=poll_interval,
                    n_prompts=n_prompts,
                    group_size=group_size,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    torch_threads=torch_threads,
                    max_versions=max_versions,
                    engine=engine,
                    trainer_addr=trainer_addr,
                ),
            },
        )
    except ShardnetError as exc:
        _fail(exc)
    _run(run_peer, s, "peer")


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


def main() -> None:
    """Console-script entry point."""
    app(prog_name="shardnet")


if __name__ == "__main__":
    main()
