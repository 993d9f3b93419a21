"""The signed manifest of one checkpoint version.

Theory of operation
-------------------
A manifest names the run, the policy step, every file of the checkpoint (name, size, BLAKE3
digest) and every shard (index, file, offset, length, BLAKE3 digest of the shard's bytes).
Shards tile each file exactly, in file order then offset order, so a downloader that holds
every verified shard holds every file, and the file digests are a second, independent check.

Encoding (schema version 1) is canonical JSON: UTF-8, keys sorted, no whitespace, integers and
strings only (no floats), digests as 64 lowercase hex characters. The trainer signs the
canonical bytes of the ``manifest`` object under the domain ``manifest/v1`` with its Ed25519
PeerID key (see :mod:`p2p.identity`). The envelope is::

    {"manifest": {...}, "signer": "<PeerID>", "signature": "<128 hex chars>"}

:meth:`SignedManifest.decode` treats its input as hostile: size bound, schema and value checks
(safe file names, shards that tile the files exactly), signature, and the pinned signer, each
failure a typed error naming what was wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3

from p2p.errors import IntegrityError, RemoteProtocolError
from p2p.identity import Identity, verify
from p2p.trust import TrustList

SCHEMA_VERSION = 1
SIGN_DOMAIN = "manifest/v1"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_FILES = 10_000
MAX_SHARDS = 1_000_000
MAX_FILE_BYTES = 1 << 44  # 16 TiB
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_FILE = "manifest.json"


class ManifestError(RemoteProtocolError):
    """A manifest that is malformed or inconsistent (the sender's fault)."""


def check_file_name(name: str, source: str = "") -> str:
    """Return ``name`` if it is a safe, flat file name inside a version directory.

    Only ``[A-Za-z0-9._-]`` with a non-dot first character, at most 255 characters: no ``/``,
    no ``..``, no absolute paths, no hidden files, so a name can never escape the data dir.

    Raises:
        ManifestError: the name is unsafe.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == MANIFEST_FILE:
        raise ManifestError(source, f"unsafe or reserved file name {name!r}")
    return name


def check_run_id(run_id: str, source: str = "") -> str:
    """Return ``run_id`` if it matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``.

    Raises:
        ManifestError: otherwise.
    """
    if not isinstance(run_id, str) or not _RUN_RE.match(run_id):
        raise ManifestError(source, f"invalid run id {run_id!r}")
    return run_id


def blake3_hex(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3-256 digest of ``data`` as 64 lowercase hex characters."""
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One checkpoint file: flat name, size in bytes, BLAKE3 hex digest of its content."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class ShardEntry:
    """One shard: bytes ``[offset, offset + length)`` of ``file``, with their BLAKE3 digest."""

    index: int
    file: str
    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    """The unsigned content of a manifest (see module docstring).

    Attributes:
        run_id: the training run.
        step: the policy step (version number), >= 0.
        shard_size: nominal shard size in bytes (the last shard of a file may be shorter).
        files: files in canonical (name) order.
        shards: shards in file order then offset order; ``shards[i].index == i``.
    """

    run_id: str
    step: int
    shard_size: int
    files: tuple[FileEntry, ...]
    shards: tuple[ShardEntry, ...]

    @property
    def total_bytes(self) -> int:
        """Sum of the file sizes, bytes."""
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry:
        """The entry of file ``name``; raises KeyError if absent."""
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_obj(self) -> dict[str, Any]:
        """The JSON object (schema version 1)."""
        return {
            "v": SCHEMA_VERSION,
            "run_id": self.run_id,
            "step": self.step,
            "shard_size": self.shard_size,
            "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in self.files],
            "shards": [[s.file, s.offset, s.length, s.digest] for s in self.shards],
        }

    def canonical_bytes(self) -> bytes:
        """Canonical JSON encoding (the bytes that are signed)."""
        return canonical_json(self.to_obj())

    def digest(self) -> str:
        """BLAKE3 hex digest of :meth:`canonical_bytes`: the version's identity on the wire."""
        return blake3_hex(self.canonical_bytes())

    @classmethod
    def from_obj(cls, obj: Any, source: str = "") -> Manifest:
        """Parse and validate a manifest object.

        Raises:
            ManifestError: wrong schema version, field types or values, unsafe names, or
                shards that do not tile the files exactly.
        """
        if not isinstance(obj, dict):
            raise ManifestError(source, "manifest is not an object")
        if obj.get("v") != SCHEMA_VERSION:
            raise ManifestError(
                source,
                f"manifest schema version {obj.get('v')!r}, this node reads {SCHEMA_VERSION}",
            )
        run_id = check_run_id(obj.get("run_id"), source)  # type: ignore[arg-type]
        step = _int(obj, "step", 0, (1 << 62), source)
        shard_size = _int(obj, "shard_size", 1, 1 << 34, source)
        raw_files = obj.get("files")
        raw_shards = obj.get("shards")
        if not isinstance(raw_files, list) or not 0 < len(raw_files) <= MAX_FILES:
            raise ManifestError(source, "files must be a non-empty list")
        if not isinstance(raw_shards, list) or len(raw_shards) > MAX_SHARDS:
            raise ManifestError(source, "shards must be a list")
        files = []
        for rf in raw_files:
            if not isinstance(rf, dict):
                raise ManifestError(source, "file entry is not an object")
            files.append(
                FileEntry(
                    check_file_name(rf.get("name"), source),  # type: ignore[arg-type]
                    _int(rf, "size", 0, MAX_FILE_BYTES, source),
                    _digest(rf.get("digest"), source),
                )
            )
        shards = []
        for i, rs in enumerate(raw_shards):
            if not isinstance(rs, list) or len(rs) != 4:
                raise ManifestError(source, f"shard {i} is not [file, offset, length, digest]")
            name, off, length, dig = rs
            for label, val in (("offset", off), ("length", length)):
                if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                    raise ManifestError(source, f"shard {i} {label} is not a non-negative int")
            shards.append(
                ShardEntry(i, check_file_name(name, source), off, length, _digest(dig, source))
            )
        m = cls(run_id, step, shard_size, tuple(files), tuple(shards))
        _check_tiling(m, source)
        return m


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, ASCII only; rejects floats.

    Raises:
        TypeError: ``obj`` contains a float or another non-JSON type (caller bug).
    """
    _reject_floats(obj)
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _reject_floats(obj: Any) -> None:
    if isinstance(obj, float):
        raise TypeError("floats are not allowed in canonical manifests")
    if isinstance(obj, Mapping):
        for v in obj.values():
            _reject_floats(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _reject_floats(v)


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, source: str) -> int:
    val = obj.get(key)
    if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
        raise ManifestError(source, f"{key}={val!r} is not an integer in [{lo}, {hi}]")
    return val


def _digest(val: Any, source: str) -> str:
    if not isinstance(val, str) or not _DIGEST_RE.match(val):
        raise ManifestError(source, f"digest {val!r} is not 64 lowercase hex characters")
    return val


def _check_tiling(m: Manifest, source: str) -> None:
    names = [f.name for f in m.files]
    if names != sorted(names) or len(set(names)) != len(names):
        raise ManifestError(source, "file names must be unique and sorted")
    by_file: dict[str, list[ShardEntry]] = {n: [] for n in names}
    order: list[str] = []
    for s in m.shards:
        if s.file not in by_file:
            raise ManifestError(source, f"shard {s.index} names unknown file {s.file!r}")
        if s.length == 0 or s.length > m.shard_size:
            raise ManifestError(
                source, f"shard {s.index} length {s.length} not in [1, {m.shard_size}]"
            )
        by_file[s.file].append(s)
        if not order or order[-1] != s.file:
            order.append(s.file)
    if order != [n for n in names if by_file[n]]:
        raise ManifestError(source, "shards are not in file order")
    for f in m.files:
        pos = 0
        for s in by_file[f.name]:
            if s.offset != pos:
                raise ManifestError(
                    source, f"shard {s.index} of {f.name} starts at {s.offset}, expected {pos}"
                )
            pos += s.length
        if pos != f.size:
            raise ManifestError(source, f"shards of {f.name} cover {pos} of {f.size} bytes")


@dataclass(frozen=True)
class SignedManifest:
    """A manifest with the signer's PeerID and Ed25519 signature."""

    manifest: Manifest
    signer: str
    signature: bytes

    @property
    def digest(self) -> str:
        """The manifest digest (see :meth:`Manifest.digest`)."""
        return self.manifest.digest()

    def encode(self) -> bytes:
        """The envelope as canonical JSON bytes."""
        return canonical_json(
            {
                "manifest": self.manifest.to_obj(),
                "signer": self.signer,
                "signature": self.signature.hex(),
            }
        )

    @classmethod
    def decode(
        cls, data: bytes, *, trust: TrustList, source: str = "", max_bytes: int = MAX_MANIFEST_BYTES
    ) -> SignedManifest:
        """Parse, validate and verify an envelope from an untrusted source.

        Args:
            data: the envelope bytes.
            trust: the node's trust list; the signer must be its pinned trainer.
            source: who sent it (PeerID or URL), for errors and logs.
            max_bytes: size bound checked before parsing.

        Raises:
            ManifestError: too large, not JSON, or not a valid manifest.
            IntegrityError: the signature does not verify.
            UntrustedSigner: valid signature by a PeerID other than the pinned trainer.
        """
        if len(data) > max_bytes:
            raise ManifestError(source, f"manifest of {len(data)} bytes exceeds {max_bytes}")
        try:
            env = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(source, f"manifest is not JSON: {exc}") from exc
        if not isinstance(env, dict) or set(env) != {"manifest", "signer", "signature"}:
            raise ManifestError(source, "envelope must have exactly manifest, signer, signature")
        signer, sig_hex = env["signer"], env["signature"]
        if not isinstance(signer, str) or not isinstance(sig_hex, str):
            raise ManifestError(source, "signer and signature must be strings")
        try:
            signature = bytes.fromhex(sig_hex)
        except ValueError as exc:
            raise ManifestError(source, "signature is not hex") from exc
        manifest = Manifest.from_obj(env["manifest"], source)
        try:
            verify(signer, SIGN_DOMAIN, manifest.canonical_bytes(), signature)
        except IntegrityError as exc:
            raise IntegrityError(
                f"manifest {manifest.run_id}/step-{manifest.step}: {exc}", source
            ) from exc
        trust.require_trainer(signer, f"manifest {manifest.run_id}/step-{manifest.step}")
        return cls(manifest, signer, signature)


def sign_manifest(manifest: Manifest, identity: Identity) -> SignedManifest:
    """Sign ``manifest`` with ``identity`` (the trainer's key)."""
    return SignedManifest(
        manifest, identity.peer_id, identity.sign(SIGN_DOMAIN, manifest.canonical_bytes())
    )


def shards_of(manifest: Manifest, file: str) -> Iterable[ShardEntry]:
    """The shards of one file, in offset order."""
    return (s for s in manifest.shards if s.file == file)
