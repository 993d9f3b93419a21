"""A minimal STUN binding responder for the port-mapping lab (tests/deploy/test_portmap.py).

Debian's miniupnpd (2.3.1) refuses to map ports when its external interface has a private
address, as the lab's routers do (10.211.K.0/24 plays the internet), unless a STUN check
(RFC 5389 Binding, with RFC 5780's CHANGE-REQUEST variants) says that nothing in front of the
router filters inbound packets. This responder answers every Binding Request with the
sender's address and port (XOR-MAPPED-ADDRESS), from the address it was asked at, whatever
CHANGE-REQUEST says: the router then sees four answers, its own address unchanged, and enables
port forwarding with that address as its external one. Run on a host of the lab's bridge:
``python -m tests.deploy.stun HOST PORT``; prints ``stun_ready`` (stderr) once bound; runs
until killed.
"""

from __future__ import annotations

import socket
import struct
import sys

_MAGIC = 0x2112A442
_BINDING_REQUEST = 0x0001
_BINDING_RESPONSE = 0x0101
_XOR_MAPPED_ADDRESS = 0x0020


def answer(request: bytes, host: str, port: int) -> bytes | None:
    """The Binding success response to ``request`` from ``host:port`` (IPv4), or None if
    ``request`` is not a STUN Binding Request."""
    if len(request) < 20:
        return None
    kind, _length, magic = struct.unpack("!HHI", request[:8])
    if kind != _BINDING_REQUEST or magic != _MAGIC:
        return None
    ip = struct.unpack("!I", socket.inet_aton(host))[0]
    attr = struct.pack("!HHBBHI", _XOR_MAPPED_ADDRESS, 8, 0, 1, port ^ (_MAGIC >> 16), ip ^ _MAGIC)
    return struct.pack("!HHI", _BINDING_RESPONSE, len(attr), _MAGIC) + request[8:20] + attr


def main() -> None:
    """Serve on ``argv[1]:argv[2]`` (UDP) until killed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((sys.argv[1], int(sys.argv[2])))
    print("stun_ready", file=sys.stderr, flush=True)
    while True:
        data, (host, port) = sock.recvfrom(2048)
        reply = answer(data, host, port)
        if reply is not None:
            sock.sendto(reply, (host, port))


if __name__ == "__main__":
    main()
