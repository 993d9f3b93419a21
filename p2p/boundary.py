"""The hostile-input boundary around py-libp2p 0.8.1: one stream's failure ends that stream.

Theory of operation
-------------------
py-libp2p 0.8.1 runs every inbound stream's handler in the nursery of its connection, and the
connection in the swarm's service: an exception that escapes a handler ends the whole node.
Its pubsub read loop catches only transport errors, so one length-prefixed ``/meshsub/1.1.0``
frame of invalid protobuf (``google.protobuf.message.DecodeError``) kills a relay, a peer or
the origin within a second. Its ``push_msg`` runs as a task of the pubsub service, so an
exception there (a message whose key does not deserialize) ends the pubsub service, and with it
the node, too. It forwards gossip before any application check, and it has no per-peer stream
limits. This module closes those holes from outside the library, in one place:

- :class:`InboundGuard` wraps stream handlers. The swarm's common handler (every inbound
  stream, before protocol negotiation) is wrapped through the swarm's public
  ``set_stream_handler``, and each protocol handler we own or that pubsub registered is wrapped
  again per protocol. A wrapped handler first admits the stream into the
  :class:`~p2p.limits.ResourceManager` (per-peer and global caps; banned peers are refused),
  then runs the library's handler; an exception that escapes it is *that stream's* failure:
  the stream is reset, the peer is charged a :class:`~p2p.limits.Offence` in the
  :class:`~p2p.limits.PeerLedger` (which bans a repeat offender: its connections are closed
  and its streams refused for ``ban_s``), and the node goes on.
- :class:`GuardedPubsub` is the library's ``Pubsub`` with a bounded inbound frame size and a
  ``push_msg`` that checks a message's shape (an Ed25519 ``from`` PeerID, a 64-byte signature,
  one topic, a bounded payload) before the library touches it, and contains any exception
  from the library's own processing of that message.
- :func:`topic_validator` adapts an application check ``(origin, data) -> None`` (raising a
  :class:`~p2p.errors.ShardnetError` to reject) into a pubsub topic validator. The library
  runs topic validators *before* it marks a message seen, caches it, delivers it or forwards
  it, so a message that fails the application's check (signature, trust list, size, schema)
  never leaves this node and never fills a queue.

Why wrap and subclass instead of a fork or a source patch: the fixes need no change *inside*
any library function — stream handlers are replaceable by public calls, and ``Pubsub`` is
designed to be subclassed (``stream_handler`` and ``push_msg`` are looked up on the instance).
A fork would have to be kept in step with upstream; a patch would edit code we do not own.
Subclassing relies on how those functions behave, though, so :func:`check_library` pins
libp2p 0.8.1 and a fingerprint (SHA-256 of the source) of every library function whose
behaviour the guard depends on; :meth:`P2PNode.open <p2p.host.P2PNode.open>` calls it and
refuses to start on a library that differs, rather than run unguarded.

Why a catch-all at the stream boundary: a stream is the unit of fault isolation, like a
request in an HTTP server. Failures that a remote peer can cause (``DecodeError``, libp2p's
parse and I/O errors, ``ValueError``/``KeyError``… from parsing its bytes) are charged to the
peer; any other exception is logged with its traceback at ERROR (it is probably our bug or the
library's) and resets the stream without charging the peer. ``trio.Cancelled`` is never
caught.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from google.protobuf.message import DecodeError
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.basic_host import BasicHost
from libp2p.network.connection.swarm_connection import SwarmConn
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore, issue_and_cache_local_record
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.stream_muxer.yamux.yamux import Yamux

from p2p.errors import LocalProtocolError, ShardnetError, short_id
from p2p.identity import is_valid_peer_id
from p2p.limits import ANY_STREAM, Offence, PeerLedger, Refusal, ResourceManager

log = logging.getLogger(__name__)

LIBP2P_VERSION = "0.8.1"

# SHA-256 (first 16 hex digits) of the source of each library function the guard relies on.
_FINGERPRINTS: dict[str, tuple[Callable[..., Any], str]] = {
    # registers self.stream_handler for the router's protocols; takes max_inbound_rpc_size
    "Pubsub.__init__": (Pubsub.__init__, "fc7e7f95ffc4b135"),
    # exceptions from parsing escape to stream_handler; publish entries go to push_msg tasks
    "Pubsub.continuously_read_stream": (Pubsub.continuously_read_stream, "ac0c4ad87ca39288"),
    "Pubsub.stream_handler": (Pubsub.stream_handler, "4be06aba2f448b7b"),
    # topic validators run before seen/cache/deliver/forward
    "Pubsub.push_msg": (Pubsub.push_msg, "1531483ab4d77674"),
    "Pubsub.validate_msg": (Pubsub.validate_msg, "9bc61633d2338dc5"),
    # every inbound stream goes through swarm.common_stream_handler, in the connection nursery
    "SwarmConn._handle_muxed_stream": (SwarmConn._handle_muxed_stream, "fb51f8a3e37c9800"),
    "BasicHost._swarm_stream_handler": (BasicHost._swarm_stream_handler, "cec985884b1ba269"),
    # p2p.peer_records: a record older (lower seq) than the held one is refused; the new
    # local record is cached and sent with every pubsub RPC after it
    "PeerStore.consume_peer_record": (PeerStore.consume_peer_record, "35e869e7ba6df92b"),
    "issue_and_cache_local_record": (issue_and_cache_local_record, "a4cc66ecd75b4900"),
    # p2p.whole_frames replaces it per connection: one secured_conn.write under _write_lock
    "Yamux._write_frame": (Yamux._write_frame, "16ff969cdd0d2b1b"),
}

PEER_FAULTS: tuple[type[BaseException], ...] = (
    DecodeError,
    BaseLibp2pError,
    ShardnetError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    UnicodeError,
    OverflowError,
    EOFError,
)
"""Exception types that a remote peer's bytes can provoke while the library parses them."""

MAX_TOPICS_PER_MESSAGE = 1
SIGNATURE_BYTES = 64
MAX_SEQNO_BYTES = 8
MAX_KEY_BYTES = 64


def _fingerprint(fn: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def check_library() -> None:
    """Check that the installed py-libp2p is the one the guard was written against.

    Raises:
        LocalProtocolError: another libp2p version, or a guarded function's source differs.
    """
    version = importlib.metadata.version("libp2p")
    if version != LIBP2P_VERSION:
        raise LocalProtocolError(
            f"p2p.boundary guards libp2p=={LIBP2P_VERSION}, found {version}: recheck the guard"
        )
    changed = [name for name, (fn, want) in _FINGERPRINTS.items() if _fingerprint(fn) != want]
    if changed:
        raise LocalProtocolError(
            f"libp2p functions differ from the guarded ones: {', '.join(changed)}"
        )


StreamHandler = Callable[[Any], Awaitable[None]]


async def reset_quietly(stream: Any) -> None:
    """Reset ``stream``, ignoring a stream that is already gone (bounded to 1 s)."""
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except (BaseLibp2pError, OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


async def close_quietly(stream: Any) -> None:
    """Close our side of ``stream``, ignoring a stream that is already gone (bounded to 1 s)."""
    with trio.move_on_after(1):
        try:
            await stream.close()
        except (BaseLibp2pError, OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


def stream_peer(stream: Any) -> str:
    """The base58 PeerID of the remote end of a libp2p stream."""
    return str(stream.muxed_conn.peer_id.to_base58())


class InboundGuard:
    """Admission, fault isolation and bans for inbound streams (see module docstring).

    Args:
        host: the py-libp2p host.
        resources: stream caps (scopes are set by the caller with ``set_limit``).
        ledger: misbehaviour scores and bans.
    """

    def __init__(self, host: Any, resources: ResourceManager, ledger: PeerLedger) -> None:
        self.host = host
        self.resources = resources
        self.ledger = ledger
        self.pubsub: Pubsub | None = None

    def install(self) -> None:
        """Wrap the swarm's common handler (every inbound stream, any protocol)."""
        network = self.host.get_network()
        network.set_stream_handler(self.wrap(ANY_STREAM, network.common_stream_handler))

    def wrap_protocol(self, protocol: str) -> None:
        """Wrap the handler registered on ``protocol`` (call after the library registered it)."""
        handlers = self.host.get_mux().handlers
        inner = handlers[protocol]
        self.host.set_stream_handler(protocol, self.wrap(protocol, inner, close_after=True))

    def wrap(self, scope: str, inner: StreamHandler, *, close_after: bool = False) -> StreamHandler:
        """A handler that admits the stream into ``scope``, runs ``inner``, isolates failures.

        ``close_after``: close the stream when ``inner`` returns (py-libp2p's pubsub handler
        returns on the remote's EOF without closing its own side, leaving it half-open).
        """

        async def guarded(stream: Any) -> None:
            peer = stream_peer(stream)
            now = trio.current_time()
            if self.ledger.is_banned(peer, now):
                await reset_quietly(stream)
                return
            ticket = self.resources.try_acquire(scope, peer)
            if isinstance(ticket, Refusal):
                log.info(
                    "stream_refused scope=%s peer=%s reason=%s", scope, short_id(peer), ticket.value
                )
                if ticket is Refusal.PEER_LIMIT:
                    await self.offend(peer, Offence.OVER_LIMIT, f"{scope} {ticket.value}", stream)
                else:
                    await reset_quietly(stream)
                return
            try:
                await inner(stream)
                if close_after:
                    await close_quietly(stream)
            except PEER_FAULTS as exc:
                await self.offend(peer, Offence.MALFORMED_FRAME, f"{scope} {exc!r}", stream)
            except Exception:
                log.exception("stream_handler_failed scope=%s peer=%s", scope, short_id(peer))
                await reset_quietly(stream)
            finally:
                self.resources.release(ticket)

        return guarded

    async def offend(self, peer: str, offence: Offence, detail: str, stream: Any = None) -> None:
        """Charge ``peer`` for ``offence`` and reset its ``stream`` (if given); on a new ban,
        close all its connections instead (<= 5 s), which ends the stream too."""
        if self._charge(peer, offence, detail):
            self._disconnect_soon(ID.from_base58(peer))
        if stream is not None:
            await reset_quietly(stream)

    def offend_soon(self, peer: str, offence: Offence, detail: str) -> None:
        """Synchronous form of :meth:`offend` for library callbacks (validators): a new ban
        closes the peer's connections from a task of the pubsub service."""
        if self._charge(peer, offence, detail):
            self._disconnect_soon(ID.from_base58(peer))

    def _charge(self, peer: str, offence: Offence, detail: str) -> bool:
        self.refresh_bans()
        log.warning(
            "peer_offence peer=%s offence=%s detail=%.200s", short_id(peer), offence.value, detail
        )
        if not self.ledger.offend(peer, offence, trio.current_time()):
            return False
        log.warning("peer_banned peer=%s duration_s=%.0f", short_id(peer), self.ledger.config.ban_s)
        if self.pubsub is not None:
            self.pubsub.blacklisted_peers.add(ID.from_base58(peer))
        return True

    def _disconnect_soon(self, pid: ID) -> None:
        # From a task of the pubsub service: the caller may run inside the very connection
        # that is being closed, and would be cancelled half-way.
        if self.pubsub is not None and self.pubsub.manager.is_running:
            self.pubsub.manager.run_task(self._disconnect, pid)

    async def _disconnect(self, pid: ID) -> None:
        with trio.move_on_after(5):
            try:
                await self.host.disconnect(pid)
            except (BaseLibp2pError, OSError) as exc:
                log.info("ban_disconnect_failed peer=%s error=%r", short_id(pid.to_base58()), exc)

    def refresh_bans(self) -> None:
        """Lift the pubsub blacklisting of peers whose ban has expired."""
        if self.pubsub is None:
            return
        now = trio.current_time()
        for pid in list(self.pubsub.blacklisted_peers):
            if not self.ledger.is_banned(pid.to_base58(), now):
                self.pubsub.blacklisted_peers.discard(pid)


def message_problem(msg: rpc_pb2.Message, max_data_bytes: int) -> str | None:
    """Why a received pubsub message is malformed before any crypto, or None if it is not."""
    if len(msg.topicIDs) != MAX_TOPICS_PER_MESSAGE:
        return f"{len(msg.topicIDs)} topics"
    if len(msg.data) > max_data_bytes:
        return f"data of {len(msg.data)} bytes"
    if len(msg.signature) != SIGNATURE_BYTES:
        return "no 64-byte signature"
    if len(msg.seqno) > MAX_SEQNO_BYTES or len(msg.key) > MAX_KEY_BYTES:
        return "oversized seqno or key"
    try:
        origin = ID(msg.from_id).to_base58()
    except PEER_FAULTS:
        return "unparseable from"
    if not is_valid_peer_id(origin):
        return "from is not an Ed25519 PeerID"
    return None


class GuardedPubsub(Pubsub):
    """py-libp2p's Pubsub with shape checks and fault containment in ``push_msg``.

    Args:
        host, router: as for ``Pubsub``.
        guard: the node's inbound guard (charges offences).
        max_data_bytes: largest gossip payload accepted, bytes.
    """

    def __init__(self, host: Any, router: Any, guard: InboundGuard, max_data_bytes: int) -> None:
        # An RPC frame may carry a few publish entries plus control; 4 payloads is ample.
        super().__init__(host, router, max_inbound_rpc_size=4 * max_data_bytes + 16 * 1024)
        self.guard = guard
        self.max_data_bytes = max_data_bytes
        guard.pubsub = self

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        """Check the message's shape, then let the library validate, deliver and forward it."""
        if msg_forwarder != self.my_id:
            problem = message_problem(msg, self.max_data_bytes)
            if problem is not None:
                self.guard.offend_soon(
                    msg_forwarder.to_base58(), Offence.INVALID_GOSSIP, f"malformed: {problem}"
                )
                return
        try:
            await super().push_msg(msg_forwarder, msg)
        except PEER_FAULTS as exc:
            self.guard.offend_soon(msg_forwarder.to_base58(), Offence.INVALID_GOSSIP, repr(exc))


GossipCheck = Callable[[str, bytes], None]
"""An application check of one gossip message: ``(origin PeerID, data)``; raises a
:class:`~p2p.errors.ShardnetError` to reject it."""


def topic_validator(
    topic: str, check: GossipCheck, guard: InboundGuard, my_id: ID
) -> Callable[[ID, rpc_pb2.Message], bool]:
    """Adapt ``check`` into a synchronous pubsub topic validator for ``topic``.

    A rejection charges the forwarder (:attr:`Offence.INVALID_GOSSIP`) unless it is this
    node. An unexpected exception in ``check`` is logged and rejects the message (fails
    closed).
    """

    def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            origin = ID(msg.from_id).to_base58()
            check(origin, bytes(msg.data))
        except ShardnetError as exc:
            if forwarder != my_id:
                guard.offend_soon(forwarder.to_base58(), Offence.INVALID_GOSSIP, f"{topic}: {exc}")
            return False
        except Exception:
            log.exception("gossip_validator_failed topic=%s", topic)
            return False
        return True

    return validate
