"""Following a run: learn of new versions from upstreams and download each one.

Relays and inference peers are followers. A follower is given the multiaddrs of its
upstreams (a relay's upstream is the origin or another relay; a peer's are relays). For each
upstream it keeps a connection and polls the upstream's info record every
``poll_interval_s`` (which also carries the newest announcement the upstream knows); it also
listens to the run's gossip topic. Whichever path delivers a newer, trainer-signed
announcement first wakes the download loop, which fetches the manifest from an upstream
(checking it against the announced digest and the trainer's signature), downloads the
version from all usable upstreams in parallel while serving every verified shard onward, and
commits it. Versions that were superseded before their download started are skipped: a
follower always moves to the newest announced version.

Every loop here has a timeout or a bounded backoff; a failing upstream is logged with its
short PeerID and retried, never allowed to stop the others.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2p.errors import ConfigError, ShardnetError, TransportError, short_id
from p2p.host import peer_id_of
from p2p.http_errors import NotAvailable
from shardcast.downloader import DownloadConfig, Downloader, DownloadStats, Source, manifest_url
from shardcast.manifest import ManifestError, SignedManifest
from shardcast.messages import NodeInfo, VersionAnnouncement, versions_topic
from shardcast.node import ShardcastNode

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowConfig:
    """Follower settings.

    Attributes:
        upstreams: multiaddrs (with ``/p2p/<PeerID>``) of the nodes to download from.
        poll_interval_s: period of the info poll per upstream, seconds.
        max_backoff_s: cap of the retry backoff for a failing upstream, seconds.
        download: downloader settings.
    """

    upstreams: tuple[str, ...]
    poll_interval_s: float = 1.0
    max_backoff_s: float = 10.0
    download: DownloadConfig = field(default_factory=DownloadConfig)

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ConfigError("upstreams", "at least one upstream multiaddr is required")
        for a in self.upstreams:
            peer_id_of(a)
        if self.poll_interval_s <= 0:
            raise ConfigError("poll_interval_s", "must be > 0")


@dataclass
class VersionRecord:
    """What happened to one version on this node (times are ``trio.current_time()``)."""

    step: int
    digest: str
    learned_at: float
    committed_at: float = 0.0
    stats: DownloadStats | None = None
    path: Path | None = None


CommitHook = Callable[[SignedManifest, Path, VersionRecord], Awaitable[None]]


class Follower:
    """Follows a run from upstreams into ``node``'s store (see module docstring).

    Args:
        node: the running shardcast node.
        config: follower settings.
        rng: seeded randomness for source selection.
        on_commit: awaited after each committed version (e.g. load the weights).
        progress: ``(step, verified_bytes, total_bytes)`` callback for a progress display.
    """

    def __init__(
        self,
        node: ShardcastNode,
        config: FollowConfig,
        rng: random.Random,
        on_commit: CommitHook | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> None:
        for a in config.upstreams:
            if not node.trust.relay_allowed(peer_id_of(a)):
                raise ConfigError("upstreams", f"{a} is not in the relay allowlist")
        self.node = node
        self.config = config
        self.downloader = Downloader(node.client, node.store, config.download, rng)
        self.on_commit = on_commit
        self.progress = progress
        self.upstreams: dict[str, NodeInfo] = {}
        self.records: list[VersionRecord] = []
        self._upstream_changed = trio.Event()
        self._learned: dict[int, float] = {}

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; ``started()`` once the first upstream answered its info."""
        async with trio.open_nursery() as nursery:
            for addr in self.config.upstreams:
                nursery.start_soon(self._poll_upstream, addr)
            nursery.start_soon(self._listen_gossip)
            while not self.upstreams:
                await self._wait_upstream_change()
            task_status.started()
            await self._download_loop()

    async def _wait_upstream_change(self) -> None:
        await self._upstream_changed.wait()

    def _note_upstream(self) -> None:
        self._upstream_changed.set()
        self._upstream_changed = trio.Event()

    def _offer(self, data: bytes, sender: str) -> None:
        ann = self.node.offer_announcement(data, sender)
        if ann is not None:
            self._learned.setdefault(ann.step, trio.current_time())

    async def _poll_upstream(self, addr: str) -> None:
        pid = peer_id_of(addr)
        backoff = self.config.poll_interval_s
        connected = False
        while True:
            try:
                if not connected or pid not in self.node.p2p.connected_peers():
                    await self.node.p2p.connect(addr)
                    connected = True
                info = await self.node.query_info(pid)
            except (TransportError, ShardnetError) as exc:
                if pid in self.upstreams:
                    del self.upstreams[pid]
                    self._note_upstream()
                connected = False
                log.info(
                    "upstream_unreachable upstream=%s error=%s retry_s=%.1f",
                    short_id(pid),
                    exc,
                    backoff,
                )
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)
                continue
            backoff = self.config.poll_interval_s
            if info.run_id != self.node.config.run_id:
                log.warning("upstream_wrong_run upstream=%s run=%s", short_id(pid), info.run_id)
            else:
                new = pid not in self.upstreams or self.upstreams[pid].http_url != info.http_url
                self.upstreams[pid] = info
                if new:
                    log.info(
                        "upstream_ready upstream=%s role=%s http_url=%s",
                        short_id(pid),
                        info.role,
                        info.http_url,
                    )
                    self._note_upstream()
                if info.announcement is not None:
                    self._offer(info.announcement, pid)
            await trio.sleep(self.config.poll_interval_s)

    async def _listen_gossip(self) -> None:
        sub = await self.node.p2p.subscribe(versions_topic(self.node.config.run_id))
        async for msg in sub:
            self._offer(msg.data, msg.origin)

    def _sources(self) -> list[Source]:
        return [Source(pid, info.http_url) for pid, info in sorted(self.upstreams.items())]

    async def _fetch_manifest(self, ann: VersionAnnouncement) -> SignedManifest | None:
        """The manifest of ``ann`` from any upstream, or None if superseded meanwhile."""
        delay = 0.05
        while True:
            for src in self._sources():
                url = manifest_url(src.base_url, ann.run_id, ann.step)
                try:
                    data = await self.node.client.get_bytes(url, max_bytes=16 << 20, timeout_s=10.0)
                    signed = SignedManifest.decode(data, trust=self.node.trust, source=src.id)
                except NotAvailable:
                    continue
                except (TransportError, ManifestError, ShardnetError) as exc:
                    log.warning(
                        "manifest_fetch_failed source=%s step=%d error=%s",
                        short_id(src.id),
                        ann.step,
                        exc,
                    )
                    continue
                if signed.digest != ann.manifest_digest or signed.manifest.step != ann.step:
                    log.warning("manifest_mismatch source=%s step=%d", short_id(src.id), ann.step)
                    continue
                return signed
            if self.node.announcement is not None and self.node.announcement.step > ann.step:
                return None
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _download_loop(self) -> None:
        have = self.node.store.latest()
        current = -1 if have is None else have
        while True:
            ann = await self.node.wait_announcement(newer_than=current)
            while not self.upstreams:
                await self._wait_upstream_change()
            signed = await self._fetch_manifest(ann)
            if signed is None:
                continue
            step = signed.manifest.step
            record = VersionRecord(
                step, signed.digest, self._learned.get(step, trio.current_time())
            )
            server = self.node.server
            try:
                path, stats = await self.downloader.download(
                    signed,
                    self._sources(),
                    on_partial=server.add_partial,
                    on_shard=functools.partial(server.shard_ready, step),
                    progress=(
                        None if self.progress is None else functools.partial(self.progress, step)
                    ),
                )
            except ShardnetError as exc:
                log.warning("download_failed step=%d error=%s", step, exc)
                await trio.sleep(self.config.poll_interval_s)
                continue
            finally:
                server.partial_done(step)
            record.committed_at = trio.current_time()
            record.stats, record.path = stats, path
            self.records.append(record)
            current = step
            log.info(
                "version_downloaded step=%d size_bytes=%d download_s=%.3f sources=%s",
                step,
                signed.manifest.total_bytes,
                stats.elapsed_s,
                ",".join(f"{short_id(k)}:{v}" for k, v in sorted(stats.bytes_by_source.items())),
            )
            if self.on_commit is not None:
                await self.on_commit(signed, path, record)
