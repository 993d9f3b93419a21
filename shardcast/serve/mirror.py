"""serve: static mirrors: a node's committed versions as a tree any HTTP server serves unchanged.

Layout (``OUT`` is the export directory, the web server's document root)::

    OUT/shardnet/v1/<run>/versions                  {"committed": [...], "in_progress": [],
                                                     "digests": {"<step>": "<digest>"}}
    OUT/shardnet/v1/<run>/<step>/<digest>/manifest           the complete manifest document
    OUT/shardnet/v1/<run>/<step>/<digest>/have               the have-bitmap, every bit set
    OUT/shardnet/v1/<run>/<step>/<digest>/files/<name>       each file of the version
    OUT/shardnet/v1/<run>/<step>/<digest>/shard/<i>/<enc>    each encoded shard blob kept

(``<digest>``: the version's manifest digest, :mod:`shardcast.wire.lane_urls`.)

These are exactly the URL paths of the HTTP lane (:mod:`shardcast.serve.server`), so a downloader
uses ``http://mirror`` as it uses a node's lane: ``Range`` requests on files and blobs, the
manifest, ``/have`` and ``/versions``. ``.../manifest/part/<k>`` is not exported (a plain file
system cannot hold both a file ``manifest`` and a directory ``manifest/``); it is never needed
from a mirror, whose manifest document is always complete.

Theory of operation
-------------------
:func:`export_mirror` reads a node's store (a relay's data directory, say) and, for each
committed version, re-verifies its manifest against the pinned trainer and (by default) every
file and blob against its signed digest, so a damaged store never reaches a mirror. A version
is built in a hidden ``.tmp-`` directory beside its final place and renamed into place, so a
web server never serves half a version; a step already exported with the same manifest digest
is left as it is (versions are immutable), one exported with another digest is replaced (the
new digest's directory appears, then the old one is removed).
``versions`` is written last, by rename, and lists only what is in place; steps the store no
longer holds are removed after it (``prune``). Files are hard links to the store's (no copy,
no extra disk) when they are world-readable and on the same filesystem, else copies; files
are ``0644`` and directories ``0755`` so a web server running as another user can read them.

A mirror is never trusted: followers check every byte it serves against the trainer-signed
manifest, exactly as for any other source (:mod:`shardcast.download.follower`).

Blocking file I/O; no networking. Not safe to run two exports into one ``OUT`` at once.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from p2p.errors import ConfigError, IntegrityError, ShardnetError
from p2p.trust import TrustList
from shardcast.store import (
    ChainBroken,
    ChainReader,
    VersionStore,
    build_file,
    chains,
    file_matches,
    hash_file,
)
from shardcast.wire import (
    ENCODINGS,
    MANIFEST_FILE,
    RAW,
    Manifest,
    blake3_hex,
    check_run_id,
    document_signer,
    full_bits,
)

log = logging.getLogger(__name__)

PREFIX = Path("shardnet") / "v1"
"""Where a run's tree lives under the export directory (the lane's URL prefix)."""
_FILE_MODE = 0o644
_DIR_MODE = 0o755


@dataclass
class MirrorExport:
    """What one :func:`export_mirror` call did.

    Attributes:
        run_dir: ``OUT/shardnet/v1/<run>``.
        exported: steps written now.
        digests: the manifest digest of each step the mirror serves.
        unchanged: steps already exported with the same manifest digest.
        skipped: steps not exported, with the reason (a damaged or unverifiable version).
        pruned: exported steps removed because the store no longer holds them.
        linked: files and blobs hard-linked.
        copied: files and blobs copied (not linkable: another filesystem, or not readable).
    """

    run_dir: Path
    exported: list[int] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    unchanged: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    pruned: list[int] = field(default_factory=list)
    linked: int = 0
    copied: int = 0

    @property
    def steps(self) -> list[int]:
        """The steps the mirror serves now, ascending."""
        return sorted(self.exported + self.unchanged)


def open_store(data_dir: Path, run_id: str) -> VersionStore:
    """The store of ``run_id`` in a node's data directory (read here; nothing is changed).

    Raises:
        ConfigError: no such run in ``data_dir``.
    """
    check_run_id(run_id)
    root = data_dir / "versions"
    if not (root / run_id).is_dir():
        raise ConfigError("data_dir", f"{data_dir} holds no versions of run {run_id!r}")
    return _ReadOnlyStore(root, run_id)


def version_problems(step_dir: Path, m: Manifest) -> list[str]:
    """What in committed version directory ``step_dir`` (``<data_dir>/versions/<run>/step-N``)
    does not match manifest ``m``: each full file against its signed digest, each file of a
    version kept as a chain built shard by shard and verified (:mod:`shardcast.store.chains`),
    through a read-only view of the store (the node may be running; nothing is changed).
    Empty: every byte is the trainer's."""
    try:
        record = chains.read_record(step_dir)
    except (OSError, ValueError) as exc:
        return [f"chain record unreadable: {exc}"]
    chained = record.files if record is not None else frozenset()
    problems = [
        f"{f.name} digest mismatch"
        for f in m.header.files
        if f.name not in chained and not file_matches(step_dir / f.name, m, f.name)
    ]
    if chained:
        view = open_store(step_dir.parents[2], m.run_id)
        for ref in m.header.shards:
            if ref.file not in chained:
                continue
            try:
                view.chains.read_shard(m.step, ref.index)
            except (ChainBroken, OSError) as exc:
                problems.append(f"{ref.file} shard {ref.index} does not verify: {exc}")
    return problems


class _ReadOnlyStore(VersionStore):
    """A :class:`VersionStore` view that leaves the directory as it is (no recovery, no
    leftover clean-up, no open marker): the node may be running."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.run_dir = root / check_run_id(run_id)
        self.run_id = run_id
        self.keep_last = 1 << 30
        self.durable = False
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()
        self._open_partials: set[int] = set()
        self._digests: dict[int, tuple[int, int, str]] = {}
        self._manifests: dict[int, Manifest] = {}
        self.chains = ChainReader(self)
        self.damaged: dict[int, str] = {}

    def quarantine(self, step: int, reason: str) -> list[int]:
        """Record a damaged version without removing it (the node owns the directory)."""
        self.damaged[step] = reason
        log.error("mirror_version_damaged step=%d reason=%s", step, reason)
        return []


def export_mirror(
    source: Path | VersionStore,
    out_dir: Path,
    *,
    run_id: str | None = None,
    trainer_id: str | None = None,
    verify: bool = True,
    prune: bool = True,
) -> MirrorExport:
    """Export the committed versions of a store as a static mirror tree (module docstring).

    Args:
        source: a node's data directory (with ``run_id``) or an open :class:`VersionStore`.
        out_dir: the web server's document root (created if missing).
        run_id: the run, when ``source`` is a data directory.
        trainer_id: the trainer's PeerID every manifest must be signed by (None: the signer
            named in each stored manifest, i.e. only the store's own consistency is checked).
        verify: re-hash every file and blob against its signed digest before exporting it.
        prune: remove exported steps the store no longer holds.

    Returns:
        what was exported.

    Raises:
        ConfigError: ``run_id`` missing for a data directory, or no such run there.
        OSError: ``out_dir`` cannot be written.

    A version that does not verify is skipped (logged, listed in ``skipped``), never exported.
    """
    if isinstance(source, VersionStore):
        store = source
    else:
        if run_id is None:
            raise ConfigError("run_id", "required to export from a data directory")
        store = open_store(source, run_id)
    run_dir = out_dir / PREFIX / store.run_id
    for d in (out_dir, out_dir / "shardnet", out_dir / PREFIX, run_dir):
        _mkdir(d)
    for leftover in run_dir.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    result = MirrorExport(run_dir)
    for step in store.committed_steps():
        try:
            with store.pinned(step):
                _export_version(store, step, run_dir, trainer_id, verify, result)
        except (OSError, ValueError, KeyError, ShardnetError) as exc:
            result.skipped[step] = str(exc)
            log.warning("mirror_version_skipped step=%d error=%s", step, exc)
    held = set(result.steps)
    _write_atomic(
        run_dir / "versions",
        json.dumps(
            {
                "committed": result.steps,
                "in_progress": [],
                "digests": {str(s): result.digests[s] for s in result.steps},
            }
        ).encode(),
    )
    if prune:
        for p in run_dir.iterdir():
            if p.name.isdigit() and int(p.name) not in held:
                _remove(p)
                result.pruned.append(int(p.name))
        result.pruned.sort()
    log.info(
        "mirror_exported run=%s out=%s exported=%s unchanged=%s skipped=%s pruned=%s "
        "linked=%d copied=%d",
        store.run_id,
        out_dir,
        result.exported,
        result.unchanged,
        sorted(result.skipped),
        result.pruned,
        result.linked,
        result.copied,
    )
    return result


def _export_version(
    store: VersionStore,
    step: int,
    run_dir: Path,
    trainer_id: str | None,
    verify: bool,
    result: MirrorExport,
) -> None:
    vdir = store.version_dir(step)
    raw = (vdir / MANIFEST_FILE).read_bytes()
    signer = trainer_id or document_signer(raw, str(vdir))
    m = Manifest.decode(raw, trust=TrustList(trainer=signer), source=str(vdir))
    if not m.complete:
        raise IntegrityError(f"{vdir}: manifest parts are missing")
    step_dir = run_dir / str(step)
    final = step_dir / m.digest
    doc = m.encode()
    result.digests[step] = m.digest
    if final.is_dir() and _same_manifest(final, doc):
        _remove_others(step_dir, m.digest)
        result.unchanged.append(step)
        return
    tmp = run_dir / f".tmp-{step}-{secrets.token_hex(4)}"
    try:
        _mkdir(tmp)
        _write(tmp / "manifest", doc)
        n = len(m.header.shards)
        _write(tmp / "have", full_bits(n))
        _mkdir(tmp / "files")
        chained = store.chained_files(step)
        for f in m.header.files:
            path = vdir / f.name
            if f.name in chained:  # a chain version: built shard by shard, every one verified
                build_file(store.chains, step, m, f.name, tmp / "files" / f.name, False)
                os.chmod(tmp / "files" / f.name, _FILE_MODE)
                result.copied += 1
                continue
            if verify and not file_matches(path, m, f.name):
                raise IntegrityError(f"{path} does not match its manifest digest")
            _place(path, tmp / "files" / f.name, result)
        blobs = tmp / "shard"
        _mkdir(blobs)
        for i in range(n):
            entry = m.shard(i)
            for enc in ENCODINGS:
                offered = entry.offered(enc) if enc != RAW else None
                ref = store.blob_ref(step, i, enc) if offered is not None else None
                if ref is None or offered is None:
                    continue
                alone = ref.offset == 0 and ref.path.stat().st_size == ref.length
                data = None if alone else ref.read()  # in a pack: written out
                if verify and (
                    ref.length != offered.size
                    or (hash_file(ref.path) if data is None else blake3_hex(data)) != offered.digest
                ):
                    log.warning("mirror_blob_skipped step=%d shard=%d encoding=%s", step, i, enc)
                    continue
                _mkdir(blobs / str(i))
                if data is None:
                    _place(ref.path, blobs / str(i) / enc, result)
                else:
                    _write(blobs / str(i) / enc, data)
                    result.copied += 1
        if not step_dir.is_dir():
            _mkdir(step_dir)
        if final.exists():
            old = run_dir / f".tmp-old-{step}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
            _remove(old)
        else:
            os.rename(tmp, final)
        _remove_others(step_dir, m.digest)  # another digest of the step, or the old layout
    except BaseException:
        _remove(tmp)
        raise
    result.exported.append(step)


def _remove_others(step_dir: Path, digest: str) -> None:
    """Remove everything in ``step_dir`` but the ``digest`` directory."""
    for p in step_dir.iterdir():
        if p.name == digest:
            continue
        if p.is_dir() and not p.is_symlink():
            _remove(p)
        else:
            p.unlink(missing_ok=True)


def _same_manifest(final: Path, doc: bytes) -> bool:
    try:
        return (final / "manifest").read_bytes() == doc
    except OSError:
        return False


def _place(src: Path, dst: Path, result: MirrorExport) -> None:
    """Hard-link ``src`` at ``dst`` if it is world-readable, else copy it (``0644``)."""
    if src.stat().st_mode & 0o004:
        try:
            os.link(src, dst)
            result.linked += 1
            return
        except OSError:
            pass  # another filesystem, or links not allowed: copy
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, _FILE_MODE)
    os.rename(tmp, dst)
    result.copied += 1


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, _FILE_MODE)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    _write(tmp, data)
    os.rename(tmp, path)


def _mkdir(path: Path) -> None:
    path.mkdir(exist_ok=True)
    os.chmod(path, _DIR_MODE)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "PREFIX",
    "MirrorExport",
    "export_mirror",
    "open_store",
]
