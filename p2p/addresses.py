"""Addresses a node advertises, as opposed to the addresses it binds.

Theory of operation
-------------------
A node binds its libp2p listener and its HTTP lane to local addresses (``--listen``,
``--http-host``/``--http-port``) and tells other nodes where to reach it (its ``shardnet-ready``
line, its info record, node adverts, the trainer's announcements). The two differ as soon as a
node is bound to an unspecified address (``0.0.0.0``, ``::``) or sits behind NAT or a load
balancer. The rules here follow go-libp2p's ``AddrsFactory``/kubo's ``Addresses.Announce``:

1. explicit announce addresses (``--announce`` multiaddrs, ``--public-url`` for the HTTP lane,
   or ``--public-host`` for both) replace everything else;
2. otherwise each bound address is advertised as is, except an unspecified one, which is
   expanded into this host's interface addresses of the same family and port, loopback last
   (so a node reachable from other hosts never advertises only ``127.0.0.1``);
3. an unspecified address is never advertised.

Which families a node binds by default (:func:`default_listen`, :func:`default_http_host`):
IPv4 always; IPv6 too where this host has a routable IPv6 address (global or ULA) or where
the node advertises an IPv6 address (an IPv6 ``--public-host`` or an ``/ip6/`` announce). The
HTTP lane has one listener: ``::`` where it advertises IPv6 or the host has no IPv4 address
but loopback, else ``0.0.0.0``.
An IPv6 listener binds ``::`` without ``IPV6_V6ONLY`` (py-libp2p and the HTTP lane leave the
Linux default), so it accepts IPv4 too. Advertising a family that no listener binds is an
operator error (:func:`check_advertised_families`), never a silent "connection refused".

Everything but :func:`interface_addresses` is pure.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from p2p.errors import ConfigError

_UNSPECIFIED = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True)
class Interfaces:
    """This host's interface addresses (numeric strings), per family.

    Attributes:
        ipv4: IPv4 addresses, loopback included.
        ipv6: IPv6 addresses without scope (link-local ones are left out), loopback included.
    """

    ipv4: tuple[str, ...]
    ipv6: tuple[str, ...] = ()


def interface_addresses() -> Interfaces:
    """Read this host's interface addresses (psutil), loopback last in each family."""
    import psutil

    v4: list[str] = []
    v6: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET:
                v4.append(a.address)
            elif a.family == socket.AF_INET6 and "%" not in a.address:
                ip6 = ipaddress.IPv6Address(a.address)
                if not ip6.is_link_local:
                    v6.append(a.address)
    return Interfaces(_loopback_last(v4), _loopback_last(v6))


def interface_subnets() -> tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...]:
    """Read this host's interface addresses with their prefix lengths (psutil), from each
    netmask (``192.168.77.2`` with ``255.255.255.0`` gives ``192.168.77.2/24``); IPv6
    link-local ones (with a scope) left out, as in :func:`interface_addresses`."""
    import psutil

    out: list[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or "%" in a.address:
                continue
            ip = ipaddress.ip_address(a.address)
            bits: int = ip.max_prefixlen
            if a.netmask:
                bits = bin(int(ipaddress.ip_address(a.netmask))).count("1")
            out.append(ipaddress.ip_interface(f"{ip}/{bits}"))
    return tuple(dict.fromkeys(out))


def _loopback_last(addrs: Iterable[str]) -> tuple[str, ...]:
    uniq = list(dict.fromkeys(addrs))
    return tuple(sorted(uniq, key=lambda a: ipaddress.ip_address(a).is_loopback))


def is_unspecified(host: str) -> bool:
    """True for ``0.0.0.0``, ``::`` and the empty host (all mean "every interface")."""
    return host in _UNSPECIFIED or host == ""


def check_multiaddr_text(text: str, option: str) -> str:
    """Check that ``text`` is a dialable TCP multiaddr (``/ip4|ip6|dns*/…/tcp/PORT[/p2p/ID]``).

    Returns:
        ``text`` unchanged.

    Raises:
        ConfigError: naming ``option``, if it is not such a multiaddr or names an unspecified
            address or port 0.
    """
    parts = text.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[3] != "tcp":
        raise ConfigError(option, f"{text!r} is not a multiaddr like /ip4/1.2.3.4/tcp/4001")
    proto, host, port = parts[1], parts[2], parts[4]
    if proto not in ("ip4", "ip6", "dns", "dns4", "dns6"):
        raise ConfigError(option, f"{text!r}: {proto!r} is not ip4, ip6, dns, dns4 or dns6")
    if proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(option, f"{text!r}: {host!r} is not an IP address") from None
        if (proto == "ip4") != (ip.version == 4):
            raise ConfigError(option, f"{text!r}: {host!r} is not an {proto} address")
        if ip.is_unspecified:
            raise ConfigError(option, f"{text!r}: an unspecified address cannot be dialled")
    elif not host:
        raise ConfigError(option, f"{text!r}: empty host name")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(option, f"{text!r}: port must be 1..65535")
    rest = parts[5:]
    if rest and not (len(rest) == 2 and rest[0] == "p2p" and rest[1]):
        raise ConfigError(option, f"{text!r}: only /p2p/<PeerID> may follow the port")
    return text


def check_http_url(text: str, option: str, *, base_path: bool = False) -> str:
    """Check an HTTP URL other hosts dial.

    Args:
        text: the URL.
        option: the setting named in errors.
        base_path: False for an advertised HTTP lane URL (``http://HOST:PORT``, no path, port
            required); True for a base URL such as a static mirror's
            (``http://HOST[:PORT][/PATH]``, port 80 by default).

    Returns:
        the URL without a trailing ``/``.

    Raises:
        ConfigError: naming ``option``.
    """
    shape = "http://HOST[:PORT][/PATH]" if base_path else "http://HOST:PORT"
    try:
        u = urlsplit(text)
        port = u.port
    except ValueError as exc:
        raise ConfigError(option, f"{text!r} is not a URL: {exc}") from None
    if u.scheme != "http" or not u.hostname:
        raise ConfigError(option, f"{text!r} is not an {shape} URL")
    if u.query or u.fragment or u.username or u.password:
        raise ConfigError(option, f"{text!r}: an {shape} URL takes no query, fragment or user")
    if not base_path and u.path not in ("", "/"):
        raise ConfigError(option, f"{text!r}: the HTTP lane URL takes no path")
    if is_unspecified(u.hostname):
        raise ConfigError(option, f"{text!r}: an unspecified address cannot be dialled")
    if port is None and not base_path:
        raise ConfigError(option, f"{text!r}: give the port (http://HOST:PORT)")
    return text.rstrip("/")


def check_public_host(text: str, option: str) -> str:
    """Check a host name or IP address to advertise (``--public-host``).

    Raises:
        ConfigError: naming ``option``, for an empty, unspecified or malformed host.
    """
    host = text.strip("[]")
    if not host or is_unspecified(host):
        raise ConfigError(option, f"{text!r}: give an address other hosts can dial")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-.")
        if not set(host.lower()) <= allowed or host.startswith(("-", ".")):
            raise ConfigError(
                option, f"{text!r} is neither an IP address nor a host name"
            ) from None
    return host


def host_multiaddr(host: str, port: int) -> str:
    """``/ip4|ip6|dns/HOST/tcp/PORT`` for a numeric address or a DNS name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{ip.version}/{host}/tcp/{port}"


def host_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (IPv6 bracketed)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def ip_family(host: str) -> int | None:
    """4 or 6 for a numeric address (brackets allowed), None for a DNS name."""
    try:
        return ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        return None


def has_routable_ipv6(interfaces: Interfaces) -> bool:
    """True if this host has an IPv6 address other hosts could reach (not loopback,
    link-local or unspecified): a global or a unique local (ULA, ``fc00::/7``) one."""
    for a in interfaces.ipv6:
        ip = ipaddress.IPv6Address(a)
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            return True
    return False


def _advertised_families(announce: Iterable[str], public_host: str | None) -> set[int]:
    """Families named by numeric announce multiaddrs and a numeric public host."""
    fams: set[int] = set()
    for a in announce:
        proto = a.split("/")[1] if a.count("/") > 1 else ""
        if proto in ("ip4", "ip6"):
            fams.add(int(proto[2]))
    if public_host is not None and (f := ip_family(public_host)) is not None:
        fams.add(f)
    return fams


def default_listen(
    port: int,
    interfaces: Interfaces,
    public_host: str | None = None,
    announce: Iterable[str] = (),
) -> tuple[str, ...]:
    """The libp2p listen multiaddrs of a node given no ``--listen``.

    Args:
        port: the role's port (0: any free port, chosen per listener).
        interfaces: this host's addresses (:func:`interface_addresses`).
        public_host: the advertised host, if any.
        announce: the explicit announce multiaddrs, if any.

    Returns:
        ``/ip4/0.0.0.0/tcp/PORT`` unless only IPv6 is advertised, then
        ``/ip6/::/tcp/PORT`` where IPv6 is advertised or this host has a routable IPv6
        address (:func:`has_routable_ipv6`).
    """
    fams = _advertised_families(announce, public_host)
    out: list[str] = []
    if fams != {6}:
        out.append(f"/ip4/0.0.0.0/tcp/{port}")
    if 6 in fams or has_routable_ipv6(interfaces):
        out.append(f"/ip6/::/tcp/{port}")
    return tuple(out)


def default_http_host(
    public_host: str | None, public_url: str | None, interfaces: Interfaces | None = None
) -> str:
    """The HTTP lane's bind address given no ``--http-host``: ``::`` (both families) when
    the advertised lane host is an IPv6 address, or when none is named and this host has a
    routable IPv6 address but no IPv4 one other than loopback (an IPv6-only host: bound to
    ``0.0.0.0`` its lane advertised ``http://127.0.0.1:PORT``); else ``0.0.0.0``."""
    host = public_host
    if public_url:
        host = urlsplit(public_url).hostname
    if host is not None:
        return "::" if ip_family(host) == 6 else "0.0.0.0"
    if interfaces is not None and has_routable_ipv6(interfaces):
        if all(ipaddress.IPv4Address(a).is_loopback for a in interfaces.ipv4):
            return "::"
    return "0.0.0.0"


def _bound_families(hosts: Iterable[str]) -> set[int]:
    fams: set[int] = set()
    for h in hosts:
        f = ip_family(h)
        if f == 6 and is_unspecified(h.strip("[]")):
            fams |= {4, 6}  # "::" without IPV6_V6ONLY accepts IPv4 too
        elif f is not None:
            fams.add(f)
    return fams


def check_advertised_families(
    listen: Iterable[str],
    announce: Iterable[str],
    public_host: str | None,
    http_host: str,
    public_url: str | None,
) -> None:
    """Refuse to advertise an address family that nothing binds.

    Args:
        listen: the libp2p listen multiaddrs (``/ip4|ip6/HOST/tcp/PORT``).
        announce: explicit announce multiaddrs (win over ``public_host`` for libp2p).
        public_host: the advertised host of both lanes, if any.
        http_host: the HTTP lane's bind address.
        public_url: the advertised HTTP lane URL (wins over ``public_host`` for HTTP).

    Raises:
        ConfigError: naming ``announce``, ``public_host`` or ``public_url``: e.g. an IPv6
            public host while libp2p listens only on IPv4 (other hosts would get "connection
            refused"). DNS names are not checked.
    """
    listen_hosts = [a.split("/")[2] for a in listen if a.split("/")[1:2] in (["ip4"], ["ip6"])]
    p2p_fams = _bound_families(listen_hosts)
    http_fams = _bound_families([http_host])
    announce = list(announce)
    if announce:
        for a in announce:
            fam = _advertised_families([a], None)
            if fam and not fam <= p2p_fams:
                raise ConfigError(
                    "announce",
                    f"{a} is IPv{min(fam)} but libp2p listens only on "
                    f"{', '.join(listen)}: add --listen /ip{min(fam)}/...",
                )
    elif public_host is not None and (f := ip_family(public_host)) is not None:
        if f not in p2p_fams:
            raise ConfigError(
                "public_host",
                f"{public_host} is IPv{f} but libp2p listens only on "
                f"{', '.join(listen)}: add --listen {'/ip6/::' if f == 6 else '/ip4/0.0.0.0'}"
                "/tcp/PORT",
            )
    url_host = urlsplit(public_url).hostname if public_url else public_host
    if url_host is not None and (f := ip_family(url_host)) is not None and f not in http_fams:
        raise ConfigError(
            "public_url" if public_url else "public_host",
            f"{url_host} is IPv{f} but the HTTP lane binds {http_host}: "
            f"set --http-host {'::' if f == 6 else '0.0.0.0'}",
        )


def advertised_multiaddrs(
    bound: Iterable[str],
    announce: Iterable[str],
    interfaces: Interfaces,
    public_host: str | None = None,
) -> list[str]:
    """The libp2p multiaddrs to advertise (without the ``/p2p/<PeerID>`` suffix).

    Args:
        bound: the listener's actual addresses (ports resolved), e.g. ``/ip4/0.0.0.0/tcp/4001``.
        announce: explicit announce multiaddrs; when non-empty they are the answer.
        interfaces: this host's addresses, used to expand unspecified bound addresses.
        public_host: if given (and no ``announce``), the bound TCP ports are advertised on
            this host name or address instead: those of listeners of the public host's family
            where there are any, else all.

    Returns:
        Addresses in order: each bound address, unspecified ones expanded (loopback last
        within the expansion), duplicates removed. Never an unspecified address.
    """
    explicit = list(announce)
    if explicit:
        return list(dict.fromkeys(explicit))
    out: list[str] = []
    if public_host is not None:
        want = ip_family(public_host)
        bound = list(bound)
        # a listener of the public host's own family where there is one (a node listening on
        # both families has two ports); "::" accepts IPv4 too, so any listener otherwise
        same = [a for a in bound if ip_family(a.split("/")[2] if a.count("/") > 2 else "") == want]
        for addr in same or bound:
            parts = addr.split("/")
            if len(parts) >= 5 and parts[3] == "tcp":
                out.append(host_multiaddr(public_host, int(parts[4])))
        return list(dict.fromkeys(out))
    for addr in bound:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and is_unspecified(parts[2]):
            family = interfaces.ipv4 if parts[1] == "ip4" else interfaces.ipv6
            tail = "/".join(parts[3:])
            out += [f"/{parts[1]}/{ip}/{tail}" for ip in family]
        else:
            out.append(addr)
    return list(dict.fromkeys(out))


def advertised_url(
    bind_host: str,
    port: int,
    public_url: str | None,
    interfaces: Interfaces,
    public_host: str | None = None,
) -> str:
    """The HTTP lane URL to advertise.

    Args:
        bind_host: the numeric address the lane is bound to.
        port: the bound port.
        public_url: explicit URL, if given (the answer).
        public_host: else, if given, ``http://PUBLIC_HOST:PORT``.
        interfaces: used when ``bind_host`` is unspecified: the first non-loopback address of
            the family (loopback only if there is nothing else).
    """
    if public_url:
        return public_url
    if public_host:
        return host_url(public_host, port)
    if is_unspecified(bind_host):
        family = interfaces.ipv6 if bind_host == "::" else interfaces.ipv4
        if not family:
            family = ("::1",) if bind_host == "::" else ("127.0.0.1",)
        return host_url(family[0], port)
    return host_url(bind_host, port)


def ensure_bindable(
    host: str, port: int, option: str, lane: str, host_option: str | None = None
) -> None:
    """Fail early if ``host:port`` cannot be bound by this process.

    The probe binds without ``SO_REUSEPORT``, so a port that another process holds (even one
    that set ``SO_REUSEPORT``, as py-libp2p's TCP listener does) is reported instead of being
    silently shared. Port 0 (any free port) is probed too: it still fails when ``host`` is not
    one of this host's addresses.

    Raises:
        ConfigError: naming ``option`` and ``lane`` (``host_option``, where given, when the
            address is not one of this host's): the port is in use, the address is not one of
            this host's, or binding is not permitted.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            what = {
                errno.EADDRINUSE: f"port {port} ({lane}) is already in use on {host}: "
                "stop the other process or choose another port",
                errno.EADDRNOTAVAIL: f"{host} is not an address of this host ({lane}): "
                "bind 0.0.0.0 and advertise the public address with "
                "--announce/--public-url/--public-host",
                errno.EACCES: f"binding port {port} ({lane}) is not permitted: use a port >= 1024",
            }.get(exc.errno or 0, f"cannot bind {host}:{port} ({lane}): {exc.strerror}")
            if exc.errno == errno.EADDRNOTAVAIL and host_option is not None:
                option = host_option
            raise ConfigError(option, what) from None


def ensure_listen_bindable(listen: Iterable[str], option: str = "listen") -> None:
    """:func:`ensure_bindable` for each ``/ip4|ip6/HOST/tcp/PORT`` listen multiaddr.

    Raises:
        ConfigError: naming ``option``, as :func:`ensure_bindable`.
    """
    for a in listen:
        parts = a.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            ensure_bindable(parts[2], int(parts[4]), option, "libp2p")
