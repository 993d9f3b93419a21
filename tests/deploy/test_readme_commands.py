"""The README's operator commands are complete and use options the CLI has (no root needed).

The multi-host test (test_operator_path.py) runs these commands; this one catches drift on
machines where it skips.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy import readme

KNOWN = {"RUN_ID", "TRAINER_IP", "TRAINER_ID", "RELAY_IP", "RELAY_ID", "PEER_IP", "PEER_ID"}


def test_operator_section_has_a_keyed_command_per_role() -> None:
    commands = readme.operator_commands()
    roles = readme.by_role(commands)
    assert set(roles) >= {"trainer", "relay", "peer"}
    for argv in roles.values():
        readme.keygen_for(commands, argv)
        assert readme.placeholders(argv) <= KNOWN, argv


@pytest.mark.parametrize("role", ["trainer", "relay", "peer"])
def test_readme_options_exist(role: str) -> None:
    argv = readme.by_role(readme.operator_commands())[role]
    res = subprocess.run(
        [sys.executable, "-m", "shardnet.cli", role, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    for opt in (a for a in argv if a.startswith("--")):
        assert opt in res.stdout, f"`shardnet {role}` has no option {opt}"


def test_substitute_repeats_list_options() -> None:
    argv = [
        "shardnet",
        "trainer",
        "--listen",
        "/ip4/<TRAINER_IP>/tcp/1",
        "--expect-peer",
        "<PEER_ID>",
    ]
    got = readme.substitute(argv, {"TRAINER_IP": "10.0.0.2", "PEER_ID": ["a", "b"]})
    assert got == [
        "shardnet", "trainer", "--listen", "/ip4/10.0.0.2/tcp/1",
        "--expect-peer", "a", "--expect-peer", "b",
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="RELAY_ID"):
        readme.substitute(["--upstream", "<RELAY_ID>"], {})
