"""Pipelined origin encoding: files hashed and encoded ahead give the same parts, are used only
while unchanged, and are picked up when written in place or atomically (temp + rename)."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from shardcast.publish.encode import EncodeSettings, PreEncoded, encode_file
from shardcast.publish.layout import CheckpointLayoutError
from shardcast.publish.plan import Base, hash_parts, make_header
from shardcast.publish.preencode import (
    Ahead,
    FileIdentity,
    PreEncodeCache,
    PreEncoder,
    candidate_name,
    list_identities,
    pre_encode_file,
    quiet,
)
from shardcast.store.store import BLOB_DIR
from shardcast.wire import codecs
from shardcast.wire.manifest import Part
from tests.helpers import make_checkpoint, next_checkpoint

SIZES = {
    "model-00001-of-00002.safetensors": 10_000,
    "model-00002-of-00002.safetensors": 7_000,
}
SHARD = 2048
ENCODINGS = (codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD)
BASE_DIGEST = "ab" * 32


def _versions(tmp_path: Path) -> tuple[Path, Path]:
    """A base checkpoint and its next version with a few 16-bit words changed per file."""
    base = make_checkpoint(tmp_path / "base", SIZES, seed=1)
    new = next_checkpoint(base, tmp_path / "new", SIZES, seed=7, every=200)
    return base, new


def _settings(base: Base | None) -> EncodeSettings:
    return EncodeSettings(
        SHARD,
        ENCODINGS if base is not None else (codecs.ZSTD,),
        None if base is None else (base.step, base.digest),
        codecs.DEFAULT_LEVEL,
    )


def _publish(
    directory: Path, base: Base | None, pre: dict[str, PreEncoded] | None, workers: int = 1
) -> tuple[list[Part], list[int], dict[str, bytes]]:
    """hash_parts as the origin runs it; returns parts, emission order and the blobs."""
    header = make_header(directory, "run", 1, shard_size=SHARD, shards_per_part=2, base=base)
    header = dataclasses.replace(header, nonce="00" * 16)  # both runs: the same header
    seen: list[int] = []
    blob_dir = directory / BLOB_DIR
    parts = hash_parts(
        directory,
        header,
        header.digest(),
        encodings=_settings(base).encodings,
        base=base,
        blob_dir=blob_dir,
        on_part=lambda p: seen.append(p.index),
        pre_encoded=pre,
        workers=workers,
    )
    blobs = {p.name: p.read_bytes() for p in sorted(blob_dir.iterdir())}
    shutil.rmtree(blob_dir)
    return parts, seen, blobs


def test_pre_encoded_files_give_identical_parts_and_blobs(tmp_path: Path) -> None:
    base_dir, new = _versions(tmp_path)
    base = Base(0, BASE_DIGEST, base_dir)
    serial, order, serial_blobs = _publish(new, base, None)
    assert order == sorted(order)
    assert any(e.encoding == codecs.SPARSE for p in serial for es in p.encodings for e in es)
    # the second weight file was encoded ahead (the trainer wrote it first): its parts go first
    name = "model-00002-of-00002.safetensors"
    pre = pre_encode_file(
        new / name, name, SIZES[name], _settings(base), base, tmp_path / "cache" / "step-1"
    )
    piped, order, piped_blobs = _publish(new, base, {name: pre})
    assert piped == serial
    assert piped_blobs == serial_blobs
    assert order != sorted(order)
    assert sorted(order) == list(range(len(serial)))


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("with_base", [True, False])
def test_shards_encoded_on_threads_give_identical_parts_and_blobs(
    tmp_path: Path, workers: int, with_base: bool
) -> None:
    base_dir, new = _versions(tmp_path)
    base = Base(0, BASE_DIGEST, base_dir) if with_base else None
    serial, order, serial_blobs = _publish(new, base, None)
    threaded, t_order, threaded_blobs = _publish(new, base, None, workers)
    assert threaded == serial
    assert threaded_blobs == serial_blobs
    assert t_order == order
    name = "model-00002-of-00002.safetensors"
    one = pre_encode_file(new / name, name, SIZES[name], _settings(base), base, tmp_path / "a")
    many = pre_encode_file(
        new / name, name, SIZES[name], _settings(base), base, tmp_path / "b", workers
    )
    assert many.shards == one.shards
    assert many.digest == one.digest


def test_a_base_of_another_size_gets_no_delta_on_threads_either(tmp_path: Path) -> None:
    base_dir, new = _versions(tmp_path)
    base = Base(0, BASE_DIGEST, base_dir)

    def deltas(blobs: dict[str, bytes]) -> int:
        return sum(n.endswith((codecs.SPARSE, codecs.XOR_ZSTD)) for n in blobs)

    whole = deltas(_publish(new, base, None, 2)[2])
    name = "model-00001-of-00002.safetensors"
    with open(base_dir / name, "r+b") as fh:
        fh.truncate(SIZES[name] - 1)
    serial, _, serial_blobs = _publish(new, base, None)
    threaded, _, threaded_blobs = _publish(new, base, None, 2)
    assert threaded == serial
    assert threaded_blobs == serial_blobs
    assert deltas(threaded_blobs) == whole - -(-SIZES[name] // SHARD)  # none for that file


def test_a_file_shorter_than_announced_fails_on_threads(tmp_path: Path) -> None:
    _, new = _versions(tmp_path)
    name = "model-00001-of-00002.safetensors"
    settings = _settings(None)
    with pytest.raises(CheckpointLayoutError, match="changed while hashing"):
        list(
            encode_file(
                new / name,
                SIZES[name] + SHARD,
                settings,
                None,
                lambda o, e: tmp_path / f"{o}.{e}",
                2,
            )
        )


def test_pre_encoded_file_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, new = _versions(tmp_path)
    names = sorted(SIZES)
    pre = {
        n: pre_encode_file(new / n, n, SIZES[n], _settings(None), None, tmp_path / "c")
        for n in names
    }
    serial, _, _ = _publish(new, None, None)
    import shardcast.publish.plan as plan

    read: list[Path] = []
    real = plan.encode_file

    def spy(path: Path, *args: Any) -> Any:
        read.append(path)
        return real(path, *args)

    monkeypatch.setattr(plan, "encode_file", spy)
    piped, _, _ = _publish(new, None, pre)
    assert piped == serial
    # only the files not encoded ahead
    assert sorted(read) == [new / "config.json", new / "model.safetensors.index.json"]


def test_results_of_other_settings_or_size_are_not_used(tmp_path: Path) -> None:
    base_dir, new = _versions(tmp_path)
    base = Base(0, BASE_DIGEST, base_dir)
    name = sorted(SIZES)[0]
    # encoded against another base (or without one): read again, same parts as serial
    other = pre_encode_file(new / name, name, SIZES[name], _settings(None), None, tmp_path / "c")
    serial, _, blobs = _publish(new, base, None)
    piped, order, piped_blobs = _publish(new, base, {name: other})
    assert (piped, piped_blobs, order) == (serial, blobs, sorted(order))
    # blobs removed from the cache meanwhile: read again
    pre = pre_encode_file(new / name, name, SIZES[name], _settings(base), base, tmp_path / "d")
    for p in (tmp_path / "d").iterdir():
        p.unlink()
    assert _publish(new, base, {name: pre})[0] == serial


def test_cache_decisions() -> None:
    s = _settings(None)
    now = 100 * 10**9
    old = FileIdentity(1, 10, 500, now - 5 * 10**9, now - 5 * 10**9)
    fresh = FileIdentity(1, 11, 500, now - 10**8, now - 10**8)
    listing = {
        "a.safetensors": old,
        "b.safetensors": fresh,
        ".hidden": old,
        "c.safetensors.tmp": old,
        "empty.json": FileIdentity(1, 12, 0, 0, 0),
    }
    assert quiet(old, now, 1.0)
    assert not quiet(fresh, now, 1.0)
    assert not candidate_name("manifest.json")
    assert candidate_name("config.json")
    cache = PreEncodeCache()
    assert cache.wanted(3, s, listing, now, 1.0) == ["a.safetensors"]
    res = PreEncoded("a.safetensors", 500, s, (), "d" * 64, Path("/nonexistent"))
    # changed while being read: not recorded, wanted again
    moved = FileIdentity(1, 10, 500, now, now)
    assert not cache.add(3, "a.safetensors", old, moved, res)
    assert cache.wanted(3, s, listing, now, 1.0) == ["a.safetensors"]
    assert cache.add(3, "a.safetensors", old, old, res)
    assert cache.wanted(3, s, listing, now, 1.0) == []
    # settings moved on (e.g. the base was committed meanwhile): results dropped
    s2 = _settings(Base(2, BASE_DIGEST, Path("/b")))
    assert cache.wanted(3, s2, listing, now, 1.0) == ["a.safetensors"]
    assert not cache.add(3, "a.safetensors", old, old, res)  # old settings
    assert cache.wanted(3, s, listing, now, 1.0) == ["a.safetensors"]
    assert cache.add(3, "a.safetensors", old, old, res)
    # at the marker: only results whose file is unchanged since
    assert cache.take(3, {"a.safetensors": moved}).files == {}
    assert cache.take(3, {"a.safetensors": old}).files == {"a.safetensors": res}
    # closed: nothing more for steps up to 3
    assert cache.wanted(3, s, {"z.safetensors": old}, now, 1.0) == []
    assert cache.wanted(2, s, {"z.safetensors": old}, now, 1.0) == []
    assert cache.drop_through(3) == [3]


def _write(path: Path, data: bytes, mtime_s: float) -> None:
    path.write_bytes(data)
    os.utime(path, (mtime_s, mtime_s))


def test_pre_encoder_in_place_and_atomic_writes(tmp_path: Path) -> None:
    """Files written in place, then rewritten; a file written as temp + rename; restarts."""
    watch = tmp_path / "watch"
    step_dir = watch / "step-1"
    step_dir.mkdir(parents=True)
    cache_dir = tmp_path / "staging" / ".pre"
    rng = random.Random(3)
    settings = _settings(None)
    clock = [time.time_ns() + 60 * 10**9]  # a minute ahead: every file is quiet

    def make() -> PreEncoder:
        return PreEncoder(lambda step: (settings, None), cache_dir, 1.0, clock_ns=lambda: clock[0])

    async def main() -> None:
        pre = make()
        a, b = step_dir / "a.safetensors", step_dir / "b.safetensors"
        _write(a, rng.randbytes(5000), 1_000)
        assert await pre.scan_once(watch, "DONE") == 1
        assert await pre.scan_once(watch, "DONE") == 0  # nothing new
        # b is written as a temp file: never taken under that name; renamed: taken at once
        tmp = step_dir / "b.safetensors.tmp"
        _write(tmp, rng.randbytes(3000), 1_000)
        assert await pre.scan_once(watch, "DONE") == 0
        os.rename(tmp, b)
        assert await pre.scan_once(watch, "DONE") == 1
        # a is rewritten in place (same size) after it was encoded: its result is not used
        a_data = rng.randbytes(5000)
        with a.open("r+b") as fh:
            fh.write(a_data)
        (step_dir / "DONE").touch()
        taken = (await pre.take(1, step_dir)).files
        assert sorted(taken) == ["b.safetensors"]
        assert (
            taken["b.safetensors"].digest
            == pre_encode_file(b, "b.safetensors", 3000, settings, None, tmp_path / "x").digest
        )
        pre.published(1)
        assert not (cache_dir / "step-1").exists()
        # step 2 is partly encoded, then the origin restarts: the cache starts empty
        (watch / "step-2").mkdir()
        _write(watch / "step-2" / "a.safetensors", a_data, 1_000)
        assert await pre.scan_once(watch, "DONE") == 1
        assert (cache_dir / "step-2").is_dir()
        pre2 = make()
        assert not cache_dir.exists()
        (watch / "step-2" / "DONE").touch()
        assert await pre2.take(2, watch / "step-2") == Ahead()

    trio.run(main)


def test_files_not_yet_quiet_wait(tmp_path: Path) -> None:
    watch = tmp_path / "watch"
    (watch / "step-4").mkdir(parents=True)
    (watch / "step-4" / "a.safetensors").write_bytes(b"x" * 100)
    clock = [time.time_ns()]
    plans: list[int] = []

    def plan(step: int) -> tuple[EncodeSettings, Base | None] | None:
        plans.append(step)
        return (_settings(None), None)

    pre = PreEncoder(plan, tmp_path / "pre", 30.0, clock_ns=lambda: clock[0])

    async def main() -> None:
        assert await pre.scan_once(watch, "DONE") == 0  # written just now
        clock[0] += 31 * 10**9
        assert await pre.scan_once(watch, "DONE") == 1
        assert sorted(list_identities(watch / "step-4")) == ["a.safetensors"]

    trio.run(main)
    assert plans == [4, 4]


def test_a_file_completed_meanwhile_is_encoded_without_waiting_a_poll(tmp_path: Path) -> None:
    """b settles while a is being encoded: the same call encodes it too (file by file)."""
    watch = tmp_path / "watch"
    (watch / "step-4").mkdir(parents=True)
    now_s = time.time()
    _write(watch / "step-4" / "a.safetensors", b"a" * 100, 1_000)
    _write(watch / "step-4" / "b.safetensors", b"b" * 100, now_s + 50)  # modified "later"
    times = iter([now_s + 15, now_s + 70, now_s + 70])  # each scan's clock: b quiet at the 2nd
    pre = PreEncoder(
        lambda step: (_settings(None), None),
        tmp_path / "pre",
        10.0,
        clock_ns=lambda: int(next(times) * 1e9),
    )
    assert trio.run(pre.scan_until_idle, watch, "DONE") == 2
    assert pre.encoded_files == 2


def test_undecided_base_waits(tmp_path: Path) -> None:
    watch = tmp_path / "watch"
    (watch / "step-5").mkdir(parents=True)
    _write(watch / "step-5" / "a.safetensors", b"y" * 100, 1_000)
    pre = PreEncoder(lambda step: None, tmp_path / "pre", 0.0)
    assert trio.run(pre.scan_once, watch, "DONE") == 0
