"""A peer's weight swap: in place from the version's sparse delta, or a full load.

Theory of operation
-------------------
A peer whose engine holds version ``N`` and commits ``N+1`` as a delta against ``N`` already
has what changed: the follower keeps every verified encoded blob of a committed version
(the ``sparse`` blobs in ``step-<N+1>/.enc/``, :mod:`shardcast.store.blobpack`).
:func:`swap_weights` then

1. checks that the delta fits what the engine holds (:func:`gather_changes`): the new
   manifest's delta base is the held version (step and header digest), the file list and
   sizes are the same, every file that is not weights (config, tokenizer, index) has the same
   signed digest, and every shard of the weight files has its ``sparse`` blob, whose size and
   BLAKE3 still match the signed digest in the manifest (the blob was checked on receipt; this
   catches one damaged at rest, for ~1 ms per 10 MB);
2. plans the update from the held version's safetensors layouts
   (:func:`rollout.delta_plan.plan_update`) and applies it
   (:meth:`~rollout.engine.InPlaceEngine.apply_update`): only the changed words are touched and
   the checkpoint is not read;
3. otherwise (an engine without in-place updates, nothing held yet, a skipped version, a shard
   received raw or as ``xor-zstd``, a layout change, a tensor that does not fit) loads the
   version in full, as before, and reads the new layouts (headers only); a version kept as a
   chain is materialized first (every shard verified, :mod:`shardcast.store.chains`).

Why the result is the trainer's bytes: the engine held ``N``'s bytes (a verified full load, or
an in-place update from one), each blob is the one the trainer signed, and the decoding is
deterministic. A follower that wrote ``N+1`` eagerly also checked that applying the blob to
``N`` gives ``N+1``'s signed shard digest; one that kept ``N+1`` as a chain (the default,
:mod:`shardcast.store.chains`) checks that whenever the shard is read (an anchor's
materialization, a full range served, a full load), so a trainer whose signed blob and
signed shard disagree, or a decoder bug, is found there, not before this update. A held tensor
in another dtype than the checkpoint's (an engine that casts on load) is refused by the
planner, so the bytes patched are always the checkpoint's.

CPU: with a :class:`~shardcast.core.StageCpu`, the swap's CPU is charged to
``engine_update``: the calling thread's, and that of the threads decoding the blobs; not that
of the engine's own worker threads (the patch pool, torch's intra-op threads).

The result says which path was taken, why a fallback happened (a
:class:`~rollout.delta_plan.MismatchReason`) and how long it took; the peer logs it.
Blocking (run it in a worker thread); not safe concurrently with other engine calls.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from p2p.errors import IntegrityError
from rollout.delta_plan import (
    UPDATE_THREADS,
    DeltaMismatch,
    FileLayout,
    MismatchReason,
    ShardChanges,
    plan_update,
    read_layout,
)
from rollout.engine import Engine, InPlaceEngine
from rollout.model import tensor_files
from shardcast.core import Stage, StageCpu
from shardcast.store import VersionStore
from shardcast.wire import Manifest, ShardRef, blake3_hex, codecs

__all__ = ["HeldVersion", "SwapPath", "SwapResult", "gather_changes", "swap_weights"]

log = logging.getLogger(__name__)


class SwapPath(enum.Enum):
    """How a version reached the engine (value: the log/metric string)."""

    IN_PLACE = "in_place"
    FULL = "full"


@dataclass(frozen=True)
class HeldVersion:
    """The version an engine holds: its manifest and its weight files' layouts (by name)."""

    manifest: Manifest
    layouts: dict[str, FileLayout]


@dataclass(frozen=True)
class SwapResult:
    """One swap.

    Attributes:
        path: in place or full.
        duration_s: wall time of the whole swap, checks included, seconds.
        held: what the engine holds now (None: layouts unknown, the next swap loads in full).
        fallback: why a full load was done although the engine updates in place, or None.
        changed_words: 16-bit words patched (in place only).
    """

    path: SwapPath
    duration_s: float
    held: HeldVersion | None
    fallback: MismatchReason | None = None
    changed_words: int = 0


def gather_changes(
    store: VersionStore,
    manifest: Manifest,
    held: HeldVersion,
    threads: int = UPDATE_THREADS,
    cpu: StageCpu | None = None,
) -> list[ShardChanges]:
    """The changes of ``manifest``'s version against the held one, from the kept blobs.

    Args:
        store: the store holding ``manifest``'s committed version.
        manifest: the new version (complete).
        held: what the engine holds.
        threads: shards decoded at once (worker threads; 1: in the calling thread).
        cpu: charged with the decoding threads' CPU (``engine_update``), or None.

    Returns:
        the changes of every shard of the weight files, in shard order.

    Raises:
        DeltaMismatch: (``BASE``, ``FILES``, ``OTHER_FILE``, ``ENCODING``, ``BLOB``) see the
            module docstring.
        OSError: a blob could not be read for another reason than being absent.
    """
    header, base = manifest.header, held.manifest
    if header.base_step is None:  # an anchor: the expected full reload, not a fault
        raise DeltaMismatch(
            MismatchReason.BASE, f"step {manifest.step} is a full version (no delta base)"
        )
    if (header.base_step, header.base_digest) != (base.step, base.digest):
        raise DeltaMismatch(
            MismatchReason.BASE,
            f"step {manifest.step} is a delta of {header.base_step}, the engine holds {base.step}",
        )
    if header.files != base.header.files:
        raise DeltaMismatch(MismatchReason.FILES, f"step {manifest.step} has other files")
    for f in header.files:
        if f.name not in held.layouts and manifest.file_digest(f.name) != base.file_digest(f.name):
            raise DeltaMismatch(MismatchReason.OTHER_FILE, f"{f.name} changed")
    refs = [ref for ref in header.shards if ref.file in held.layouts]

    def decode(ref: ShardRef) -> ShardChanges:
        offered = manifest.shard(ref.index).offered(codecs.SPARSE)
        at = store.blob_ref(manifest.step, ref.index, codecs.SPARSE)
        try:
            blob = at.read() if at is not None else None
        except FileNotFoundError:
            blob = None
        if offered is None or at is None or blob is None:
            raise DeltaMismatch(MismatchReason.ENCODING, f"shard {ref.index} has no sparse blob")
        where = f"{at.path}@{at.offset}"
        if len(blob) != offered.size or blake3_hex(blob) != offered.digest:
            raise DeltaMismatch(MismatchReason.BLOB, f"{where} does not match its signed digest")
        return ShardChanges.from_sparse(ref.file, ref.offset, ref.length, blob, where)

    if threads <= 1 or len(refs) <= 1:
        return [decode(ref) for ref in refs]
    work = decode if cpu is None else cpu.wrap(Stage.ENGINE_UPDATE, decode)
    with ThreadPoolExecutor(min(threads, len(refs))) as pool:  # zstd and numpy release the GIL
        return list(pool.map(work, refs))  # the first failure in shard order is raised


def read_layouts(directory: Path) -> dict[str, FileLayout]:
    """The layouts of a checkpoint's weight files (headers only), by file name.

    Raises:
        CheckpointMismatch: no weight files, or a bad index.
        DeltaMismatch: a malformed safetensors header.
        OSError: a file cannot be read.
    """
    return {p.name: read_layout(p) for p in tensor_files(directory)}


def swap_weights(
    engine: Engine,
    store: VersionStore,
    manifest: Manifest,
    directory: Path,
    held: HeldVersion | None,
    cpu: StageCpu | None = None,
) -> SwapResult:
    """Bring ``engine`` to ``manifest``'s version (committed at ``directory``): in place when
    it can (module docstring), else ``engine.load(directory)``; with ``cpu``, its CPU is
    charged to ``engine_update`` (module docstring).

    A version kept as a chain (:mod:`shardcast.store.chains`) is materialized before a full
    load, every shard verified on the way; the in-place path reads only its blobs.

    Returns:
        what was done.

    Raises:
        ChainBroken: a chain version's shard did not verify (nothing was loaded; the store
            removed the version).
        whatever ``engine.load`` raises (``CheckpointMismatch``, ...) on the full path; the
        engine then holds an unknown version (pass ``held=None`` next time).
    """
    if cpu is None:
        return _swap(engine, store, manifest, directory, held, None)
    with cpu.measure(Stage.ENGINE_UPDATE):
        return _swap(engine, store, manifest, directory, held, cpu)


def _swap(
    engine: Engine,
    store: VersionStore,
    manifest: Manifest,
    directory: Path,
    held: HeldVersion | None,
    cpu: StageCpu | None,
) -> SwapResult:
    """:func:`swap_weights`."""
    started = time.perf_counter()
    fallback: MismatchReason | None = None
    if isinstance(engine, InPlaceEngine) and held is not None:
        try:
            changes = gather_changes(store, manifest, held, cpu=cpu)
            plan = plan_update(held.layouts, changes, engine.weight_specs())
            engine.apply_update(plan, directory)
        except DeltaMismatch as exc:
            fallback = exc.reason
            log.info(
                "in_place_update_refused step=%d reason=%s detail=%s",
                manifest.step,
                exc.reason.value,
                exc.what,
            )
        else:
            return SwapResult(
                SwapPath.IN_PLACE,
                time.perf_counter() - started,
                HeldVersion(manifest, held.layouts),
                None,
                plan.changed_words,
            )
    if store.chain_of(manifest.step) is not None:  # a chain: full files first, all verified
        with (cpu or StageCpu()).measure(Stage.MATERIALIZE):  # nested: not engine_update too
            store.materialize(manifest.step)
    engine.load(directory)
    now_held = None
    if isinstance(engine, InPlaceEngine):
        try:
            now_held = HeldVersion(manifest, read_layouts(directory))
        except (IntegrityError, OSError) as exc:  # the engine loaded it: only in place is lost
            log.warning("weight_layout_unreadable step=%d error=%s", manifest.step, exc)
    return SwapResult(SwapPath.FULL, time.perf_counter() - started, now_held, fallback)
