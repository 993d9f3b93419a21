"""wire: the ``sparse`` delta encoding: positions and differences of the changed 16-bit words.

Theory of operation
-------------------
Consecutive RL checkpoints differ in a few percent of their bf16 elements, and an element that
changes under a small learning rate usually moves by one or two units in the last place (ulp).
PULSE (arXiv 2602.03839) ships such steps as lossless sparse patches: the changed positions and
their new values, compressed. ``sparse`` does the same on a shard's bytes read as little-endian
16-bit words (the byte pairs at even offsets from the shard's start; bf16 tensors in a
safetensors file start at even offsets, and any other dtype still round-trips exactly, only
less compactly):

- the gap before each changed word (``index - previous index``, the first from -1), as uint32;
- its difference ``new - base`` modulo 2**16, as uint16, where ``base`` is the same word of the
  previous version: mostly +-1, so it compresses much better than the new value or an XOR.

Both arrays are stored as byte planes (all low bytes, then all next bytes, ...) inside one zstd
frame, so runs of zero high bytes cost almost nothing. A shard of odd length carries its last
byte in the header. Layout (little-endian)::

    b"SPD1" | u64 length | u32 count | u8 has_tail | u8 tail_byte | zstd(planes)

where ``planes`` is exactly ``6 * count`` bytes. Decoding copies the base and patches
``count`` words: its cost is the base copy (which a caller patching in place avoids) plus work
proportional to the changes. Every field is checked before any allocation that depends on it:
``count`` cannot exceed the number of words, the frame must declare exactly ``6 * count``
bytes, and indices must stay inside the shard, so hostile input costs at most ``O(length)``.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from p2p.errors import LocalProtocolError
from shardcast.wire.codec_errors import CodecError

MAGIC = b"SPD1"
_HEADER = struct.Struct("<4sQIBB")
HEADER_BYTES = _HEADER.size
MAX_WINDOW_BYTES = 1 << 27


class SparseError(CodecError):
    """A sparse blob that does not decode within its bounds (the sender's fault)."""


Buffer = bytes | bytearray | memoryview


def _words(buf: Buffer, n_words: int) -> np.ndarray:
    return np.frombuffer(buf, dtype="<u2", count=n_words)


_SCAN_BLOCKS = 1 << 16  # 8-byte blocks compared per slice: 512 KiB of each buffer, cache-sized


#: zstd level of the planes. Level 1 gives smaller planes than 3 on real deltas and costs
#: ~35 % less CPU (a 64 MiB slice of real-1b's next version, 656 k changes: 957,535 bytes in
#: 7.0 ms at level 1; 969,950 bytes in 10.9 ms at level 3; decoding 3.0 vs 2.9 ms).
PLANES_LEVEL = 1


def changed_words(raw: Buffer, base: Buffer) -> tuple[np.ndarray, np.ndarray]:
    """The 16-bit words in which ``raw`` and ``base`` (same length) differ.

    The buffers are compared as 64-bit words first (a quarter of the comparisons and of the
    mask to scan), and only the 8-byte blocks that differ are compared word by word, slice by
    slice while the slice is still in cache; the last ``len % 8`` bytes are compared as 16-bit
    words (a trailing odd byte is not a word). Costs one pass over both buffers.

    Returns:
        ``(index, diff)``: ``index`` int64, the strictly increasing indices of the changed
        words (word ``i`` is bytes ``2i, 2i+1``, little-endian); ``diff`` uint16, each
        ``new - base`` modulo 2**16.
    """
    n_words = len(raw) // 2
    n_blocks = n_words // 4
    new8 = np.frombuffer(raw, dtype="<u8", count=n_blocks)
    old8 = np.frombuffer(base, dtype="<u8", count=n_blocks)
    idxs, diffss = [], []
    for start in range(0, n_blocks, _SCAN_BLOCKS):  # a slice at a time, gathered while cached
        a, b = new8[start : start + _SCAN_BLOCKS], old8[start : start + _SCAN_BLOCKS]
        blocks = np.flatnonzero(a != b)
        new4 = a[blocks].view("<u2")  # the changed blocks' words, 4 per block, in order
        old4 = b[blocks].view("<u2")
        j = np.flatnonzero(new4 != old4)
        idxs.append(((blocks[j >> 2] + start) << 2) | (j & 3))
        diffss.append(new4[j] - old4[j])  # uint16: wraps modulo 2**16
    idx = np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int64)
    diffs = np.concatenate(diffss) if diffss else np.zeros(0, dtype="<u2")
    done = 4 * n_blocks
    if done < n_words:  # the last 1-3 words
        tail_new, tail_old = _words(raw, n_words)[done:], _words(base, n_words)[done:]
        tail = np.flatnonzero(tail_new != tail_old)
        idx = np.concatenate([idx, tail + done])
        diffs = np.concatenate([diffs, tail_new[tail] - tail_old[tail]])
    return idx, diffs


def encode_sparse(raw: Buffer, base: Buffer, level: int = PLANES_LEVEL) -> bytes:
    """Encode ``raw`` as a patch of ``base`` (same length).

    Args:
        raw: the new shard bytes.
        base: the same byte range of the base version.
        level: zstd level of the planes.

    Returns:
        the blob (header + one zstd frame).

    Raises:
        LocalProtocolError: lengths differ.
    """
    if len(raw) != len(base):
        raise LocalProtocolError(f"sparse delta of {len(raw)} and {len(base)} bytes")
    n = len(raw)
    idx, diffs = changed_words(raw, base)
    return encode_changes(idx, diffs, n, raw[n - 1] if n % 2 else None, level)


def encode_changes(
    index: np.ndarray, diff: np.ndarray, length: int, tail: int | None, level: int = PLANES_LEVEL
) -> bytes:
    """The sparse blob of a ``length``-byte shard from its changes, as :func:`changed_words`
    finds them (a caller that scans a shard piece by piece concatenates the pieces' changes,
    their indices shifted by each piece's word offset): :func:`encode_sparse` is this after
    :func:`changed_words`, so both give the same bytes.

    Args:
        index: int64, the strictly increasing indices of the changed words.
        diff: uint16, each ``new - base`` modulo 2**16.
        length: the shard's length, bytes.
        tail: the new last byte of an odd-length shard (carried changed or not), else None.
        level: zstd level of the planes.

    Raises:
        LocalProtocolError: ``tail`` given for an even length or missing for an odd one, or
            ``index`` and ``diff`` of different lengths.
    """
    if (tail is None) != (length % 2 == 0) or len(index) != len(diff):
        raise LocalProtocolError(f"sparse changes do not fit a {length}-byte shard")
    count = len(index)
    planes = np.empty(6 * count, dtype=np.uint8)
    gaps = np.diff(index, prepend=-1).astype("<u4")
    planes[: 4 * count].reshape(4, count)[...] = gaps.view(np.uint8).reshape(count, 4).T
    planes[4 * count :].reshape(2, count)[...] = (
        diff.astype("<u2", copy=False).view(np.uint8).reshape(count, 2).T
    )
    header = _HEADER.pack(MAGIC, length, count, length % 2, tail or 0)
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return header + cctx.compress(planes.data)  # no copy of the planes


def encode_sparse_reference(raw: Buffer, base: Buffer, level: int = PLANES_LEVEL) -> bytes:
    """SPD1 written the straightforward way (every 16-bit word compared, planes concatenated):
    the format's executable definition, slower than :func:`encode_sparse`, which must give the
    same bytes (tests/unit/test_sparse.py; bench/sparse_encode.py measures one against the
    other). Same arguments and errors as :func:`encode_sparse`."""
    if len(raw) != len(base):
        raise LocalProtocolError(f"sparse delta of {len(raw)} and {len(base)} bytes")
    n = len(raw)
    new = _words(raw, n // 2)
    old = _words(base, n // 2)
    idx = np.flatnonzero(new != old)
    gaps = np.diff(idx, prepend=-1).astype("<u4")
    diffs = (new[idx] - old[idx]).astype("<u2")  # wraps modulo 2**16
    planes = np.concatenate(
        [
            gaps.view(np.uint8).reshape(-1, 4).T.reshape(-1),
            diffs.view(np.uint8).reshape(-1, 2).T.reshape(-1),
        ]
    )
    has_tail = n % 2
    header = _HEADER.pack(MAGIC, n, len(idx), has_tail, raw[n - 1] if has_tail else 0)
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return header + cctx.compress(planes.tobytes())


def sparse_count(blob: Buffer) -> int:
    """The number of changed words a sparse blob lists (its header only; not validated)."""
    return int(_HEADER.unpack_from(blob)[2])


def is_identity(blob: Buffer, length: int) -> bool:
    """True if ``blob`` is a well-formed sparse header for ``length`` bytes that lists no
    change and carries no tail byte: applying it leaves the base as it is, so a receiver can
    copy the base range (an in-kernel copy or a reflink) without decoding or hashing it.
    Only the fixed-size header is read; the caller has checked the blob's signed digest."""
    if len(blob) < HEADER_BYTES:
        return False
    magic, n, count, has_tail, tail = _HEADER.unpack_from(blob)
    return bool(magic == MAGIC and n == length and count == 0 and has_tail == 0 and tail == 0)


def sparse_changes(
    blob: Buffer, length: int, source: str = ""
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """The changes a sparse blob lists, without applying them (for a caller that patches
    another copy of the same bytes, e.g. the weights an inference engine holds).

    Args:
        blob: the received bytes.
        length: the shard's decoded length (from the manifest), bytes.
        source: who sent the blob (for errors).

    Returns:
        ``(index, diff, tail)``: ``index`` int64 ``[count]``, strictly increasing word indices
        (word ``i`` is bytes ``2i, 2i+1`` of the shard, little-endian) below ``length // 2``;
        ``diff`` uint16 ``[count]``, each ``new - base`` modulo 2**16; ``tail`` the new value
        of the last byte of an odd-length shard (always carried, changed or not), else None.

    Raises:
        SparseError: bad magic, a header that disagrees with ``length``, a count over the
            number of words, a frame of the wrong declared size, or an index out of range.
    """
    if len(blob) < HEADER_BYTES:
        raise SparseError(f"sparse blob of {len(blob)} bytes is shorter than its header", source)
    magic, n, count, has_tail, tail = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise SparseError("not a sparse blob (bad magic)", source)
    if n != length or has_tail != length % 2 or (not has_tail and tail):
        raise SparseError(f"sparse blob is for {n} bytes, expected {length}", source)
    n_words = length // 2
    if count > n_words:
        raise SparseError(f"sparse blob lists {count} changes of {n_words} words", source)
    frame = memoryview(blob)[HEADER_BYTES:]
    want = 6 * count
    try:
        params = zstandard.get_frame_parameters(bytes(frame[:18]))
    except zstandard.ZstdError as exc:
        raise SparseError(f"sparse planes are not a zstd frame: {exc}", source) from exc
    if params.content_size != want or params.window_size > MAX_WINDOW_BYTES:
        raise SparseError(f"sparse planes declare {params.content_size} bytes, not {want}", source)
    try:
        planes = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).decompress(
            frame, max_output_size=want
        )
    except zstandard.ZstdError as exc:
        raise SparseError(f"sparse planes do not decode: {exc}", source) from exc
    if len(planes) != want:
        raise SparseError(f"sparse planes decode to {len(planes)} bytes, not {want}", source)
    p = np.frombuffer(planes, dtype=np.uint8)
    gaps = np.ascontiguousarray(p[: 4 * count].reshape(4, count).T).view("<u4").reshape(-1)
    diffs = np.ascontiguousarray(p[4 * count :].reshape(2, count).T).view("<u2").reshape(-1)
    if count and not gaps.all():  # every gap >= 1: indices strictly increasing, first >= 0
        raise SparseError("sparse indices are not strictly increasing", source)
    idx = np.cumsum(gaps, dtype=np.int64) - 1
    if count and idx[-1] >= n_words:
        raise SparseError(f"sparse index {int(idx[-1])} outside {n_words} words", source)
    return idx, diffs, (int(tail) if has_tail else None)


def decode_sparse(
    blob: Buffer,
    length: int,
    base: Buffer,
    source: str = "",
    out: bytearray | memoryview | None = None,
) -> memoryview:
    """Apply a sparse blob to ``base``.

    Args:
        blob: the received bytes.
        length: the shard's decoded length (from the manifest).
        base: the base version's bytes of the same range.
        source: who sent the blob (for errors).
        out: where the result goes (a writable buffer of at least ``length`` bytes). It may be
            ``base`` itself: the patch is then applied in place, touching only changed words.

    Returns:
        a view of the decoded shard in ``out`` (the caller checks its digest).

    Raises:
        SparseError: as :func:`sparse_changes`.
        LocalProtocolError: ``base`` or ``out`` of the wrong length.
    """
    if len(base) != length:
        raise LocalProtocolError("sparse decoding needs a base of the shard's length")
    idx, diffs, tail = sparse_changes(blob, length, source)
    if out is None:
        out = bytearray(length)
    if len(out) < length:
        raise LocalProtocolError("sparse output buffer too short")
    view = memoryview(out)[:length]
    if out is not base:
        view[:] = base
    words = np.frombuffer(view, dtype="<u2", count=length // 2)
    words[idx] = words[idx] + diffs
    if tail is not None:
        view[length - 1] = tail
    return view
