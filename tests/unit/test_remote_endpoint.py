"""remote_endpoint: where a direct connection comes from, read from its socket when
py-libp2p does not say (as for every IPv6 connection); never a relay's socket for a circuit."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from p2p.connections import remote_endpoint


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        yield client, accepted
        client.close()
        accepted.close()


def _conn(sock: socket.socket, transport: list[str]) -> Any:
    """A py-libp2p-shaped connection whose library address is unknown (None)."""
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    muxed = SimpleNamespace(
        get_remote_address=lambda: None,
        secured_conn=SimpleNamespace(conn=SimpleNamespace(stream=SimpleNamespace(stream=stream))),
    )
    return SimpleNamespace(muxed_conn=muxed, get_transport_addresses=lambda: transport)


def test_a_direct_connection_is_read_from_its_socket(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, accepted = tcp_pair
    conn = _conn(accepted, ["/ip4/127.0.0.1/tcp/1"])
    assert remote_endpoint(conn) == ("127.0.0.1", client.getsockname()[1])


def test_a_circuit_is_not_placed_at_its_relay(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    _, accepted = tcp_pair
    relayed = ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRelay/p2p-circuit"]
    assert remote_endpoint(_conn(accepted, relayed)) is None
