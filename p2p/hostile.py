"""A hostile libp2p client, for regression tests and the chaos bench: malformed frames on demand.

It is a bare py-libp2p host (its own identity, TCP + Noise + yamux, no pubsub) that connects to
a node and writes raw bytes on a negotiated stream of any protocol, so a test can send exactly
the frames a broken or malicious peer would: garbage protobuf on ``/meshsub/1.1.0``, a length
prefix far over any bound, a truncated frame, an over-long varint, structurally valid pubsub
RPCs with hostile fields, correctly signed gossip with a payload of the attacker's choice, and
streams that are opened and never finished. Use it only against nodes on 127.0.0.0/8 that the
test started itself.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.pb import rpc_pb2
from libp2p.utils.varint import encode_uvarint

from p2p.boundary import reset_quietly
from p2p.connections import disable_auto_connect
from p2p.identity import Identity

MESHSUB = "/meshsub/1.1.0"
_GONE = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
_PUBSUB_SIGNING_PREFIX = b"libp2p-pubsub:"


class Malformed(enum.Enum):
    """Kinds of malformed frames (the value names the kind in reports)."""

    GARBAGE = "garbage"  # a well-delimited frame whose body does not parse
    OVERSIZED_LENGTH = "oversized_length"  # a length prefix of 1 TiB, then a few bytes
    TRUNCATED = "truncated"  # a prefix announcing 100 bytes, 10 sent, then EOF
    OVERLONG_VARINT = "overlong_varint"  # an 11-byte varint (never terminates within 64 bits)
    HOSTILE_RPC = "hostile_rpc"  # valid pubsub protobuf, garbage PeerID/key/signature


def frame(kind: Malformed, topic: str = "t") -> bytes:
    """The bytes of one malformed frame of ``kind`` (``topic``: for HOSTILE_RPC)."""
    if kind is Malformed.GARBAGE:
        body = b"\xff\xff\xff\xff\x0f" + bytes(range(7, 40))
        return encode_uvarint(len(body)) + body
    if kind is Malformed.OVERSIZED_LENGTH:
        return encode_uvarint(1 << 40) + b"\x00" * 16
    if kind is Malformed.TRUNCATED:
        return encode_uvarint(100) + b"\x0a" * 10
    if kind is Malformed.OVERLONG_VARINT:
        return b"\xff" * 11
    msg = rpc_pb2.Message(
        from_id=b"\x00\x05junk!",
        data=b"x",
        seqno=b"\x01",
        topicIDs=[topic],
        signature=b"\x00" * 7,
        key=b"\x08\x01\x12\x03bad",
    )
    rpc = rpc_pb2.RPC(
        publish=[msg],
        subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic)],
    )
    body = rpc.SerializeToString()
    return encode_uvarint(len(body)) + body


class HostileClient:
    """A bare libp2p host that sends raw bytes (see module docstring). Use :meth:`open`."""

    def __init__(self, identity: Identity, host: Any) -> None:
        self.identity = identity
        self._host = host
        self._seqno = 0

    @classmethod
    @asynccontextmanager
    async def open(cls, identity: Identity | None = None) -> AsyncIterator[HostileClient]:
        """Start a host on 127.0.0.1 (a fresh identity unless one is given); close on exit."""
        ident = identity or Identity.generate()
        host = new_host(key_pair=ident.key_pair, muxer_preference="YAMUX")
        disable_auto_connect(host)
        listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with host.run(listen_addrs=listen):
            try:
                yield cls(ident, host)
            finally:
                with trio.move_on_after(5):
                    await host.close()

    async def connect(self, addr: str) -> str:
        """Dial ``addr`` (with ``/p2p/<PeerID>``); returns the PeerID."""
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        with trio.fail_after(10):
            await self._host.connect(info)
        return str(info.peer_id.to_base58())

    async def open_stream(self, peer_id: str, protocol: str) -> Any:
        """Open and negotiate a stream (the raw py-libp2p stream object)."""
        with trio.fail_after(10):
            return await self._host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])

    async def send(
        self, peer_id: str, protocol: str, data: bytes, *, hold: bool = False, wait_s: float = 10
    ) -> str:
        """Write ``data`` on a new stream and wait (at most ``wait_s``) until the node ends it.

        Args:
            hold: keep the stream open after writing (a half-sent request); otherwise close
                the writing side, as a peer that has finished sending does.

        Returns:
            how the stream ended: ``"reset"`` (the node reset it or refused it), ``"eof"``
            (the node closed it; the bytes read are discarded) or ``"open"`` (still open
            after ``wait_s``; it is then reset).
        """
        try:
            stream = await self.open_stream(peer_id, protocol)
        except _GONE:
            return "reset"
        try:
            await stream.write(data)
            if not hold:
                await stream.close()
        except _GONE:
            return "reset"
        return await self.wait_ended(stream, wait_s)

    async def wait_ended(self, stream: Any, wait_s: float = 10) -> str:
        """Read ``stream`` until the node ends it: ``"reset"``, ``"eof"`` or ``"open"`` (not
        within ``wait_s``; it is then reset). Bytes read are discarded."""
        with trio.move_on_after(wait_s):
            try:
                while await stream.read(65536):
                    pass
            except _GONE:
                return "reset"
            return "eof"
        await reset_quietly(stream)
        return "open"

    async def hold(self, peer_id: str, protocol: str, data: bytes) -> Any | None:
        """Open a stream, write ``data`` (e.g. half a request) and keep it open: the stream
        object, or None if the node refused it at once. It is reset when the client closes."""
        try:
            stream = await self.open_stream(peer_id, protocol)
            await stream.write(data)
        except _GONE:
            return None
        return stream

    def signed_publish(self, topic: str, data: bytes) -> bytes:
        """One length-prefixed pubsub RPC carrying ``data`` on ``topic``, correctly signed by
        this client's identity (valid to libp2p; the payload is whatever the caller wants)."""
        self._seqno += 1
        from_id = ID.from_base58(self.identity.peer_id).to_bytes()
        msg = rpc_pb2.Message(
            from_id=from_id, data=data, seqno=self._seqno.to_bytes(8, "big"), topicIDs=[topic]
        )
        payload = _PUBSUB_SIGNING_PREFIX + msg.SerializeToString()
        msg.signature = self.identity.key_pair.private_key.sign(payload)
        rpc = rpc_pb2.RPC(
            publish=[msg], subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic)]
        )
        body = rpc.SerializeToString()
        return bytes(encode_uvarint(len(body)) + body)
