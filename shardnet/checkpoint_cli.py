"""``shardnet checkpoint generate|evolve``: real-architecture checkpoints (tests, benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from p2p.errors import ShardnetError
from shardnet.errors import fail

Opt = typer.Option

checkpoint_app = typer.Typer(help="Generate real-architecture checkpoints for tests/benchmarks.")


@checkpoint_app.command("generate")
def checkpoint_generate(
    out: Annotated[Path, Opt("--out", help="Checkpoint directory to create.")],
    preset: Annotated[
        str,
        Opt(
            help="Model preset: tiny, real-1b, real-2b (>= 2 GiB), real-6b (6 GB; builds in "
            "fp32 here, ~12 GB of memory: bench/scaled.py writes it tensor by tensor)."
        ),
    ] = "tiny",
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
        fail(exc)
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
        fail(exc)
    typer.echo(
        f"{dst}: loss {st.loss:.4f}, {st.changed}/{st.elements} bf16 elements changed "
        f"({100 * st.changed_fraction:.2f} %)"
    )
