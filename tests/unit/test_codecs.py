"""Shard codecs: lossless round trips (Hypothesis, random and bf16-like data) and hostile frames."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.errors import LocalProtocolError
from shardcast.wire import codecs
from shardcast.wire.codec_errors import CodecError
from shardcast.wire.codecs import RAW, XOR_ZSTD, ZSTD


def bf16_like(n: int, seed: int) -> bytes:
    """bf16 bit patterns of N(0, 0.02) weights (what checkpoints hold)."""
    rng = np.random.default_rng(seed)
    f = (rng.standard_normal(n) * 0.02).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def nudge(raw: bytes, fraction: float, seed: int) -> bytes:
    """Flip the low mantissa bit of a fraction of bf16 elements (an RL-like update)."""
    a = np.frombuffer(raw, dtype=np.uint16).copy()
    idx = np.random.default_rng(seed).random(a.size) < fraction
    a[idx] ^= 1
    return a.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.binary(min_size=0, max_size=5000))
def test_round_trip_random(raw: bytes, other: bytes) -> None:
    base = (other * (len(raw) // max(1, len(other)) + 1))[: len(raw)] if other else bytes(len(raw))
    for enc in (ZSTD, XOR_ZSTD):
        blob = codecs.encode(enc, raw, base)
        assert codecs.decode(enc, blob, len(raw), base) == raw
        # into a reused (oversized, dirty) scratch buffer, XOR in place into a copy of the base
        scratch = bytearray(b"\xff" * (len(raw) + 7))
        out = bytearray(base)
        got = codecs.decode(enc, blob, len(raw), out, out=out, scratch=scratch)
        assert bytes(got) == raw
    assert codecs.decode(RAW, raw, len(raw)) == raw


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 20000), st.integers(0, 2**31), st.floats(0.0, 0.2))
def test_round_trip_bf16(n: int, seed: int, fraction: float) -> None:
    base = bf16_like(n, seed)
    new = nudge(base, fraction, seed + 1)
    blob = codecs.encode(XOR_ZSTD, new, base)
    assert codecs.decode(XOR_ZSTD, blob, len(new), base) == new
    assert codecs.decode(ZSTD, codecs.encode(ZSTD, new), len(new)) == new


def test_deltas_are_small_for_rl_like_updates() -> None:
    base = bf16_like(1 << 20, 1)
    new = nudge(base, 0.01, 2)
    assert abs(codecs.changed_fraction_bf16(base, new) - 0.01) < 0.002
    delta = codecs.encode(XOR_ZSTD, new, base)
    assert len(delta) < len(new) / 10
    dense = codecs.encode(ZSTD, new)
    assert len(dense) > len(new) / 2  # dense bf16 barely compresses


def test_wrong_base_decodes_to_other_bytes() -> None:
    base = bf16_like(4096, 1)
    new = nudge(base, 0.05, 2)
    blob = codecs.encode(XOR_ZSTD, new, base)
    wrong = nudge(base, 0.05, 3)
    assert codecs.decode(XOR_ZSTD, blob, len(new), wrong) != new  # the digest check catches it


def test_hostile_frames_rejected() -> None:
    raw = b"x" * 1000
    blob = codecs.encode(ZSTD, raw)
    with pytest.raises(CodecError, match="declares"):
        codecs.decode(ZSTD, blob, 999)
    with pytest.raises(CodecError, match="not a zstd frame"):
        codecs.decode(ZSTD, b"garbage!" * 4, 1000)
    with pytest.raises(CodecError):
        codecs.decode(ZSTD, blob[:-3], 1000)  # truncated frame
    with pytest.raises(CodecError):
        codecs.decode(ZSTD, blob[:-3], 1000, scratch=bytearray(1000))
    # a frame without a declared content size
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(CodecError, match="declares"):
        codecs.decode(ZSTD, no_size, 1000)
    # a hand-made frame that declares a 2 GiB window (a decompression bomb's header):
    # magic, descriptor (8-byte content size, not single-segment), window 2^31, size 10,
    # then one raw block of 10 bytes
    bomb = (
        b"\x28\xb5\x2f\xfd"
        + bytes([0xC0, 21 << 3])
        + (10).to_bytes(8, "little")
        + ((10 << 3) | 1).to_bytes(3, "little")
        + b"0123456789"
    )
    params = zstandard.get_frame_parameters(bomb[:18])
    assert params.window_size > codecs.MAX_WINDOW_BYTES
    assert params.content_size == 10
    with pytest.raises(CodecError, match="window"):
        codecs.decode(ZSTD, bomb, 10)
    with pytest.raises(CodecError):
        codecs.decode(RAW, b"abc", 4)


def test_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        codecs.encode(XOR_ZSTD, b"abc")
    with pytest.raises(LocalProtocolError):
        codecs.decode(XOR_ZSTD, codecs.encode(ZSTD, b"abc"), 3, b"ab")
    with pytest.raises(LocalProtocolError):
        codecs.encode("gzip", b"abc")


def test_decode_buffer_pool_is_bounded_and_reuses_buffers() -> None:
    from shardcast.download.receive import BufferPool

    pool = BufferPool(keep=2)
    a, b, c = pool.get(100), pool.get(80), pool.get(100)
    assert len(b) == 100  # as large as the largest request: reusable for any shard
    for buf in (a, b, c):
        pool.put(buf)
    assert pool.get(50) is a  # reused, and only `keep` were kept
    assert pool.get(100) is b
    assert pool.get(100) is not c
    small = pool.get(10)
    big = pool.get(1000)
    pool.put(small)  # smaller than the largest request seen: dropped, not kept
    assert pool.get(1000) is not small
    assert len(big) == 1000
