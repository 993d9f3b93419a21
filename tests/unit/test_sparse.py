"""The sparse delta encoding (shardcast.wire.sparse): exact round trips and bounded hostile
input."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from shardcast.publish.plan import Base, build_manifest
from shardcast.wire import codecs
from shardcast.wire.sparse import (
    HEADER_BYTES,
    MAGIC,
    SparseError,
    changed_words,
    decode_sparse,
    encode_changes,
    encode_sparse,
    encode_sparse_reference,
)


def _rl_update(n_bytes: int, fraction: float, seed: int) -> tuple[bytes, bytes]:
    """A bf16 buffer and its next version with ``fraction`` of the elements moved +-1 ulp."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n_bytes // 2).astype(np.float32) * 0.02).view(np.uint32) >> 16
    base16 = base.astype(np.uint16)
    new = base16.copy()
    moved = rng.random(len(new)) < fraction
    new[moved] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), int(moved.sum()))
    return new.tobytes(), base16.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_encoder_matches_the_reference_bytes(raw: bytes, data: st.DataObject) -> None:
    """Any length (odd, not a multiple of 8), any mix of equal and changed bytes."""
    keep = data.draw(st.lists(st.booleans(), min_size=len(raw), max_size=len(raw)))
    other = data.draw(st.binary(min_size=len(raw), max_size=len(raw)))
    base = bytes(r if k else o for r, k, o in zip(raw, keep, other, strict=True))
    assert encode_sparse(raw, base) == encode_sparse_reference(raw, base)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_changes_found_piece_by_piece_give_the_reference_bytes(
    raw: bytes, data: st.DataObject
) -> None:
    """``encode_changes`` of the changes of even-length pieces, concatenated with their
    indices shifted by each piece's word offset (as the origin scans a shard), is the blob."""
    keep = data.draw(st.lists(st.booleans(), min_size=len(raw), max_size=len(raw)))
    other = data.draw(st.binary(min_size=len(raw), max_size=len(raw)))
    base = bytes(r if k else o for r, k, o in zip(raw, keep, other, strict=True))
    piece = 2 * data.draw(st.integers(1, 80))
    found = [
        changed_words(raw[at : at + piece], base[at : at + piece])
        for at in range(0, len(raw), piece)
    ]
    index = np.concatenate(
        [np.zeros(0, np.int64)] + [i + k * piece // 2 for k, (i, _) in enumerate(found)]
    )
    diff = np.concatenate([np.zeros(0, "<u2")] + [d for _, d in found])
    tail = raw[-1] if len(raw) % 2 else None
    assert encode_changes(index, diff, len(raw), tail) == encode_sparse_reference(raw, base)


def test_encode_changes_refuses_a_tail_that_does_not_fit() -> None:
    empty = np.zeros(0, np.int64), np.zeros(0, "<u2")
    with pytest.raises(LocalProtocolError):
        encode_changes(*empty, 3, None)
    with pytest.raises(LocalProtocolError):
        encode_changes(*empty, 4, 7)


@pytest.mark.parametrize(
    "n_bytes", [0, 1, 2, 7, 8, 9, 14, 15, 16, 17, 1 << 20, (1 << 20) + 6, 5 * 2**19 + 3]
)
@pytest.mark.parametrize("kind", ["none", "all", "sparse", "tail_only"])
def test_encoder_matches_the_reference_at_edges(n_bytes: int, kind: str) -> None:
    """No change, every byte changed, a sparse update and a change in the last bytes only, at
    lengths around the 8-byte blocks and over more than one scan slice."""
    rng = np.random.default_rng(n_bytes)
    base = rng.integers(0, 256, n_bytes, dtype=np.uint8)
    raw = base.copy()
    if kind == "all":
        raw += 1
    elif kind == "sparse":
        moved = rng.random(n_bytes) < 0.02
        raw[moved] ^= rng.integers(1, 256, int(moved.sum()), dtype=np.uint8)
    elif kind == "tail_only":
        raw[-3:] ^= 0x5A
    a, b = raw.tobytes(), base.tobytes()
    blob = encode_sparse(a, b)
    assert blob == encode_sparse_reference(a, b)
    assert bytes(decode_sparse(blob, n_bytes, b)) == a


def test_changed_words_reads_unaligned_views() -> None:
    """Buffers that start at an odd address (a view into a larger buffer) scan the same."""
    raw, base = _rl_update(1 << 16, 0.05, seed=3)
    a, b = memoryview(b"x" + raw)[1:], memoryview(b"yyy" + base)[3:]
    idx, diff = changed_words(a, b)
    new, old = np.frombuffer(raw, "<u2"), np.frombuffer(base, "<u2")
    want = np.flatnonzero(new != old)
    assert idx.tolist() == want.tolist()
    assert diff.tolist() == (new[want] - old[want]).tolist()
    assert encode_sparse(a, b) == encode_sparse_reference(raw, base)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=257), st.data())
def test_round_trip_any_bytes(raw: bytes, data: st.DataObject) -> None:
    base = data.draw(st.binary(min_size=len(raw), max_size=len(raw)))
    blob = encode_sparse(raw, base)
    assert bytes(decode_sparse(blob, len(raw), base)) == raw
    assert bytes(codecs.decode(codecs.SPARSE, blob, len(raw), base)) == raw


def test_round_trip_in_place_touches_only_changes() -> None:
    raw, base = _rl_update(1 << 16, 0.02, seed=1)
    blob = encode_sparse(raw, base)
    buf = bytearray(base)
    out = decode_sparse(blob, len(raw), buf, out=buf)
    assert out.obj is buf
    assert bytes(buf) == raw


def test_rl_like_update_is_under_1_7_bytes_per_change() -> None:
    raw, base = _rl_update(4 << 20, 0.018, seed=2)
    changed = int(np.count_nonzero(np.frombuffer(raw, "<u2") != np.frombuffer(base, "<u2")))
    blob = encode_sparse(raw, base)
    xor = codecs.encode(codecs.XOR_ZSTD, raw, base)
    assert len(blob) / changed < 1.7
    assert len(blob) < 0.6 * len(xor)


def test_identical_and_fully_changed() -> None:
    same = bytes(range(256)) * 4
    blob = encode_sparse(same, same)
    assert len(blob) < HEADER_BYTES + 16
    assert bytes(decode_sparse(blob, len(same), same)) == same
    other = bytes((b + 1) % 256 for b in same)
    assert bytes(decode_sparse(encode_sparse(other, same), len(same), same)) == other


def _blob(n: int, count: int, planes: bytes, has_tail: int = 0, tail: int = 0) -> bytes:
    header = struct.pack("<4sQIBB", MAGIC, n, count, has_tail, tail)
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(planes)
    return header + frame


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"", "shorter than its header"),
        (b"XXXX" + bytes(14), "bad magic"),
        (_blob(100, 0, b""), "for 100 bytes"),
        (_blob(64, 33, bytes(6 * 33)), "33 changes of 32 words"),
        (_blob(64, 2, bytes(6)), "declare"),
        (_blob(64, 1, bytes(6)), "not strictly increasing"),  # gap 0
        (_blob(64, 1, bytes([40, 0, 0, 0, 1, 0])), "outside 32 words"),
        (_blob(64, 2, bytes([1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0])), "not strictly increasing"),
        (struct.pack("<4sQIBB", MAGIC, 64, 1, 0, 0) + b"garbage-frame", "zstd"),
        (_blob(64, 0, b"", 0, 7), "for 64 bytes"),
    ],
)
def test_hostile_blobs_are_typed_errors(blob: bytes, match: str) -> None:
    with pytest.raises(SparseError, match=match):
        decode_sparse(blob, 64, bytes(64))


def test_big_declared_frame_is_refused_before_decompressing() -> None:
    # a frame that declares more than 6 * count bytes never gets decompressed
    huge = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    blob = struct.pack("<4sQIBB", MAGIC, 64, 1, 0, 0) + huge
    with pytest.raises(SparseError, match="declare"):
        decode_sparse(blob, 64, bytes(64))


def test_codec_dispatch_needs_a_base() -> None:
    with pytest.raises(codecs.LocalProtocolError):
        codecs.decode(codecs.SPARSE, b"", 4)
    with pytest.raises(codecs.LocalProtocolError):
        codecs.encode(codecs.SPARSE, b"abcd")


@pytest.mark.parametrize(("fraction", "dense"), [(0.01, False), (0.7, True)])
def test_plan_offers_the_smallest_delta_only(tmp_path: Path, fraction: float, dense: bool) -> None:
    new, old = _rl_update(1 << 18, fraction, seed=3)
    base_dir, new_dir = tmp_path / "v0", tmp_path / "v1"
    for d, data in ((base_dir, old), (new_dir, new)):
        d.mkdir()
        (d / "model.safetensors").write_bytes(data)
        (d / "config.json").write_text("{}")
    base = Base(0, "0" * 64, base_dir)
    m = build_manifest(
        new_dir,
        "run",
        1,
        Identity.from_seed("sparse-plan"),
        shard_size=1 << 16,
        encodings=(codecs.SPARSE, codecs.XOR_ZSTD),
        base=base,
        blob_dir=tmp_path / "blobs",
    )
    for i in range(len(m.header.shards)):
        entry = m.shard(i)
        if entry.file != "model.safetensors":
            continue  # config.json: two bytes, no encoding beats raw
        deltas = [e for e in entry.encodings if e.encoding in codecs.DELTAS]
        assert len(deltas) == 1
        delta = entry.delta()
        assert delta is not None
        if not dense:
            assert delta.encoding == codecs.SPARSE
        lo, hi = entry.offset, entry.offset + entry.length
        blob = (tmp_path / "blobs" / f"{i}.{delta.encoding}").read_bytes()
        assert bytes(codecs.decode(delta.encoding, blob, entry.length, old[lo:hi])) == new[lo:hi]
        if dense:
            sparse = codecs.encode(codecs.SPARSE, new[lo:hi], old[lo:hi])
            xor = codecs.encode(codecs.XOR_ZSTD, new[lo:hi], old[lo:hi])
            assert delta.size == min(len(sparse), len(xor))
