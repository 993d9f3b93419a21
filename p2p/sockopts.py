"""TCP options that let the kernel notice a dead peer, and aborting a stuck socket.

Theory of operation
-------------------
A connection whose path died silently (a NAT that lost its state) keeps its socket
``ESTABLISHED`` on both sides. Two kernel mechanisms end it without any help from the
application: ``TCP_USER_TIMEOUT`` (Linux, RFC 5482) aborts a connection whose sent data
stays unacknowledged for that long, and TCP keepalive probes (``SO_KEEPALIVE`` with
``TCP_KEEPIDLE``/``TCP_KEEPINTVL``/``TCP_KEEPCNT``) do the same for an idle one. Both lanes
set them on every connection (:func:`tune`); the libp2p lane also pings
(:mod:`p2p.keepalive`), which finds a dead connection sooner.

:func:`abort` closes a socket with ``SO_LINGER`` 0: the kernel sends RST and drops the send
queue at once, and trio wakes every task blocked on the socket (``ClosedResourceError``),
so a close that waits behind a full send buffer ends now instead of never.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from typing import Any

#: idle seconds before the first keepalive probe, seconds between probes, probes lost
KEEPIDLE_S = 15
KEEPINTVL_S = 5
KEEPCNT = 3


def tune(sock: Any, user_timeout_s: float) -> None:
    """Set ``SO_KEEPALIVE`` (probes after :data:`KEEPIDLE_S` idle, every
    :data:`KEEPINTVL_S`, :data:`KEEPCNT` lost ones end it) and, if ``user_timeout_s`` > 0,
    ``TCP_USER_TIMEOUT`` on a connected TCP socket (stdlib or trio). Options the platform
    lacks are skipped; a socket already closed is left alone.
    """
    opts: list[tuple[int, int, int]] = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPIDLE_S),
        ("TCP_KEEPINTVL", KEEPINTVL_S),
        ("TCP_KEEPCNT", KEEPCNT),
        ("TCP_USER_TIMEOUT", int(user_timeout_s * 1000)),
    ):
        if hasattr(socket, name) and value > 0:
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            return  # closed meanwhile (EBADF) or not TCP: nothing to tune


def abort(sock: Any) -> None:
    """Close a TCP socket at once with RST, dropping unsent data (``SO_LINGER`` 0).

    Safe on a socket already closed. Tasks blocked on a trio socket are woken with
    ``trio.ClosedResourceError``.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed: close() below is a no-op
    sock.close()


def unsent_bytes(sock: Any) -> int:
    """Bytes in a TCP socket's send queue, sent but unacknowledged included (``TIOCOUTQ``);
    0 for a closed socket."""
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", buf)[0])
