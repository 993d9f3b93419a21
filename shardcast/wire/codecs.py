"""wire: shard encodings: raw, zstd, and deltas against the previous version (xor-zstd, sparse).

Theory of operation
-------------------
Every shard is identified by the BLAKE3 digest of its *decoded* bytes; an encoding only
changes what travels. The origin may offer, per shard:

============  ==========================================================================
``raw``       the bytes themselves (always available; a range of the file)
``zstd``      ``zstd(raw)``: dense bf16 only shrinks ~1.28x (DESIGN.md), so it pays off on
              slow links only
``xor-zstd``  ``zstd(raw XOR base)``, where ``base`` is the same byte range of the previous
              version's same file. Lossless. Consecutive RL checkpoints differ in a few percent
              of bf16 elements (0.6-3 % published; an update below half an ulp rounds away),
              so the XOR is mostly zero bytes and compresses 30-100x.
``sparse``    the changed 16-bit words' positions and differences (:mod:`shardcast.wire.sparse`,
              as PULSE does): ~1.3 bytes per changed bf16 element where ``xor-zstd`` needs
              ~2.5, and decoding costs work proportional to the changes. The origin offers
              whichever delta is smaller per shard.
============  ==========================================================================

XOR works on bytes, so it needs no alignment assumption about where bf16 elements start; a
byte that did not change XORs to zero whatever the dtype. Decoding a delta against the wrong
base yields bytes that fail the shard digest, which the caller checks before anything is
written, so a wrong or corrupt base can never be committed.

Decompression is bounded: the frame must declare its content size, which must equal the
shard length, and the window is capped at ``MAX_WINDOW_BYTES``, so a frame that declares an
enormous window or size is rejected before any large allocation (zstd "decompression bombs").
"""

from __future__ import annotations

import numpy as np
import zstandard

from p2p.errors import LocalProtocolError
from shardcast.wire.codec_errors import CodecError as CodecError  # codecs.CodecError, as before

RAW = "raw"
ZSTD = "zstd"
XOR_ZSTD = "xor-zstd"
SPARSE = "sparse"
ENCODINGS = (RAW, ZSTD, XOR_ZSTD, SPARSE)
DELTAS = (XOR_ZSTD, SPARSE)  #: encodings decoded against the base version
MAX_WINDOW_BYTES = 1 << 27  # 128 MiB: larger frames are refused
DEFAULT_LEVEL = 1


Buffer = bytes | bytearray | memoryview


def xor_bytes(a: Buffer, b: Buffer, out: bytearray | memoryview | None = None) -> memoryview:
    """Bytewise XOR of two equal-length buffers, written into ``out`` (or a new buffer).

    ``out`` may be ``b`` itself (in-place) when ``b`` is writable; no other copy is made.

    Raises:
        LocalProtocolError: lengths differ, or ``out`` is too short.
    """
    if len(a) != len(b):
        raise LocalProtocolError(f"xor of {len(a)} and {len(b)} bytes")
    if out is None:
        out = bytearray(len(a))
    if len(out) < len(a):
        raise LocalProtocolError("xor output buffer too short")
    view = memoryview(out)[: len(a)]
    np.bitwise_xor(
        np.frombuffer(a, dtype=np.uint8),
        np.frombuffer(b, dtype=np.uint8),
        out=np.frombuffer(view, dtype=np.uint8),
    )
    return view


def encode(
    encoding: str,
    raw: Buffer,
    base: Buffer | None = None,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    scratch: bytearray | None = None,
) -> bytes:
    """Encode one shard.

    Args:
        encoding: ``zstd``, ``xor-zstd`` or ``sparse`` (``raw`` needs no encoding).
        raw: the shard's bytes.
        base: for a delta, the same range of the base version (same length).
        level: zstd level.
        threads: zstd worker threads (0: single-threaded).
        scratch: a reusable buffer of at least ``len(raw)`` bytes for the XOR (saves an
            allocation per shard); its content is overwritten.

    Returns:
        the encoded bytes (a zstd frame with its content size recorded).

    Raises:
        LocalProtocolError: unknown encoding, or a missing/mis-sized base.
    """
    data: Buffer
    if encoding in DELTAS and base is None:
        raise LocalProtocolError(f"{encoding} needs the base shard")
    if encoding == SPARSE:
        from shardcast.wire.sparse import encode_sparse

        assert base is not None
        return encode_sparse(raw, base, level)
    if encoding == ZSTD:
        data = raw
    elif encoding == XOR_ZSTD:
        assert base is not None
        data = xor_bytes(raw, base, scratch)
    else:
        raise LocalProtocolError(f"cannot encode {encoding!r}")
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, threads=threads)
    return cctx.compress(data)


def decode(
    encoding: str,
    encoded: Buffer,
    length: int,
    base: Buffer | None = None,
    source: str = "",
    out: bytearray | memoryview | None = None,
    scratch: bytearray | None = None,
) -> Buffer:
    """Decode one shard of ``length`` bytes.

    Args:
        encoding: ``raw``, ``zstd``, ``xor-zstd`` or ``sparse``.
        encoded: the bytes received.
        length: the shard's decoded length (from the manifest).
        base: for a delta, the base version's bytes of the same range.
        source: who sent the bytes (for errors).
        out: for a delta, where to write the result (may be ``base`` itself, in place:
            ``sparse`` then only touches the changed words).
        scratch: a reusable buffer of at least ``length`` bytes to decompress into (saves
            allocating, and faulting in, a fresh output buffer per shard); the result of a
            ``zstd`` decode is then a view of it, valid until it is reused.

    Returns:
        the decoded shard bytes (the caller checks their digest).

    Raises:
        CodecError: not a zstd frame, no or wrong declared content size, window over
            ``MAX_WINDOW_BYTES``, or a decoded length other than ``length``.
        LocalProtocolError: unknown encoding, or a delta without a base of ``length``.
    """
    if encoding == RAW:
        if len(encoded) != length:
            raise CodecError(f"raw shard of {len(encoded)} bytes, expected {length}", source)
        return encoded
    if encoding not in ENCODINGS:
        raise LocalProtocolError(f"unknown encoding {encoding!r}")
    if encoding in DELTAS and (base is None or len(base) != length):
        raise LocalProtocolError(f"{encoding} needs a base shard of the same length")
    if encoding == SPARSE:
        from shardcast.wire.sparse import decode_sparse

        assert base is not None
        return decode_sparse(encoded, length, base, source, out)
    try:
        params = zstandard.get_frame_parameters(bytes(encoded[:18]))
    except zstandard.ZstdError as exc:
        raise CodecError(f"not a zstd frame: {exc}", source) from exc
    if params.content_size != length:
        raise CodecError(
            f"zstd frame declares {params.content_size} bytes, expected {length}", source
        )
    if params.window_size > MAX_WINDOW_BYTES:
        raise CodecError(
            f"zstd window of {params.window_size} bytes over the {MAX_WINDOW_BYTES} cap", source
        )
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
    plain: Buffer
    try:
        if scratch is not None and len(scratch) >= length:
            plain = _decompress_into(dctx, encoded, memoryview(scratch)[:length], source)
        else:
            plain = dctx.decompress(encoded, max_output_size=length)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}", source) from exc
    if len(plain) != length:
        raise CodecError(f"decoded {len(plain)} bytes, expected {length}", source)
    if encoding == XOR_ZSTD:
        assert base is not None
        return xor_bytes(plain, base, out)
    return plain


def _decompress_into(
    dctx: zstandard.ZstdDecompressor, encoded: Buffer, view: memoryview, source: str
) -> memoryview:
    """Decompress one frame into ``view`` (exactly its length), refusing trailing output."""
    with dctx.stream_reader(encoded, read_across_frames=False) as reader:
        got = 0
        while got < len(view):
            n = reader.readinto(view[got:])
            if n == 0:
                break
            got += n
        if got != len(view) or reader.read(1):
            raise CodecError(f"zstd frame does not decode to {len(view)} bytes", source)
    return view


def changed_fraction_bf16(
    a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview
) -> float:
    """Share of 2-byte (bf16) elements that differ between two equal-length buffers."""
    n = (len(a) // 2) * 2
    if n == 0:
        return 0.0
    x = np.frombuffer(a[:n], dtype=np.uint16)
    y = np.frombuffer(b[:n], dtype=np.uint16)
    return float(np.count_nonzero(x != y)) / (n // 2)
