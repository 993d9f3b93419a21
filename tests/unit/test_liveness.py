"""The pure abandonment policy (DownloadWatch) and the superseded rule (worth_finishing)."""

from __future__ import annotations

import random
from pathlib import Path

from shardcast.core.catchup import worth_finishing
from shardcast.core.liveness import Abandon, Answer, DownloadWatch
from shardcast.publish.plan import Base, build_manifest
from shardcast.wire.codecs import XOR_ZSTD
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, make_checkpoint

SIZES = {"model-00001-of-00001.safetensors": 8000}


def watch(now: float = 0.0) -> DownloadWatch:
    w = DownloadWatch(now, no_source_grace_s=30.0, gone_grace_s=5.0, no_progress_s=100.0)
    w.add_source("a")
    w.add_source("b")
    return w


def test_gone_needs_every_source_for_the_grace() -> None:
    w = watch()
    w.on_answer("a", Answer.GONE, 1.0)
    w.tick(1.0, active=True)
    assert w.verdict(10.0) is None  # b has not said so
    w.on_answer("b", Answer.UNREACHABLE, 2.0)  # unreachable counts with a 404 elsewhere
    assert w.verdict(6.9) is None
    assert w.next_change(6.0) == 1.0
    assert w.verdict(7.0) is Abandon.GONE


def test_an_answer_that_shows_the_version_clears_gone() -> None:
    w = watch()
    w.on_answer("a", Answer.GONE, 0.0)
    w.on_answer("b", Answer.GONE, 0.0)
    w.on_answer("b", Answer.PRESENT, 4.0)  # 503: it holds it, just not this shard now
    assert w.verdict(20.0) is None
    assert not w.gone("b")


def test_unreachable_alone_is_not_gone() -> None:
    w = watch()
    w.on_answer("a", Answer.UNREACHABLE, 0.0)
    w.on_answer("b", Answer.UNREACHABLE, 0.0)
    assert w.verdict(29.0) is None


def test_activity_towards_gone_sources_is_not_usable() -> None:
    """404 is not a usable answer: requests that keep going to gone sources do not restart
    the no-source timer (the gone verdict comes first here, with a longer grace the other)."""
    w = DownloadWatch(0.0, no_source_grace_s=3.0, gone_grace_s=50.0, no_progress_s=100.0)
    w.add_source("a")
    w.on_answer("a", Answer.GONE, 1.0)
    for t in range(1, 10):
        w.tick(float(t), active=True)
    assert w.verdict(4.5) is Abandon.NO_SOURCE


def test_no_progress_bounds_a_source_that_only_says_503() -> None:
    w = watch()
    for t in range(200):
        w.on_answer("a", Answer.PRESENT, float(t))
        w.tick(float(t), active=True)
        if w.verdict(float(t)) is not None:
            break
    assert t == 101
    assert w.verdict(float(t)) is Abandon.NO_PROGRESS
    w.on_progress(float(t))
    assert w.verdict(float(t)) is None


def _chain(tmp_path: Path, steps: range, anchor: int | None = None) -> dict[int, Manifest]:
    out: dict[int, Manifest] = {}
    rng = random.Random(0)
    ck = make_checkpoint(tmp_path / "c0", SIZES, seed=0)
    prev: Manifest | None = None
    prev_dir = ck
    for step in steps:
        d = tmp_path / f"c{step}"
        d.mkdir()
        for f in prev_dir.iterdir():
            data = bytearray(f.read_bytes())
            if f.name.endswith(".safetensors"):
                data[rng.randrange(len(data))] ^= 1
            (d / f.name).write_bytes(data)
        base = None if prev is None or step == anchor else Base(prev.step, prev.digest, prev_dir)
        out[step] = build_manifest(
            d,
            "run",
            step,
            TRAINER,
            shard_size=2000,
            encodings=[XOR_ZSTD] if base else [],
            base=base,
            blob_dir=tmp_path / f"enc{step}",
        )
        prev, prev_dir = out[step], d
    return out


def test_worth_finishing(tmp_path: Path) -> None:
    ms = _chain(tmp_path, range(1, 5))
    assert worth_finishing(1, ms[1].digest, ms[2], {})  # the next one is a delta on it
    assert not worth_finishing(1, "0" * 64, ms[2], {})  # a delta on another publication
    assert worth_finishing(1, ms[1].digest, ms[4], {3: ms[3], 2: ms[2]})  # a cheap chain
    assert not worth_finishing(1, ms[1].digest, ms[4], {2: ms[2]})  # a link is gone
    anchored = _chain(tmp_path / "b", range(1, 4), anchor=3)
    assert not worth_finishing(1, anchored[1].digest, anchored[3], {2: anchored[2]})
    assert not worth_finishing(2, anchored[2].digest, anchored[3], {})
