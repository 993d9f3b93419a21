"""Replay the committed fuzz corpus (default suite): every decoder raises only its typed error,
within a memory bound, on every saved input, including the ones that once broke it."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from tests.fuzz.harness import as_input, check
from tests.fuzz.targets import BY_NAME

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(p for p in CORPUS.glob("*/*") if p.is_file())
PEAK_BOUND_BYTES = 32 << 20
"""Python allocations one decode may make (inputs are at most ~100 KiB)."""


def test_corpus_covers_every_decoder() -> None:
    assert {p.parent.name for p in FILES} == set(BY_NAME)


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_corpus_input(path: Path) -> None:
    target = BY_NAME[path.parent.name]
    data = as_input(target, path.read_bytes())
    tracemalloc.start()
    try:
        check(target, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND_BYTES, f"{path.name}: {peak >> 20} MiB"
