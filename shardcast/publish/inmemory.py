"""publish: hash and delta-encode a version from bytes the trainer holds in memory.

Theory of operation
-------------------
After an optimizer step the trainer holds the new weights and, from its previous publish, the
old ones. Diffing the written files afterwards re-reads both versions from disk on the critical
path; this module produces the very same digests and blobs from the bytes in memory instead, so
the trainer can encode while its writer thread puts the files on disk.

A file is described as :class:`FileBytes`: an ordered list of buffers that tile it (for a
safetensors file: its header, then each tensor's bytes in data-offset order). A shard is a
byte range of the file (``shard_size`` bytes tiling each file, as on disk); it is a view into
one buffer when it falls inside one, else its pieces are copied into a scratch buffer (shards
that straddle tensors or the header). The base's bytes of the same range come the same way
from the previous version's :class:`FileBytes`. Both go to
:func:`shardcast.publish.encode.encode_views`, whose per-shard code (``scan_shard``,
``shard_blobs``) hashes and encodes files read from disk too, so every shard digest, chunk
list, file digest and blob (``sparse``; ``xor-zstd`` where denser; ``zstd``) is
byte-identical to the file path's: the wire format does not change.
Shards are independent, so several threads may encode them side by side
(:func:`encode_bytes` ``workers``); the results come back in offset order, the same.

The layout of a safetensors file (`format <https://github.com/huggingface/safetensors>`_):
``u64 little-endian header length N | N bytes of JSON | data``; the JSON maps each tensor to
``data_offsets`` relative to the data, which the tensors tile without gaps. The header is known
before the file is written (:func:`safetensors_header` builds what the ``safetensors`` library
writes: ``__metadata__`` first, tensors sorted by descending dtype then name, compact JSON
padded with spaces to a multiple of 8); :func:`safetensors_file` maps the tensors' buffers
through its offsets. The writer checks the header on disk against it afterwards
(:func:`header_matches`), and a file whose header differs is hashed from disk as before.
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from shardcast.publish.encode import (
    EncodeSettings,
    PreEncoded,
    ShardResult,
    ShardViews,
    cached_blob,
    encode_shard,
    encode_views,
    in_order,
)
from shardcast.publish.layout import CheckpointLayoutError
from shardcast.wire import codecs, file_root

__all__ = [
    "DTYPE_BYTES",
    "FileBytes",
    "TensorBytes",
    "encode_bytes",
    "header_matches",
    "pre_encode_bytes",
    "safetensors_file",
    "safetensors_header",
    "shard_views",
]

#: safetensors dtype codes this module lays out, with their element size in bytes, in the
#: order of the library's ``Dtype`` enum (files sort tensors by descending dtype, then name).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
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
_DTYPE_RANK = {code: k for k, code in enumerate(DTYPE_BYTES)}
_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorBytes:
    """One tensor as the writer stores it: safetensors dtype code (:data:`DTYPE_BYTES`),
    shape, and its bytes (C order, little-endian; ``len(data)`` = elements x dtype size)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True)
class FileBytes:
    """A file's bytes held in memory as ``pieces`` that tile it in order (none empty).

    Attributes:
        name: the file's name in the checkpoint directory.
        pieces: its bytes, in file order.
    """

    name: str
    pieces: tuple[memoryview, ...]

    @property
    def starts(self) -> list[int]:
        """File offset of each piece."""
        out, at = [], 0
        for p in self.pieces:
            out.append(at)
            at += len(p)
        return out

    @property
    def size(self) -> int:
        """The file's size, bytes."""
        return sum(len(p) for p in self.pieces)


def safetensors_header(
    tensors: Sequence[tuple[str, TensorBytes]], metadata: Mapping[str, str]
) -> bytes:
    """The first bytes of the safetensors file of ``tensors`` (length prefix and JSON header,
    padded with spaces to a multiple of 8), as ``safetensors`` 0.8 writes them (module
    docstring); ``metadata`` is left out when empty. Pure.

    Raises:
        CheckpointLayoutError: a dtype outside :data:`DTYPE_BYTES`, a tensor whose byte count
            is not its shape's, or a name used twice.
    """
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise CheckpointLayoutError("a tensor name is used twice")
    for name, t in tensors:
        if t.dtype not in DTYPE_BYTES:
            raise CheckpointLayoutError(f"tensor {name}: dtype {t.dtype} is not laid out here")
        n = DTYPE_BYTES[t.dtype]
        for d in t.shape:
            n *= d
        if n != t.data.nbytes:
            raise CheckpointLayoutError(f"tensor {name}: {t.data.nbytes} bytes for {t.shape}")
    order = sorted(tensors, key=lambda nt: (-_DTYPE_RANK[nt[1].dtype], nt[0]))
    head: dict[str, object] = {}
    if metadata:
        head["__metadata__"] = dict(metadata)
    at = 0
    for name, t in order:
        head[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [at, at + t.data.nbytes],
        }
        at += t.data.nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return _LEN.pack(len(text)) + text


def safetensors_file(name: str, header: bytes, tensors: Mapping[str, memoryview]) -> FileBytes:
    """The bytes of a safetensors file: ``header`` (length prefix and JSON, as on disk) then
    each tensor's buffer at its ``data_offsets``. Pure.

    Raises:
        CheckpointLayoutError: a malformed header, a tensor the header and ``tensors`` do not
            both name, a buffer of another length than its offsets, or offsets that do not
            tile the data.
    """
    try:
        (n,) = _LEN.unpack_from(header)
        if len(header) != 8 + n:
            raise ValueError(f"header of {len(header)} bytes declares {n} + 8")
        head = json.loads(header[8:])
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]), k)
            for k, v in head.items()
            if k != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise CheckpointLayoutError(f"{name}: malformed safetensors header: {exc}") from exc
    if {k for _, _, k in spans} != set(tensors):
        raise CheckpointLayoutError(f"{name}: the header and the tensors name different tensors")
    pieces = [memoryview(header)]
    at = 0
    for start, end, k in spans:
        data = tensors[k]
        if start != at or end - start != data.nbytes:
            raise CheckpointLayoutError(f"{name}: tensor {k} at [{start}, {end}) breaks the tiling")
        at = end
        if data.nbytes:
            pieces.append(data if data.format == "B" and data.ndim == 1 else data.cast("B"))
    return FileBytes(name, tuple(pieces))


def header_matches(path: Path, header: bytes) -> bool:
    """True if the file at ``path`` begins with ``header`` (reads ``len(header)`` bytes).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        return fh.read(len(header)) == header


def shard_views(
    new: FileBytes, old: FileBytes | None, shard_size: int, buf: bytearray, scratch: bytearray
) -> ShardViews:
    """Each shard of ``new`` (``shard_size`` bytes at a time) with the same byte range of
    ``old`` (None if ``old`` is None or of another size): a view into one piece when the
    range lies in one, else copied into ``buf`` (new) or ``scratch`` (old). Each shard's views
    are valid until the next is produced.

    Raises:
        CheckpointLayoutError: ``shard_size < 1`` or buffers shorter than a shard.
    """
    if shard_size < 1 or len(buf) < min(shard_size, new.size):
        raise CheckpointLayoutError("shard views need shard_size >= 1 and a shard of buffer")
    size = new.size
    base = old if old is not None and old.size == size else None
    if base is not None and len(scratch) < min(shard_size, size):
        raise CheckpointLayoutError("shard views of a base need a shard of scratch")
    new_starts = new.starts
    base_starts = base.starts if base is not None else []
    for offset in range(0, size, shard_size):
        length = min(shard_size, size - offset)
        view = _range(new, new_starts, offset, length, buf)
        base_view = None if base is None else _range(base, base_starts, offset, length, scratch)
        yield offset, view, base_view


def _range(
    f: FileBytes, starts: list[int], offset: int, length: int, into: bytearray
) -> memoryview:
    """Bytes ``[offset, offset + length)`` of ``f``: a view of one piece, or copied ``into``."""
    k = bisect.bisect_right(starts, offset) - 1
    inner = offset - starts[k]
    piece = f.pieces[k]
    if inner + length <= len(piece):
        return piece[inner : inner + length]
    out = memoryview(into)[:length]
    at = 0
    while at < length:
        piece = f.pieces[k]
        take = min(len(piece) - inner, length - at)
        out[at : at + take] = piece[inner : inner + take]
        at += take
        k, inner = k + 1, 0
    return out


def encode_bytes(
    new: FileBytes, old: FileBytes | None, settings: EncodeSettings, workers: int = 1
) -> Iterator[tuple[ShardResult, dict[str, bytes], str | None]]:
    """Hash and encode every shard of ``new`` against ``old`` (the base version's file of the
    same name; deltas only if its size is equal) without touching the disk. Pure.

    Args:
        new: the file to encode.
        old: the base version's file of the same name, or None.
        settings: shard size, encodings, zstd level, digest kind.
        workers: threads that encode shards side by side (hashing, comparing and zstd release
            the GIL); at most ``2 * workers`` shards' results are held ahead of the consumer.
            The results do not depend on it.

    Yields:
        ``(shard, {encoding: blob}, file digest after the last shard else None)`` in offset
        order, exactly as :func:`shardcast.publish.encode.encode_views` gives for the same
        bytes read from disk (the same code, shard by shard).

    Raises:
        CheckpointLayoutError: an empty file.
        LocalProtocolError: an encoding that cannot be offered.
    """
    size = new.size
    if size == 0:
        raise CheckpointLayoutError(f"{new.name}: an empty file has no shards")
    n = min(settings.shard_size, size)
    deltas = old is not None and any(e in codecs.DELTAS for e in settings.encodings)
    if workers <= 1:
        views = shard_views(
            new,
            old if deltas else None,
            settings.shard_size,
            bytearray(n),
            bytearray(n if deltas else 0),
        )
        yield from encode_views(views, size, settings, bytearray(n if settings.encodings else 0))
        return
    base = old if deltas and old is not None and old.size == size else None
    new_starts = new.starts
    base_starts = base.starts if base is not None else []
    local = threading.local()

    def one(offset: int) -> tuple[ShardResult, dict[str, bytes]]:
        bufs = getattr(local, "bufs", None)
        if bufs is None:
            x = n if settings.encodings else 0
            bufs = local.bufs = (bytearray(n), bytearray(n if base else 0), bytearray(x))
        length = min(settings.shard_size, size - offset)
        view = _range(new, new_starts, offset, length, bufs[0])
        base_view = None if base is None else _range(base, base_starts, offset, length, bufs[1])
        return encode_shard(offset, view, base_view, settings, bufs[2])

    shard_list: list[tuple[int, str]] = []
    for shard, blobs in in_order(one, range(0, size, settings.shard_size), workers):
        shard_list.append((shard.length, shard.digest))
        file_digest = None
        if shard.offset + shard.length == size:
            file_digest = _file_digest(new, shard_list, settings.rooted)
        yield shard, blobs, file_digest


def _file_digest(f: FileBytes, shard_list: list[tuple[int, str]], rooted: bool) -> str:
    """As :func:`shardcast.publish.encode.encode_views` computes it: the hash-list root, or the
    whole-file BLAKE3 (over the pieces, which tile the file)."""
    if rooted:
        return file_root(shard_list)
    whole = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for piece in f.pieces:
        whole.update(piece)
    return whole.hexdigest()


def pre_encode_bytes(
    new: FileBytes,
    old: FileBytes | None,
    settings: EncodeSettings,
    cache_dir: Path,
    workers: int = 1,
) -> PreEncoded:
    """:func:`encode_bytes`, with the blobs written to ``cache_dir`` as
    ``<name>.<offset>.<encoding>``: the :class:`~shardcast.publish.encode.PreEncoded` that
    ``Origin.publish(..., pre_encoded=...)`` links into the version without reading the file.

    Raises:
        CheckpointLayoutError: an empty file.
        OSError: a blob cannot be written.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    digest = ""
    for shard, blobs, file_digest in encode_bytes(new, old, settings, workers):
        for enc, data in blobs.items():
            cached_blob(cache_dir, f"{new.name}.", shard.offset, enc).write_bytes(data)
        shards.append(shard)
        if file_digest is not None:
            digest = file_digest
    return PreEncoded(
        new.name, new.size, settings, tuple(shards), digest, cache_dir, f"{new.name}."
    )
