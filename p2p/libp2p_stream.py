"""A py-libp2p stream as a :class:`p2p.bytestream.ByteStream`: the stream lane's transport.

Theory of operation
-------------------
:class:`Libp2pByteStream` wraps one ``INetStream`` (yamux over Noise over TCP in shardnet) so
that the HTTP lane's server and client drive h11 over it exactly as over a TCP socket:
``receive_some`` reads at most ``max_bytes`` (yamux hands out what it has buffered, bounded by
its receive window of 256 KiB to 16 MiB per stream), ``b""`` at the remote's end of stream;
``send_all`` writes (yamux blocks on the remote's window, so a reader that stops reading
stalls the writer, whose own timeout then ends it); ``aclose`` closes gracefully for at most
:data:`CLOSE_TIMEOUT_S` and resets the stream if that fails. Every library error is
translated here into ``trio.BrokenResourceError`` (after :meth:`~Libp2pByteStream.aclose`:
``trio.ClosedResourceError``), the contract of :class:`~p2p.bytestream.ByteStream`.

:func:`open_lane_stream` opens such a stream to a peer *only over a connection the host
already holds* (the peer dialled us, or we dialled it): shardnet dials nothing it was not told
to (see :func:`p2p.connections.disable_auto_connect`), and a node behind a NAT is reachable
only over the connections it opened itself.
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectClientError

from p2p.boundary import reset_quietly
from p2p.bytestream import ByteStream
from p2p.errors import PeerUnreachable, RemoteProtocolError

__all__ = ["CLOSE_TIMEOUT_S", "Libp2pByteStream", "open_lane_stream"]

#: longest graceful close of a lane stream before it is reset, seconds
CLOSE_TIMEOUT_S = 1.0
_DEFAULT_READ_BYTES = 64 * 1024


class Libp2pByteStream:
    """One libp2p stream as a :class:`~p2p.bytestream.ByteStream` (see the module docstring).

    Not safe for concurrent sends or concurrent receives (as trio streams).
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to ``max_bytes`` bytes (64 KiB if None); ``b""`` once the remote closed.

        Raises:
            trio.BrokenResourceError: the stream was reset or its connection failed.
            trio.ClosedResourceError: after :meth:`aclose`.
        """
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        try:
            data = await self._stream.read(max_bytes or _DEFAULT_READ_BYTES)
        except StreamEOF:
            return b""
        except (BaseLibp2pError, OSError) as exc:
            raise trio.BrokenResourceError(f"libp2p stream: {exc!r}") from exc
        return bytes(data)

    async def send_all(self, data: bytes | memoryview) -> None:
        """Write all of ``data``.

        Raises:
            trio.BrokenResourceError: the stream was reset, closed by the remote for reading,
                or its connection failed.
            trio.ClosedResourceError: after :meth:`aclose`.
        """
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        try:
            await self._stream.write(bytes(data))
        except (BaseLibp2pError, OSError) as exc:
            raise trio.BrokenResourceError(f"libp2p stream: {exc!r}") from exc

    async def aclose(self) -> None:
        """Close gracefully (at most :data:`CLOSE_TIMEOUT_S`), else reset; idempotent."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    await self._stream.close()
                    return
                except (BaseLibp2pError, OSError, trio.BrokenResourceError):
                    pass
            await reset_quietly(self._stream)


async def open_lane_stream(host: Any, peer_id: str, protocol: str, timeout_s: float) -> ByteStream:
    """A new stream to ``peer_id`` on ``protocol`` over a connection ``host`` already holds.

    Args:
        host: the py-libp2p host.
        peer_id: base58 PeerID.
        protocol: the protocol id to negotiate (:data:`p2p.bytestream.STREAM_LANE_PROTOCOL`).
        timeout_s: bound on opening and negotiating, seconds.

    Raises:
        PeerUnreachable: no open connection to ``peer_id``, a malformed PeerID, or the stream
            could not be opened in time.
        RemoteProtocolError: ``peer_id`` does not speak ``protocol``.
    """
    source = f"p2p://{peer_id}"
    try:
        pid = ID.from_base58(peer_id)
    except ValueError as exc:
        raise PeerUnreachable(source, f"not a PeerID: {exc}") from exc
    if not host.get_network().get_connections(pid):
        raise PeerUnreachable(source, "no libp2p connection to this peer")
    try:
        with trio.fail_after(timeout_s):
            stream = await host.new_stream(pid, [TProtocol(protocol)])
    except trio.TooSlowError as exc:
        raise PeerUnreachable(source, f"stream not opened within {timeout_s}s") from exc
    except StreamFailure as exc:
        if isinstance(exc.__cause__, MultiselectClientError):  # negotiation refused
            raise RemoteProtocolError(source, f"does not speak {protocol}") from exc
        raise PeerUnreachable(source, f"stream not opened: {exc!r}") from exc
    except (BaseLibp2pError, OSError, trio.BrokenResourceError) as exc:
        raise PeerUnreachable(source, f"stream not opened: {exc!r}") from exc
    return Libp2pByteStream(stream)
