"""The ``shardnet`` command line: one subcommand per role, plus the demo.

Every option can also come from the environment (``SHARDNET_<FIELD>``) or a TOML file given
with ``--config``; the command line wins (see :mod:`shardnet.config`). torch is imported only by
the subcommands that need it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import trio
import typer

from p2p.errors import ConfigError, ShardnetError
from shardnet.checkpoint_cli import checkpoint_app
from shardnet.errors import fail
from shardnet.mirror_cli import mirror_app
from shardnet.options import add_role_command
from shardnet.simulate_cli import simulate_app

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
        fail(exc)
    logs.configure(settings.log_level, settings.log_json, cls.role)
    try:
        code = trio.run(runner, settings)
    except KeyboardInterrupt:
        code = 0
    except BaseException as exc:  # unwrap nursery groups to report a single error in one line
        leaf = _leaf(exc)
        if isinstance(leaf, ConfigError):
            fail(leaf)
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
        fail(exc)
    except OSError as exc:  # an unwritable place: the operator's, not a bug
        fail(ConfigError("key", f"{key}: cannot create the key file ({exc.strerror or exc})"))


@app.command("sample-config")
def sample_config(
    role: Annotated[str, typer.Argument(help="trainer, origin, relay or peer.")],
) -> None:
    """Print a sample TOML configuration of ROLE listing every setting (configs/ROLE.toml)."""
    import importlib

    from shardnet.samples import sample_toml

    if role not in ROLES:
        fail(ConfigError("role", f"{role!r} is not one of {', '.join(ROLES)}"))
    typer.echo(
        sample_toml(getattr(importlib.import_module("shardnet.config"), ROLES[role][0])), nl=False
    )


@app.command()
def status(
    target: Annotated[
        str | None,
        typer.Argument(
            help="HTTP lane URL (http://HOST:PORT) or multiaddr with /p2p/<PeerID> of any "
            "node [default: http://127.0.0.1:8001, a local trainer]"
        ),
    ] = None,
    json_out: Annotated[bool, Opt("--json", help="Print the status document as JSON.")] = False,
    watch: Annotated[bool, Opt("--watch", help="Refresh in place until Ctrl-C.")] = False,
    interval_s: Annotated[float, Opt("--interval-s", help="Refresh period, seconds.")] = 2.0,
) -> None:
    """Show a node's status: versions, downloads, upstreams, known nodes, rollouts, run card."""
    from shardnet import logs
    from shardnet.status import run_status

    # The tables, or one line saying why there are none: the dial's own log records (ours
    # and py-libp2p's) would only repeat that line in another form.
    logs.configure("CRITICAL")

    raise typer.Exit(run_status(target, json_out, watch, interval_s))


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
        fail(exc)
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(simulate_app, name="simulate")
app.add_typer(mirror_app, name="mirror")


def _add_roles() -> None:
    import importlib

    config = importlib.import_module("shardnet.config")
    for name, (cls_name, _, help_text) in ROLES.items():
        add_role_command(app, name, getattr(config, cls_name), _run_role, help_text)


_add_roles()


def main() -> None:
    """Console-script entry point.

    A usage mistake (unknown option, a value of the wrong type, a missing argument) is one line
    on stderr and exit 2, like every other operator error (:mod:`shardnet.errors`); click's
    multi-line usage block is not printed.
    """
    try:
        rv = app(prog_name="shardnet", standalone_mode=False)
    except typer.Abort:
        typer.echo("shardnet: aborted", err=True)
        sys.exit(1)
    except typer.TyperException as exc:  # typer's usage and parameter errors (its own click)
        fmt = getattr(exc, "format_message", None)
        msg = fmt() if callable(fmt) else str(exc)
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `shardnet`: the help, exit 2
            typer.echo(msg, err=True)
            sys.exit(2)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        typer.echo(f"shardnet: error: {msg}{hint}", err=True)
        sys.exit(int(getattr(exc, "exit_code", 2)))
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
