"""``shardnet mirror export``: a node's versions as a static tree for nginx, a bucket or a CDN."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from p2p.errors import ConfigError, ShardnetError
from shardnet.errors import fail

Opt = typer.Option

mirror_app = typer.Typer(help="Static mirrors: serve a node's versions from any HTTP server.")


def _only_run(data_dir: Path) -> str:
    """The run held in ``data_dir`` when there is exactly one.

    Raises:
        ConfigError: none or several (then ``--run-id`` is needed).
    """
    root = data_dir / "versions"
    runs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if len(runs) != 1:
        found = ", ".join(runs) if runs else "none"
        raise ConfigError("run_id", f"give the run to export (runs in {data_dir}: {found})")
    return runs[0]


@mirror_app.command("export")
def mirror_export(
    data_dir: Annotated[
        Path, Opt("--data-dir", help="The node's data directory (a relay's, say).")
    ],
    out: Annotated[Path, Opt("--out", help="The web server's document root (created).")],
    run_id: Annotated[
        str | None, Opt("--run-id", help="Run to export (default: the only one held).")
    ] = None,
    trainer_id: Annotated[
        str | None,
        Opt("--trainer-id", help="Trainer PeerID every manifest must be signed by."),
    ] = None,
    verify: Annotated[
        bool, Opt(help="Re-hash every file and blob against its signed digest first.")
    ] = True,
    prune: Annotated[bool, Opt(help="Remove exported versions the node no longer holds.")] = True,
    every_s: Annotated[
        float, Opt("--every-s", help="Export again every this many seconds (0: once).")
    ] = 0.0,
) -> None:
    """Write the node's committed, verified versions under OUT/shardnet/v1/<run>/ in the
    HTTP lane's URL layout; serve OUT with any web server and give peers --mirror URL."""
    from p2p.keys import is_valid_peer_id
    from shardcast.serve import export_mirror

    try:
        if not data_dir.is_dir():
            raise ConfigError("data_dir", f"{data_dir} is not a directory")
        if every_s < 0:
            raise ConfigError("every_s", "must be >= 0")
        if trainer_id is not None and not is_valid_peer_id(trainer_id):
            raise ConfigError("trainer_id", f"{trainer_id!r} is not a PeerID (12D3KooW...)")
        run = run_id if run_id is not None else _only_run(data_dir)
        while True:
            try:
                r = export_mirror(
                    data_dir, out, run_id=run, trainer_id=trainer_id, verify=verify, prune=prune
                )
            except OSError as exc:
                raise ConfigError("out", f"cannot write {out}: {exc}") from None
            typer.echo(
                f"{r.run_dir}: steps {r.steps} (new {r.exported}, pruned {r.pruned}, "
                f"skipped {sorted(r.skipped)}; {r.linked} linked, {r.copied} copied)"
            )
            if every_s == 0:
                return
            time.sleep(every_s)
    except ShardnetError as exc:
        fail(exc)
