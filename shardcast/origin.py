"""The origin: publishes the trainer's checkpoint directories as signed, served versions.

``Origin.publish(directory, step)`` hashes the checkpoint into a manifest (in a worker thread),
signs it with the trainer's key, moves the directory into the store as ``step-N`` (without
hashing it a second time: the manifest was built from this very directory a moment before),
starts serving it over the HTTP lane, and announces it on the run's gossip topic. Relays learn of it
from gossip or from polling the origin's info record, whichever comes first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import trio

from p2p.errors import LocalProtocolError
from shardcast.manifest import SignedManifest, sign_manifest
from shardcast.messages import VersionAnnouncement, versions_topic
from shardcast.node import ShardcastNode
from shardcast.plan import DEFAULT_SHARD_BYTES, build_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishResult:
    """What one publish did.

    Attributes:
        signed: the signed manifest.
        path: the committed version directory.
        hash_s: seconds spent hashing.
        published_at: ``trio.current_time()`` when the announcement went out.
    """

    signed: SignedManifest
    path: Path
    hash_s: float
    published_at: float


class Origin:
    """Publishes versions from a :class:`ShardcastNode` whose identity is the trainer's.

    Args:
        node: the trainer's node.
        shard_size: bytes per shard.
        trainer_addrs: multiaddrs put in announcements (where rollouts go); defaults to the
            node's own listen addresses.
    """

    def __init__(
        self,
        node: ShardcastNode,
        shard_size: int = DEFAULT_SHARD_BYTES,
        trainer_addrs: tuple[str, ...] | None = None,
    ) -> None:
        if node.identity.peer_id != node.trust.trainer:
            raise LocalProtocolError("the origin must run with the pinned trainer identity")
        self.node = node
        self.shard_size = shard_size
        self.trainer_addrs = trainer_addrs or tuple(node.p2p.multiaddrs())

    async def publish(self, directory: Path, step: int) -> PublishResult:
        """Hash, sign, commit and announce ``directory`` as version ``step``.

        Raises:
            CheckpointLayoutError: not a valid checkpoint directory.
            LocalProtocolError: ``step`` is not newer than the last published one.
        """
        node = self.node
        latest = node.store.latest()
        if latest is not None and step <= latest:
            raise LocalProtocolError(f"step {step} is not newer than published step {latest}")
        t0 = trio.current_time()
        manifest = await trio.to_thread.run_sync(
            build_manifest, directory, node.config.run_id, step, self.shard_size
        )
        signed = sign_manifest(manifest, node.identity)
        hash_s = trio.current_time() - t0
        path = await trio.to_thread.run_sync(
            lambda: node.store.adopt(directory, signed, rehash=False)
        )
        ann = VersionAnnouncement.create(
            node.identity, node.config.run_id, step, signed.digest, self.trainer_addrs
        )
        node.set_announcement(ann)
        await node.p2p.publish(versions_topic(node.config.run_id), ann.encode())
        published_at = trio.current_time()
        log.info(
            "version_published step=%d size_bytes=%d shards=%d hash_s=%.3f digest=%s",
            step,
            manifest.total_bytes,
            len(manifest.shards),
            hash_s,
            signed.digest[:16],
        )
        return PublishResult(signed, path, hash_s, published_at)

    def egress_bytes(self) -> int:
        """Body bytes the origin's HTTP lane has sent so far."""
        return self.node.http.statistics().bytes_sent
