"""Encoding a version from the bytes a trainer holds gives exactly what diffing the written files
gives: the same shard digests, chunk lists, file digests and blobs (sparse, xor-zstd where
denser, zstd), on a real ``tiny`` checkpoint, with shards that straddle tensors and the header."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from rollout.model import SINGLE_WEIGHTS_NAME, build_model, build_tokenizer
from shardcast.publish.encode import EncodeSettings, encode_file
from shardcast.publish.inmemory import (
    FileBytes,
    TensorBytes,
    encode_bytes,
    pre_encode_bytes,
    safetensors_file,
    safetensors_header,
    shard_views,
)
from shardcast.publish.layout import CheckpointLayoutError
from shardcast.publish.plan import Base, hash_parts, make_header
from shardcast.store.store import BLOB_DIR
from shardcast.wire import chunk_digests, codecs
from trainer.checkpoint import METADATA, WeightFile, file_bytes, save_checkpoint, weight_files
from trainer.encode import Layouts, TensorEncoder, usable

DELTAS = (codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD)


def _settings(shard: int, rooted: bool = True, chunk: int = 1 << 10) -> EncodeSettings:
    return EncodeSettings(shard, DELTAS, (0, "ab" * 32), codecs.DEFAULT_LEVEL, rooted, chunk)


def _step(model: torch.nn.Module, fraction: float, scale: float, seed: int) -> None:
    """Move a seeded ``fraction`` of every weight by ``scale`` (relative): a sparse update at a
    small scale, a dense one at a large scale (where xor-zstd can win)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < fraction
            p.add_(mask * p.abs() * scale)


def _layouts(weights: list[WeightFile], step: int) -> Layouts:
    made = {w.name: file_bytes(w) for w in weights}
    assert all(m is not None for m in made.values())
    return Layouts(
        step,
        {n: m[0] for n, m in made.items() if m is not None},
        {n: m[1] for n, m in made.items() if m is not None},
    )


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Layouts, Layouts]:
    """Version 0 and 1 of the tiny preset (two weight files), written and held in memory."""
    root = tmp_path_factory.mktemp("tiny")
    model = build_model("tiny", 0, dtype=torch.float32)
    tokenizer = build_tokenizer()
    out = []
    for step, (fraction, scale) in enumerate([(0.0, 0.0), (0.02, 0.01)]):
        _step(model, fraction, scale, seed=step)
        weights = weight_files(model, 1 << 17, copy=True)
        d = root / f"v{step}"
        save_checkpoint(model, tokenizer, d, 1 << 17, weights=weights)
        out.append((d, _layouts(weights, step)))
    assert len(out[1][1].files) > 1
    return out[0][0], out[1][0], out[0][1], out[1][1]


def test_held_bytes_are_the_written_files(versions: tuple[Path, Path, Layouts, Layouts]) -> None:
    _, v1, _, layouts = versions
    for name, f in layouts.files.items():
        assert b"".join(bytes(p) for p in f.pieces) == (v1 / name).read_bytes()


def test_header_is_the_librarys_for_every_dtype() -> None:
    """Tensors of every laid-out dtype (equal-size dtypes too, empty and 0-d tensors) sort and
    serialize as ``safetensors`` itself writes them."""
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16]
    dtypes += [torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64]
    dtypes += [torch.int64, torch.uint64]
    tensors = {f"t{k}.w": torch.ones(k % 3 + 1, 2, dtype=dt) for k, dt in enumerate(dtypes)}
    tensors["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    tensors["scalar"] = torch.tensor(3.0)
    tensors["é"] = torch.ones(1, dtype=torch.bfloat16)
    made = file_bytes(WeightFile("x.safetensors", tensors))
    assert made is not None
    assert b"".join(bytes(p) for p in made[0].pieces) == save(tensors, metadata=METADATA)


@pytest.mark.parametrize("shard", [1001, 4096, 65536, 1 << 24])
@pytest.mark.parametrize("rooted", [True, False])
@pytest.mark.parametrize("workers", [1, 3])
def test_same_digests_and_blobs_as_the_file_diff(
    versions: tuple[Path, Path, Layouts, Layouts],
    tmp_path: Path,
    shard: int,
    rooted: bool,
    workers: int,
) -> None:
    """Every shard size (odd, straddling tensors and the header, one shard per file), on one
    thread or several."""
    v0, v1, old, new = versions
    settings = _settings(shard, rooted)
    for name, f in new.files.items():
        disk: dict[str, bytes] = {}

        def blob(offset: int, enc: str) -> Path:
            return tmp_path / f"{offset}.{enc}"

        from_file = list(encode_file(v1 / name, f.size, settings, v0 / name, blob))
        for p in tmp_path.iterdir():
            disk[p.name] = p.read_bytes()
            p.unlink()
        from_memory = list(encode_bytes(f, old.files[name], settings, workers))
        assert [s for s, _ in from_file] == [s for s, _, _ in from_memory]
        assert [d for _, d in from_file] == [d for _, _, d in from_memory]
        memory = {f"{s.offset}.{e}": b for s, blobs, _ in from_memory for e, b in blobs.items()}
        assert memory == disk
        assert any(codecs.SPARSE in blobs for _, blobs, _ in from_memory)


def test_dense_update_keeps_xor_zstd(tmp_path: Path) -> None:
    """A dense step (the last bit of 90 % of the words flipped): the xor-zstd fallback wins,
    identically."""
    model = build_model("tiny", 1, dtype=torch.float32)
    w0 = weight_files(model, 1 << 30, copy=True)
    gen = torch.Generator().manual_seed(5)
    flipped = {}
    for name, t in w0[0].tensors.items():
        bits = (torch.rand(t.shape, generator=gen) < 0.9).to(torch.int16)
        flipped[name] = (t.view(torch.int16) ^ bits).view(t.dtype)
    w1 = [WeightFile(w0[0].name, flipped)]
    old, new = _layouts(w0, 0), _layouts(w1, 1)
    for step, w in enumerate([w0, w1]):
        tensors = w[0].tensors
        (tmp_path / f"v{step}").mkdir()
        (tmp_path / f"v{step}" / SINGLE_WEIGHTS_NAME).write_bytes(save(tensors, metadata=METADATA))
    f = new.files[SINGLE_WEIGHTS_NAME]
    settings = _settings(8192)
    kept: list[str] = []

    def blob(offset: int, enc: str) -> Path:
        kept.append(f"{offset}.{enc}")
        return tmp_path / "blobs" / f"{offset}.{enc}"

    (tmp_path / "blobs").mkdir()
    path = tmp_path / "v1" / SINGLE_WEIGHTS_NAME
    base = tmp_path / "v0" / SINGLE_WEIGHTS_NAME
    from_file = list(encode_file(path, f.size, settings, base, blob))
    from_memory = list(encode_bytes(f, old.files[SINGLE_WEIGHTS_NAME], settings, 2))
    assert [s for s, _ in from_file] == [s for s, _, _ in from_memory]
    memory = {f"{s.offset}.{e}": b for s, blobs, _ in from_memory for e, b in blobs.items()}
    assert memory == {k: (tmp_path / "blobs" / k).read_bytes() for k in kept}
    assert any(k.endswith(codecs.XOR_ZSTD) for k in memory)


def test_a_shard_sent_whole_has_a_chunk_list_and_a_delta_none(tmp_path: Path) -> None:
    """Every word rewritten at random (no delta, nor zstd, beats the raw bytes): each shard
    goes whole and gets its chunk list after all, from memory as from the file; in a sparse
    step's shards, which go as deltas, there is none."""
    model = build_model("tiny", 1, dtype=torch.float32)
    w0 = weight_files(model, 1 << 30, copy=True)
    gen = torch.Generator().manual_seed(6)
    rewritten = {
        name: torch.randint(-(1 << 15), 1 << 15, t.view(torch.int16).shape, generator=gen)
        .to(torch.int16)
        .view(t.dtype)
        for name, t in w0[0].tensors.items()
    }
    w1 = [WeightFile(w0[0].name, rewritten)]
    old, new = _layouts(w0, 0), _layouts(w1, 1)
    for step, w in enumerate([w0, w1]):
        (tmp_path / f"v{step}").mkdir()
        (tmp_path / f"v{step}" / SINGLE_WEIGHTS_NAME).write_bytes(
            save(w[0].tensors, metadata=METADATA)
        )
    f, settings = new.files[SINGLE_WEIGHTS_NAME], _settings(8192)
    path, base = tmp_path / "v1" / SINGLE_WEIGHTS_NAME, tmp_path / "v0" / SINGLE_WEIGHTS_NAME
    (tmp_path / "blobs").mkdir()
    from_file = list(
        encode_file(path, f.size, settings, base, lambda o, e: tmp_path / "blobs" / f"{o}.{e}")
    )
    from_memory = list(encode_bytes(f, old.files[SINGLE_WEIGHTS_NAME], settings, 2))
    assert [s for s, _ in from_file] == [s for s, _, _ in from_memory]
    data, whole = path.read_bytes(), 0
    for shard, blobs, _ in from_memory:
        raw = data[shard.offset : shard.offset + shard.length]
        if any(e in codecs.DELTAS for e in blobs):  # the safetensors header, unchanged
            assert shard.offset == 0
            assert shard.chunks == ()
        else:
            whole += 1
            assert shard.chunks == chunk_digests(raw, settings.chunk_bytes)
    assert whole >= len(from_memory) - 1 > 0


def test_a_shard_sent_as_a_delta_has_no_chunk_list(
    versions: tuple[Path, Path, Layouts, Layouts],
) -> None:
    _, _, old, new = versions
    deltas = 0
    for name, f in new.files.items():
        for shard, blobs, _ in encode_bytes(f, old.files[name], _settings(4096), 2):
            if any(e in codecs.DELTAS for e in blobs):
                deltas += 1
                assert shard.chunks == ()
            else:
                assert len(shard.chunks) == -(-shard.length // 1024)
    assert deltas


def test_no_base_or_another_size_gives_no_delta(
    versions: tuple[Path, Path, Layouts, Layouts],
) -> None:
    _, _, _old, new = versions
    name = sorted(new.files)[0]
    f = new.files[name]
    shorter = FileBytes("x", (f.pieces[0], f.pieces[1][:-2]))
    for base in (None, shorter):
        for s, blobs, _ in encode_bytes(f, base, _settings(4096)):
            assert set(blobs) <= {codecs.ZSTD}
            assert {e.encoding for e in s.encoded} == set(blobs)


def test_shard_views_straddle_pieces() -> None:
    """Shards over several pieces are copied, shards inside one are views of it."""
    data = bytes(range(256)) * 4
    cuts = [0, 3, 4, 100, 700, 1024]
    f = FileBytes("f", tuple(memoryview(data[a:b]) for a, b in itertools.pairwise(cuts)))
    g = FileBytes("g", (memoryview(data[::-1]),))
    for shard in (1, 7, 96, 1000, 4096):
        n = min(shard, len(data))
        offsets = []
        for offset, view, base in shard_views(f, g, shard, bytearray(n), bytearray(n)):
            offsets.append(offset)
            assert bytes(view) == data[offset : offset + shard]
            assert base is not None
            assert bytes(base) == data[::-1][offset : offset + shard]
        assert offsets == list(range(0, len(data), shard))
    buf = bytearray(50)
    views = shard_views(f, None, 50, buf, bytearray())
    assert next(views)[1].obj is buf  # [0, 50) straddles four pieces: copied
    next(views)
    assert next(views)[1].obj is f.pieces[3].obj  # [100, 150) lies in one piece: a view


def test_safetensors_file_rejects_what_does_not_tile() -> None:
    t = {"a": TensorBytes("BF16", (2,), memoryview(b"abcd"))}
    header = safetensors_header(list(t.items()), METADATA)
    data = {"a": memoryview(b"abcd")}
    assert safetensors_file("f", header, data).size == len(header) + 4
    with pytest.raises(CheckpointLayoutError, match="breaks the tiling"):
        safetensors_file("f", header, {"a": memoryview(b"abc")})
    with pytest.raises(CheckpointLayoutError, match="different tensors"):
        safetensors_file("f", header, {"b": memoryview(b"abcd")})
    with pytest.raises(CheckpointLayoutError, match="malformed"):
        safetensors_file("f", header[:-1], data)
    gap = json.dumps({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}}).encode()
    with pytest.raises(CheckpointLayoutError, match="breaks the tiling"):
        safetensors_file("f", struct.pack("<Q", len(gap)) + gap, data)
    with pytest.raises(CheckpointLayoutError, match="dtype"):
        safetensors_header([("a", TensorBytes("F8_E4M3", (4,), memoryview(b"abcd")))], {})
    with pytest.raises(CheckpointLayoutError, match="bytes for"):
        safetensors_header([("a", TensorBytes("BF16", (3,), memoryview(b"abcd")))], {})


def test_pre_encoded_from_memory_publish_the_same_parts(
    versions: tuple[Path, Path, Layouts, Layouts], tmp_path: Path
) -> None:
    """hash_parts with the trainer's results gives the parts and blobs it gives from disk,
    and reads no weight file."""
    v0, v1, old, new = versions
    base = Base(0, "ab" * 32, v0)
    header = make_header(v1, "run", 1, shard_size=4096, shards_per_part=8, base=base)
    header = dataclasses.replace(header, nonce="00" * 16)
    encodings = (codecs.SPARSE, codecs.XOR_ZSTD)
    settings = EncodeSettings(4096, encodings, (0, base.digest), codecs.DEFAULT_LEVEL)
    runs = []
    for pre in (None, TensorEncoder()):
        directory = tmp_path / ("disk" if pre is None else "memory")
        shutil.copytree(v1, directory)
        results = None
        if pre is not None:
            pre.published(old)
            found = pre.encode(new, settings, base, tmp_path / "cache")
            results = usable(directory, new, found)
            assert set(results) == set(new.files)
            for name in new.files:
                (directory / name).write_bytes(b"\0" * (directory / name).stat().st_size)
        parts = hash_parts(
            directory,
            header,
            header.digest(),
            encodings=encodings,
            base=base,
            blob_dir=directory / BLOB_DIR,
            on_part=lambda p: None,
            pre_encoded=results,
        )
        blobs = {p.name: p.read_bytes() for p in sorted((directory / BLOB_DIR).iterdir())}
        runs.append((parts, blobs))
    assert runs[0] == runs[1]


def test_encoder_needs_the_base_it_holds(
    versions: tuple[Path, Path, Layouts, Layouts], tmp_path: Path
) -> None:
    v0, _v1, old, new = versions
    enc = TensorEncoder()
    settings = _settings(4096)
    assert enc.encode(new, settings, Base(0, "ab" * 32, v0), tmp_path) == {}  # nothing held
    enc.published(old)
    assert enc.encode(new, settings, Base(7, "ab" * 32, v0), tmp_path) == {}  # another base
    nodelta = dataclasses.replace(settings, encodings=(codecs.ZSTD,), base=None)
    got = enc.encode(new, nodelta, None, tmp_path / "a")  # an anchor: hashes only
    assert set(got) == set(new.files)
    name = sorted(new.files)[0]
    pre = pre_encode_bytes(new.files[name], old.files[name], settings, tmp_path / "b")
    assert pre.blob(0, pre.shards[0].encoded[0].encoding).is_file()


def test_a_header_other_than_predicted_is_not_used(
    versions: tuple[Path, Path, Layouts, Layouts], tmp_path: Path
) -> None:
    _, v1, old, new = versions
    enc = TensorEncoder()
    enc.published(old)
    found = enc.encode(new, _settings(4096), Base(0, "ab" * 32, v1), tmp_path / "c")
    directory = tmp_path / "d"
    shutil.copytree(v1, directory)
    name = sorted(new.files)[0]
    data = bytearray((directory / name).read_bytes())
    data[9] ^= 1  # inside the JSON header
    (directory / name).write_bytes(bytes(data))
    assert set(usable(directory, new, found)) == set(new.files) - {name}
