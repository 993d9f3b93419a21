"""Command-line options generated from the settings models: each setting is declared once.

A role's subcommand (``shardnet trainer|origin|relay|peer``) is built from its pydantic settings
class in :mod:`shardnet.config`: every field becomes one option whose name is the field's name
with dashes (``step_timeout_s`` → ``--step-timeout-s``), the same name as the TOML key and the
environment variable (``SHARDNET_STEP_TIMEOUT_S``). The help text is the field's description
with its default; list fields are repeatable options, booleans ``--x/--no-x`` flags, literals
choices. An option left off the command line is absent from the overrides, so the environment,
the TOML file (``--config``) and the defaults apply in that order (see
:func:`shardnet.config.load_settings`).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from shardnet.config import CommonSettings


def option_name(field: str) -> str:
    """The command-line spelling of a settings field: ``step_timeout_s`` → ``--step-timeout-s``."""
    return "--" + field.replace("_", "-")


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is_list) of ``T``, ``T | None``, ``list[T]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else (str, False)
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _show_default(info: FieldInfo) -> str | None:
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    if default is None or default == []:
        return None
    if isinstance(default, bool):
        return "yes" if default else "no"
    return str(default)


def settings_parameters(cls: type[CommonSettings]) -> list[inspect.Parameter]:
    """One keyword parameter, annotated with its typer option, per field of ``cls``.

    Fields come in declaration order (common fields first); every default is None so that an
    option left off the command line can be told apart from one given.
    """
    out: list[inspect.Parameter] = []
    for name, info in cls.model_fields.items():
        inner, is_list = _unwrap(info.annotation)
        if typing.get_origin(inner) is Literal:
            choices = ", ".join(str(a) for a in typing.get_args(inner))
            inner = str
            extra = f" (one of: {choices})"
        else:
            extra = ""
        default = _show_default(info)
        help_text = (info.description or "").rstrip(".") + extra
        if default is not None:
            help_text += f" [default: {default}]"
        if is_list:
            help_text += " (repeatable)"
        opt = option_name(name)
        if inner is bool and not is_list:
            option = typer.Option(f"{opt}/--no-{opt[2:]}", help=help_text, show_default=False)
        else:
            option = typer.Option(opt, help=help_text, show_default=False, metavar=name.upper())
        annotation = list[inner] if is_list else inner  # type: ignore[valid-type]
        out.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[annotation | None, option],
            )
        )
    return out


def overrides_from(params: dict[str, Any]) -> dict[str, Any]:
    """The options given on the command line, as settings overrides.

    Unset options (None, or an empty list for a repeatable one) are left out so that lower
    layers (environment, file, defaults) apply.
    """
    return {k: v for k, v in params.items() if v is not None and v != [] and v != ()}


def add_role_command(
    app: typer.Typer,
    name: str,
    cls: type[CommonSettings],
    run: Callable[[type[CommonSettings], Path | None, dict[str, Any]], None],
    help_text: str,
) -> None:
    """Register subcommand ``name`` on ``app`` with one option per field of ``cls``.

    Args:
        app: the typer application.
        name: the subcommand (``relay``).
        cls: its settings model.
        run: called with ``(cls, config_file, overrides)``; loads the settings and runs.
        help_text: the command's help.
    """

    def command(**kw: Any) -> None:
        config_file = kw.pop("config")
        run(cls, config_file, overrides_from(kw))

    config = inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(
                "--config",
                help="TOML file with the role's settings (keys: the option names with _).",
            ),
        ],
    )
    command.__signature__ = inspect.Signature([config, *settings_parameters(cls)])  # type: ignore[attr-defined]
    command.__doc__ = help_text
    app.command(name, context_settings={"max_content_width": 100})(command)
