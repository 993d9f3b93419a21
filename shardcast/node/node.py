"""node: a shardcast node: libp2p host + HTTP lane + version store + info protocol.

Every role (origin inside the trainer, relay, inference peer) runs one :class:`ShardcastNode`.
It owns, for the duration of :meth:`ShardcastNode.open`:

- the libp2p host (identity, gossip, request/response) from :mod:`p2p.host`;
- the HTTP lane server (:mod:`p2p.http_server`) serving
  :class:`~shardcast.serve.server.VersionServer`;
- the :class:`~shardcast.store.store.VersionStore` of the run under ``<data_dir>/versions``;
- the ``/shardnet/info/1.0.0`` handler answering with :class:`~shardcast.wire.messages.NodeInfo`;
- the ``/shardnet/dialback/1`` handler (:mod:`shardcast.node.dialback`): it tells a connected node
  whether its lane is reachable from here;
- ``/metrics`` (:mod:`shardcast.node.metrics`) and ``/status`` (:mod:`shardcast.node.nodestatus`) on
  the HTTP lane; components add status sections to :attr:`ShardcastNode.status_sections`
  and metric families through :attr:`ShardcastNode.metrics`;
- the newest verified :class:`~shardcast.wire.messages.VersionAnnouncement` this node knows, with
  an event that fires when a newer one arrives (from gossip, an info poll, or the origin):
  what is taken is decided by its :class:`~shardcast.core.tracker.VersionTracker`
  (:attr:`ShardcastNode.tracker`), which holds that state; the node verifies, logs and wakes;
- the run card (:mod:`shardcast.wire.runcard`) it holds, kept in ``<data_dir>/runcard.json`` and
  served at ``GET /shardnet/v1/runcard`` and on ``/shardnet/runcard/1.0.0``. Opening the node
  checks that the data directory belongs to the configured run
  (:func:`shardcast.node.cardsync.check_data_dir`);
- the trainer's signed :class:`~shardcast.wire.finish.RunFinished`, once the run has ended (lifted
  again by an announcement of a newer step, or by the trainer's signed
  :class:`~shardcast.wire.finish.RunContinued` when it was restarted with more steps).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from p2p import wire
from p2p.addresses import advertised_url, check_http_url, ensure_bindable, interface_addresses
from p2p.bytestream import STREAM_LANE_PROTOCOL, ByteStream
from p2p.errors import ConfigError, ShardnetError, UntrustedSigner, short_id
from p2p.host import HostConfig
from p2p.http_server import HttpRequest, HttpResponse, HttpServerConfig
from p2p.identity import Identity
from p2p.lanes import REAL_NETWORK, Host, HttpLaneClient, HttpLaneServer, Network
from p2p.trust import TrustList
from shardcast.core import DialbackLimits, FinishedTake, Take, VersionTracker, judge
from shardcast.node.cardsync import check_data_dir, save_card
from shardcast.node.datalock import lock_data_dir
from shardcast.node.dialback import serve_dialback
from shardcast.node.endrecord import load_end, save_end
from shardcast.node.metrics import CONTENT_TYPE, ORIGIN_ROLES, NodeMetrics
from shardcast.node.nodestatus import node_status_json
from shardcast.serve import VersionServer
from shardcast.store import VersionStore
from shardcast.wire import (
    HOLD_HEADER,
    INFO_PROTOCOL,
    MAX_CARD_BYTES,
    MAX_INFO_BYTES,
    NO_RUNCARD,
    RUNCARD_PROTOCOL,
    NodeInfo,
    RequestSigner,
    RunContinued,
    RunFinished,
    SignedRunCard,
    VersionAnnouncement,
    check_run_id,
    decode_versions_message,
    lane_route,
)

log = logging.getLogger(__name__)

EndT = TypeVar("EndT", RunFinished, RunContinued)


SHUTDOWN_FLUSH_S = 2.0
"""How long a stopping node waits for its store's ``sync`` (seconds) before it leaves the
unclean-stop marker in place instead (the next start re-verifies): part of the issue's
"shutdown is prompt with stuck sockets (<= 5 s)"."""


@dataclass(frozen=True)
class NodeConfig:
    """Settings shared by every shardcast role.

    Attributes:
        role: ``origin``/``trainer``, ``relay`` or ``peer``.
        run_id: the run this node follows.
        data_dir: where versions (and the key, by default) live.
        keep_last: committed versions kept on disk.
        host: libp2p host settings.
        http: HTTP lane server settings.
        serve_wait_s: how long a request for a not-yet-verified shard waits, seconds.
        info_timeout_s: bound on one info request, seconds.
        serve_once_s: origin super-seeding window (see :mod:`shardcast.serve.server`), or None.
        serve_once_min_bytes: versions offering at most this many bytes (deltas, usually)
            are not super-seeded (0: every version is).
        durable: fsync every committed version (see :mod:`shardcast.store.store`).
        public_url: the HTTP lane URL to advertise (None: derived from the bound address, see
            :func:`p2p.addresses.advertised_url`).
    """

    role: str
    run_id: str
    data_dir: Path
    keep_last: int = 3
    host: HostConfig = field(default_factory=HostConfig)
    http: HttpServerConfig = field(default_factory=HttpServerConfig)
    serve_wait_s: float = 10.0
    info_timeout_s: float = 10.0
    serve_once_s: float | None = None
    serve_once_min_bytes: int = 0
    durable: bool = True
    public_url: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("origin", "trainer", "relay", "peer"):
            raise ConfigError("role", f"unknown role {self.role!r}")
        try:
            check_run_id(self.run_id)
        except ShardnetError as exc:
            raise ConfigError("run_id", str(exc)) from exc
        if self.keep_last < 1:
            raise ConfigError("keep_last", "must be >= 1")
        if self.public_url is not None:
            check_http_url(self.public_url, "public_url")


_Route = Callable[[], Awaitable[HttpResponse]]


def _http_handler(
    routes: Mapping[str, _Route], server: VersionServer, metrics: NodeMetrics
) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
    """The HTTP lane's handler: a path in ``routes`` (observability, looked up per request,
    so routes may be added later) is answered by its route and counted as observability
    bytes; any other request goes to ``server`` and is counted by status."""

    async def handle(req: HttpRequest) -> HttpResponse:
        route = routes.get(req.path)
        if route is not None:  # observability: neither lane traffic nor lane requests
            resp = await route()
            if req.method == "GET" and isinstance(resp.body, bytes):
                metrics.observability_bytes += len(resp.body)
            return resp
        resp = await server.handle(req)
        metrics.count_request(resp.status, lane_route(req.path))
        return resp

    return handle


async def _open_lane_stream(host: Host, peer_id: str, timeout_s: float) -> ByteStream:
    """A stream-lane stream to ``peer_id`` over ``host``'s connection (the HTTP client's
    :data:`p2p.bytestream.StreamOpener`)."""
    return await host.open_stream(peer_id, STREAM_LANE_PROTOCOL, timeout_s)


async def _flush_on_stop(store: VersionStore) -> None:
    """A stopping node's last step: flush the store and mark it clean, waiting at most
    :data:`SHUTDOWN_FLUSH_S` (shielded: any stop, including cancellation, comes here; only an
    OS crash or power loss skips it, and then the marker stays behind)."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(SHUTDOWN_FLUSH_S) as flushing:
            await trio.to_thread.run_sync(store.flush, abandon_on_cancel=True)  # type: ignore[call-arg]
        if flushing.cancelled_caught:
            # a slow disk must not hold a SIGTERM: the marker stays, the next start
            # re-verifies what was committed (correct, only slower)
            log.warning("store_flush_slow seconds=%.0f next_start=reverify", SHUTDOWN_FLUSH_S)
        else:
            store.mark_clean()


class ShardcastNode:
    """A running node; only valid inside :meth:`open`."""

    def __init__(
        self,
        identity: Identity,
        trust: TrustList,
        config: NodeConfig,
        p2p: Host,
        http: HttpLaneServer,
        client: HttpLaneClient,
        store: VersionStore,
        server: VersionServer,
        metrics: NodeMetrics,
    ) -> None:
        self.identity = identity
        self.trust = trust
        self.config = config
        self.p2p = p2p
        self.http = http
        self.client = client
        self.store = store
        self.server = server
        self.metrics = metrics
        self.started_at = time.time()
        """Wall-clock start time (Unix seconds)."""
        self.status_sections: dict[str, Callable[[], Any]] = {}
        """Extra ``/status`` sections (name -> JSON-ready value), added by the role running
        on this node (follower, trainer, peer)."""
        self.tracker = VersionTracker(config.run_id)
        """What this node knows of the run's versions and decides from it (announcement,
        run end, upstreams' last words, upstream poll backoff)."""
        self._announced = trio.Event()
        self._reported: set[tuple[str, ...]] = set()
        self.http_url = advertised_url(
            config.http.host,
            http.port,
            config.public_url,
            interface_addresses(),
            config.host.public_host,
        )
        self.card: SignedRunCard | None = None
        self._card_changed = trio.Event()
        self._record_end = False  # keep the run end on disk (followers, see restore_run_end)

    @property
    def announcement(self) -> VersionAnnouncement | None:
        """The newest verified announcement this node knows (held by :attr:`tracker`)."""
        return self.tracker.announcement

    @property
    def finished(self) -> RunFinished | None:
        """The trainer's run end, while no newer step is announced (held by :attr:`tracker`)."""
        return self.tracker.finished

    @property
    def continued(self) -> RunContinued | None:
        """The trainer's newest run continuation known (held by :attr:`tracker`)."""
        return self.tracker.continued

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        identity: Identity,
        trust: TrustList,
        config: NodeConfig,
        *,
        network: Network | None = None,
        before_listening: Callable[[VersionStore], object] | None = None,
    ) -> AsyncIterator[ShardcastNode]:
        """Start host, HTTP lane and store; stop everything on exit.

        Args:
            network: opens the host and the HTTP lane (default: :data:`p2p.lanes.REAL_NETWORK`;
                tests pass an in-memory one, :mod:`p2p.memnet`).
            before_listening: run on the opened store, in a worker thread, before the host
                and the lane listen (the standalone origin quarantines versions whose files
                changed while it was down there, so none is ever served).

        Raises:
            ConfigError: a port in use or an address not of this host (``listen`` or
                ``http_port``); the data directory is another running node's
                (:mod:`shardcast.node.datalock`), holds another run's card or versions, or a
                card not signed by the pinned trainer (all before anything listens).
        """
        if network is None:
            network = REAL_NETWORK
            ensure_bindable(
                config.http.host, config.http.port, "http_port", "HTTP lane", "http_host"
            )
        with lock_data_dir(config.data_dir):  # one node per data directory
            async with cls._open_locked(identity, trust, config, network, before_listening) as n:
                yield n

    @classmethod
    @asynccontextmanager
    async def _open_locked(
        cls,
        identity: Identity,
        trust: TrustList,
        config: NodeConfig,
        network: Network,
        before_listening: Callable[[VersionStore], object] | None,
    ) -> AsyncIterator[ShardcastNode]:
        """:meth:`open` once the data directory's lock is held."""
        ledger = dataclasses.replace(config.host.ledger, never_ban=frozenset({trust.trainer}))
        config = dataclasses.replace(config, host=dataclasses.replace(config.host, ledger=ledger))
        stored_card = check_data_dir(config.data_dir, config.run_id, trust.trainer)
        store = VersionStore(
            config.data_dir / "versions", config.run_id, config.keep_last, durable=config.durable
        )
        server = VersionServer(
            store,
            trust,
            wait_s=config.serve_wait_s,
            serve_once_s=config.serve_once_s,
            identity=identity,
            serve_once_min_bytes=config.serve_once_min_bytes,
            first_copies_first=config.role in ORIGIN_ROLES,  # the origin's uplink
        )
        routes: dict[str, _Route] = {}
        metrics = NodeMetrics(config.role, config.run_id, identity.peer_id)
        handle = _http_handler(routes, server, metrics)
        try:
            if before_listening is not None:  # a stop while it runs still flushes the store
                await trio.to_thread.run_sync(before_listening, store)
            async with (
                network.open_host(identity, config.host) as p2p,
                network.open_http_server(handle, config.http) as http,
                network.open_http_client(
                    sign=RequestSigner(identity, time.time),
                    open_stream=functools.partial(_open_lane_stream, p2p),
                    # ask upstream nodes to hold requests for shards they are still verifying
                    headers={HOLD_HEADER: f"{config.serve_wait_s:g}"},
                ) as client,
            ):
                node = cls(identity, trust, config, p2p, http, client, store, server, metrics)
                node.card = stored_card
                token = trio.lowlevel.current_trio_token()
                store.on_quarantine = lambda steps: token.run_sync_soon(node.versions_lost, steps)
                metrics.bind(node)
                p2p.on_peer_gone(server.holder_gone)
                routes["/shardnet/v1/runcard"] = node._runcard_route
                routes["/metrics"] = node._metrics_route
                routes["/status"] = node._status_route
                node._serve_protocols()
                log.info(
                    "node_ready role=%s peer_id=%s http_url=%s run=%s",
                    config.role,
                    identity.peer_id,
                    node.http_url,
                    config.run_id,
                )
                yield node
        finally:
            await _flush_on_stop(store)

    async def _runcard_route(self) -> HttpResponse:
        """``GET /shardnet/v1/runcard``: the signed run card this node holds (404 if none)."""
        if self.card is None:
            return HttpResponse(404)
        return HttpResponse(200, [("content-type", "application/json")], self.card.encode())

    async def _metrics_route(self) -> HttpResponse:
        """``GET /metrics``: the Prometheus text exposition of :attr:`metrics`."""
        return HttpResponse(200, [("content-type", CONTENT_TYPE)], self.metrics.render())

    async def _status_route(self) -> HttpResponse:
        """``GET /status``: the node's status as JSON (:func:`node_status_json`)."""
        body = node_status_json(self)
        return HttpResponse(200, [("content-type", "application/json")], body)

    def _serve_protocols(self) -> None:
        """Answer info and run-card requests, and dial-back checks, over libp2p."""
        self.p2p.serve(
            INFO_PROTOCOL,
            self._on_info,
            max_request_bytes=1024,
            max_response_bytes=MAX_INFO_BYTES,
            timeout_s=self.config.info_timeout_s,
        )
        self.p2p.serve(
            RUNCARD_PROTOCOL,
            self._on_runcard,
            max_request_bytes=1024,
            max_response_bytes=MAX_CARD_BYTES,
            timeout_s=self.config.info_timeout_s,
        )
        serve_dialback(self.p2p, self.client, DialbackLimits())
        # the lane over libp2p streams: how a node behind a NAT serves (see p2p.bytestream)
        self.p2p.serve_stream(
            STREAM_LANE_PROTOCOL,
            self.http.serve_stream,
            max_per_peer=self.config.http.max_connections_per_ip,
            max_concurrent=self.config.http.max_connections,
        )

    def info(self) -> NodeInfo:
        """This node's info record."""
        return NodeInfo(
            self.identity.peer_id,
            self.config.role,
            self.config.run_id,
            self.http_url,
            tuple(self.store.committed_steps()),
            self.announcement.encode() if self.announcement else None,
            self.card.version if self.card else 0,
            self.card.digest if self.card else "",
            self.finished.encode() if self.finished else None,
            self.continued.encode() if self.continued else None,
        )

    async def _on_info(self, sender: str, request: bytes) -> bytes:
        wire.decode(request, max_bytes=1024, sender=sender)
        return self.info().encode()

    async def _on_runcard(self, sender: str, request: bytes) -> bytes:
        wire.decode(request, max_bytes=1024, sender=sender)
        return self.card.encode() if self.card is not None else NO_RUNCARD

    def set_card(self, card: SignedRunCard) -> bool:
        """Adopt a verified run card if it is newer than the one held; store and serve it.

        Args:
            card: a card already verified against the pinned trainer.

        Returns:
            True if adopted; False if it is not newer, for another run, or conflicts with the
            held card of the same version (logged: the trainer signed two different cards).

        Blocking (a small file write, fsynced on durable nodes); safe from the trio thread.
        """
        old = self.card
        if card.card.run_id != self.config.run_id or card.signer != self.trust.trainer:
            log.warning(
                "runcard_wrong_run run=%s card_run=%s", self.config.run_id, card.card.run_id
            )
            return False
        if old is not None and card.version <= old.version:
            if card.version == old.version and card.digest != old.digest:
                log.warning(
                    "runcard_conflict version=%d held=%s offered=%s",
                    card.version,
                    old.digest[:16],
                    card.digest[:16],
                )
            return False
        save_card(self.config.data_dir, card, self.config.durable)
        self.card = card
        rules = card.card.sampling
        log.info(
            "runcard_adopted run=%s version=%d digest=%s prompts_per_step=%d group_size=%d "
            "max_new_tokens=%d temperature=%s engines=%s async_level=%d",
            card.card.run_id,
            card.version,
            card.digest[:16],
            rules.prompts_per_step,
            rules.group_size,
            rules.max_new_tokens,
            rules.temperature,
            ",".join(e.id for e in card.card.engines),
            card.card.async_level,
        )
        self._card_changed.set()
        self._card_changed = trio.Event()
        return True

    async def wait_card(self, at_least: int = 1) -> SignedRunCard:
        """Wait until the node holds a card with ``version >= at_least``."""
        while self.card is None or self.card.version < at_least:
            await self._card_changed.wait()
        return self.card

    async def query_info(self, peer_id: str) -> NodeInfo:
        """Ask ``peer_id`` for its info record.

        Raises:
            PeerUnreachable, StreamBroken, RemoteProtocolError: transport or protocol failure.
        """
        data = await self.p2p.request(
            peer_id,
            INFO_PROTOCOL,
            wire.encode({"v": 1}),
            max_response_bytes=MAX_INFO_BYTES,
            timeout_s=self.config.info_timeout_s,
        )
        return NodeInfo.decode(data, sender=peer_id)

    def offer_announcement(self, data: bytes, sender: str) -> VersionAnnouncement | None:
        """Verify an announcement and keep it if it is newer than the one we know.

        Returns:
            the announcement if it was new, else None. Invalid ones are logged and dropped.
        """
        try:
            ann = VersionAnnouncement.decode(data, trust=self.trust, sender=sender)
        except ShardnetError as exc:
            self._rejected(exc, sender)
            return None
        return self._keep_announcement(ann, sender)

    def offer_versions_message(
        self, data: bytes, sender: str, *, replace_same_step: bool = True
    ) -> VersionAnnouncement | RunFinished | RunContinued | None:
        """Verify a message of the versions topic (announcement, run end or continuation) and
        keep it if new.

        Args:
            replace_same_step: an announcement of the known step with another digest
                replaces the known one. Pass False for messages from open gossip: a replayed
                old announcement of the same step (trainer-signed, but superseded) must not
                flip the node back; the replacement arrives from an upstream's info record
                (allowlisted nodes, which converge on the origin's) within a poll interval.

        Returns:
            the message if it changed what this node knows, else None. Invalid ones are
            logged and dropped.
        """
        try:
            msg = decode_versions_message(data, trust=self.trust, sender=sender)
        except ShardnetError as exc:
            self._rejected(exc, sender)
            return None
        if isinstance(msg, RunFinished):
            return self._keep_finished(msg)
        if isinstance(msg, RunContinued):
            return self._keep_continued(msg)
        return self._keep_announcement(msg, sender, replace_same_step=replace_same_step)

    def offer_finished(self, data: bytes, sender: str) -> RunFinished | None:
        """Verify a run-finished message (e.g. from an info record) and keep it if new."""
        msg = self._decode_end(RunFinished, data, sender)
        return None if msg is None else self._keep_finished(msg)

    def offer_continued(self, data: bytes, sender: str) -> RunContinued | None:
        """Verify a run-continued message (e.g. from an info record) and keep it if new."""
        msg = self._decode_end(RunContinued, data, sender)
        return None if msg is None else self._keep_continued(msg)

    def _decode_end(self, kind: type[EndT], data: bytes, sender: str) -> EndT | None:
        """``kind.decode`` of ``data``, or None (logged once per cause) if it does not verify."""
        try:
            return kind.decode(data, trust=self.trust, sender=sender)
        except ShardnetError as exc:
            self._rejected(exc, sender)
            return None

    def _rejected(self, exc: ShardnetError, sender: str) -> None:
        """Log a refused versions-topic message once per cause (not on every poll)."""
        if isinstance(exc, UntrustedSigner):
            if self.report_once(("trainer_id", exc.source)):
                log.error(
                    "trainer_id_mismatch sender=%s signed_by=%s expected=%s "
                    "hint=the upstream follows another trainer; check --trainer-id",
                    short_id(sender),
                    exc.source,
                    self.trust.trainer,
                )
        elif self.report_once(("announcement", sender, type(exc).__name__)):
            log.warning("announcement_rejected sender=%s error=%s", short_id(sender), exc)

    def _keep_announcement(
        self, ann: VersionAnnouncement, sender: str, *, replace_same_step: bool = True
    ) -> VersionAnnouncement | None:
        known = self.announcement
        take = judge(known, ann, self.config.run_id, replace_same_step=replace_same_step)
        if take is Take.SAME_STEP_HELD and known is not None:
            if self.report_once(("same_step", str(ann.step), ann.manifest_digest)):
                log.info(
                    "announcement_same_step_ignored step=%d digest=%s known=%s from=%s "
                    "hint=a same-step replacement is taken from upstreams only",
                    ann.step,
                    ann.manifest_digest[:16],
                    known.manifest_digest[:16],
                    short_id(sender),
                )
        if not take.taken:
            return None
        self.set_announcement(ann, sender)
        return ann

    def report_once(self, key: tuple[str, ...]) -> bool:
        """True the first time ``key`` is seen (bounded: at most 1,024 keys remembered).

        For operator-facing problems that would otherwise be logged on every poll (a wrong
        ``--trainer-id`` or ``--run-id``, a sender of malformed announcements).
        """
        if key in self._reported:
            return False
        if len(self._reported) >= 1024:
            self._reported.clear()
        self._reported.add(key)
        return True

    def _keep_finished(self, msg: RunFinished) -> RunFinished | None:
        if self.tracker.offer_finished(msg) is not FinishedTake.TAKEN:
            return None
        self._record(msg)
        self._finished_news(msg)
        return msg

    def _keep_continued(self, msg: RunContinued) -> RunContinued | None:
        take, lifted = self.tracker.offer_continued(msg)
        if take is not FinishedTake.TAKEN:
            return None
        self._record(msg)
        self._continued_news(msg, lifted)
        return msg

    def _record(self, msg: RunFinished | RunContinued) -> None:
        if self._record_end:
            save_end(self.versions_dir(), msg)

    def restore_run_end(self) -> None:
        """Take the run end or continuation recorded before a restart, if it still verifies
        (:mod:`shardcast.node.endrecord`), and record every one taken from now on. For
        followers; the origin's run ends are its own. Blocking (one small file)."""
        self._record_end = True
        msg = load_end(self.versions_dir(), self.trust, self.config.run_id, self.store.latest())
        if msg is None:
            return
        if isinstance(msg, RunFinished):
            taken = self.tracker.offer_finished(msg)
        else:
            taken = self.tracker.offer_continued(msg)[0]
        if taken is FinishedTake.TAKEN:
            log.info("run_end_restored kind=%s step=%d seq=%d", msg.NAME, msg.step, msg.seq)
            self._changed()

    def set_continued(self, msg: RunContinued) -> None:
        """Record that the run goes on after ``msg.step`` (the origin's own; logged once)."""
        self.tracker.continue_(msg)
        self._continued_news(msg, True)

    def _continued_news(self, msg: RunContinued, lifted: bool) -> None:
        log.info("run_continued run=%s step=%d lifted_end=%s", msg.run_id, msg.step, lifted)
        self._changed()

    def set_finished(self, msg: RunFinished) -> None:
        """Record that the run ended at ``msg.step`` (logged once) and wake waiters."""
        self.tracker.finish(msg)
        self._finished_news(msg)

    def _finished_news(self, msg: RunFinished) -> None:
        log.info(
            "run_finished run=%s step=%d digest=%s",
            msg.run_id,
            msg.step,
            msg.manifest_digest[:16],
        )
        self._changed()

    def set_announcement(self, ann: VersionAnnouncement, sender: str | None = None) -> None:
        """Record ``ann`` as the newest known version and wake waiters.

        Args:
            sender: who passed it on (None: this node announces it, i.e. the origin).
        """
        if self.tracker.take(ann, trio.current_time()):
            log.info("run_resumed run=%s step=%d", ann.run_id, ann.step)
        if sender is None:
            log.info(
                "version_announced run=%s step=%d digest=%s",
                ann.run_id,
                ann.step,
                ann.manifest_digest[:16],
            )
        else:
            log.info(
                "announcement_received run=%s step=%d digest=%s from=%s",
                ann.run_id,
                ann.step,
                ann.manifest_digest[:16],
                short_id(sender),
            )
        self._changed()

    def _changed(self) -> None:
        """Wake what waits for a change (:meth:`wait_change`). While the run's end is in force
        the host expects its kept peers to leave (the trainer exits after its linger), so
        losing them is no warning (:meth:`p2p.lanes.Host.expect_departures`)."""
        self.p2p.expect_departures("run_finished" if self.finished is not None else None)
        self._announced.set()
        self._announced = trio.Event()

    async def wait_announcement(self, newer_than: int) -> VersionAnnouncement:
        """Wait for an announcement with ``step > newer_than``."""
        while self.announcement is None or self.announcement.step <= newer_than:
            await self._announced.wait()
        return self.announcement

    async def wait_change(self) -> None:
        """Wait until the known announcement or run end changes, or versions were lost."""
        await self._announced.wait()

    def versions_lost(self, steps: list[int]) -> None:
        """The store removed damaged ``steps`` (a chain that did not verify,
        :mod:`shardcast.store.chains`): wake what waits for a change, so a follower fetches
        the version again. Runs on the event loop (scheduled from the thread that found it)."""
        log.warning("versions_lost steps=%s", steps)
        self._changed()

    def versions_dir(self) -> Path:
        """The run's directory of committed versions."""
        return self.store.run_dir
