"""publish: the origin, publishing the trainer's checkpoints as signed, pipelined versions.

``Origin.publish(directory, step)``:

1. describes the directory as a manifest header (file sizes only, no data read), signs it,
   registers the version with the HTTP lane as *live*, and announces it on the run's gossip
   topic (naming the run card the node holds) — relays can start at once;
2. hashes the files in one sequential pass in a worker thread
(:func:`shardcast.publish.plan.hash_parts`);
   each part (shard digests, encoded forms, file digests) is signed and served the moment it
   is done, so the first shards flow while the rest is still being hashed;
3. offers deltas: unless ``step`` is an anchor (``step % anchor_every == 0``), the previous
   committed version is the delta base and every shard whose file has the same size there gets
   a ``sparse`` or ``xor-zstd`` form, whichever is smaller (kept only if smaller than raw;
   see :func:`shardcast.publish.plan.hash_parts`); ``zstd`` is offered too if
   configured (for slow links);
   Files the :class:`~shardcast.publish.preencode.PreEncoder` hashed and encoded while the trainer
   was
   still writing the others (``publish(..., pre_encoded=...)``) are not read again: their
   parts are signed at once, only the rest is hashed here;
4. moves the directory into the store as ``step-N`` (the manifest was built from it a moment
   before, so it is not hashed twice) and serves it from there.

Restarts: before announcing, the origin records the header's nonce with the identity of the
files (name, size, modification time in ns) in ``<run>/.publishing-step-<N>.json``. An origin
restarted mid-publish that publishes the same directory again, unchanged, reuses that nonce:
the header, its digest and every signed part come out identical (Ed25519 signatures are
deterministic), so followers that were fetching the first publication go on with it. A
directory that changed gets a fresh nonce (a new digest). The record goes when the version is
committed.

``Origin.reannounce()`` (at start, on a data directory that already holds versions) signs and
sends the announcement of the newest committed version again, and keeps it in the node's info
record, so a restarted origin is followed at once, not from its next step.
``Origin.announce_finished()`` signs and sends the run's end
(:class:`~shardcast.wire.finish.RunFinished`); ``Origin.announce_continued()`` signs and sends
that a finished run goes on (:class:`~shardcast.wire.finish.RunContinued`), each numbered by
the counter of :mod:`shardcast.publish.runend`.

With ``serve_once_s`` set on the node's server, the origin sends each shard to one relay and
lets relays exchange the rest (super-seeding), keeping its egress near one copy per version.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import trio

from p2p.errors import LocalProtocolError
from shardcast.node import ShardcastNode
from shardcast.publish.encode import ENCODE_WORKERS, EncodeSettings, KnownShards, PreEncoded
from shardcast.publish.plan import (
    DEFAULT_DELTA_SHARDS_PER_PART,
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARDS_PER_PART,
    Base,
    hash_parts,
    make_header,
)
from shardcast.publish.runend import END_SEQ_FILE, next_end_seq
from shardcast.store import BLOB_DIR, BlobRef, find_blob, replace_file
from shardcast.wire import (
    Header,
    Manifest,
    Part,
    RunContinued,
    RunFinished,
    VersionAnnouncement,
    codecs,
    shard_bits,
    sign_header,
    sign_part,
    versions_topic,
)

log = logging.getLogger(__name__)

CONTINUE_REPEAT_S = 5.0
"""Period of the continuation's resending while no newer version is out, seconds (a protocol
constant, not a setting: the message is ~200 bytes, on the versions topic only)."""


@dataclass(frozen=True)
class OriginConfig:
    """Publishing settings.

    Attributes:
        shard_size: bytes per shard.
        shards_per_part: shards per signed manifest part (smaller: earlier first bytes).
        delta_shards_per_part: the same for a version offered as a delta against its base
            (``deltas`` on and a base held). Its delta blobs are ~1-2 % of the shards' bytes,
            so first bytes gain little from small parts while each part costs every follower a
            part request and a blob batch: on ``real-1b`` (85 shards, one follower, loopback,
            ``bench/follower_cpu.py``) 4 -> 16 took a follower's next version from 46 to 14
            requests and from ~0.30 to ~0.19 CPU-s, and its wall time fell.
        max_parts: at most this many parts per version: a larger version gets larger parts
            (:func:`parts_of`). Downloaders fetch every missing part at once, each request
            held open at its source until the part exists, on a connection pool of 64: a
            bounded part count keeps those from crowding out the shard requests.
        anchor_every: a full version (no delta base) every this many steps.
        deltas: offer a delta against the previous version (``sparse`` or ``xor-zstd``,
            whichever is smaller per shard).
        zstd: also offer ``zstd`` of every shard (worth it on slow links only).
        zstd_level: compression level.
        encode_workers: threads that hash and encode a file's shards side by side
            (:func:`shardcast.publish.encode.encode_file`; 0: one per CPU core, at most 8,
            :data:`~shardcast.publish.encode.ENCODE_WORKERS`); the version does not depend on
            it.
    """

    shard_size: int = DEFAULT_SHARD_BYTES
    shards_per_part: int = DEFAULT_SHARDS_PER_PART
    delta_shards_per_part: int = DEFAULT_DELTA_SHARDS_PER_PART
    max_parts: int = 32
    anchor_every: int = 10
    deltas: bool = True
    zstd: bool = False
    zstd_level: int = codecs.DEFAULT_LEVEL
    encode_workers: int = 0

    def __post_init__(self) -> None:
        sizes = (self.shard_size, self.shards_per_part, self.delta_shards_per_part)
        if min(*sizes, self.max_parts, self.anchor_every) < 1:
            raise LocalProtocolError(
                "shard_size, shards_per_part, delta_shards_per_part, max_parts and "
                "anchor_every must be >= 1"
            )
        if self.encode_workers < 0:
            raise LocalProtocolError(f"encode_workers must be >= 0, got {self.encode_workers}")

    @property
    def workers(self) -> int:
        """Encoder threads to run (``encode_workers``, 0 resolved to this machine's)."""
        return self.encode_workers or ENCODE_WORKERS


def parts_of(n_shards: int, shards_per_part: int, max_parts: int) -> int:
    """Shards per part for a version of ``n_shards``: ``shards_per_part``, or more if that
    would make more than ``max_parts`` parts (the smallest size that makes at most
    ``max_parts``)."""
    return max(shards_per_part, -(-n_shards // max_parts))


@dataclass(frozen=True)
class PublishResult:
    """What one publish did.

    Attributes:
        manifest: the complete signed manifest.
        path: the committed version directory.
        announced_at: ``trio.current_time()`` when the announcement went out.
        hashed_at: when the last part was signed.
        hash_s: seconds spent hashing (and encoding).
        encoded_bytes: bytes of the encoded blobs offered, by encoding.
    """

    manifest: Manifest
    path: Path
    announced_at: float
    hashed_at: float
    hash_s: float
    encoded_bytes: dict[str, int]


class _Publishing:
    """The version being hashed, as the HTTP lane sees it (shards of signed parts only)."""

    def __init__(self, manifest: Manifest, directory: Path) -> None:
        self.manifest = manifest
        self.dir = directory
        self._bits: tuple[int, bytes] = (-1, b"")  # (parts known, bitmap): built on first use

    def has(self, index: int) -> bool:
        return self.manifest.known(index)

    def have_bits(self) -> bytes:
        """The ``/have`` bitmap (the shards of the parts signed so far), rebuilt only when a
        part was added."""
        parts = len(self.manifest.parts)
        if self._bits[0] != parts:
            self._bits = (parts, shard_bits(len(self.manifest.header.shards), self.manifest.known))
        return self._bits[1]

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        """Where the encoder wrote shard ``index``'s ``encoding`` blob (one file per blob)."""
        return find_blob(self.dir / BLOB_DIR, index, encoding)


class Origin:
    """Publishes versions from a :class:`ShardcastNode` whose identity is the trainer's.

    Args:
        node: the trainer's node.
        config: publishing settings.
        trainer_addrs: multiaddrs put in announcements (where rollouts go); defaults to the
            node's own listen addresses.
    """

    def __init__(
        self,
        node: ShardcastNode,
        config: OriginConfig | None = None,
        trainer_addrs: tuple[str, ...] | None = None,
    ) -> None:
        if node.identity.peer_id != node.trust.trainer:
            raise LocalProtocolError("the origin must run with the pinned trainer identity")
        self.node = node
        self.config = config or OriginConfig()
        self.trainer_addrs = trainer_addrs or tuple(node.p2p.multiaddrs())
        self._base_digests: dict[int, str] = {}

    def _base(self, step: int) -> Base | None:
        prev = step - 1
        store = self.node.store
        if not self.config.deltas or step % self.config.anchor_every == 0 or not store.has(prev):
            return None
        digest = self._base_digests.get(prev)
        if digest is None:
            digest = store.load_manifest(prev, self.node.trust).digest
            self._base_digests = {prev: digest}  # one entry: the newest base asked for
        return Base(prev, digest, store.version_dir(prev))

    def _encodings(self, base: Base | None) -> tuple[str, ...]:
        deltas = [codecs.SPARSE, codecs.XOR_ZSTD] if base is not None else []
        return tuple(deltas + ([codecs.ZSTD] if self.config.zstd else []))

    def encode_plan(
        self, step: int, previous_pending: bool
    ) -> tuple[EncodeSettings, Base | None] | None:
        """The encode settings and delta base :meth:`publish` would use for ``step`` now, or
        None while they are undecided: ``step`` wants a base and ``step - 1`` is not committed
        but may still be (``previous_pending``: its directory is waiting to be published).
        For :class:`~shardcast.publish.preencode.PreEncoder`.

        Raises:
            ManifestError / IntegrityError: the stored base manifest does not verify.
        """
        cfg = self.config
        wants_base = cfg.deltas and step % cfg.anchor_every != 0
        if wants_base and previous_pending and not self.node.store.has(step - 1):
            return None
        base = self._base(step)
        settings = EncodeSettings(
            cfg.shard_size,
            self._encodings(base),
            None if base is None else (base.step, base.digest),
            cfg.zstd_level,
        )
        return settings, base

    async def publish(
        self,
        directory: Path,
        step: int,
        pre_encoded: Mapping[str, PreEncoded] | None = None,
        known: Mapping[str, KnownShards] | None = None,
    ) -> PublishResult:
        """Announce, hash (pipelined), sign, commit and serve ``directory`` as ``step``.

        ``pre_encoded``: files of ``directory`` hashed and encoded ahead, unchanged since
        (:meth:`shardcast.publish.preencode.PreEncoder.take`); their parts go out at once, nothing
        of them is read again (:func:`shardcast.publish.plan.hash_parts`). ``known``: shards of
        the other files encoded while they were being written; each is hashed again here
        and used if its bytes are the same.

        Raises:
            CheckpointLayoutError: not a valid checkpoint directory.
            LocalProtocolError: ``step`` is not newer than the last published one.
        """
        node, cfg = self.node, self.config
        latest = node.store.latest()
        if latest is not None and step <= latest:
            raise LocalProtocolError(f"step {step} is not newer than published step {latest}")
        base = self._base(step)
        header = await self._describe(directory, step, base)
        manifest = Manifest(sign_header(header, node.identity))
        node.server.add_live(_Publishing(manifest, directory))
        await self._announce(step, manifest)
        announced_at = trio.current_time()
        encodings = self._encodings(base)
        on_part = self._part_publisher(manifest, step)
        try:
            with node.store.pinned(base.step) if base is not None else nullcontext():
                parts = await trio.to_thread.run_sync(
                    functools.partial(
                        hash_parts,
                        directory,
                        header,
                        manifest.digest,
                        encodings=encodings,
                        base=base,
                        blob_dir=directory / BLOB_DIR,
                        zstd_level=cfg.zstd_level,
                        on_part=on_part,
                        pre_encoded=pre_encoded,
                        workers=cfg.workers,
                        known=known,
                    )
                )
            hashed_at = trio.current_time()
            path = await trio.to_thread.run_sync(
                lambda: node.store.adopt(directory, manifest, rehash=False)
            )
            self._record_path(step).unlink(missing_ok=True)
        finally:
            node.server.live_done(step)
        node.metrics.versions_committed.inc()
        if node.metrics.origin:
            node.metrics.publish_hash.observe(hashed_at - announced_at)
        encoded = _encoded_bytes(parts)
        log.info(
            "version_published step=%d size_bytes=%d shards=%d parts=%d base=%s "
            "hash_s=%.3f pre_encoded_files=%d known_files=%d encoded=%s digest=%s",
            step,
            header.total_bytes,
            len(header.shards),
            header.n_parts,
            base.step if base else None,
            hashed_at - announced_at,
            len(pre_encoded or {}),
            len(known or {}),
            encoded,
            manifest.digest[:16],
        )
        return PublishResult(
            manifest, path, announced_at, hashed_at, hashed_at - announced_at, encoded
        )

    def _part_publisher(self, manifest: Manifest, step: int) -> Callable[[Part], None]:
        """``on_part`` of :func:`hash_parts`, called in its worker thread: sign the part, then
        hand it to the trio thread, which adds it to ``manifest`` and serves it."""
        node, token = self.node, trio.lowlevel.current_trio_token()

        def on_part(part: Part) -> None:  # worker thread: sign, then hand to the trio thread
            signed = sign_part(part, node.identity)

            def publish_part() -> None:
                manifest.add_part(signed)
                node.server.progress(step)

            trio.from_thread.run_sync(publish_part, trio_token=token)

        return on_part

    async def _describe(self, directory: Path, step: int, base: Base | None) -> Header:
        """The header of ``directory`` as ``step`` (sizes only, no data read): larger parts for
        a delta version and a large one, and the nonce of an interrupted publication of the same,
        unchanged files (:func:`stable_header`)."""
        cfg = self.config
        describe = functools.partial(
            make_header, directory, self.node.config.run_id, step, cfg.shard_size
        )
        wanted = cfg.delta_shards_per_part if base is not None else cfg.shards_per_part
        header = await trio.to_thread.run_sync(describe, wanted, base)
        per_part = parts_of(len(header.shards), wanted, cfg.max_parts)
        if per_part != header.shards_per_part:  # a large version: fewer, larger parts
            header = await trio.to_thread.run_sync(describe, per_part, base)
        return await trio.to_thread.run_sync(
            stable_header, self._record_path(step), directory, header
        )

    async def _announce(self, step: int, manifest: Manifest) -> None:
        """Announce ``step`` on the run's versions topic, naming the run card the node holds."""
        node = self.node
        card = (node.card.version, node.card.digest) if node.card is not None else (0, "")
        ann = VersionAnnouncement.create(
            node.identity, node.config.run_id, step, manifest.digest, self.trainer_addrs, card
        )
        node.set_announcement(ann)
        await node.p2p.publish(versions_topic(node.config.run_id), ann.encode())

    def _record_path(self, step: int) -> Path:
        return self.node.store.run_dir / f".publishing-step-{step}.json"

    async def reannounce(self) -> VersionAnnouncement | None:
        """Announce the newest committed version again (after a restart).

        Returns:
            the announcement, or None if the store holds no version.

        Raises:
            ManifestError / IntegrityError: the stored manifest does not verify.
        """
        node = self.node
        step = node.store.latest()
        if step is None:
            return None
        manifest = await trio.to_thread.run_sync(lambda: node.store.load_manifest(step, node.trust))
        card = (node.card.version, node.card.digest) if node.card is not None else (0, "")
        ann = VersionAnnouncement.create(
            node.identity, node.config.run_id, step, manifest.digest, self.trainer_addrs, card
        )
        node.set_announcement(ann)
        await node.p2p.publish(versions_topic(node.config.run_id), ann.encode())
        log.info("version_reannounced step=%d digest=%s", step, manifest.digest[:16])
        return ann

    async def announce_finished(self) -> RunFinished | None:
        """Sign and send "the run ended at the newest committed version".

        Returns:
            the message, or None if nothing was ever published.
        """
        node = self.node
        ann = node.announcement
        if ann is None:
            return None
        seq = await trio.to_thread.run_sync(next_end_seq, node.store.run_dir / END_SEQ_FILE)
        msg = RunFinished.create(
            node.identity, node.config.run_id, ann.step, ann.manifest_digest, seq
        )
        node.set_finished(msg)
        await node.p2p.publish(versions_topic(node.config.run_id), msg.encode())
        return msg

    async def announce_continued(self) -> RunContinued | None:
        """Sign and send "the run goes on after the newest committed version", which lifts
        a run end followers hold (the trainer restarted on a finished run with more steps).
        Sent only if this origin ever signed a run end of this run (its counter exists).

        Returns:
            the message, or None if nothing was published or no run end was ever signed.

        Raises:
            OSError: the run-end counter cannot be written.
        """
        node = self.node
        ann = node.announcement
        path = node.store.run_dir / END_SEQ_FILE
        if ann is None or not await trio.to_thread.run_sync(path.exists):
            return None
        seq = await trio.to_thread.run_sync(next_end_seq, path)
        msg = RunContinued.create(node.identity, node.config.run_id, ann.step, seq)
        node.set_continued(msg)
        await node.p2p.publish(versions_topic(node.config.run_id), msg.encode())
        log.info("run_continued_announced step=%d seq=%d", msg.step, seq)
        return msg

    async def resend_until(
        self,
        msg: RunContinued | RunFinished | VersionAnnouncement,
        interval_s: float,
        done: Callable[[], bool],
    ) -> None:
        """Send an already signed versions-topic message again every ``interval_s`` seconds
        until ``done()`` (checked before each send). Gossip reaches only the nodes connected
        at the instant of sending: a node that reconnects later would otherwise learn the
        message only at its next info poll.

        Raises:
            MessageTooLarge: never for a message this origin signed (bounded bodies).
        """
        node = self.node
        data = msg.encode()
        while True:
            await trio.sleep(interval_s)
            if done():
                return
            await node.p2p.publish(versions_topic(node.config.run_id), data)

    async def continue_run(self, nursery: trio.Nursery) -> RunContinued | None:
        """:meth:`announce_continued`, then its resending every :data:`CONTINUE_REPEAT_S`
        (in ``nursery``) until a newer version is announced or the run ends again.

        Returns:
            the continuation, or None (nothing published, or no run end ever signed).

        Raises:
            OSError: the run-end counter cannot be written.
        """
        node = self.node
        cont = await self.announce_continued()
        if cont is not None:

            def done() -> bool:
                ann = node.announcement
                return (ann is not None and ann.step > cont.step) or node.finished is not None

            nursery.start_soon(self.resend_until, cont, CONTINUE_REPEAT_S, done)
        return cont

    def egress_bytes(self) -> int:
        """Body bytes the origin's HTTP lane has sent so far."""
        return self.node.http.statistics().bytes_sent


def stable_header(path: Path, directory: Path, header: Header) -> Header:
    """``header`` with the nonce of an interrupted publication of the same, unchanged files
    (recorded at ``path``; see module docstring), or with its own nonce, which is recorded
    there (blocking, fsynced).

    Raises:
        OSError: the record cannot be written.
    """
    identity = {
        "files": [[f.name, f.size, (directory / f.name).stat().st_mtime_ns] for f in header.files],
        "shard_size": header.shard_size,
        "shards_per_part": header.shards_per_part,
        "base_step": header.base_step,
        "base_digest": header.base_digest,
    }
    for stale in path.parent.glob(".publishing-step-*.json"):  # older interrupted steps
        suffix = stale.name[len(".publishing-step-") : -len(".json")]
        if suffix.isdigit() and int(suffix) < header.step:
            stale.unlink(missing_ok=True)
    try:
        old = json.loads(path.read_bytes())
        if old.get("identity") == identity and isinstance(old.get("nonce"), str):
            log.info("publish_resumed step=%d nonce_kept=true", header.step)
            return dataclasses.replace(header, nonce=old["nonce"])
    except (OSError, ValueError):
        pass
    replace_file(
        path, json.dumps({"identity": identity, "nonce": header.nonce}).encode(), durable=True
    )
    return header


def _encoded_bytes(parts: list[Part]) -> dict[str, int]:
    """Bytes of the encoded forms the parts offer, by encoding."""
    encoded: dict[str, int] = {}
    for p in parts:
        for encs in p.encodings:
            for e in encs:
                encoded[e.encoding] = encoded.get(e.encoding, 0) + e.size
    return encoded
