"""How the CLI reports an operator's mistake: one line on stderr, exit status 2."""

from __future__ import annotations

from typing import NoReturn

import typer

from p2p.errors import ConfigError, ShardnetError
from shardnet.options import option_name


def fail(exc: ShardnetError) -> NoReturn:
    """Print ``exc`` as one line (a setting is named by its option) and exit with status 2."""
    if isinstance(exc, ConfigError) and exc.names_option and exc.field.split(".")[0] != "config":
        name = exc.field.split(".")[0]
        msg = str(exc)[len(exc.field) + 2 :]
        typer.echo(f"shardnet: error: {option_name(name)}: {msg}", err=True)
    else:
        typer.echo(f"shardnet: error: {exc}", err=True)
    raise typer.Exit(2)
