"""A shardcast node: libp2p host + HTTP lane + version store + info protocol.

Every role (origin inside the trainer, relay, inference peer) runs one :class:`ShardcastNode`.
It owns, for the duration of :meth:`ShardcastNode.open`:

- the libp2p host (identity, gossip, request/response) from :mod:`p2p.host`;
- the HTTP lane server (:mod:`p2p.http_server`) serving :class:`~shardcast.serve.VersionServer`;
- the :class:`~shardcast.store.VersionStore` of the run under ``<data_dir>/versions``;
- the ``/shardnet/info/1.0.0`` handler answering with :class:`~shardcast.messages.NodeInfo`;
- the newest verified :class:`~shardcast.messages.VersionAnnouncement` this node knows, with
  an event that fires when a newer one arrives (from gossip, an info poll, or the origin);
  an announcement of the same step with another manifest digest replaces the known one (the
  trainer's newest signed word is authoritative; followers then replace their copy);
- the trainer's signed :class:`~shardcast.finish.RunFinished`, once the run has ended (lifted
  again by an announcement of a newer step).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2p import wire
from p2p.errors import ConfigError, ShardnetError, short_id
from p2p.host import HostConfig, P2PNode
from p2p.http_client import HttpClient
from p2p.http_server import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpServerConfig,
    open_http_server,
)
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.finish import RunFinished, decode_versions_message
from shardcast.manifest import check_run_id
from shardcast.messages import INFO_PROTOCOL, MAX_INFO_BYTES, NodeInfo, VersionAnnouncement
from shardcast.metrics import CONTENT_TYPE, registry_for, render
from shardcast.serve import PEER_HEADER, VersionServer
from shardcast.store import VersionStore

log = logging.getLogger(__name__)


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
        serve_once_s: origin super-seeding window (see :mod:`shardcast.serve`), or None.
        durable: fsync every committed version (see :mod:`shardcast.store`).
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
    durable: bool = True

    def __post_init__(self) -> None:
        if self.role not in ("origin", "trainer", "relay", "peer"):
            raise ConfigError("role", f"unknown role {self.role!r}")
        try:
            check_run_id(self.run_id)
        except ShardnetError as exc:
            raise ConfigError("run_id", str(exc)) from exc
        if self.keep_last < 1:
            raise ConfigError("keep_last", "must be >= 1")


class ShardcastNode:
    """A running node; only valid inside :meth:`open`."""

    def __init__(
        self,
        identity: Identity,
        trust: TrustList,
        config: NodeConfig,
        p2p: P2PNode,
        http: HttpServer,
        client: HttpClient,
        store: VersionStore,
        server: VersionServer,
    ) -> None:
        self.identity = identity
        self.trust = trust
        self.config = config
        self.p2p = p2p
        self.http = http
        self.client = client
        self.store = store
        self.server = server
        self.announcement: VersionAnnouncement | None = None
        self._announced = trio.Event()
        self.finished: RunFinished | None = None

    @classmethod
    @asynccontextmanager
    async def open(
        cls, identity: Identity, trust: TrustList, config: NodeConfig
    ) -> AsyncIterator[ShardcastNode]:
        """Start host, HTTP lane and store; stop everything on exit."""
        store = VersionStore(
            config.data_dir / "versions", config.run_id, config.keep_last, durable=config.durable
        )
        server = VersionServer(
            store, trust, wait_s=config.serve_wait_s, serve_once_s=config.serve_once_s
        )
        routes: dict[str, Callable[[], Awaitable[HttpResponse]]] = {}

        async def handle(req: HttpRequest) -> HttpResponse:
            route = routes.get(req.path)
            return await (route() if route is not None else server.handle(req))

        try:
            async with (
                P2PNode.open(identity, config.host) as p2p,
                open_http_server(handle, config.http) as http,
                HttpClient(headers={PEER_HEADER: identity.peer_id}) as client,
            ):
                node = cls(identity, trust, config, p2p, http, client, store, server)
                registry = registry_for(node)

                async def metrics() -> HttpResponse:
                    return HttpResponse(200, [("content-type", CONTENT_TYPE)], render(registry))

                routes["/metrics"] = metrics
                p2p.serve(
                    INFO_PROTOCOL,
                    node._on_info,
                    max_request_bytes=1024,
                    max_response_bytes=MAX_INFO_BYTES,
                    timeout_s=config.info_timeout_s,
                )
                log.info(
                    "node_ready role=%s peer_id=%s http_url=%s run=%s",
                    config.role,
                    identity.peer_id,
                    http.url,
                    config.run_id,
                )
                yield node
        finally:
            # any stop (normal exit, cancellation, an exception) leaves the page cache intact;
            # only an OS crash or power loss skips this, and then the marker stays behind
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(store.close)

    def info(self) -> NodeInfo:
        """This node's info record."""
        return NodeInfo(
            self.identity.peer_id,
            self.config.role,
            self.config.run_id,
            self.http.url,
            tuple(self.store.committed_steps()),
            self.announcement.encode() if self.announcement else None,
            self.finished.encode() if self.finished else None,
        )

    async def _on_info(self, sender: str, request: bytes) -> bytes:
        wire.decode(request, max_bytes=1024, sender=sender)
        return self.info().encode()

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
            log.warning("announcement_rejected sender=%s error=%s", short_id(sender), exc)
            return None
        return self._keep_announcement(ann)

    def offer_versions_message(
        self, data: bytes, sender: str
    ) -> VersionAnnouncement | RunFinished | None:
        """Verify a message of the versions topic (announcement or run end) and keep it if new.

        Returns:
            the message if it changed what this node knows, else None. Invalid ones are
            logged and dropped.
        """
        try:
            msg = decode_versions_message(data, trust=self.trust, sender=sender)
        except ShardnetError as exc:
            log.warning("announcement_rejected sender=%s error=%s", short_id(sender), exc)
            return None
        if isinstance(msg, RunFinished):
            return self._keep_finished(msg)
        return self._keep_announcement(msg)

    def offer_finished(self, data: bytes, sender: str) -> RunFinished | None:
        """Verify a run-finished message (e.g. from an info record) and keep it if new."""
        try:
            msg = RunFinished.decode(data, trust=self.trust, sender=sender)
        except ShardnetError as exc:
            log.warning("finished_rejected sender=%s error=%s", short_id(sender), exc)
            return None
        return self._keep_finished(msg)

    def _keep_announcement(self, ann: VersionAnnouncement) -> VersionAnnouncement | None:
        if ann.run_id != self.config.run_id:
            return None
        known = self.announcement
        if known is not None and (
            ann.step < known.step
            or (ann.step == known.step and ann.manifest_digest == known.manifest_digest)
        ):
            return None
        self.set_announcement(ann)
        return ann

    def _keep_finished(self, msg: RunFinished) -> RunFinished | None:
        if msg.run_id != self.config.run_id:
            return None
        if self.finished is not None and msg.step <= self.finished.step:
            return None
        if self.announcement is not None and msg.step < self.announcement.step:
            return None  # an old run end; the trainer has resumed since
        self.set_finished(msg)
        return msg

    def set_finished(self, msg: RunFinished) -> None:
        """Record that the run ended at ``msg.step`` (logged once) and wake waiters."""
        self.finished = msg
        log.info(
            "run_finished run=%s step=%d digest=%s",
            msg.run_id,
            msg.step,
            msg.manifest_digest[:16],
        )
        self._announced.set()
        self._announced = trio.Event()

    def set_announcement(self, ann: VersionAnnouncement) -> None:
        """Record ``ann`` as the newest known version and wake waiters."""
        if self.finished is not None and ann.step > self.finished.step:
            log.info("run_resumed run=%s step=%d", ann.run_id, ann.step)
            self.finished = None
        self.announcement = ann
        log.info(
            "version_announced run=%s step=%d digest=%s",
            ann.run_id,
            ann.step,
            ann.manifest_digest[:16],
        )
        self._announced.set()
        self._announced = trio.Event()

    async def wait_announcement(self, newer_than: int) -> VersionAnnouncement:
        """Wait for an announcement with ``step > newer_than``."""
        while self.announcement is None or self.announcement.step <= newer_than:
            await self._announced.wait()
        return self.announcement

    async def wait_change(self) -> None:
        """Wait until the known announcement or run end changes."""
        await self._announced.wait()

    def versions_dir(self) -> Path:
        """The run's directory of committed versions."""
        return self.store.run_dir
