"""Muxer frames are written whole: a cancelled stream never corrupts its connection.

Theory of operation
-------------------
py-libp2p 0.8.1's yamux writes each frame (a stream's data, a window update, a reset) with one
``secured_conn.write``: Noise encrypts it into one or more length-prefixed messages and writes
them to the TCP socket. When the socket's send buffer is full (a peer on a slow link, a relay
fanning out) that write waits, and a cancellation then (a download that completed cancels its
other requests: their reads send window updates, their server's writes send data) leaves a
message half written. Every later byte of the connection is garbage to the peer's Noise, which
closes the whole connection: every stream on it, and for a hole-punched connection the punch
itself (measured in the namespaced NAT test: each peer's punched connections closed within
30 ms of a version completing, and the peers punched again).

:func:`write_frames_whole` makes one muxer write each of its frames whole: it still waits for
the muxer's write lock cancellably, but the write itself is shielded from cancellation and
bounded by ``timeout_s``; a frame not written by then (the peer stopped reading) leaves the
connection unusable, so it is closed and :class:`RawConnError` raised, which the library
handles like a lost connection. A cancellation arrives at the next checkpoint after the frame.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.network.connection.exceptions import RawConnError
from libp2p.stream_muxer.yamux.yamux import Yamux

log = logging.getLogger(__name__)

__all__ = ["write_frames_whole"]


def write_frames_whole(muxer: Any, timeout_s: float) -> bool:
    """Make ``muxer`` (one connection's py-libp2p ``Yamux``) write each frame whole (module
    docstring), each bounded by ``timeout_s`` seconds. Only this muxer changes; idempotent.

    Returns:
        False if ``muxer`` is not a py-libp2p ``Yamux`` (left as it is), else True.
    """
    if not isinstance(muxer, Yamux):
        return False
    if "_write_frame" in vars(muxer):  # replaced on this instance already
        return True

    async def write_frame(data: bytes) -> None:
        async with muxer._write_lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(timeout_s) as late:
                    await muxer.secured_conn.write(data)
                if late.cancelled_caught:
                    log.info(
                        "muxer_frame_write_timeout peer=%s timeout_s=%.1f",
                        muxer.peer_id,
                        timeout_s,
                    )
                    with trio.move_on_after(1.0):
                        await muxer.secured_conn.close()
                    raise RawConnError(f"frame not written within {timeout_s}s")
        await trio.lowlevel.checkpoint()

    vars(muxer)["_write_frame"] = write_frame  # this instance only
    return True
