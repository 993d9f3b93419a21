"""The origin's file path (``encode.encode_file``: shards read, hashed and compared piece by
piece) gives exactly the digests, chunk lists and blobs of the straightforward definition:
BLAKE3 of the whole shard, ``chunk_digests`` of it unless a delta of it is kept (a shard sent
as a delta has no chunk list), ``encode_sparse_reference`` against the base's range,
``xor-zstd`` where more than 5 % of the words changed, ``zstd``; the smallest delta kept,
forms not smaller than the shard dropped."""

from __future__ import annotations

import random
from pathlib import Path

import blake3
import pytest

from shardcast.publish import encode
from shardcast.publish.encode import SPARSE_DENSE_FRACTION, EncodeSettings, encode_file
from shardcast.wire import chunk_digests, codecs, encode_sparse_reference, sparse_count

ENCODINGS = (codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD)


def _versions(size: int, seed: int) -> tuple[bytes, bytes]:
    """A base and its next version: a few words moved by one unit in most of the file, an
    unchanged stretch, a densely changed stretch (where ``xor-zstd`` is tried), and a last
    stretch of 45,000 random bytes (no form smaller than the raw shard)."""
    rng = random.Random(seed)
    base = bytearray(rng.getrandbits(4) for _ in range(size))  # compressible: zstd is kept
    new = bytearray(base)
    for i in rng.sample(range(size // 3), size // 300):
        new[i] = (new[i] + 1) % 256
    for i in range(2 * size // 3, size):  # dense: every byte of the last third, where
        new[i] ^= 0x80  # the XOR is one repeated byte and xor-zstd wins
    new[size - 1] ^= 0x5A
    for i in range(size - 45_000, size):  # rewritten at random: no delta beats the raw
        new[i] = rng.getrandbits(8)  # bytes, so the last shard goes whole, with a chunk list
    return bytes(base), bytes(new)


def _reference(
    new: bytes, base: bytes | None, s: EncodeSettings
) -> list[tuple[str, tuple[str, ...], dict[str, bytes]]]:
    out = []
    for off in range(0, len(new), s.shard_size):
        raw = new[off : off + s.shard_size]
        blobs: dict[str, bytes] = {}
        if base is not None:
            old = base[off : off + s.shard_size]
            blobs[codecs.SPARSE] = encode_sparse_reference(raw, old, s.zstd_level)
            if sparse_count(blobs[codecs.SPARSE]) > SPARSE_DENSE_FRACTION * (len(raw) // 2):
                blobs[codecs.XOR_ZSTD] = codecs.encode(codecs.XOR_ZSTD, raw, old, s.zstd_level)
            for _, loser in sorted((len(b), e) for e, b in blobs.items())[1:]:
                del blobs[loser]
        blobs[codecs.ZSTD] = codecs.encode(codecs.ZSTD, raw, level=s.zstd_level)
        blobs = {e: b for e, b in blobs.items() if len(b) < len(raw)}
        whole = base is None or not any(e in codecs.DELTAS for e in blobs)
        chunks = chunk_digests(raw, s.chunk_bytes) if s.chunk_bytes and whole else ()
        out.append((blake3.blake3(raw).hexdigest(), chunks, blobs))
    return out


@pytest.mark.parametrize(
    ("shard", "chunk", "piece", "workers", "with_base"),
    [
        (40_000, 1024, 4096, 1, True),  # many pieces, an odd last shard
        (40_001, 1024, 4096, 2, True),  # odd shards: the sparse tail byte
        (40_000, 0, 6000, 2, True),  # no chunk lists
        (40_000, 3000, 4096, 1, True),  # a chunk size that is not a power of two
        (40_000, 1001, 4096, 1, True),  # an odd chunk size: the shard is one piece
        (40_000, 1024, 1 << 20, 2, True),  # the default piece size: one piece per shard
        (40_000, 1024, 4096, 1, False),  # no base: zstd only
    ],
)
def test_encode_file_matches_the_definition(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shard: int,
    chunk: int,
    piece: int,
    workers: int,
    with_base: bool,
) -> None:
    monkeypatch.setattr(encode, "SCAN_PIECE_BYTES", piece)
    base, new = _versions(150_001, seed=shard + chunk + piece)
    (tmp_path / "v0").write_bytes(base)
    (tmp_path / "v1").write_bytes(new)
    blob_dir = tmp_path / "blobs"
    blob_dir.mkdir()
    settings = EncodeSettings(shard, ENCODINGS, (0, "ab" * 32), 3, True, chunk)
    got = list(
        encode_file(
            tmp_path / "v1",
            len(new),
            settings,
            tmp_path / "v0" if with_base else None,
            lambda off, enc: blob_dir / f"{off}.{enc}",
            workers,
        )
    )
    want = _reference(new, base if with_base else None, settings)
    assert [(s.digest, s.chunks) for s, _ in got] == [(d, c) for d, c, _ in want]
    for (shard_result, _), (_, _, blobs) in zip(got, want, strict=True):
        assert {e.encoding for e in shard_result.encoded} == set(blobs)
        for e in shard_result.encoded:
            data = (blob_dir / f"{shard_result.offset}.{e.encoding}").read_bytes()
            assert data == blobs[e.encoding]
            assert (e.size, e.digest) == (len(data), blake3.blake3(data).hexdigest())
    kinds = {e.encoding for s, _ in got for e in s.encoded}
    assert kinds == ({codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD} if with_base else {"zstd"})


def test_encode_file_whole_file_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema 2 (whole-file BLAKE3): the file digest over every piece, in order."""
    monkeypatch.setattr(encode, "SCAN_PIECE_BYTES", 4096)
    base, new = _versions(100_003, seed=7)
    (tmp_path / "v0").write_bytes(base)
    (tmp_path / "v1").write_bytes(new)
    settings = EncodeSettings(30_000, (codecs.SPARSE,), (0, "ab" * 32), 3, False, 1024)
    got = list(
        encode_file(
            tmp_path / "v1",
            len(new),
            settings,
            tmp_path / "v0",
            lambda off, enc: tmp_path / f"{off}.{enc}",
            workers=2,
        )
    )
    assert [d for _, d in got] == [None] * (len(got) - 1) + [blake3.blake3(new).hexdigest()]
