"""wire: the signed manifest of one checkpoint version: a header, then parts.

Theory of operation
-------------------
A version's manifest is signed in pieces so that the origin can announce it before it has
finished hashing the checkpoint (pipelining, DESIGN.md decision 3):

- the **header** (schema version 2) names the run, the policy step, every file with its size,
  the shard size, how many shards each part covers, and the delta base (the previous step and
  its header digest) if the origin offers deltas. Shards tile each file at ``shard_size``
  bytes, in file-name order, so the shard layout follows from the header alone. The header's
  BLAKE3 digest is the version's identity on the wire (announcements carry it).
- each **part** ``k`` covers shards ``[k·S, (k+1)·S)``: the BLAKE3 digest of every shard's
  decoded bytes, the encodings offered for it (``[encoding, size, digest]`` of the encoded
  bytes, see :mod:`shardcast.wire.codecs`), and the file digests of the files whose last
  shard lies in this part (empty files: part 0). A part names the header digest it belongs to.

File digests: schema 3 and schema 2
-----------------------------------
In schema 3 (written by the origin since issue 16) a file's digest is the **hash-list root**
of its shards, :func:`file_root`: BLAKE3 in key-derivation mode under the context
:data:`FILE_ROOT_CONTEXT` (a domain tag no other hash in shardnet uses) over the shard count
and then, per shard in file order, its length (u64, little-endian) and its 32-byte digest. In
schema 2 (still read) it is the BLAKE3 of the whole file's bytes. Both schemas share the
header and part layout; the body's ``v`` says which one applies, and parts carry their
header's ``v``.

Why the root is as strong as a whole-file hash: a receiver writes a shard only after its
bytes hashed to the shard digest listed in a signed part, so the committed file is the
concatenation of byte strings each bound to a signed digest. Producing a file that passes
with other bytes requires a BLAKE3 collision, either of one shard (other bytes, same shard
digest) or of the root (another list, same root; the fixed-width encoding with the count and
the lengths makes the list decode uniquely, and the context separates roots from every other
BLAKE3 use). BLAKE3's collision resistance (128-bit) is the same assumption the whole-file
digest rested on, and the signature over the parts binds the list to the trainer exactly as
it bound the whole-file digest. What the root saves is a second pass: the receiver derives
it from the signed shard digests it already checked, so committing a schema-3 version reads
no file again (schema-2 commits still re-hash every file). A node that must check files at
rest (after an unclean stop) hashes each shard range and recomputes the root: the same work
as hashing the whole file.

Deltas: what the signatures bind
--------------------------------
A part signs, per shard, the digest of the shard's decoded bytes *and* the digest of every
encoded blob it offers (for a delta, ``decode(blob, base shard)``), and the header signs the
base (``base_step``, ``base_digest``), whose own parts sign the base's shard digests. A
follower may therefore keep a delta version as a *chain* (its verified blobs over the base it
holds) and build the shard only when something reads it, hashing the result against the
signed shard digest then: the base bytes, the blob and the result are each bound to a signed
digest, and the decoding in between is deterministic. :mod:`shardcast.store.chains` states
the argument, what could break it (a base damaged at rest, a decoder bug, a blob that does not
give its signed shard) and where each is caught.

Chunk lists: verifying a shard while it streams
-----------------------------------------------
A part may list, per shard, a **chunk list**: ``[chunk_bytes, [d0, d1, ...]]``, the BLAKE3
digest of each ``chunk_bytes``-sized piece of the shard's decoded bytes in order (the last one
shorter), signed with the part. Parts without it (written before issue 16's swarm work) still
read; a part lists it for every shard or for none. A receiver checks each chunk the moment its
last byte arrives (:class:`shardcast.download.receive.ShardSink`) and may re-serve a verified chunk
at
once, long before the 32 MiB shard is complete: the swarm swarms at chunk granularity.

Why a signed list and not BLAKE3's verified streaming (``bao``): the ``blake3`` package we use
exposes no chaining values, so a ``bao`` tree would need a second hash implementation on the
critical path; a list costs 32 bytes per MiB in the part (about 2 KiB per 32 MiB shard, 3 % of
a part), is checked with the same BLAKE3 call as everything else, and a failure names the one
chunk and therefore the one source that sent it. The list binds the bytes exactly as the shard
digest does (same signature, same collision assumption): a shard whose every chunk matched its
signed chunk digest *is* the origin's shard, so a receiver that checked every chunk does not
hash the whole shard again (the shard digest stays the shard's identity for file roots, the
journal and checks at rest). The origin computes both in the one pass that reads the shard.
A shard of a delta version that is offered as a delta gets no chunk list (its part then lists
none): it travels as a small blob checked against its own signed digest, nobody streams its
raw bytes, and the list would cost the origin a second hash of every byte
(:func:`shardcast.publish.encode.scan_chunk_bytes`). A follower without the base takes such a
shard whole and checks its shard digest.

Header and parts are canonical JSON (UTF-8, sorted keys, no whitespace, integers and strings
only), each sealed by the trainer's Ed25519 PeerID key in a :mod:`p2p.envelope` of its own kind
(``manifest-header``, ``manifest-part``). One part is served (``.../manifest/part/<k>``) as its
envelope bytes. The document stored beside a committed version (``manifest.json``) and served
at ``.../manifest`` is canonical JSON ``{"v": 3, "header": "<base64 envelope>", "parts":
["<base64 envelope>", ...]}``.

Older format, still read (data at rest, and nodes serving it): document ``{"header": E,
"parts": [E, ...]}`` and single parts as JSON ``E``, where ``E = {"body": {...}, "signer":
"<PeerID>", "signature": "<hex>"}`` signed under the domains ``manifest-header/v2`` and
``manifest-part/v2`` of :func:`p2p.keys.domain_message`. A version read in the old format is
written and served in it (its signatures cannot be converted); its parts must be old too.

Every decoder treats its input as hostile: size bounds, schema and value checks (safe flat
file names, consistent counts), signature, and the pinned trainer, each failure a typed error.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import blake3

from p2p import envelope, fields
from p2p.envelope import Kind
from p2p.errors import FieldError, IntegrityError, LocalProtocolError, RemoteProtocolError
from p2p.keys import KeyHolder, public_key_of, verify
from p2p.trust import TrustList
from shardcast.wire.canonical import (
    DIGEST_RE,
    RUN_ID_RE,
    blake3_hex,
    canonical_json,
    loads_untrusted,
)
from shardcast.wire.codecs import DELTAS, SPARSE, XOR_ZSTD, ZSTD

SCHEMA_VERSION = 3  #: written: file digests are hash-list roots (:func:`file_root`)
READ_SCHEMAS = (2, 3)  #: read: 2 has whole-file digests
FILE_ROOT_CONTEXT = "shardnet 2026-12-01 manifest v3 file hash-list root"
DOCUMENT_VERSION = 3
HEADER_KIND = Kind.MANIFEST_HEADER
PART_KIND = Kind.MANIFEST_PART
HEADER_DOMAIN = "manifest-header/v2"
"""Signature domain of headers in the old format (read only)."""
PART_DOMAIN = "manifest-part/v2"
"""Signature domain of parts in the old format (read only)."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_PART_BYTES = 8 * 1024 * 1024
MAX_FILES = 10_000
MAX_SHARDS = 1_000_000
MAX_FILE_BYTES = 1 << 44  # 16 TiB
MANIFEST_FILE = "manifest.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_RUN_RE = RUN_ID_RE
_DIGEST_RE = DIGEST_RE
OFFERABLE = (ZSTD, XOR_ZSTD, SPARSE)
CHUNK_BYTES = 1 << 20  #: chunk size written in chunk lists (a power of two)
MIN_CHUNK_BYTES = 1 << 10  #: smallest chunk size read (a part is bounded by MAX_PART_BYTES)


class ManifestError(FieldError):
    """A manifest header, part or document that is malformed or inconsistent."""


def check_file_name(name: object, source: str = "") -> str:
    """Return ``name`` if it is a safe, flat file name inside a version directory.

    Only ``[A-Za-z0-9._-]`` with a non-dot first character, at most 255 characters: no ``/``,
    no ``..``, no absolute paths, no hidden files, so a name can never escape the data dir.

    Raises:
        ManifestError: the name is unsafe or reserved.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == MANIFEST_FILE:
        raise ManifestError(source, f"unsafe or reserved file name {name!r}")
    return name


def check_run_id(run_id: object, source: str = "") -> str:
    """Return ``run_id`` if it matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``.

    Raises:
        ManifestError: otherwise.
    """
    if not isinstance(run_id, str) or not _RUN_RE.match(run_id):
        raise ManifestError(source, f"invalid run id {run_id!r}")
    return run_id


EMPTY_DIGEST = blake3.blake3(b"").hexdigest()


def file_root(shards: Sequence[tuple[int, str]]) -> str:
    """The schema-3 file digest: the hash-list root over a file's shards (module docstring).

    Args:
        shards: ``(length in bytes, hex digest)`` of each shard of the file, in file order
            (empty for an empty file).

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: a digest that is not 64 hex characters.
    """
    h = blake3.blake3(derive_key_context=FILE_ROOT_CONTEXT)
    h.update(struct.pack("<Q", len(shards)))
    for length, digest in shards:
        raw = bytes.fromhex(digest)
        if len(raw) != 32:
            raise ValueError(f"shard digest {digest!r} is not 32 bytes")
        h.update(struct.pack("<Q", length))
        h.update(raw)
    return h.hexdigest()


def chunk_digests(data: bytes | bytearray | memoryview, chunk_bytes: int) -> tuple[str, ...]:
    """The chunk list of a shard: BLAKE3 hex digest of each ``chunk_bytes`` piece of ``data``
    in order (the last one shorter; one chunk for an empty shard)."""
    view = memoryview(data)
    if not len(view):
        return (EMPTY_DIGEST,)
    return tuple(
        blake3.blake3(view[i : i + chunk_bytes]).hexdigest()
        for i in range(0, len(view), chunk_bytes)
    )


def chunk_count(length: int, chunk_bytes: int) -> int:
    """Chunks in a ``length``-byte shard (at least 1)."""
    return max(1, -(-length // chunk_bytes))


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, source: str) -> int:
    return fields.need_int(obj, key, lo, hi, source, error=ManifestError)


def _digest(val: Any, source: str) -> str:
    if not isinstance(val, str) or not _DIGEST_RE.match(val):
        raise ManifestError(source, f"digest {val!r} is not 64 lowercase hex characters")
    return val


@dataclass(frozen=True)
class FileEntry:
    """One checkpoint file: flat name and size in bytes."""

    name: str
    size: int


@dataclass(frozen=True)
class ShardRef:
    """Where a shard lives: bytes ``[offset, offset + length)`` of ``file``."""

    index: int
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Encoded:
    """An encoded form of a shard offered by the origin: its encoding, size and digest."""

    encoding: str
    size: int
    digest: str


@dataclass(frozen=True)
class Header:
    """The signed header of a version (see module docstring).

    Attributes:
        run_id: the training run.
        step: the policy step (version number), >= 0.
        shard_size: bytes per shard (the last shard of a file may be shorter).
        files: files in name order.
        shards_per_part: shards covered by each signed part.
        base_step: the version deltas are computed against, or None (full version only).
        base_digest: that version's header digest, or None.
        nonce: 32 hex characters chosen per publication, so that two publications of the same
            step (e.g. after a trainer restart) never share a header digest even when their
            files have the same sizes; parts name the header digest, so parts of one
            publication can never be mixed with another's.
        schema: manifest schema, one of :data:`READ_SCHEMAS` (3: hash-list root file
            digests; 2: whole-file digests, still read).
    """

    run_id: str
    step: int
    shard_size: int
    files: tuple[FileEntry, ...]
    shards_per_part: int
    base_step: int | None = None
    base_digest: str | None = None
    nonce: str = "0" * 32
    schema: int = SCHEMA_VERSION
    shards: tuple[ShardRef, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        refs: list[ShardRef] = []
        for f in self.files:
            for off in range(0, f.size, self.shard_size):
                refs.append(ShardRef(len(refs), f.name, off, min(self.shard_size, f.size - off)))
        object.__setattr__(self, "shards", tuple(refs))

    @property
    def total_bytes(self) -> int:
        """Sum of the file sizes, bytes."""
        return sum(f.size for f in self.files)

    @property
    def n_parts(self) -> int:
        """Number of parts (at least 1, even with no shards)."""
        return max(1, -(-len(self.shards) // self.shards_per_part))

    def part_range(self, k: int) -> range:
        """Shard indices covered by part ``k``."""
        return range(
            k * self.shards_per_part, min((k + 1) * self.shards_per_part, len(self.shards))
        )

    def files_ending_in(self, k: int) -> list[str]:
        """Files whose whole-file digest part ``k`` carries (empty files: part 0)."""
        last: dict[str, int] = {}
        for s in self.shards:
            last[s.file] = s.index
        out = []
        for f in self.files:
            if f.name in last:
                if last[f.name] // self.shards_per_part == k:
                    out.append(f.name)
            elif k == 0:
                out.append(f.name)
        return out

    def file(self, name: str) -> FileEntry:
        """The entry of file ``name``; raises KeyError if absent."""
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def first_shard(self, name: str) -> int:
        """Index of the first shard of file ``name`` (raises KeyError if it has none).

        A dictionary lookup (built once per header): servers call it on every wake of a held
        range request."""
        return self._first_shards[name]

    @cached_property
    def _first_shards(self) -> dict[str, int]:
        first: dict[str, int] = {}
        for s in self.shards:
            first.setdefault(s.file, s.index)
        return first

    def to_obj(self) -> dict[str, Any]:
        """The JSON body."""
        obj: dict[str, Any] = {
            "v": self.schema,
            "run_id": self.run_id,
            "step": self.step,
            "shard_size": self.shard_size,
            "shards_per_part": self.shards_per_part,
            "nonce": self.nonce,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
        }
        if self.base_step is not None:
            obj["base_step"] = self.base_step
            obj["base_digest"] = self.base_digest
        return obj

    def canonical_bytes(self) -> bytes:
        """Canonical JSON (the signed bytes)."""
        return canonical_json(self.to_obj())

    def digest(self) -> str:
        """BLAKE3 hex digest of the canonical bytes: the version's identity.

        Computed once per header (it is frozen) and kept: every lane request of a download
        names the version by it, so recomputing it cost a canonical encoding per shard."""
        cached: str | None = self.__dict__.get("_digest")
        if cached is None:
            cached = blake3_hex(self.canonical_bytes())
            object.__setattr__(self, "_digest", cached)
        return cached

    @classmethod
    def from_obj(cls, obj: Any, source: str = "") -> Header:
        """Parse and validate a header body.

        Raises:
            ManifestError: wrong schema version, types, values or unsafe names.
        """
        if not isinstance(obj, dict):
            raise ManifestError(source, "header is not an object")
        schema = obj.get("v")
        if not isinstance(schema, int) or isinstance(schema, bool) or schema not in READ_SCHEMAS:
            raise ManifestError(
                source,
                f"manifest schema version {schema!r}, this node reads {list(READ_SCHEMAS)}",
            )
        allowed = {
            "v",
            "run_id",
            "step",
            "shard_size",
            "shards_per_part",
            "files",
            "base_step",
            "base_digest",
            "nonce",
        }
        if set(obj) - allowed:
            raise ManifestError(source, f"unknown header fields {sorted(set(obj) - allowed)}")
        run_id = check_run_id(obj.get("run_id"), source)
        step = _int(obj, "step", 0, 1 << 62, source)
        shard_size = _int(obj, "shard_size", 1, 1 << 34, source)
        spp = _int(obj, "shards_per_part", 1, MAX_SHARDS, source)
        raw_files = obj.get("files")
        if not isinstance(raw_files, list) or not 0 < len(raw_files) <= MAX_FILES:
            raise ManifestError(source, "files must be a non-empty list")
        files = []
        for rf in raw_files:
            if not isinstance(rf, dict) or set(rf) != {"name", "size"}:
                raise ManifestError(source, "file entry must be {name, size}")
            files.append(
                FileEntry(
                    check_file_name(rf["name"], source), _int(rf, "size", 0, MAX_FILE_BYTES, source)
                )
            )
        names = [f.name for f in files]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ManifestError(source, "file names must be unique and sorted")
        if sum(-(-f.size // shard_size) for f in files) > MAX_SHARDS:
            raise ManifestError(source, f"more than {MAX_SHARDS} shards")
        base_step = base_digest = None
        if "base_step" in obj or "base_digest" in obj:
            base_step = _int(obj, "base_step", 0, step - 1, source)
            base_digest = _digest(obj.get("base_digest"), source)
        nonce = obj.get("nonce")
        if not isinstance(nonce, str) or not re.fullmatch(r"[0-9a-f]{32}", nonce):
            raise ManifestError(source, f"nonce {nonce!r} is not 32 lowercase hex characters")
        return cls(
            run_id, step, shard_size, tuple(files), spp, base_step, base_digest, nonce, schema
        )


@dataclass(frozen=True)
class Part:
    """One signed part: shard digests, encodings and completed file digests.

    Attributes:
        run_id, step: the version.
        header_digest: digest of the header this part belongs to.
        index: the part number ``k``.
        digests: BLAKE3 of each covered shard's decoded bytes, in shard order.
        encodings: per covered shard, the encoded forms offered.
        file_digests: file digests (schema 3: hash-list roots; 2: whole-file BLAKE3) of the
            files ending in this part.
        schema: its header's schema.
        chunk_bytes: the chunk size of ``chunks`` (0: the part lists no chunks).
        chunks: per covered shard, its chunk list (module docstring), or ``()``.
    """

    run_id: str
    step: int
    header_digest: str
    index: int
    digests: tuple[str, ...]
    encodings: tuple[tuple[Encoded, ...], ...]
    file_digests: tuple[tuple[str, str], ...]
    schema: int = SCHEMA_VERSION
    chunk_bytes: int = 0
    chunks: tuple[tuple[str, ...], ...] = ()

    def to_obj(self) -> dict[str, Any]:
        """The JSON body."""
        shards: list[list[Any]] = [
            [d, [[e.encoding, e.size, e.digest] for e in encs]]
            for d, encs in zip(self.digests, self.encodings, strict=True)
        ]
        if self.chunks:
            for entry, chunks in zip(shards, self.chunks, strict=True):
                entry.append([self.chunk_bytes, list(chunks)])
        return {
            "v": self.schema,
            "run_id": self.run_id,
            "step": self.step,
            "header": self.header_digest,
            "part": self.index,
            "shards": shards,
            "files": {n: d for n, d in self.file_digests},
        }

    def canonical_bytes(self) -> bytes:
        """Canonical JSON (the signed bytes)."""
        return canonical_json(self.to_obj())

    @classmethod
    def from_obj(cls, obj: Any, header: Header, source: str = "") -> Part:
        """Parse a part body and check it against ``header``.

        Raises:
            ManifestError: malformed, for another header, wrong shard count or files, or an
                encoding that the header does not allow.
        """
        _check_part_fields(obj, header, source)
        k = _int(obj, "part", 0, header.n_parts - 1, source)
        rng = header.part_range(k)
        raw = obj["shards"]
        if not isinstance(raw, list) or len(raw) != len(rng):
            raise ManifestError(source, f"part {k} must list {len(rng)} shards")
        digests, encs = [], []
        chunk_lists: list[tuple[str, ...]] = []
        chunk_bytes = 0
        listed = bool(raw) and isinstance(raw[0], list) and len(raw[0]) == 3
        for i, entry in zip(rng, raw, strict=True):
            if (
                not isinstance(entry, list)
                or len(entry) != (3 if listed else 2)
                or not isinstance(entry[1], list)
            ):
                raise ManifestError(
                    source, f"shard {i} entry is not [digest, encodings] (or + chunk list)"
                )
            digests.append(_digest(entry[0], source))
            if listed:
                size, chunks = _chunk_list(entry[2], header.shards[i].length, source, i)
                if chunk_bytes and size != chunk_bytes:
                    raise ManifestError(source, f"shard {i}: chunk size differs within a part")
                chunk_bytes = size
                chunk_lists.append(chunks)
            encs.append(_encodings(entry[1], header, i, source))
        files = obj["files"]
        if not isinstance(files, dict) or sorted(files) != sorted(header.files_ending_in(k)):
            raise ManifestError(
                source, f"part {k} must carry the digests of {header.files_ending_in(k)}"
            )
        fd = tuple(sorted((n, _digest(d, source)) for n, d in files.items()))
        return cls(
            header.run_id,
            header.step,
            obj["header"],
            k,
            tuple(digests),
            tuple(encs),
            fd,
            header.schema,
            chunk_bytes,
            tuple(chunk_lists),
        )


def _check_part_fields(obj: Any, header: Header, source: str) -> None:
    """Check that a part body is an object of ``header``'s schema with exactly the part's
    fields, naming ``header``'s run, step and digest.

    Raises:
        ManifestError: another schema, missing or extra fields, or another version.
    """
    if not isinstance(obj, dict) or obj.get("v") != header.schema:
        raise ManifestError(source, f"part is not a version-{header.schema} object")
    if set(obj) != {"v", "run_id", "step", "header", "part", "shards", "files"}:
        raise ManifestError(
            source, "part fields must be v, run_id, step, header, part, shards, files"
        )
    if (
        obj["run_id"] != header.run_id
        or obj["step"] != header.step
        or obj["header"] != header.digest()
    ):
        raise ManifestError(source, "part belongs to another version")


def _encodings(raw: list[Any], header: Header, i: int, source: str) -> tuple[Encoded, ...]:
    """Parse shard ``i``'s offered encodings, ``[[encoding, size, digest], ...]``.

    Raises:
        ManifestError: an encoding not offerable, a delta when ``header`` has no base, an
            encoded size outside 1 .. 2 x shard size + 1024 bytes, or an encoding listed twice.
    """
    offered = []
    for e in raw:
        if not isinstance(e, list) or len(e) != 3 or e[0] not in OFFERABLE:
            raise ManifestError(source, f"shard {i} has an invalid encoding {e!r}")
        if e[0] in DELTAS and header.base_step is None:
            raise ManifestError(source, f"shard {i} offers a delta without a base")
        if (
            not isinstance(e[1], int)
            or isinstance(e[1], bool)
            or not 1 <= e[1] <= 2 * header.shard_size + 1024
        ):
            raise ManifestError(source, f"shard {i} encoded size {e[1]!r} out of range")
        offered.append(Encoded(e[0], e[1], _digest(e[2], source)))
    if len({o.encoding for o in offered}) != len(offered):
        raise ManifestError(source, f"shard {i} lists an encoding twice")
    return tuple(offered)


def _chunk_list(obj: Any, length: int, source: str, i: int) -> tuple[int, tuple[str, ...]]:
    """Parse ``[chunk_bytes, [digests]]`` for a ``length``-byte shard.

    Raises:
        ManifestError: malformed, a chunk size that is not a power of two of at least
            :data:`MIN_CHUNK_BYTES`, or the wrong number of digests.
    """
    if not isinstance(obj, list) or len(obj) != 2 or not isinstance(obj[1], list):
        raise ManifestError(source, f"shard {i} chunk list is not [chunk_bytes, [digests]]")
    size = obj[0]
    if (
        not isinstance(size, int)
        or isinstance(size, bool)
        or size < MIN_CHUNK_BYTES
        or size > 1 << 34
        or size & (size - 1)
    ):
        raise ManifestError(source, f"shard {i} chunk size {size!r} is not a power of two")
    if len(obj[1]) != chunk_count(length, size):
        raise ManifestError(source, f"shard {i} must list {chunk_count(length, size)} chunks")
    return size, tuple(_digest(d, source) for d in obj[1])


def _legacy_envelope(body: bytes, signer: str, signature: bytes) -> dict[str, Any]:
    return {"body": json.loads(body), "signer": signer, "signature": signature.hex()}


def _open_legacy(
    env: Any, domain: str, trust: TrustList, what: str, source: str
) -> tuple[Any, str, bytes]:
    """Verify an old-format JSON envelope; returns (body object, signer, signature)."""
    if not isinstance(env, dict) or set(env) != {"body", "signer", "signature"}:
        raise ManifestError(source, f"{what} envelope must have exactly body, signer, signature")
    signer, sig_hex = env["signer"], env["signature"]
    if not isinstance(signer, str) or not isinstance(sig_hex, str):
        raise ManifestError(source, "signer and signature must be strings")
    try:
        signature = bytes.fromhex(sig_hex)
    except ValueError as exc:
        raise ManifestError(source, "signature is not hex") from exc
    try:
        body_bytes = canonical_json(env["body"])
    except TypeError as exc:
        raise ManifestError(source, f"{what} body is not canonical JSON: {exc}") from exc
    try:
        verify(signer, domain, body_bytes, signature)
    except IntegrityError as exc:
        raise IntegrityError(f"{what}: {exc}", source) from exc
    trust.require_trainer(signer, what)
    return env["body"], signer, signature


def _open_sealed(
    kind: Kind, data: bytes, trust: TrustList, max_bytes: int, what: str, source: str
) -> tuple[Any, str, bytes]:
    """Verify an envelope holding canonical JSON; returns (body object, signer, signature).

    Raises:
        ManifestError: not an envelope of ``kind``, too large, or a body that is not
            canonical JSON.
        IntegrityError (BadSignature, UntrustedSigner): see :func:`p2p.envelope.open`.
    """
    try:
        opened = envelope.open(kind, data, trust.trainer, max_bytes, sender=source)
    except RemoteProtocolError as exc:  # MalformedEnvelope, MessageTooLarge
        raise ManifestError(source, f"{what}: {exc}") from exc
    try:
        obj = loads_untrusted(opened.body)
        canonical = canonical_json(obj) == opened.body
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise ManifestError(source, f"{what} body is not JSON: {exc}") from exc
    if not canonical:
        raise ManifestError(source, f"{what} body is not canonical JSON")
    return obj, opened.signer, opened.signature


def _b64(sealed: bytes) -> str:
    return base64.b64encode(sealed).decode("ascii")


def _unb64(text: Any, max_bytes: int, what: str, source: str) -> bytes:
    if not isinstance(text, str) or len(text) > (max_bytes + 1024) * 4 // 3 + 4:
        raise ManifestError(source, f"{what} must be a bounded base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ManifestError(source, f"{what} is not base64") from exc
    if _b64(raw) != text:
        raise ManifestError(source, f"{what} is not canonical base64")
    return raw


@dataclass(frozen=True)
class SignedHeader:
    """A header with the signer's PeerID and signature.

    ``legacy``: signed in the old format (see module docstring); re-encoded in it.
    """

    header: Header
    signer: str
    signature: bytes
    legacy: bool = False

    @property
    def digest(self) -> str:
        """The header digest (the version's identity)."""
        return self.header.digest()

    def sealed(self) -> bytes:
        """The envelope bytes (new format only).

        Raises:
            LocalProtocolError: the header was signed in the old format.
        """
        _require_sealed(self.legacy)
        return self._sealed

    @cached_property
    def _sealed(self) -> bytes:
        """:meth:`sealed`, encoded once (not a field: equality and hashing ignore it), or the
        envelope bytes it was verified from (:meth:`from_sealed`): the server sends it with
        every manifest asked for, and a commit writes it."""
        return envelope.encode_sealed(
            HEADER_KIND, self.header.canonical_bytes(), public_key_of(self.signer), self.signature
        )

    def envelope(self) -> dict[str, Any]:
        """The old-format JSON envelope (only for a header read in that format)."""
        return _legacy_envelope(self.header.canonical_bytes(), self.signer, self.signature)

    @classmethod
    def from_sealed(cls, data: bytes, *, trust: TrustList, source: str = "") -> SignedHeader:
        """Verify and parse envelope bytes (see module docstring for the errors)."""
        body, signer, sig = _open_sealed(
            HEADER_KIND, data, trust, MAX_HEADER_BYTES, "manifest header", source
        )
        signed = cls(Header.from_obj(body, source), signer, sig)
        signed.__dict__["_sealed"] = bytes(data)  # the verified bytes: served and stored as is
        return signed

    @classmethod
    def from_envelope(cls, env: Any, *, trust: TrustList, source: str = "") -> SignedHeader:
        """Verify and parse an old-format JSON envelope."""
        body, signer, sig = _open_legacy(env, HEADER_DOMAIN, trust, "manifest header", source)
        return cls(Header.from_obj(body, source), signer, sig, legacy=True)


@dataclass(frozen=True)
class SignedPart:
    """A part with the signer's PeerID and signature (``legacy``: as :class:`SignedHeader`)."""

    part: Part
    signer: str
    signature: bytes
    legacy: bool = False

    def envelope(self) -> dict[str, Any]:
        """The old-format JSON envelope (only for a part read in that format)."""
        return _legacy_envelope(self.part.canonical_bytes(), self.signer, self.signature)

    def sealed(self) -> bytes:
        """The envelope bytes (new format only; raises LocalProtocolError otherwise)."""
        _require_sealed(self.legacy)
        return self._sealed

    @cached_property
    def _sealed(self) -> bytes:
        """:meth:`sealed`, encoded once (not a field: equality and hashing ignore it), or the
        envelope bytes it was verified from (:meth:`from_sealed`): a part's canonical JSON
        lists every chunk digest of its shards, and it was encoded again for every
        ``/part`` request served and every manifest document written."""
        return envelope.encode_sealed(
            PART_KIND, self.part.canonical_bytes(), public_key_of(self.signer), self.signature
        )

    def encode(self) -> bytes:
        """What is served for one part: the envelope bytes (old format: its JSON)."""
        return canonical_json(self.envelope()) if self.legacy else self.sealed()

    @classmethod
    def from_sealed(
        cls, data: bytes, header: Header, *, trust: TrustList, source: str = ""
    ) -> SignedPart:
        """Verify and parse part envelope bytes belonging to ``header``."""
        body, signer, sig = _open_sealed(
            PART_KIND, data, trust, MAX_PART_BYTES, "manifest part", source
        )
        signed = cls(Part.from_obj(body, header, source), signer, sig)
        signed.__dict__["_sealed"] = bytes(data)  # the verified bytes: served and stored as is
        return signed

    @classmethod
    def from_envelope(
        cls, env: Any, header: Header, *, trust: TrustList, source: str = ""
    ) -> SignedPart:
        """Verify and parse an old-format part envelope belonging to ``header``."""
        body, signer, sig = _open_legacy(env, PART_DOMAIN, trust, "manifest part", source)
        return cls(Part.from_obj(body, header, source), signer, sig, legacy=True)


def _require_sealed(legacy: bool) -> None:
    if legacy:
        raise LocalProtocolError("an old-format manifest has no envelope bytes")


def sign_header(header: Header, identity: KeyHolder) -> SignedHeader:
    """Sign a header with the trainer's key (an Identity or its signing key)."""
    key = identity.key
    return SignedHeader(
        header, key.peer_id, envelope.sign(HEADER_KIND, header.canonical_bytes(), key)
    )


def sign_part(part: Part, identity: KeyHolder) -> SignedPart:
    """Sign a part with the trainer's key (an Identity or its signing key)."""
    key = identity.key
    return SignedPart(part, key.peer_id, envelope.sign(PART_KIND, part.canonical_bytes(), key))


@dataclass(frozen=True)
class ShardEntry:
    """Everything known about one shard once its part arrived."""

    index: int
    file: str
    offset: int
    length: int
    digest: str
    encodings: tuple[Encoded, ...]
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()
    """Its chunk list (module docstring) and chunk size, if its part lists one."""

    def offered(self, encoding: str) -> Encoded | None:
        """The encoded form ``encoding`` if offered."""
        return next((e for e in self.encodings if e.encoding == encoding), None)

    def delta(self) -> Encoded | None:
        """The smallest delta against the base version offered, if any."""
        deltas = [e for e in self.encodings if e.encoding in DELTAS]
        return min(deltas, key=lambda e: e.size) if deltas else None


class Manifest:
    """A signed header plus the signed parts received so far (grows; see module docstring).

    Not thread-safe for concurrent ``add_part``; read-only use from several threads is fine.
    """

    def __init__(self, signed_header: SignedHeader) -> None:
        self.signed_header = signed_header
        self.header = signed_header.header
        self.parts: dict[int, SignedPart] = {}

    @property
    def run_id(self) -> str:
        """The run."""
        return self.header.run_id

    @property
    def step(self) -> int:
        """The policy step."""
        return self.header.step

    @property
    def digest(self) -> str:
        """The header digest (the version's identity)."""
        return self.signed_header.digest

    @property
    def total_bytes(self) -> int:
        """Sum of the file sizes, bytes."""
        return self.header.total_bytes

    @property
    def complete(self) -> bool:
        """True when every part is present."""
        return len(self.parts) == self.header.n_parts

    def add_part(self, signed: SignedPart) -> bool:
        """Add a verified part; returns False if it was already present.

        Raises:
            ManifestError: a different part with the same index (equivocation), or a part in
                another format than the header.
        """
        if signed.legacy != self.signed_header.legacy:
            raise ManifestError(signed.signer, "part and header are in different formats")
        k = signed.part.index
        if k in self.parts:
            if self.parts[k].part != signed.part:
                raise ManifestError(signed.signer, f"two different versions of part {k}")
            return False
        self.parts[k] = signed
        return True

    def known(self, index: int) -> bool:
        """True if shard ``index``'s part has arrived."""
        return index // self.header.shards_per_part in self.parts

    def shard(self, index: int) -> ShardEntry:
        """Full entry of shard ``index``.

        Raises:
            KeyError: its part has not arrived.
        """
        ref = self.header.shards[index]
        part = self.parts[index // self.header.shards_per_part].part
        j = index - part.index * self.header.shards_per_part
        return ShardEntry(
            index,
            ref.file,
            ref.offset,
            ref.length,
            part.digests[j],
            part.encodings[j],
            part.chunk_bytes,
            part.chunks[j] if part.chunks else (),
        )

    def file_digest(self, name: str) -> str | None:
        """Whole-file digest of ``name`` once its part arrived, else None."""
        for p in self.parts.values():
            for n, d in p.part.file_digests:
                if n == name:
                    return d
        return None

    @property
    def rooted(self) -> bool:
        """True if file digests are hash-list roots (schema 3), False for whole-file BLAKE3."""
        return self.header.schema >= 3

    def shard_root(self, name: str) -> str:
        """:func:`file_root` of file ``name`` from the signed shard digests.

        Raises:
            KeyError: no such file, or a part covering one of its shards has not arrived.
        """
        self.header.file(name)
        return file_root(
            [(s.length, self.shard(s.index).digest) for s in self.header.shards if s.file == name]
        )

    def document(self) -> dict[str, Any]:
        """``{"v": 3, "header": base64 envelope, "parts": [base64 envelopes in index order]}``
        (old format, for a manifest read in it: ``{"header": E, "parts": [E...]}``)."""
        parts = [self.parts[k] for k in sorted(self.parts)]
        if self.signed_header.legacy:
            return {
                "header": self.signed_header.envelope(),
                "parts": [p.envelope() for p in parts],
            }
        return {
            "v": DOCUMENT_VERSION,
            "header": _b64(self.signed_header.sealed()),
            "parts": [_b64(p.sealed()) for p in parts],
        }

    def encode(self) -> bytes:
        """Canonical JSON bytes of :meth:`document`."""
        return canonical_json(self.document())

    @classmethod
    def decode(
        cls, data: bytes, *, trust: TrustList, source: str = "", max_bytes: int = MAX_MANIFEST_BYTES
    ) -> Manifest:
        """Parse and verify a document (header and any parts present).

        Raises:
            ManifestError: too large, not JSON, malformed.
            IntegrityError: a signature does not verify.
            UntrustedSigner: signed by someone other than the pinned trainer.
        """
        if len(data) > max_bytes:
            raise ManifestError(source, f"manifest of {len(data)} bytes exceeds {max_bytes}")
        try:
            doc = loads_untrusted(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(source, f"manifest is not JSON: {exc}") from exc
        if isinstance(doc, dict) and set(doc) == {"header", "parts"}:  # the old format
            if not isinstance(doc["parts"], list):
                raise ManifestError(source, "manifest document must be {header, parts: [...]}")
            m = cls(SignedHeader.from_envelope(doc["header"], trust=trust, source=source))
            for env in doc["parts"]:
                m.add_part(SignedPart.from_envelope(env, m.header, trust=trust, source=source))
            return m
        if not isinstance(doc, dict) or set(doc) != {"v", "header", "parts"}:
            raise ManifestError(source, "manifest document must be {v, header, parts: [...]}")
        fields.need_version(doc, DOCUMENT_VERSION, "manifest document", source, error=ManifestError)
        raw_parts = fields.need_list(doc, "parts", MAX_SHARDS, source, error=ManifestError)
        header = _unb64(doc["header"], MAX_HEADER_BYTES, "header", source)
        m = cls(SignedHeader.from_sealed(header, trust=trust, source=source))
        for text in raw_parts:
            part = _unb64(text, MAX_PART_BYTES, "part", source)
            m.add_part(SignedPart.from_sealed(part, m.header, trust=trust, source=source))
        return m

    def parts_after(self, k: int) -> Sequence[SignedPart]:
        """Parts with index > ``k``, in order."""
        return [self.parts[i] for i in sorted(self.parts) if i > k]


def document_signer(data: bytes, source: str = "") -> str:
    """The PeerID that signed a manifest document's header, WITHOUT verifying anything: for
    tools re-checking their own stored versions, which then :meth:`Manifest.decode` with it.

    Raises:
        ManifestError: not a manifest document in either format.
    """
    try:
        doc = loads_untrusted(data)
        header = doc["header"]
        if isinstance(header, dict):  # the old format
            signer = header["signer"]
            if isinstance(signer, str):
                return signer
        else:
            raw = _unb64(header, MAX_HEADER_BYTES, "header", source)
            return envelope.peek_signer(raw, max_bytes=MAX_HEADER_BYTES, sender=source)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, RemoteProtocolError) as exc:
        raise ManifestError(source, f"not a manifest document: {exc}") from exc
    raise ManifestError(source, "manifest header has no signer")


def decode_part(data: bytes, header: Header, *, trust: TrustList, source: str = "") -> SignedPart:
    """Parse and verify one part's envelope bytes (or an old-format JSON part: ``{...``).

    Raises:
        ManifestError, IntegrityError, UntrustedSigner: see :meth:`Manifest.decode`.
    """
    if len(data) > MAX_PART_BYTES:
        raise ManifestError(source, f"part of {len(data)} bytes exceeds {MAX_PART_BYTES}")
    if not data.startswith(b"{"):
        return SignedPart.from_sealed(data, header, trust=trust, source=source)
    try:
        env = loads_untrusted(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(source, f"part is not JSON: {exc}") from exc
    return SignedPart.from_envelope(env, header, trust=trust, source=source)
