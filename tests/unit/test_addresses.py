"""Advertised vs bound addresses (p2p.addresses): pure rules, and the bind probe on loopback."""

from __future__ import annotations

import socket

import pytest

from p2p.addresses import (
    Interfaces,
    advertised_multiaddrs,
    advertised_url,
    check_advertised_families,
    check_http_url,
    check_multiaddr_text,
    check_public_host,
    default_http_host,
    default_listen,
    ensure_bindable,
    ensure_listen_bindable,
    interface_addresses,
)
from p2p.errors import ConfigError

IFACES = Interfaces(ipv4=("10.1.0.2", "192.0.2.7", "127.0.0.1"), ipv6=("2001:db8::5", "::1"))


def test_unspecified_is_expanded_loopback_last_and_never_advertised() -> None:
    got = advertised_multiaddrs(["/ip4/0.0.0.0/tcp/4001"], [], IFACES)
    assert got == ["/ip4/10.1.0.2/tcp/4001", "/ip4/192.0.2.7/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]
    got6 = advertised_multiaddrs(["/ip6/::/tcp/4001"], [], IFACES)
    assert got6 == ["/ip6/2001:db8::5/tcp/4001", "/ip6/::1/tcp/4001"]
    assert all("0.0.0.0" not in a for a in got)


def test_specific_bind_is_advertised_as_is() -> None:
    assert advertised_multiaddrs(["/ip4/192.0.2.7/tcp/4002"], [], IFACES) == [
        "/ip4/192.0.2.7/tcp/4002"
    ]


def test_announce_replaces_everything() -> None:
    ann = ["/dns/relay.example.org/tcp/4002", "/ip4/203.0.113.9/tcp/4002"]
    assert advertised_multiaddrs(["/ip4/0.0.0.0/tcp/4002"], ann, IFACES, "x.org") == ann


def test_public_host_keeps_the_bound_ports() -> None:
    got = advertised_multiaddrs(
        ["/ip4/0.0.0.0/tcp/4002", "/ip4/0.0.0.0/tcp/4003"], [], IFACES, "203.0.113.9"
    )
    assert got == ["/ip4/203.0.113.9/tcp/4002", "/ip4/203.0.113.9/tcp/4003"]
    assert advertised_multiaddrs(["/ip4/0.0.0.0/tcp/1"], [], IFACES, "relay.example.org") == [
        "/dns/relay.example.org/tcp/1"
    ]


def test_http_url_rules() -> None:
    assert advertised_url("0.0.0.0", 8002, None, IFACES) == "http://10.1.0.2:8002"
    assert advertised_url("::", 8002, None, IFACES) == "http://[2001:db8::5]:8002"
    assert advertised_url("127.0.0.1", 9, None, IFACES) == "http://127.0.0.1:9"
    assert advertised_url("0.0.0.0", 9, "http://cdn.example.org:80", IFACES) == (
        "http://cdn.example.org:80"
    )
    assert advertised_url("0.0.0.0", 9, None, IFACES, "203.0.113.9") == "http://203.0.113.9:9"
    # a host with loopback only still advertises something dialable locally
    assert advertised_url("0.0.0.0", 9, None, Interfaces(("127.0.0.1",))) == "http://127.0.0.1:9"


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        "/ip4/0.0.0.0/tcp/4001",
        "/ip4/1.2.3.4/udp/4001",
        "/ip4/1.2.3/tcp/4001",
        "/ip6/1.2.3.4/tcp/4001",
        "/ip4/1.2.3.4/tcp/0",
        "/ip4/1.2.3.4/tcp/70000",
        "/ip4/1.2.3.4/tcp/1/ws",
        "/dns//tcp/1",
    ],
)
def test_bad_announce_multiaddrs(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_multiaddr_text(bad, "announce")
    assert info.value.field == "announce"


@pytest.mark.parametrize(
    "good", ["/ip4/1.2.3.4/tcp/4001", "/ip6/2001:db8::1/tcp/1", "/dns4/a.b/tcp/2/p2p/Qm"]
)
def test_good_announce_multiaddrs(good: str) -> None:
    assert check_multiaddr_text(good, "announce") == good


@pytest.mark.parametrize(
    "bad", ["ftp://a:1", "http://a", "http://a:1/path", "http://0.0.0.0:1", "http://a:99999"]
)
def test_bad_public_urls(bad: str) -> None:
    with pytest.raises(ConfigError):
        check_http_url(bad, "public_url")


def test_public_host_names() -> None:
    assert check_public_host("relay-1.example.org", "public_host") == "relay-1.example.org"
    assert check_public_host("[2001:db8::1]", "public_host") == "2001:db8::1"
    for bad in ("", "0.0.0.0", "::", "a b", "-x"):
        with pytest.raises(ConfigError):
            check_public_host(bad, "public_host")


def test_bind_probe_sees_a_reuseport_holder() -> None:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} \\(libp2p\\) is already in use"):
            ensure_bindable("127.0.0.1", port, "listen", "libp2p")
    ensure_bindable("127.0.0.1", 0, "listen", "libp2p")  # port 0: always fine


def test_bind_probe_names_foreign_addresses() -> None:
    with pytest.raises(ConfigError, match="not an address of this host"):
        ensure_bindable("192.0.2.200", 4001, "listen", "libp2p")  # TEST-NET-1, never local


def test_bind_probe_names_foreign_addresses_on_port_0() -> None:
    # port 0 (a peer's default) must not skip the check: the lane would die with a traceback
    with pytest.raises(ConfigError, match="not an address of this host") as err:
        ensure_bindable("192.0.2.200", 0, "http_port", "HTTP lane", "http_host")
    assert err.value.field == "http_host"
    with pytest.raises(ConfigError, match="not an address of this host"):
        ensure_listen_bindable(["/ip4/192.0.2.200/tcp/0"])


def test_interface_addresses_have_loopback_last() -> None:
    ifs = interface_addresses()
    assert "127.0.0.1" in ifs.ipv4
    assert ifs.ipv4[-1] == "127.0.0.1"


V4_ONLY = Interfaces(ipv4=("10.1.0.2", "127.0.0.1"), ipv6=("fe80::1", "::1"))


def test_default_listen_adds_ipv6_where_the_host_has_it_or_advertises_it() -> None:
    assert default_listen(4001, V4_ONLY) == ("/ip4/0.0.0.0/tcp/4001",)  # link-local, loopback
    both = ("/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001")
    assert default_listen(4001, IFACES) == both  # 2001:db8::5 is routable
    assert default_listen(4001, Interfaces(("127.0.0.1",), ("fd77::2",))) == both  # ULA
    assert default_listen(4001, V4_ONLY, "fd77::2") == ("/ip6/::/tcp/4001",)
    assert default_listen(4001, V4_ONLY, "203.0.113.5") == ("/ip4/0.0.0.0/tcp/4001",)
    assert default_listen(4001, V4_ONLY, "relay.example.org") == ("/ip4/0.0.0.0/tcp/4001",)
    assert default_listen(0, V4_ONLY, None, ["/ip6/fd77::2/tcp/4001"]) == ("/ip6/::/tcp/0",)
    mixed = ["/ip6/fd77::2/tcp/4001", "/ip4/203.0.113.5/tcp/4001"]
    assert default_listen(4001, V4_ONLY, None, mixed) == both


def test_default_http_host_follows_the_advertised_family() -> None:
    assert default_http_host(None, None) == "0.0.0.0"
    assert default_http_host("fd77::2", None) == "::"
    assert default_http_host("[fd77::2]", None) == "::"
    assert default_http_host("203.0.113.5", None) == "0.0.0.0"
    assert default_http_host("fd77::2", "http://203.0.113.5:8002") == "0.0.0.0"  # URL wins
    assert default_http_host(None, "http://[fd77::2]:8002") == "::"
    assert default_http_host("relay.example.org", None) == "0.0.0.0"
    # no host named: an IPv6-only host binds :: (its lane then advertises its IPv6 address);
    # a dual-stack one keeps IPv4, which its followers may be limited to
    v6_only = Interfaces(("127.0.0.1",), ("fd77::3", "::1"))
    dual = Interfaces(("192.0.2.7", "127.0.0.1"), ("fd77::3", "::1"))
    v4_only = Interfaces(("192.0.2.7", "127.0.0.1"), ("::1",))
    assert default_http_host(None, None, v6_only) == "::"
    assert default_http_host(None, None, dual) == "0.0.0.0"
    assert default_http_host(None, None, v4_only) == "0.0.0.0"
    assert default_http_host("203.0.113.5", None, v6_only) == "0.0.0.0"  # named: its family
    assert advertised_url("::", 8003, None, v6_only) == "http://[fd77::3]:8003"


def test_public_host_advertises_the_listener_of_its_own_family() -> None:
    bound = ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4009"]
    assert advertised_multiaddrs(bound, [], IFACES, "fd77::2") == ["/ip6/fd77::2/tcp/4009"]
    assert advertised_multiaddrs(bound, [], IFACES, "203.0.113.5") == ["/ip4/203.0.113.5/tcp/4001"]
    assert advertised_multiaddrs(bound, [], IFACES, "relay.example.org") == [
        "/dns/relay.example.org/tcp/4001",
        "/dns/relay.example.org/tcp/4009",
    ]
    # "::" accepts IPv4 too: an IPv4 public host on an IPv6-only listener keeps its port
    assert advertised_multiaddrs(["/ip6/::/tcp/4009"], [], IFACES, "203.0.113.5") == [
        "/ip4/203.0.113.5/tcp/4009"
    ]


@pytest.mark.parametrize(
    ("listen", "announce", "public_host", "http_host", "public_url", "field"),
    [
        (["/ip4/0.0.0.0/tcp/4001"], [], "fd77::2", "::", None, "public_host"),
        (["/ip6/::/tcp/4001"], [], "fd77::2", "0.0.0.0", None, "public_host"),
        (["/ip4/0.0.0.0/tcp/4001"], ["/ip6/fd77::2/tcp/4001"], None, "::", None, "announce"),
        (["/ip6/::1/tcp/4001"], ["/ip4/203.0.113.5/tcp/4001"], None, "::", None, "announce"),
        (["/ip6/::/tcp/4001"], [], None, "0.0.0.0", "http://[fd77::2]:8001", "public_url"),
        (["/ip4/0.0.0.0/tcp/4001"], [], None, "::1", "http://203.0.113.5:8001", "public_url"),
    ],
)
def test_advertising_a_family_nothing_binds_is_refused(
    listen: list[str],
    announce: list[str],
    public_host: str | None,
    http_host: str,
    public_url: str | None,
    field: str,
) -> None:
    with pytest.raises(ConfigError) as err:
        check_advertised_families(listen, announce, public_host, http_host, public_url)
    assert err.value.field == field
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("listen", "announce", "public_host", "http_host", "public_url"),
    [
        (["/ip6/::/tcp/4001"], [], "fd77::2", "::", None),
        (["/ip6/::/tcp/4001"], [], "203.0.113.5", "::", None),  # "::" takes IPv4 too
        (["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"], [], "fd77::2", "::", None),
        (["/ip4/0.0.0.0/tcp/4001"], [], "relay.example.org", "0.0.0.0", None),  # DNS: unchecked
        (["/ip4/0.0.0.0/tcp/4001"], [], "203.0.113.5", "0.0.0.0", None),
        (["/ip6/::/tcp/4001"], ["/ip6/fd77::2/tcp/4001"], "fd77::2", "0.0.0.0", "http://h:1"),
    ],
)
def test_advertising_a_bound_family_is_accepted(
    listen: list[str],
    announce: list[str],
    public_host: str | None,
    http_host: str,
    public_url: str | None,
) -> None:
    check_advertised_families(listen, announce, public_host, http_host, public_url)
