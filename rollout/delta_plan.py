"""Plan an in-place weight update: sparse shard deltas → per-tensor word patches.

Theory of operation
-------------------
A next version that arrived as ``sparse`` deltas (:mod:`shardcast.wire.sparse`) says, per shard (a
byte range ``[offset, offset + length)`` of one checkpoint file), which 16-bit words changed
and by how much (``new - base`` modulo 2**16). An engine that holds the base version's tensors
byte for byte (same dtype as the checkpoint) can apply those words to its own parameter storage
and end with exactly the bytes that loading the new version would give, without reading the
checkpoint: PULSE (arXiv 2602.03839) applies its sparse patches this way.

A safetensors file is ``u64 N`` (little-endian) ``| N bytes of JSON header | data``; the
header maps each tensor name to its dtype, shape and ``data_offsets [begin, end)`` relative to
the data section (https://github.com/huggingface/safetensors, "Format"). :func:`parse_layout`
turns it into absolute file ranges (:class:`FileLayout`). :func:`plan_update` maps every
changed word (file offset ``offset + 2 * index``) to the tensor whose range holds it with a
binary search over the tensor starts and groups the words per tensor (:class:`TensorPatch`:
word indices relative to the tensor's first byte, and the differences). The plan is pure: no
torch, no I/O; applying it is the engine's job (``TransformersEngine.apply_update``).

A plan is made only if the delta fits the loaded model; otherwise :class:`DeltaMismatch`
names why (:class:`MismatchReason`), before any weight is touched, and the caller falls back
to a full load:

- a changed word in a file header or outside every tensor (the layout changed), a word that
  straddles a tensor boundary or starts at an odd offset inside a tensor (a tensor that does
  not start at an even file offset), a shard outside its file, overlapping shards;
- a checkpoint tensor the engine does not hold, or holds with another shape;
- a changed tensor the engine holds in another dtype (its bytes are not the checkpoint's).

The layout must be the base version's; it is also the new version's when no header word
changed and the file sizes are equal (the caller checks the sizes). The last byte of an odd
length shard is carried as a new value (``tail``), not a difference; it becomes a byte patch.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from p2p.errors import IntegrityError
from shardcast.wire import SparseError, sparse_changes

__all__ = [
    "DTYPE_BYTES",
    "UPDATE_THREADS",
    "DeltaMismatch",
    "FileLayout",
    "MismatchReason",
    "ShardChanges",
    "TensorPatch",
    "TensorSpan",
    "TensorSpec",
    "UpdatePlan",
    "parse_layout",
    "plan_update",
    "read_layout",
]

DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
"""Bytes per element of each safetensors dtype name."""

UPDATE_THREADS = 4
"""Worker threads that decode shards and patch tensors in an in-place update. Decoding (zstd,
numpy) releases the GIL and scales with cores; patching is one scattered read-modify-write
per changed word, bound by memory latency (on ``real-1b``, 10.5 M words, ~0.14 s on this
project's 2-vCPU machine, with one thread as with four; ``bench/engine_update.py``)."""

MAX_HEADER_BYTES = 100 << 20  #: a larger safetensors header is refused (as safetensors does)


class MismatchReason(enum.Enum):
    """Why a delta cannot be applied in place (value: the log/metric string)."""

    BASE = "base"  #: the delta's base is not the version the engine holds
    ENCODING = "encoding"  #: a shard has no sparse blob (received raw or as xor-zstd)
    BLOB = "blob"  #: a kept blob no longer matches its signed digest, or does not decode
    FILES = "files"  #: the file list or sizes changed
    OTHER_FILE = "other_file"  #: a file that is not weights (config, tokenizer) changed
    LAYOUT = "layout"  #: a change outside tensor data, or a tensor not word-aligned
    MISSING_TENSOR = "missing_tensor"  #: a checkpoint tensor the engine does not hold
    SHAPE = "shape"  #: a tensor the engine holds with another shape
    DTYPE = "dtype"  #: a changed tensor the engine holds in another dtype
    UNSUPPORTED = "unsupported"  #: the engine cannot update in place (as configured)


class DeltaMismatch(IntegrityError):
    """A delta that does not fit the loaded model (nothing was touched).

    Attributes:
        reason: why (:class:`MismatchReason`).
        what: the detail, without the prefixes of the message (for logs).
    """

    def __init__(self, reason: MismatchReason, what: str) -> None:
        super().__init__(f"in-place update impossible ({reason.value}): {what}")
        self.reason = reason
        self.what = what


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as an engine holds it: safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file: bytes ``[start, end)`` of the file (absolute)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of one safetensors file lies.

    Attributes:
        size: the file's size, bytes.
        data_start: first byte of the data section (``8 + N``).
        tensors: by start offset.
    """

    size: int
    data_start: int
    tensors: tuple[TensorSpan, ...]
    starts: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)
    ends: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", np.array([t.start for t in self.tensors], np.int64))
        object.__setattr__(self, "ends", np.array([t.end for t in self.tensors], np.int64))


def parse_layout(prefix: bytes, size: int, source: str = "") -> FileLayout:
    """The layout of a safetensors file from its first bytes.

    Args:
        prefix: at least ``8 + N`` bytes from the start of the file.
        size: the file's size, bytes.
        source: the file (for errors).

    Raises:
        DeltaMismatch: (``LAYOUT``) a short prefix, a header over ``MAX_HEADER_BYTES``, bad
            JSON, an unknown dtype, a range that disagrees with dtype and shape, overlapping
            tensors or a tensor past the end of the file.
    """
    if len(prefix) < 8:
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: no safetensors header")
    (n,) = struct.unpack_from("<Q", prefix)
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: header of {n} bytes")
    try:
        header = json.loads(bytes(prefix[8 : 8 + n]))
    except ValueError as exc:
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: header: {exc}") from exc
    if not isinstance(header, dict):
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: header is not an object")
    data_start = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: tensor {name}: {exc}") from exc
        if dtype not in DTYPE_BYTES or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: tensor {name} {dtype} {shape}")
        spans.append(TensorSpan(name, dtype, shape, data_start + begin, data_start + end))
    spans.sort(key=lambda t: (t.start, t.end))
    for a, b in itertools.pairwise(spans):
        if b.start < a.end:
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: {a.name} overlaps {b.name}")
    if spans and (spans[0].start < data_start or spans[-1].end > size):
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{source}: tensors outside the file")
    return FileLayout(size, data_start, tuple(spans))


def read_layout(path: Path) -> FileLayout:
    """:func:`parse_layout` of a file on disk (reads only its header).

    Raises:
        DeltaMismatch: as :func:`parse_layout`.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        prefix = head + fh.read(min(n, MAX_HEADER_BYTES))
        size = fh.seek(0, 2)
    return parse_layout(prefix, size, str(path))


@dataclass(frozen=True)
class ShardChanges:
    """The changes of one shard: words ``index`` (of the shard, int64 ascending) move by
    ``diff`` (uint16, modulo 2**16); ``tail``: the new last byte of an odd-length shard."""

    file: str
    offset: int
    length: int
    index: npt.NDArray[np.int64]
    diff: npt.NDArray[np.uint16]
    tail: int | None = None

    @classmethod
    def from_sparse(
        cls, file: str, offset: int, length: int, blob: bytes, source: str = ""
    ) -> ShardChanges:
        """Decode a verified sparse blob of the shard at ``[offset, offset + length)``.

        Raises:
            DeltaMismatch: (``BLOB``) the blob does not decode within its bounds.
        """
        try:
            index, diff, tail = sparse_changes(blob, length, source)
        except SparseError as exc:
            raise DeltaMismatch(MismatchReason.BLOB, f"{file}@{offset}: {exc}") from exc
        return cls(file, offset, length, index, diff, tail)


@dataclass(frozen=True)
class TensorPatch:
    """The changes of one tensor, relative to its first byte.

    Attributes:
        name, dtype, shape: the checkpoint tensor.
        words: int64 ascending indices of 16-bit little-endian words of the tensor's bytes.
        diffs: uint16, ``new - old`` modulo 2**16 of each word.
        byte_index, byte_value: int64 byte indices and uint8 new values (a shard's tail).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    words: npt.NDArray[np.int64]
    diffs: npt.NDArray[np.uint16]
    byte_index: npt.NDArray[np.int64]
    byte_value: npt.NDArray[np.uint8]


@dataclass(frozen=True)
class UpdatePlan:
    """Everything to change, per tensor (tensors without a change are absent)."""

    patches: tuple[TensorPatch, ...]

    @property
    def changed_words(self) -> int:
        """16-bit words changed over all tensors."""
        return sum(len(p.words) for p in self.patches)


def plan_update(
    layouts: Mapping[str, FileLayout],
    changes: Iterable[ShardChanges],
    loaded: Mapping[str, TensorSpec],
) -> UpdatePlan:
    """Map shard changes onto the loaded tensors (see module docstring).

    Args:
        layouts: file name → layout of the version the engine holds (the base).
        changes: the shards' changes, each shard at most once; shards of other files (not
            weights) must not be given.
        loaded: checkpoint tensor name → how the engine holds it.

    Returns:
        the per-tensor patches.

    Raises:
        DeltaMismatch: the delta does not fit (reasons ``LAYOUT``, ``FILES``,
            ``MISSING_TENSOR``, ``SHAPE``, ``DTYPE``); nothing is applied.
    """
    for fname, layout in layouts.items():
        for held in layout.tensors:
            spec = loaded.get(held.name)
            if spec is None:
                raise DeltaMismatch(MismatchReason.MISSING_TENSOR, f"{held.name} ({fname})")
            if spec.shape != held.shape:
                raise DeltaMismatch(
                    MismatchReason.SHAPE,
                    f"{held.name}: checkpoint {held.shape}, engine {spec.shape}",
                )
    words: dict[tuple[str, int], list[npt.NDArray[np.int64]]] = {}
    diffs: dict[tuple[str, int], list[npt.NDArray[np.uint16]]] = {}
    tails: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for ch in changes:
        if ch.file not in layouts:
            raise DeltaMismatch(MismatchReason.FILES, f"{ch.file} is not a weight file held")
        layout = layouts[ch.file]
        if ch.offset < 0 or ch.offset % 2 or ch.offset + ch.length > layout.size:
            raise DeltaMismatch(MismatchReason.FILES, f"{ch.file}: shard at {ch.offset}")
        if len(ch.index):
            _map_words(ch, layout, words, diffs)
        if ch.tail is not None:
            at = ch.offset + ch.length - 1
            t = int(np.searchsorted(layout.starts, at, side="right")) - 1
            if t < 0 or at >= layout.ends[t]:
                raise DeltaMismatch(MismatchReason.LAYOUT, f"{ch.file}: last byte outside tensors")
            tails.setdefault((ch.file, t), []).append((at - int(layout.starts[t]), ch.tail))
    patches = []
    for key in sorted(words.keys() | tails.keys()):
        fname, t = key
        span = layouts[fname].tensors[t]
        spec = loaded[span.name]
        if spec.dtype != span.dtype:
            raise DeltaMismatch(
                MismatchReason.DTYPE, f"{span.name}: checkpoint {span.dtype}, engine {spec.dtype}"
            )
        segments = words.get(key, [])  # each strictly increasing (sparse_changes)
        if any(b[0] <= a[-1] for a, b in itertools.pairwise(segments)):
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{span.name}: overlapping shards")
        w, d = _joined(segments, np.int64), _joined(diffs.get(key, []), np.uint16)
        tb = tails.get(key, [])
        patches.append(
            TensorPatch(
                span.name,
                span.dtype,
                span.shape,
                w,
                d,
                np.array([i for i, _ in tb], np.int64),
                np.array([v for _, v in tb], np.uint8),
            )
        )
    return UpdatePlan(tuple(patches))


def _joined(parts: list[npt.NDArray[Any]], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """``parts`` as one array (no copy for a single part)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _map_words(
    ch: ShardChanges,
    layout: FileLayout,
    words: dict[tuple[str, int], list[npt.NDArray[np.int64]]],
    diffs: dict[tuple[str, int], list[npt.NDArray[np.uint16]]],
) -> None:
    """Add the words of one shard to the per-tensor lists.

    The words are sorted, so each tensor's are one slice, found by binary search of the
    tensor's bounds in shard word units (``O(tensors · log words)``, then one subtraction per
    word). Tensor ``t`` (starting at an even byte) holds the shard's words ``i`` with
    ``start_t <= offset + 2i`` and ``offset + 2i + 2 <= end_t``; a tensor starting at an odd
    byte holds none. Any word left over (header, gap, straddling, odd tensor) is refused.
    """
    index, off = ch.index, ch.offset
    if not layout.tensors:
        raise DeltaMismatch(MismatchReason.LAYOUT, f"{ch.file}: changed, but holds no tensor")
    first = int(np.searchsorted(layout.ends, off, side="right"))
    last = int(np.searchsorted(layout.starts, off + ch.length, side="left"))
    placed = 0
    for t in range(first, last):
        start, end = int(layout.starts[t]), int(layout.ends[t])
        if start % 2:
            continue
        w0 = (start - off) // 2  # word index of the tensor's first byte (may be negative)
        lo = int(np.searchsorted(index, max(w0, 0), side="left"))
        hi = int(np.searchsorted(index, (end - off) // 2, side="left"))
        if hi > lo:
            key = (ch.file, t)
            words.setdefault(key, []).append(index[lo:hi] - w0)
            diffs.setdefault(key, []).append(ch.diff[lo:hi])
            placed += hi - lo
    if placed != len(index):
        at = off + 2 * index
        t_of = np.searchsorted(layout.starts, at, side="right") - 1
        inside = (t_of >= 0) & (at + 2 <= layout.ends[t_of]) & (layout.starts[t_of] % 2 == 0)
        k = int(np.flatnonzero(~inside)[0])
        where = "a header byte" if int(at[k]) < layout.data_start else "a word outside tensors"
        raise DeltaMismatch(
            MismatchReason.LAYOUT,
            f"{ch.file}: {where} changed (byte {int(at[k])}; or a tensor not word-aligned)",
        )
