"""download: following a run: learn of new versions, find sources, download each version.

Relays and inference peers are followers. A follower is given the multiaddrs of its upstreams
(a relay's upstream is the origin or another relay; a peer's are relays). For each upstream it
keeps a connection and polls the upstream's info record every ``poll_interval_s`` (which also
carries the newest announcement the upstream knows), or every ``watched_poll_interval_s`` and
at once when its list of versions changes while it holds a long-poll of that list
(:mod:`shardcast.download.versionwatch`); it also listens to the run's gossip
topics: version announcements (each names the run card it was made under; a newer card is
fetched from an upstream and adopted before the version is used), and node adverts
(:mod:`shardcast.download.discovery`) that tell which other nodes hold or are filling a version.
Whichever path delivers a newer, trainer-signed announcement first wakes the download loop.
What is taken, what is fetched, when a download is superseded and how far apart upstream polls
are is decided by the node's :class:`~shardcast.core.tracker.VersionTracker` (sans-IO, shared with
the simulator); this module does the I/O. The download loop

1. fetches the manifest document from an upstream (header digest checked against the
   announcement, every signature against the pinned trainer) — parts may still be missing;
2. plans the catch-up (:mod:`shardcast.core.catchup`): the newest version in full, or the chain of
   delta versions from the one it holds, whichever moves fewer bytes;
3. downloads each planned version from its upstreams plus up to ``max_extra_sources``
   discovered nodes, serving every verified part and shard onward while it fills
   (pipelining), and commits it. Upstreams that become reachable during a download join it.

Behind a NAT (its lane found unreachable by dial-back), a follower holds circuit relay
reservations and punches holes to nodes reachable only through a relay, ahead of a download and
during one (:mod:`shardcast.download.punching`); a punched node joins the download at the next
poll, over the direct connection (never the circuit). A super-seeding source that
refuses a shard names its holder; a holder this follower has no lane to and will not get one
to soon (:meth:`shardcast.download.discovery.SourceDirectory.holder_reach`: say its punch to
it failed) is named back, and the source serves the shard at once (rule 11 of
:class:`shardcast.serve.superseeding.SuperSeeding`).

A download always ends (:mod:`shardcast.core.liveness`): it fails when the version is gone from
every source (pruned: the next plan falls back to the newest version in full), when nothing
arrives for too long, and it is abandoned as soon as a newer version is announced that it
cannot be the base of (:func:`shardcast.core.catchup.worth_finishing`).

Static mirrors (``mirrors``, and those the run card names) are HTTP-only, untrusted sources,
polled for the versions they list (:mod:`shardcast.download.mirrors`): a mirror joins the
download of an announced version it lists, for the manifest document and for shards; its
manifest is checked like any other against the pinned trainer and the announced digest, every
shard against its signed digest, and a mirror that serves wrong bytes is blamed and banned like
any bad source. Requests to it are unsigned (anonymous). Node adverts are heard, scoped and
their lanes challenged by :mod:`shardcast.download.adverts`; the ``/status`` sections and
metric families are :mod:`shardcast.download.followstatus`.

Every loop here has a timeout or a bounded backoff; a failing upstream is logged with its
short PeerID and retried, never allowed to stop the others.

Versions are ``(step, manifest digest)`` everywhere: every lane request names both
(:mod:`shardcast.wire.lane_urls`), adverts carry the digest of each step they list, mirrors are
used only for the digests they list, and the manifests of a delta chain are fetched by the
digest each link names as its base.

Restarts and the end of a run: a follower started on a data directory keeps the versions it
committed (the store re-verifies them after an unclean stop) and fetches only what is newer.
If the trainer's signed announcement names the newest step this node holds with *another*
manifest digest, the trainer's is authoritative: the local copy is discarded (never served
again) and the trainer's downloaded. A node never moves backwards: an announcement of a step
older than the newest it holds is not fetched (logged once), whatever its digest.
Once the trainer's signed ``RunFinished`` is known and its final
version committed, the follower is *settled* (:meth:`Follower.wait_settled`): it keeps
serving, and polls and retries its upstreams minutes apart instead of seconds
(:func:`shardcast.core.pollpolicy.poll_delay`).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.core import Metric

from p2p.errors import ConfigError, ShardnetError, short_id
from p2p.host import peer_id_of
from shardcast.core import (
    MANIFEST_RETRY_MAX_S,
    DownloadStats,
    PollOutcome,
    PollPolicy,
    Reachability,
    Stage,
    VersionWatch,
    Want,
    abandons,
    confirmed_elsewhere,
    manifest_retry_s,
    plan,
    should_materialize,
    want,
)
from shardcast.download import followstatus
from shardcast.download.adverts import AdvertIntake
from shardcast.download.cards import adopt_card_of, card_version, ensure_card
from shardcast.download.discovery import (
    HolderReach,
    NodeAdvert,
    nodes_topic,
)
from shardcast.download.downloader import Downloader
from shardcast.download.followconfig import (
    CommitHook,
    FollowConfig,
    VersionRecord,
    source_directory,
)
from shardcast.download.manifests import fetch_chain, fetch_manifest
from shardcast.download.mirrors import Mirrors
from shardcast.download.punching import Punching
from shardcast.download.types import Source
from shardcast.download.versionwatch import watch_versions
from shardcast.node import (
    DownloadMetrics,
    PortMapping,
    ShardcastNode,
    iso,
    keep_reachability,
    source_kind,
    tcp_port,
    wall_of,
)
from shardcast.serve import Requester
from shardcast.store import ChainBroken
from shardcast.wire import (
    Manifest,
    NodeInfo,
    VersionAnnouncement,
    check_versions_gossip,
    decode_versions_message,
    versions_topic,
)

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


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
        self._metrics = (
            DownloadMetrics(node.metrics, self.kind_of) if node.metrics.follower else None
        )
        self.downloader = Downloader(
            node.client,
            node.store,
            config.download,
            rng,
            node.trust,
            observer=self._metrics,
            cpu=node.metrics.stage_cpu,
        )
        self.on_commit = on_commit
        self.progress = progress
        self.upstreams: dict[str, NodeInfo] = {}
        self.records: list[VersionRecord] = []
        self.directory = source_directory(node.identity.peer_id, config, rng)
        node.server.requester_kind = self._requester_kind
        self.downloader.unreachable = self._unreachable_holders
        self.holders_named: Counter[HolderReach] = Counter()
        """Holders named by super-seeding refusals, by what this node knew of them (metrics)."""
        self._upstream_changed = trio.Event()
        self._filling: list[tuple[int, str]] = []  # versions being downloaded
        self._hooking: set[int] = set()  # steps downloading, or committed before on_commit
        self._advert_wake = trio.Event()
        self.heard: dict[str, float] = {}
        """Upstream PeerID -> Unix time (s) of its last info answer (``/status``)."""
        self.upstream_errors: dict[str, str] = {}
        """Upstream PeerID -> its last error, until it answers again (``/status``)."""
        self.filling_progress: dict[int, tuple[int, int, float]] = {}
        """Step being downloaded -> (verified bytes, total bytes, ``trio.current_time()`` it
        started at) (``/status``)."""
        self.mirrors = Mirrors(
            node.client,
            node.config.run_id,
            config.mirrors,
            config.mirror_poll_policy(),
            self.settled,
        )
        self.reachability = Reachability(node.http_url, config.reachability)
        self.intake = AdvertIntake(
            node.p2p,
            node.client,
            node.config.run_id,
            self.directory,
            config.reachability,
            config.advert_interval_s,
        )
        self.punching = Punching(
            node.p2p,
            node.identity.peer_id,
            config.punch,
            self.directory,
            self.reachability,
            rng,
            self._readvertise,
            self._relay_upstreams,
        )
        self._nursery: trio.Nursery | None = None
        self._register_views()
        self.port_mapping = self._port_mapping(config)
        """This node's port mappings (None: ``port_mapping`` off, or no discovery)."""
        self._changed = trio.Event()
        self._poll_wake: dict[str, trio.Event] = {}  # upstream -> wakes its info poll
        self._upstream_ids = {peer_id_of(a) for a in config.upstreams}
        node.p2p.on_peer_gone(self._peer_gone)
        self._watches: dict[str, tuple[str, VersionWatch, trio.CancelScope]] = {}

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; ``started()`` once the first upstream answered its info."""
        self.node.restore_run_end()  # before the first poll: a settled node polls seldom
        async with trio.open_nursery() as nursery:
            for addr in self.config.upstreams:
                nursery.start_soon(self._poll_upstream, addr)
            self._nursery = nursery
            nursery.start_soon(self.mirrors.run, self.node)
            nursery.start_soon(self._listen_versions)
            if self.config.discovery:
                nursery.start_soon(self.intake.listen)
                nursery.start_soon(self.intake.verify)
                nursery.start_soon(self._advertise)
                nursery.start_soon(
                    keep_reachability,
                    self.node.p2p,
                    self.reachability,
                    self._dialback_askers,
                    self._on_reach_change,
                    self.intake.interfaces,
                )
                if self.config.reachability.serve_behind_nat:
                    nursery.start_soon(self.punching.keep_reservations)
                if self.port_mapping is not None:
                    nursery.start_soon(self.port_mapping.run)
                if self.config.punch.ahead_max_direct > 0:
                    nursery.start_soon(self.punching.ahead, nursery)
            while not self.upstreams:
                await self._upstream_changed.wait()
            task_status.started()
            await self._download_loop()

    def _peer_gone(self, peer_id: str) -> None:
        """A remote's last connection closed: an upstream that was ready is no longer, now,
        not at its next poll (minutes away once settled). Its poll keeps its schedule (an
        extra failed poll would only stretch the settled backoff); the host re-dials it
        (:meth:`p2p.lanes.Host.keep`). Called by the host; never blocks."""
        if peer_id not in self._upstream_ids or self.upstreams.pop(peer_id, None) is None:
            return
        self.upstream_errors[peer_id] = "connection closed"
        self._note_upstream()

    def _note_upstream(self) -> None:
        self._upstream_changed.set()
        self._upstream_changed = trio.Event()

    def _note_change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _offer(self, data: bytes, sender: str, *, upstream: bool = True) -> None:
        replace = upstream and not self._confirmed_elsewhere(sender)
        was_settled = self.settled()
        if self.node.offer_versions_message(data, sender, replace_same_step=replace) is not None:
            self._note_change()
            self._wake_polls_if_resumed(was_settled)

    def _wake_polls_if_resumed(self, was_settled: bool) -> None:
        """Poll every upstream now if the run was settled and no longer is (the trainer
        continued the run, or announced a newer step): settled polls and retries are minutes
        apart (:func:`shardcast.core.pollpolicy.poll_delay`), and a download waits for its
        upstream's info record."""
        if was_settled and not self.settled():
            log.info("polls_woken reason=run_resumed upstreams=%d", len(self._poll_wake))
            for wake in self._poll_wake.values():
                wake.set()

    def _confirmed_elsewhere(self, sender: str) -> bool:
        """True if another reachable upstream's last info record names the version this node
        knows: a same-step replacement from ``sender`` then waits
        (:func:`~shardcast.core.tracker.confirmed_elsewhere`)."""
        return confirmed_elsewhere(
            self.node.announcement, sender, self.node.tracker.said, self.upstreams
        )

    def _note_upstream_said(self, pid: str, data: bytes) -> None:
        """Tell the tracker which version upstream ``pid``'s last info record announced."""
        try:
            msg = decode_versions_message(data, trust=self.node.trust, sender=pid)
        except ShardnetError:
            self.node.tracker.heard_from(pid, None)
            return
        if isinstance(msg, VersionAnnouncement):
            self.node.tracker.heard_from(pid, msg)

    def _offer_finished(self, data: bytes, sender: str) -> None:
        if self.node.offer_finished(data, sender) is not None:
            self._note_change()

    def _offer_continued(self, data: bytes, sender: str) -> None:
        was_settled = self.settled()
        if self.node.offer_continued(data, sender) is not None:
            self._note_change()
            self._wake_polls_if_resumed(was_settled)

    def held_digest(self, step: int) -> str | None:
        """Manifest digest of committed ``step`` in this node's store, or None."""
        return self.node.store.digest_of(step)

    def settled(self) -> bool:
        """True once the run finished and its final version is committed here and handed
        to :attr:`on_commit`."""
        return self.node.tracker.settled(
            lambda step: None if step in self._hooking else self.held_digest(step)
        )

    async def wait_settled(self) -> None:
        """Wait until :meth:`settled`."""
        while not self.settled():
            await self._changed.wait()

    async def _poll_upstream(self, addr: str) -> None:
        """Poll upstream ``addr``'s info record for ever, spaced as the tracker says."""
        pid = peer_id_of(addr)
        policy = self.config.poll_policy()
        tracker = self.node.tracker
        while True:
            wake = self._poll_wake[pid] = trio.Event()
            try:
                if pid not in self.node.p2p.connected_peers():
                    await self.node.p2p.connect(addr)
                info = await self.node.query_info(pid)
            except ShardnetError as exc:
                self.upstream_errors[pid] = str(exc)
                # the host re-dials it on the keepalive's schedule (seconds) while this poll
                # backs off (minutes once settled), so a run continued reaches this node soon
                self.node.p2p.keep(addr)
                if self.upstreams.pop(pid, None) is not None:
                    self._note_upstream()
                settled = self.settled()
                after = tracker.polled(addr, PollOutcome.UNREACHABLE, policy, settled)
                if after.report:
                    log.info(
                        "upstream_unreachable upstream=%s error=%s retry_s=%.1f settled=%s",
                        short_id(pid),
                        exc,
                        after.delay_s,
                        settled,
                    )
                with trio.move_on_after(after.delay_s):
                    await wake.wait()  # the run resumed: retry now
                continue
            self.heard[pid] = time.time()
            self.upstream_errors.pop(pid, None)
            outcome = await self._take_info(pid, info)
            watch = self._watch(pid, info.http_url, policy)  # polls seldom while it holds
            after = tracker.polled(addr, outcome, policy, self.settled(), watch.watching)
            with trio.move_on_after(after.delay_s):
                await wake.wait()  # the watch saw the upstream's versions change

    def _watch(self, pid: str, url: str, policy: PollPolicy) -> VersionWatch:
        """The long-poll of upstream ``pid``'s ``/versions`` at ``url`` (started here, or
        moved to a new URL), which wakes its info poll when the list changes
        (:mod:`shardcast.download.versionwatch`)."""
        held = self._watches.get(pid)
        if held is not None and held[0] == url:
            return held[1]
        if held is not None:
            held[2].cancel()
        watch, scope = VersionWatch(policy), trio.CancelScope()
        self._watches[pid] = (url, watch, scope)
        client, run_id = self.node.client, self.node.config.run_id

        def wake() -> None:
            self._poll_wake[pid].set()

        async def run() -> None:
            with scope:
                await watch_versions(client, pid, url, run_id, watch, wake, self.settled)

        assert self._nursery is not None
        self._nursery.start_soon(run)
        return watch

    async def _take_info(self, pid: str, info: NodeInfo) -> PollOutcome:
        """Use upstream ``pid``'s info record: it is ready; its card, announcement and run
        end are offered to the node."""
        if info.run_id != self.node.config.run_id:
            if self.node.report_once(("run_id", pid, info.run_id)):
                log.error(
                    "upstream_wrong_run upstream=%s upstream_run_id=%s run_id=%s "
                    "hint=this node follows run %s (its --run-id, or the run card stored in "
                    "%s); to follow run %s start it with another --data-dir",
                    short_id(pid),
                    info.run_id,
                    self.node.config.run_id,
                    self.node.config.run_id,
                    self.node.config.data_dir,
                    info.run_id,
                )
            return PollOutcome.WRONG_RUN
        new = pid not in self.upstreams or self.upstreams[pid].http_url != info.http_url
        self.upstreams[pid] = info
        if new:
            log.info(
                "upstream_ready upstream=%s role=%s http_url=%s",
                short_id(pid),
                info.role,
                info.http_url,
            )
        if info.card_version > card_version(self.node):
            await adopt_card_of(self.node, pid)
        if info.announcement is not None:
            self._offer(info.announcement, pid)
            self._note_upstream_said(pid, info.announcement)
        if info.continued is not None:
            self._offer_continued(info.continued, pid)
        if info.finished is not None:
            self._offer_finished(info.finished, pid)
        if new:  # after its run end or continuation was taken: a restored end may be stale
            self._note_upstream()
        return PollOutcome.ANSWERED

    async def _listen_versions(self) -> None:
        run_id = self.node.config.run_id
        check = check_versions_gossip(self.node.trust, run_id)
        sub = await self.node.p2p.subscribe(versions_topic(run_id), check)
        async for msg in sub:
            self._offer(msg.data, msg.origin, upstream=False)  # open gossip: no same-step swap

    def _score_sources(self, upstream_ids: set[str]) -> None:
        """Feed the outcome of the latest download to the advertisers' scores."""
        stats = self.downloader.last_stats
        if stats is None:
            return
        now = trio.current_time()
        for source, asked in stats.asked_by_source.items():
            if source in upstream_ids or not asked:
                continue
            if stats.other_digest_by_source.get(source, 0) >= asked:
                continue  # it holds the step under another digest: no fault, no score
            delivered = stats.bytes_by_source.get(source, 0) > 0
            self.directory.record(source, delivered=delivered, now=now)

    async def _advertise(self) -> None:
        node = self.node
        topic = nodes_topic(node.config.run_id)
        role = "relay" if node.config.role == "relay" else "peer"
        while True:
            committed = await trio.to_thread.run_sync(node.store.committed_versions)
            advert = NodeAdvert.of(
                node.identity.peer_id,
                role,
                self._advertised_url(),
                committed,
                list(self._filling),
                tier=self.tier(),
                stream_lane=self.reachability.advertises_stream(),
                lan_url=self.reachability.lan_advertised(self.intake.interfaces),
                relays=self.punching.advertised_relays(),
            )
            try:
                await node.p2p.publish(topic, advert.encode())
            except ShardnetError as exc:
                log.info("advert_failed error=%s", exc)
            with trio.move_on_after(self.config.advert_interval_s):
                await self._advert_wake.wait()

    def _advertised_url(self) -> str:
        """The lane URL to advertise: the port-mapped external one once a dial-back reached
        it, else this node's own (:meth:`Reachability.advertised`)."""
        mapped = self.port_mapping.advertised() if self.port_mapping is not None else ""
        return mapped or self.reachability.advertised()

    def tier(self) -> int | None:
        """Hops from the origin (see :class:`~shardcast.download.discovery.NodeAdvert`): 1 if an
        upstream is the origin (a trainer), else one more than the upstreams' own lowest
        advertised tier; None while no upstream has answered."""
        if not self.upstreams:
            return None
        if any(info.role in ("origin", "trainer") for info in self.upstreams.values()):
            return 1
        tiers = [self.directory.tier_of(pid) for pid in self.upstreams]
        known = [t for t in tiers if t is not None]
        return min(known) + 1 if known else None

    def _requester_kind(self, peer_id: str) -> Requester:
        """What this node's server knows of requester ``peer_id`` for super-seeding, from its
        advert: a relay of this relay's tier (:meth:`_same_tier_relay`), a node whose advert
        offers no lane outside its own network (no URL, no stream lane: download-only), or
        a serving one (also when no advert was heard)."""
        if self.node.config.role == "relay" and self._same_tier_relay(peer_id):
            return Requester.SIBLING
        if self.directory.download_only(peer_id):
            return Requester.DOWNLOAD_ONLY
        return Requester.SERVING

    def _unreachable_holders(self, holders: Sequence[str]) -> tuple[str, ...]:
        """Of the ``holders`` a super-seeding refusal named, those this node cannot reach
        (:meth:`~shardcast.download.discovery.SourceDirectory.holder_reach`, with the direct
        connections held now, the punches that failed and whether its punches keep failing)."""
        now, direct = trio.current_time(), frozenset(self.node.p2p.direct_peers())
        out = []
        for h in holders:
            reach = self.directory.holder_reach(
                h,
                now,
                connected=direct,
                punch_failed=self.punching.failed,
                punching_fails=self.punching.record.failing(),
            )
            self.holders_named[reach] += 1
            if reach is HolderReach.UNREACHABLE:
                out.append(h)
        return tuple(out)

    def _same_tier_relay(self, peer_id: str) -> bool:
        """True if ``peer_id`` advertised the relay role at this node's tier: this relay does
        not super-seed to it (siblings fetch from each other at once; each shard still
        enters the tier below once per relay)."""
        mine = self.tier()
        return (
            mine is not None
            and self.directory.role_of(peer_id) == "relay"
            and self.directory.tier_of(peer_id) == mine
        )

    def _readvertise(self) -> None:
        self._advert_wake.set()
        self._advert_wake = trio.Event()

    def _on_reach_change(self) -> None:
        self._readvertise()
        self.punching.reach_changed()

    def _relay_upstreams(self) -> list[str]:
        """This node's upstreams that are relays (PeerIDs, sorted): its first candidates for
        a circuit relay reservation."""
        return [p for p, info in sorted(self.upstreams.items()) if info.role == "relay"]

    def _upstream_sources(self) -> list[Source]:
        """The upstreams as partial sources: asked only for what their have-set and verified
        prefixes show (long-polled), until they hold everything. As complete sources they
        were asked for every shard at once and held each request until that shard arrived
        there: on shaped 200 Mb/s links a peer's request slots all waited on its relays for
        4-12 s while other peers already had the bytes (last peer 16.2 -> 14.3 s)."""
        return [
            Source(pid, info.http_url, complete=False)
            for pid, info in sorted(self.upstreams.items())
        ]

    def _extra_sources(self, step: int, digest: str) -> list[Source]:
        if not self.config.discovery:
            return []
        direct = frozenset(self.node.p2p.direct_peers())
        if self._nursery is not None:
            self.punching.start(step, digest, direct, self._nursery)
        return self.directory.sources_for(
            step,
            trio.current_time(),
            self.config.max_extra_sources,
            digest=digest,
            connected=direct,
        )

    async def _sources_news(self) -> None:
        """Returns when the directory may offer new sources (its ``news``)."""
        await self.directory.news.wait()

    async def fetch_manifest(
        self,
        run_id: str,
        step: int,
        digest: str,
        give_up: Callable[[], bool],
        timeout_s: float | None = None,
    ) -> Manifest | None:
        """The manifest document of version ``(step, digest)`` from any upstream or mirror
        that holds it (parts may be missing; :func:`.manifests.fetch_manifest`).

        Args:
            digest: the header digest (from a signed announcement, or the base digest a
                newer version names).
            give_up: polled between attempts; True abandons the fetch (returns None).
            timeout_s: give up after this long too, seconds (None: only ``give_up``).
        """
        return await fetch_manifest(
            self.node.client,
            self.node.trust,
            lambda: self._upstream_sources() + self.mirrors.sources(step, digest),
            run_id,
            step,
            digest,
            give_up,
            timeout_s,
        )

    def _wanted(self) -> VersionAnnouncement | None:
        """The known announcement if it names a version to fetch, else None (see
        :func:`shardcast.core.tracker.want`: newer than what is held, or the newest step held with
        another digest; never an older step than the newest held)."""
        ann = self.node.announcement
        latest = self.node.store.latest()
        wanted = want(ann, latest, self.held_digest)
        if wanted is Want.BEHIND and ann is not None and latest is not None:
            if self.node.report_once(("behind", str(ann.step), ann.manifest_digest)):
                log.warning(
                    "announcement_behind step=%d digest=%s held_step=%d: not fetched",
                    ann.step,
                    ann.manifest_digest[:16],
                    latest,
                )
        return ann if wanted.fetch else None

    async def _download_loop(self) -> None:
        while True:
            while (ann := self._wanted()) is None:
                await self.node.wait_change()
            while not self.upstreams:
                await self._upstream_changed.wait()
            await ensure_card(
                self.node,
                self.upstreams.keys,
                ann,
                self._superseded,
                functools.partial(adopt_card_of, self.node),
            )
            held = self.held_digest(ann.step)
            if held is not None and held != ann.manifest_digest:
                log.warning(
                    "version_replaced step=%d held_digest=%s trainer_digest=%s",
                    ann.step,
                    held[:16],
                    ann.manifest_digest[:16],
                )
                await trio.to_thread.run_sync(self.node.store.discard, ann.step)
                self.node.server.live_done(ann.step)  # forget its cached manifest
                self._readvertise()
            newer = functools.partial(self._superseded, ann.step)
            target = await self.fetch_manifest(
                ann.run_id,
                ann.step,
                ann.manifest_digest,
                newer,
                timeout_s=self.config.download.no_source_grace_s,
            )
            if target is None:
                if not newer():
                    await trio.sleep(self.config.poll_interval_s)
                continue
            steps, chain = await self._plan(target)
            for step in steps:
                m = target if step == target.step else chain.get(step)
                if m is None or not await self._download(m):
                    break
            else:
                continue
            await trio.sleep(self.config.poll_interval_s)  # failed: back off, then retry

    async def _watch_superseded(self, m: Manifest, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (the download of ``m``) once a newer version is announced that
        ``m`` cannot be the base of (:func:`~shardcast.core.tracker.abandons`)."""
        seen = m.step
        while True:
            ann = await self.node.wait_announcement(newer_than=seen)
            seen = ann.step
            target = await self.fetch_manifest(
                ann.run_id,
                ann.step,
                ann.manifest_digest,
                functools.partial(self._superseded, ann.step),
                timeout_s=self.config.download.no_source_grace_s,
            )
            if target is None:
                continue
            chain = await self._fetch_chain(target, m.step)
            reason = abandons(m.step, m.digest, target, chain)
            if reason is None:
                continue
            log.info(
                "download_abandoned step=%d reason=%s newer_step=%d",
                m.step,
                reason.value,
                target.step,
            )
            scope.cancel()
            return

    def _superseded(self, step: int) -> bool:
        """True if a newer version than ``step`` has been announced."""
        return self.node.tracker.superseded(step)

    async def _fetch_chain(self, target: Manifest, down_to: int) -> dict[int, Manifest]:
        """The delta chain below ``target`` down to ``down_to`` (:func:`.manifests.fetch_chain`),
        each link fetched in one round."""

        async def once(run_id: str, step: int, digest: str) -> Manifest | None:
            return await self.fetch_manifest(run_id, step, digest, lambda: True)

        return await fetch_chain(once, target, down_to)

    async def _plan(self, target: Manifest) -> tuple[tuple[int, ...], dict[int, Manifest]]:
        """The steps to download to reach ``target`` and the chain manifests they need."""
        store = self.node.store
        have = store.latest()
        if have is None or have >= target.step - 1:
            return (target.step,), {}
        have_digest = await trio.to_thread.run_sync(store.digest_of, have)
        if have_digest is None:
            return (target.step,), {}
        chain = await self._fetch_chain(target, have)
        p = plan(have, have_digest, target, chain)
        log.info(
            "catch_up have=%d target=%d steps=%s bytes=%d full_bytes=%d",
            have,
            target.step,
            list(p.steps),
            p.bytes,
            p.full_bytes,
        )
        return p.steps, chain

    async def _download(self, m: Manifest) -> bool:
        """Download, commit and hand ``m`` to :attr:`on_commit` (:meth:`_fetch_commit`);
        until that returns, :meth:`settled` does not count ``m``'s step as held, though the
        store commits it before the hook runs (a peer leaving on its run's end left before its
        final version's hook had recorded and loaded it)."""
        self._hooking.add(m.step)
        try:
            return await self._fetch_commit(m)
        finally:
            self._hooking.discard(m.step)
            self._note_change()

    async def _fetch_commit(self, m: Manifest) -> bool:
        step = m.step
        learned = self.node.tracker.learned_at(step)
        record = VersionRecord(
            step, m.digest, learned if learned is not None else trio.current_time()
        )
        server = self.node.server
        # discovered sources join through extra_sources (bounded there); they seed the list
        # only when no upstream is known
        digest = m.digest
        sources = (
            self._upstream_sources() or self._extra_sources(step, digest)
        ) + self.mirrors.sources(step, digest)
        self._filling.append((step, digest))
        self._readvertise()
        started = trio.current_time()
        log.info(
            "download_started step=%d digest=%s sources=%d parts=%d/%d heard_s=%.3f",
            step,
            digest[:16],
            len(sources),
            len(m.parts),
            m.header.n_parts,
            started - record.learned_at,
        )
        self.filling_progress[step] = (0, m.total_bytes, started)

        def progress(done: int, total: int) -> None:
            self.filling_progress[step] = (done, total, started)
            if self.progress is not None:
                self.progress(step, done, total)

        result: tuple[Path, DownloadStats] | None = None
        error: ShardnetError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_superseded, m, nursery.cancel_scope)
                try:
                    result = await self.downloader.download(
                        m,
                        sources,
                        on_partial=server.add_live,
                        on_shard=lambda i: server.progress(step, i),
                        progress=progress,
                        extra_sources=functools.partial(self._extra_sources, step, digest),
                        max_extra_sources=self.config.max_extra_sources,
                        upstreams=lambda: (
                            self._upstream_sources() + self.mirrors.sources(step, digest)
                        ),
                        sources_changed=self._sources_news,
                    )
                except ShardnetError as exc:  # caught here: a nursery would wrap it in a group
                    error = exc
                nursery.cancel_scope.cancel()
        finally:
            server.live_done(step)
            self.filling_progress.pop(step, None)
            self._filling.remove((step, digest))
            self._readvertise()
            self._score_sources({peer_id_of(a) for a in self.config.upstreams} | set(self.mirrors))
        if error is not None:
            log.warning("download_failed step=%d error=%s", step, error)
            return False
        if result is None:  # abandoned: superseded by a version it cannot be the base of
            await trio.to_thread.run_sync(self.node.store.discard_partial, step)
            return False
        path, stats = result
        await self._committed(m, record, path, stats)
        return True

    async def _committed(
        self, m: Manifest, record: VersionRecord, path: Path, stats: DownloadStats
    ) -> None:
        """Record, count and log the download of ``m`` (committed at ``path``), then tell
        :attr:`on_commit` and the waiters on a change."""
        record.committed_at = trio.current_time()
        record.stats, record.path = stats, path
        self.records.append(record)
        if self._metrics is not None:
            self._metrics.committed(record.committed_at - record.learned_at, stats.elapsed_s)
        log.info(
            "version_downloaded step=%d size_bytes=%d download_s=%.3f resumed=%d overdue=%d "
            "encodings=%s sources=%s",
            m.step,
            m.total_bytes,
            stats.elapsed_s,
            stats.resumed,
            stats.overdue,
            ",".join(f"{k}:{v}" for k, v in sorted(stats.bytes_by_encoding.items())),
            ",".join(f"{short_id(k)}:{v}" for k, v in sorted(stats.bytes_by_source.items())),
        )
        if self.on_commit is not None:
            await self.on_commit(m, path, record)
        self._note_change()
        if self._nursery is not None and self.config.download.materialize_every:
            self._nursery.start_soon(self._anchor, m.step)

    async def _anchor(self, step: int) -> None:
        """Materialize committed ``step`` in the background, at low priority, if it is an
        anchor (:func:`~shardcast.core.retention.should_materialize`): chains stay short and
        retention can drop the bases under it. A chain that does not verify is removed
        (:class:`~shardcast.store.ChainBroken`) and fetched again later."""
        store = self.node.store
        try:
            depth = await trio.to_thread.run_sync(store.chain_depth, step)
            if should_materialize(depth, self.config.download.materialize_every):
                cpu = self.node.metrics.stage_cpu
                materialize = cpu.wrap(Stage.MATERIALIZE, store.materialize_low_priority)
                await trio.to_thread.run_sync(materialize, step)
                await trio.to_thread.run_sync(store.prune)
        except ChainBroken as exc:
            log.error("anchor_broken step=%d error=%s", step, exc)
            self._note_change()
        except (OSError, ValueError) as exc:  # gone meanwhile (pruned, replaced)
            log.info("anchor_skipped step=%d error=%s", step, exc)

    # -- observability ----------------------------------------------------------------------

    def kind_of(self, source: str) -> str:
        """``source_kind`` of a source id: its upstream info's role, else its advert's."""
        if source in self.mirrors:
            return source_kind("mirror")
        info = self.upstreams.get(source)
        return source_kind(info.role if info is not None else self.directory.role_of(source))

    def downloads_status(self) -> list[dict[str, Any]]:
        """The ``downloads`` section of ``/status`` (:func:`.followstatus.downloads`)."""
        return followstatus.downloads(self.filling_progress, self.downloader.current, self.kind_of)

    def upstreams_status(self) -> list[dict[str, Any]]:
        """The ``upstreams`` section of ``/status`` (:func:`.followstatus.upstreams`)."""
        return followstatus.upstreams(
            self.config.upstreams,
            self.upstreams,
            self.heard,
            self.upstream_errors,
            self.node.finished is not None,
        )

    def mirrors_status(self) -> list[dict[str, Any]]:
        """The ``mirrors`` section of ``/status`` (:func:`.followstatus.mirrors`)."""
        return followstatus.mirrors(self.mirrors.polls)

    def known_nodes_status(self) -> list[dict[str, Any]]:
        """The ``known_nodes`` section of ``/status`` (:func:`.followstatus.known_nodes`)."""
        return followstatus.known_nodes(self.directory)

    def reachability_status(self) -> dict[str, Any]:
        """The ``reachability`` section of ``/status`` (:func:`.followstatus.reachability`)."""
        return followstatus.reachability(self.reachability, self.punching)

    def _register_views(self) -> None:
        """Register this follower's ``/status`` sections and metric families with its node."""
        sections = self.node.status_sections
        sections.update(
            downloads=self.downloads_status,
            upstreams=self.upstreams_status,
            mirrors=self.mirrors_status,
            known_nodes=self.known_nodes_status,
        )
        if self.config.discovery:
            sections["reachability"] = self.reachability_status
        self.node.metrics.add_collector(self._families)

    def _families(self) -> list[Metric]:
        return followstatus.families(
            self.config.upstreams,
            self.upstreams,
            self.directory,
            self.reachability,
            self.intake,
            self.holders_named,
        )

    def _dialback_askers(self) -> list[str]:
        """Connected nodes to ask for a dial-back: upstreams first, then the others."""
        connected = self.node.p2p.connected_peers()
        ups = [peer_id_of(a) for a in self.config.upstreams]
        return [p for p in ups if p in connected] + [p for p in connected if p not in ups]

    def _port_mapping(self, config: FollowConfig) -> PortMapping | None:
        """The node's port mappings of its HTTP lane and libp2p TCP ports (registered in
        ``/status``), or None when ``port_mapping`` is off or discovery is."""
        if not (config.discovery and config.port_mapping.enabled):
            return None
        node = self.node
        ports = {"http": node.http.port}
        p2p_port = tcp_port(node.p2p.listen_multiaddrs())
        if p2p_port is not None:
            ports["libp2p"] = p2p_port
        mapping = PortMapping(
            node.p2p,
            ports,
            config.port_mapping,
            config.reachability,
            self._dialback_askers,
            self._on_reach_change,
        )
        node.status_sections["port_mapping"] = self.port_mapping_status
        return mapping

    def port_mapping_status(self) -> dict[str, Any]:
        """The ``port_mapping`` section of ``/status`` (see
        :meth:`shardcast.node.portmap.PortMapping.status`)."""
        assert self.port_mapping is not None
        now, wall = trio.current_time(), time.time()
        return self.port_mapping.status(now, lambda t: iso(wall_of(t, now, wall)))


__all__ = [
    "MANIFEST_RETRY_MAX_S",
    "CommitHook",
    "FollowConfig",
    "Follower",
    "VersionAnnouncement",
    "VersionRecord",
    "manifest_retry_s",
]
