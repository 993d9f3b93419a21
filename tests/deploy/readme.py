"""The operator commands of README.md, read from the README itself so the two cannot drift.

:func:`operator_commands` returns the ``shardnet ...`` commands of the section "Running the
roles yourself" (its indented code blocks; ``\\`` continues a line, ``#`` starts a comment), in
order. :func:`substitute` fills in the ``<PLACEHOLDER>``\\ s; a placeholder given a list of
values repeats the option that holds it once per value (``--expect-peer <PEER_ID>`` with two
peers becomes two ``--expect-peer`` options).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"
SECTION = "## Running the roles yourself"
PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)>")


def section(text: str, title: str = SECTION) -> str:
    """The body of the section ``title`` (up to the next heading of any level).

    Raises:
        AssertionError: no such section.
    """
    start = text.find(title + "\n")
    assert start >= 0, f"README.md has no section {title!r}"
    body = text[start + len(title) + 1 :]
    m = re.search(r"^#{1,6} ", body, flags=re.M)
    return body[: m.start()] if m else body


def operator_commands(text: str | None = None) -> list[list[str]]:
    """Every ``shardnet`` command in the operator section, as argv lists (without comments)."""
    text = README.read_text() if text is None else text
    lines: list[str] = []
    pending = ""
    for raw in section(text).splitlines():
        if not raw.startswith("    "):
            pending = ""
            continue
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    out = []
    for line in lines:
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "shardnet":
            out.append(argv)
    return out


def by_role(commands: Sequence[list[str]]) -> dict[str, list[str]]:
    """The role commands (``trainer``, ``relay``, ``peer``, …) by subcommand; each must be unique.

    Raises:
        AssertionError: a role appears twice.
    """
    out: dict[str, list[str]] = {}
    for argv in commands:
        role = argv[1]
        if role == "keygen":
            continue
        assert role not in out, f"README shows two `shardnet {role}` commands"
        out[role] = argv
    return out


def option(argv: Sequence[str], name: str) -> str | None:
    """The value of the option ``name`` (``--key``) in ``argv``, or None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def keygen_for(commands: Sequence[list[str]], role_argv: Sequence[str]) -> list[str]:
    """The ``shardnet keygen`` command that creates the key ``role_argv`` runs with.

    Raises:
        AssertionError: the role has no ``--key`` or the README creates no such key.
    """
    key = option(role_argv, "--key")
    assert key is not None, f"README's `shardnet {role_argv[1]}` has no --key"
    for argv in commands:
        if argv[1] == "keygen" and option(argv, "--key") == key:
            return list(argv)
    raise AssertionError(f"README creates no key {key!r} (shardnet keygen --key {key})")


def placeholders(argv: Sequence[str]) -> set[str]:
    """The placeholder names used in ``argv``."""
    return {m for a in argv for m in PLACEHOLDER.findall(a)}


def substitute(argv: Sequence[str], values: Mapping[str, str | Sequence[str]]) -> list[str]:
    """``argv`` with every ``<NAME>`` replaced by ``values[NAME]`` (see the module docstring).

    Raises:
        AssertionError: a placeholder has no value, or a list value is not an option's value.
    """
    missing = placeholders(argv) - set(values)
    assert not missing, f"no value for {sorted(missing)} in {shlex.join(argv)}"
    out: list[str] = []
    for i, a in enumerate(argv):
        names = PLACEHOLDER.findall(a)
        lists = [n for n in names if not isinstance(values[n], str)]
        if not lists:
            out.append(PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), a))
            continue
        where = f"list placeholder {a} must be the whole value of an option"
        assert len(names) == 1, where
        assert i > 0, where
        assert argv[i - 1].startswith("--"), where
        opt = out.pop()
        for v in values[names[0]]:
            out += [opt, a.replace(f"<{names[0]}>", v)]
    return out
