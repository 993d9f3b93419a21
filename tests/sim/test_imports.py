"""Nothing imports ``simulations/``, except the CLI's simulate commands, lazily."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("p2p", "shardcast", "rollout", "trainer", "shardnet")


def test_only_the_cli_imports_simulations_lazily() -> None:
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n == "simulations" or n.startswith("simulations.") for n in names):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    assert path == ROOT / "shardnet" / "simulate_cli.py", where
                    assert id(node) not in top, f"{where}: must be imported lazily"


def test_simulations_does_not_import_torch() -> None:
    for path in (ROOT / "simulations").rglob("*.py"):
        assert "import torch" not in path.read_text(), path
