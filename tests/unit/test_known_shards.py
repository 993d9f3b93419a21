"""Shards encoded while their file is still being written (``KnownShards``): used at publish
only where the bytes hash the same again, and the version's parts and blobs are exactly those
of a serial publish, whatever the writer did meanwhile."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import trio

from shardcast.publish import encode
from shardcast.publish.encode import (
    EncodeSettings,
    KnownShards,
    PreEncoded,
    encode_file,
    encode_known,
)
from shardcast.publish.plan import Base, hash_parts, make_header
from shardcast.publish.preencode import FileIdentity, PreEncodeCache, PreEncoder
from shardcast.store.store import BLOB_DIR
from shardcast.wire import codecs
from shardcast.wire.manifest import Part
from tests.helpers import make_checkpoint, next_checkpoint

SHARD = 2048
NAME = "model-00001-of-00002.safetensors"
SIZES = {NAME: 5 * SHARD + 300, "model-00002-of-00002.safetensors": 3000}
ENCODINGS = (codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD)
BASE_DIGEST = "cd" * 32


def _versions(tmp_path: Path) -> tuple[Base, Path]:
    """A base checkpoint and its next version with a few 16-bit words changed per file."""
    base = make_checkpoint(tmp_path / "base", SIZES, seed=1)
    new = next_checkpoint(base, tmp_path / "new", SIZES, seed=5, every=300)
    return Base(0, BASE_DIGEST, base), new


def _settings(base: Base | None, encodings: tuple[str, ...] = ENCODINGS) -> EncodeSettings:
    return EncodeSettings(
        SHARD, encodings, None if base is None else (base.step, base.digest), codecs.DEFAULT_LEVEL
    )


def _publish(
    directory: Path,
    base: Base,
    known: dict[str, KnownShards] | None,
    pre_encoded: dict[str, PreEncoded] | None = None,
) -> tuple[list[Part], dict[str, bytes]]:
    """hash_parts as the origin runs it; returns the parts and the blobs."""
    header = make_header(directory, "run", 1, shard_size=SHARD, shards_per_part=2, base=base)
    header = dataclasses.replace(header, nonce="00" * 16)  # every run: the same header
    blob_dir = directory / BLOB_DIR
    parts = hash_parts(
        directory,
        header,
        header.digest(),
        encodings=ENCODINGS,
        base=base,
        blob_dir=blob_dir,
        on_part=lambda p: None,
        known=known,
        pre_encoded=pre_encoded,
    )
    blobs = {p.name: p.read_bytes() for p in sorted(blob_dir.iterdir())}
    shutil.rmtree(blob_dir)
    return parts, blobs


def _growing(new: Path, tmp_path: Path, upto: int) -> Path:
    """A copy of ``new``'s file ``NAME`` as a writer has it after ``upto`` bytes."""
    path = tmp_path / "growing" / NAME
    path.parent.mkdir(exist_ok=True)
    path.write_bytes((new / NAME).read_bytes()[:upto])
    return path


def _confirmed(path: Path, base: Base | None, known: KnownShards) -> list[int]:
    """Offsets of the shards that encode_file took from ``known`` (not encoded again), with
    the settings of ``base`` (None: zstd only)."""
    out = []
    settings = _settings(base) if base else _settings(None, (codecs.ZSTD,))
    base_path = base.directory / NAME if base else None
    size = path.stat().st_size
    blob_dir = path.parent / "final"
    blob_dir.mkdir(exist_ok=True)
    for shard, _ in encode_file(
        path, size, settings, base_path, lambda o, e: blob_dir / f"{o}.{e}", 2, known
    ):
        if known.shards.get(shard.offset) is shard:
            out.append(shard.offset)
    return out


def test_shards_known_while_writing_give_the_serial_parts_and_blobs(tmp_path: Path) -> None:
    base, new = _versions(tmp_path)
    serial = _publish(new, base, None)
    growing = _growing(new, tmp_path, 3 * SHARD + 100)
    known = encode_known(
        growing, [0, SHARD, 2 * SHARD], _settings(base), base.directory / NAME, tmp_path / "c", "x."
    )
    assert sorted(known.shards) == [0, SHARD, 2 * SHARD]
    assert known.with_base
    assert any(e.encoding == codecs.SPARSE for s in known.shards.values() for e in s.encoded)
    # the writer finishes the file: every known shard is confirmed, the parts are the serial ones
    shutil.copyfile(new / NAME, growing)
    assert _confirmed(growing, base, known) == [0, SHARD, 2 * SHARD]
    assert _publish(new, base, {NAME: known}) == serial
    # a writer that went back and rewrote shard 1 (same size): that one is encoded again
    data = bytearray((new / NAME).read_bytes())
    data[SHARD + 10] ^= 0xFF
    (new / NAME).write_bytes(bytes(data))
    shutil.copyfile(new / NAME, growing)
    assert _confirmed(growing, base, known) == [0, 2 * SHARD]
    assert _publish(new, base, {NAME: known}) == _publish(new, base, None)


def test_known_shards_of_other_settings_base_or_length_are_not_used(tmp_path: Path) -> None:
    base, new = _versions(tmp_path)
    growing = _growing(new, tmp_path, 2 * SHARD)
    offsets = [0, SHARD]
    known = encode_known(
        growing, offsets, _settings(base), base.directory / NAME, tmp_path / "c", "x."
    )
    shutil.copyfile(new / NAME, growing)
    # other settings (no base, no delta asked): none used with these, all with their own
    other = encode_known(
        growing, offsets, _settings(None, (codecs.ZSTD,)), None, tmp_path / "d", "x."
    )
    assert not other.with_base
    assert _confirmed(growing, base, other) == []
    assert _confirmed(growing, None, other) == offsets
    # the final file has no base of its size (a base file of another size): none used
    serial = _publish(new, base, None)
    cut = base.directory / NAME
    cut_data = cut.read_bytes()
    cut.write_bytes(cut_data[:-1])
    assert _confirmed(growing, base, known) == []
    assert _publish(new, base, {NAME: known}) == _publish(new, base, None) != serial
    cut.write_bytes(cut_data)
    # the final file ends inside a known shard: that shard is not used
    short = tmp_path / "short" / NAME
    short.parent.mkdir()
    short.write_bytes((new / NAME).read_bytes()[: SHARD + 5])
    assert _confirmed(short, None, other) == [0]
    # a blob removed from the cache meanwhile: the shard is encoded again
    for p in (tmp_path / "c").glob(f"x.{SHARD}.*"):
        p.unlink()
    assert _confirmed(growing, base, known) == [0]
    assert _publish(new, base, {NAME: known}) == serial


def test_a_shard_that_changes_between_its_two_reads_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zstd needs a shard's whole bytes, read a second time: if they no longer hash to the
    first read's digest (the writer rewrote it meanwhile), the shard is not known at all."""
    _, new = _versions(tmp_path)
    growing = _growing(new, tmp_path, 2 * SHARD)
    real = encode._FileShards._whole

    def rewritten(self: encode._FileShards, offset: int, length: int, digest: str) -> object:
        if offset == SHARD:
            with growing.open("r+b") as fh:
                fh.seek(SHARD + 1)
                fh.write(b"\x00\xff")
        return real(self, offset, length, digest)

    monkeypatch.setattr(encode._FileShards, "_whole", rewritten)
    settings = _settings(None, (codecs.ZSTD,))
    known = encode_known(growing, [0, SHARD], settings, None, tmp_path / "c", "x.")
    assert sorted(known.shards) == [0]
    # a file that is not being written (encode_file) reads it twice without the check
    monkeypatch.setattr(encode._FileShards, "_whole", real)
    got = list(encode_file(growing, 2 * SHARD, settings, None, lambda o, e: tmp_path / f"{o}{e}"))
    assert len(got) == 2


def _ident(size: int, modified_s: float) -> FileIdentity:
    ns = int(modified_s * 1e9)
    return FileIdentity(1, 10, size, ns, ns)


def test_cache_picks_whole_shards_below_a_growing_files_size() -> None:
    s = _settings(None)
    now_s = 100.0
    cache = PreEncodeCache()
    growing = _ident(2 * SHARD + 10, now_s - 0.01)
    listing = {
        NAME: growing,
        "quiet.safetensors": _ident(4 * SHARD, now_s - 5),
        "x.safetensors.tmp": _ident(4 * SHARD, now_s),
        "small.json": _ident(100, now_s),
    }
    now = int(now_s * 1e9)
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {NAME: [0, SHARD]}
    # not with whole-file digests: they cannot be confirmed shard by shard
    assert cache.regions_wanted(3, dataclasses.replace(s, rooted=False), listing, now, 1.0) == {}
    first = KnownShards(NAME, s, False, {0: _shard(0)}, Path("/c"), "a.")
    assert cache.add_known(3, NAME, first)
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {NAME: [SHARD]}
    more = KnownShards(NAME, s, False, {SHARD: _shard(SHARD)}, Path("/c"), "a.")
    assert cache.add_known(3, NAME, more)
    assert sorted(cache.known(3, NAME).shards) == [0, SHARD]  # type: ignore[union-attr]
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {}
    # grown by a shard: only the new one
    listing[NAME] = _ident(3 * SHARD, now_s - 0.01)
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {NAME: [2 * SHARD]}
    # written again from the start (shorter than the known shards): forgotten
    listing[NAME] = _ident(SHARD, now_s - 0.01)
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {NAME: [0]}
    assert cache.known(3, NAME) is None
    assert cache.add_known(3, NAME, first)
    # at the marker: known shards of the files not taken whole
    listing[NAME] = _ident(2 * SHARD, now_s - 0.01)
    ahead = cache.take(3, listing)
    assert ahead.files == {}
    assert ahead.known == {NAME: first}
    # closed: nothing more, and nothing recorded
    assert cache.regions_wanted(3, s, listing, now, 1.0) == {}
    assert not cache.add_known(3, NAME, more)


def _shard(offset: int) -> encode.ShardResult:
    return encode.ShardResult(offset, SHARD, "e" * 64, ())


def test_pre_encoder_encodes_a_growing_file_shard_by_shard(tmp_path: Path) -> None:
    """The watched file grows past two shards: they are encoded then; once it is whole and
    quiet, the full pre-encode confirms them (same result as encoding it from scratch); a
    file still growing at the marker goes to the publish as known shards."""
    base, new = _versions(tmp_path)
    watch = tmp_path / "watch"
    step_dir = watch / "step-1"
    step_dir.mkdir(parents=True)
    settings = _settings(base)
    clock = [time.time_ns()]  # files written "now" are not quiet
    pre = PreEncoder(
        lambda step: (settings, base), tmp_path / "pre", 1.0, clock_ns=lambda: clock[0]
    )
    data = (new / NAME).read_bytes()

    async def main() -> None:
        (step_dir / NAME).write_bytes(data[: 2 * SHARD + 7])
        assert await pre.scan_once(watch, "DONE") == 1
        assert pre.encoded_shards == 2
        assert pre.encoded_files == 0
        assert await pre.scan_once(watch, "DONE") == 0  # nothing new below its size
        with (step_dir / NAME).open("ab") as fh:
            fh.write(data[2 * SHARD + 7 :])
        assert await pre.scan_once(watch, "DONE") == 1
        assert pre.encoded_shards == 5
        known = pre.cache.known(1, NAME)
        assert known is not None
        assert sorted(known.shards) == [o * SHARD for o in range(5)]
        # at the marker, still not quiet: handed to the publish as known shards
        (step_dir / "DONE").touch()
        ahead = await pre.take(1, step_dir)
        assert ahead.files == {}
        assert set(ahead.known) == {NAME}
        shutil.copyfile(step_dir / NAME, new / NAME)
        assert _publish(new, base, ahead.known) == _publish(new, base, None)

    trio.run(main)


def test_a_growing_file_that_turns_quiet_is_encoded_by_confirming_its_shards(
    tmp_path: Path,
) -> None:
    base, new = _versions(tmp_path)
    watch = tmp_path / "watch"
    (watch / "step-1").mkdir(parents=True)
    path = watch / "step-1" / NAME
    clock = [time.time_ns()]
    settings = _settings(base)
    pre = PreEncoder(
        lambda step: (settings, base), tmp_path / "pre", 1.0, clock_ns=lambda: clock[0]
    )

    async def main() -> None:
        path.write_bytes((new / NAME).read_bytes())
        assert await pre.scan_once(watch, "DONE") == 1
        known = pre.cache.known(1, NAME)
        assert known is not None
        assert len(known.shards) == 5
        clock[0] += 5 * 10**9  # quiet now
        assert await pre.scan_once(watch, "DONE") == 1
        assert pre.encoded_files == 1
        (watch / "step-1" / "DONE").touch()
        ahead = await pre.take(1, watch / "step-1")
        result = ahead.files[NAME]
        assert [known.shards.get(s.offset) is s for s in result.shards] == [True] * 5 + [False]
        assert _publish(new, base, ahead.known, ahead.files) == _publish(new, base, None)

    trio.run(main)
