"""One-shot request/response streams of a libp2p host: one request in, one response out.

Theory of operation
-------------------
A request protocol (``/shardnet/info/1.0.0`` and the like) runs on a new stream per request:
the caller writes one varint-length-prefixed request and reads one length-prefixed response
(py-libp2p's ``RequestResponse`` helper on the calling side, the same framing read and written
here on the serving side). :class:`RequestStreams` is that half of :class:`p2p.host.P2PNode`:

- **serving** (:meth:`RequestStreams.serve`): each inbound stream passes the host's
  :class:`~p2p.boundary.InboundGuard` (per-peer and per-protocol caps) first; its request body
  must then arrive within ``limits.request_read_timeout_s`` of this node's *own* time
  (:class:`~p2p.loop_lag.BodyDeadlines`: the host's watch task cancels a read that is overdue
  once this node's event-loop lateness is taken off, so an overloaded node does not blame its
  peers); a body over its bound, or one not sent in time, resets the stream and charges the
  sender (:class:`~p2p.limits.Offence`). The handler and the response get ``timeout_s``; a
  :class:`~p2p.errors.ShardnetError` from the handler resets the stream, and a
  :class:`~p2p.errors.RemoteProtocolError` (the caller's fault) charges the caller.
- **calling** (:meth:`RequestStreams.request`): library exceptions become :mod:`p2p.errors`
  types, once, here; each answer or timeout is told to the keepalive (``observe``), so that a
  connection whose requests keep timing out is found dead (:mod:`p2p.keepalive`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
from libp2p.io.exceptions import MessageTooLarge as LibMessageTooLarge
from libp2p.io.msgio import VarIntLengthMsgReadWriter
from libp2p.peer.id import ID
from libp2p.request_response import (
    BytesCodec,
    MessageTooLargeError,
    ProtocolNotSupportedError,
    RequestResponse,
    RequestResponseConfig,
    RequestResponseError,
    RequestTimeoutError,
)

from p2p.boundary import InboundGuard, reset_quietly, stream_peer
from p2p.errors import (
    LocalProtocolError,
    MessageTooLarge,
    NotHeld,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    short_id,
)
from p2p.keepalive import Outcome
from p2p.limits import Offence, ResourceLimits, ScopeLimit
from p2p.loop_lag import BodyDeadlines

# the host's request and response events keep the logger they had before this module
log = logging.getLogger("p2p.host")

__all__ = ["Handler", "RequestStreams"]

Handler = Callable[[str, bytes], Awaitable[bytes]]
"""``handler(sender_peer_id, request_bytes) -> response_bytes`` of a request protocol."""

#: longest graceful close of a stream after its response was written, seconds
_CLOSE_S = 1.0


class RequestStreams:
    """The request/response half of a host (module docstring).

    Args:
        host: the py-libp2p host (its stream handlers are set here).
        guard: the host's inbound guard: stream caps, offences charged to senders.
        bodies: deadlines of request bodies in this node's own time, cancelled by the host's
            watch task when overdue.
        limits: the host's stream caps (``requests_per_peer``).
        observe: told of each request's answer or timeout, by PeerID (the keepalive).
        connected: the PeerIDs this host holds connections to now.
    """

    def __init__(
        self,
        host: Any,
        guard: InboundGuard,
        bodies: BodyDeadlines,
        limits: ResourceLimits,
        observe: Callable[[str, Outcome], None],
        connected: Callable[[], list[str]],
    ) -> None:
        self._host = host
        self._guard = guard
        self._rr = RequestResponse(host)  # py-libp2p's helper for the calling side
        self._bodies = bodies
        self._limits = limits
        self._observe = observe
        self._connected = connected

    def serve(
        self,
        protocol: str,
        handler: Handler,
        *,
        max_request_bytes: int,
        max_response_bytes: int,
        timeout_s: float,
        max_concurrent: int = 64,
    ) -> None:
        """Register ``handler(peer_id, request_bytes) -> response_bytes`` on ``protocol``.

        Admission: at most ``max_concurrent`` requests run at once on ``protocol``, and at most
        ``limits.requests_per_peer`` of them from one peer; a stream over either cap is reset
        at once (the caller sees ``StreamBroken``). The request body (at most
        ``max_request_bytes``, else refused before the handler runs) must arrive within
        ``limits.request_read_timeout_s`` of this node's own time (module docstring); the
        handler and the response (at most ``max_response_bytes``) then get ``timeout_s``
        seconds. A handler that raises a :class:`ShardnetError` resets the stream (the caller
        sees ``StreamBroken``); the error is logged with the caller's short PeerID (at
        WARNING; at INFO for :class:`NotHeld`, which blames nobody), and a
        :class:`RemoteProtocolError` (the caller's fault) lowers the caller's score.
        """
        self._guard.resources.set_limit(
            protocol,
            ScopeLimit(min(self._limits.requests_per_peer, max_concurrent), max_concurrent),
        )

        async def inbound(stream: Any) -> None:
            sender = stream_peer(stream)
            request = await self._read_request(stream, sender, protocol, max_request_bytes)
            if request is not None:
                await self._answer(
                    stream, sender, protocol, handler, request, max_response_bytes, timeout_s
                )

        self._host.set_stream_handler(TProtocol(protocol), self._guard.wrap(protocol, inbound))

    async def _read_request(
        self, stream: Any, sender: str, protocol: str, max_request_bytes: int
    ) -> bytes | None:
        """The request body of an inbound ``stream``, or None when it was refused: oversize,
        lost, or not sent in time (the stream is then reset and the sender charged where it
        is at fault; see :meth:`serve`)."""
        guard = self._guard
        bodies = self._bodies
        started = trio.current_time()
        # Cancelled by the host's watch task once overdue in this node's own time; the
        # deadline is the backstop should that task not run.
        with trio.CancelScope(deadline=started + bodies.max_factor * bodies.timeout_s) as reading:
            bodies.begin(reading, started)
            try:
                request = await VarIntLengthMsgReadWriter(stream, max_request_bytes).read_msg()
            except LibMessageTooLarge:
                await guard.offend(sender, Offence.MALFORMED_FRAME, f"{protocol} oversize", stream)
                return None
            except IOException:
                await reset_quietly(stream)  # closed or reset by the caller: its loss
                return None
            finally:
                own_s = bodies.own_time(reading, trio.current_time())
                bodies.end(reading)
        if reading.cancelled_caught:
            wall_s = trio.current_time() - started
            await guard.offend(
                sender,
                Offence.SLOW_REQUEST,
                f"{protocol} body not sent in {own_s:.1f}s of own time ({wall_s:.1f}s wall)",
                stream,
            )
            return None
        return request

    async def _answer(
        self,
        stream: Any,
        sender: str,
        protocol: str,
        handler: Handler,
        request: bytes,
        max_response_bytes: int,
        timeout_s: float,
    ) -> None:
        """Run ``handler`` on ``request`` and write its response on ``stream`` within
        ``timeout_s`` seconds, then close the stream; reset it on a refusal or a timeout
        (see :meth:`serve`)."""
        with trio.move_on_after(timeout_s) as handling:
            try:
                response = await handler(sender, request)
                if len(response) > max_response_bytes:
                    raise LocalProtocolError(
                        f"{protocol} response of {len(response)} bytes over {max_response_bytes}"
                    )
                await VarIntLengthMsgReadWriter(stream, max_response_bytes).write_msg(response)
            except ShardnetError as exc:
                log.log(
                    logging.INFO if isinstance(exc, NotHeld) else logging.WARNING,
                    "request_refused protocol=%s peer=%s error=%s",
                    protocol,
                    short_id(sender),
                    exc,
                )
                if isinstance(exc, RemoteProtocolError):
                    await self._guard.offend(sender, Offence.BAD_REQUEST, f"{protocol}: {exc}")
                await reset_quietly(stream)
                return
            except IOException:
                await reset_quietly(stream)
                return
        if handling.cancelled_caught:
            log.warning(
                "request_timed_out protocol=%s peer=%s timeout_s=%s",
                protocol,
                short_id(sender),
                timeout_s,
            )
            await reset_quietly(stream)
            return
        with trio.move_on_after(_CLOSE_S):
            try:
                await stream.close()
            except IOException:
                pass

    async def request(
        self,
        peer_id: str,
        protocol: str,
        payload: bytes,
        *,
        max_response_bytes: int,
        timeout_s: float,
    ) -> bytes:
        """Send one request on a new stream to ``peer_id`` and return the response bytes
        (at most ``max_response_bytes``) within ``timeout_s`` seconds.

        Raises:
            PeerUnreachable: no connection could be opened.
            StreamBroken: the stream was reset, closed early or timed out.
            MessageTooLarge: the response exceeded ``max_response_bytes``.
            RemoteProtocolError: the peer does not speak ``protocol``.
        """
        cfg = RequestResponseConfig(
            timeout=timeout_s,
            max_request_size=max(len(payload), 1),
            max_response_size=max_response_bytes,
        )
        try:
            codec: Any = BytesCodec()
            response = bytes(
                await self._rr.send_request(
                    ID.from_base58(peer_id), [TProtocol(protocol)], payload, codec, cfg
                )
            )
            self._observe(peer_id, Outcome.REQUEST_ANSWERED)
            return response
        except RequestTimeoutError as exc:
            self._observe(peer_id, Outcome.REQUEST_TIMEOUT)
            raise StreamBroken(peer_id, f"{protocol} timed out after {timeout_s}s") from exc
        except MessageTooLargeError as exc:
            raise MessageTooLarge(
                peer_id, f"{protocol} response over {max_response_bytes} bytes"
            ) from exc
        except ProtocolNotSupportedError as exc:
            raise RemoteProtocolError(peer_id, f"does not speak {protocol}") from exc
        except RequestResponseError as exc:
            if peer_id not in self._connected():
                raise PeerUnreachable(peer_id, f"{protocol}: {exc}") from exc
            raise StreamBroken(peer_id, f"{protocol}: {exc}") from exc
