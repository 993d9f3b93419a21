"""Linux network namespaces for emulation: one per node, joined by veth pairs to a bridge.

Theory of operation
-------------------
A :class:`Lab` creates, for a run id ``ID`` (6 hex digits):

- a bridge namespace ``sns-ID-br`` holding bridge ``br0`` (address ``10.211.K.1/24``);
- per node ``i`` a namespace ``sns-ID-i`` whose ``eth0`` (``10.211.K.(i+2)/24``) is one end of
  a veth pair created directly inside the two namespaces (nothing is ever created in the
  caller's namespace, and only these private addresses are used);
- optionally, home routers (:meth:`Lab.add_nat_router`): a node on the bridge that is also the
  gateway of a LAN of its own (``10.(212+L).K.0/24``, hosts added by :meth:`Lab.add_lan_node`)
  and does source NAT for it, dropping unsolicited inbound packets (nftables). Plain
  ``masquerade`` keeps a connection's source port where it is free, so one LAN socket maps to
  one public port whatever the destination (endpoint-independent mapping, where hole punching
  works); ``symmetric`` routers use ``masquerade fully-random``, a fresh random port per
  connection (endpoint-dependent, "symmetric" NAT: a punch's dials never meet);
- shaping with ``tc``: on the node's ``eth0`` (its uplink) and on the bridge-side end (its
  downlink), ``netem`` (delay = the node's one-way ``latency_ms``, loss) as root with a ``tbf``
  child at the node's rate. A packet a → b thus sees a's uplink and b's downlink rate, and
  ``latency(a) + latency(b)`` of delay, as in the model's path. Kernels built without
  ``sch_netem`` (this machine's) get ``tbf`` alone: rates are emulated, latency and loss are
  not (:attr:`Lab.netem` says which, and the emulation report notes it).

Every resource is recorded, in creation order, in a registry file
(``/run/shardnet-sim/ID.json`` with the owner's pid) before it is created; :meth:`Lab.teardown`
kills the processes left in the lab's namespaces and deletes the namespaces in reverse order
(deleting a namespace deletes its veth ends and qdiscs). :func:`cleanup_stale` tears down labs
whose owner died (e.g. killed with SIGKILL). Needs root and ``ip`` (iproute2); :func:`available`
says whether both are there.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REGISTRY = Path("/run/shardnet-sim")
PREFIX = "sns-"


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed."""


def available() -> tuple[bool, str]:
    """(True, "") if namespaces can be used here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} (iproute2) is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return False, f"ip netns add failed: {exc}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def _run(argv: list[str], check: bool = True, stdin: str | None = None) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, check=False, input=stdin)
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {res.stderr.strip() or res.returncode}")
    return res.stdout


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@dataclass(frozen=True)
class Port:
    """A node's place in the lab."""

    index: int
    netns: str
    ip: str


def _burst_bytes(rate_bps: float) -> int:
    """tbf bucket size, bytes: 2 ms at ``rate_bps`` (bytes per second), and never below one
    whole GSO super-packet (64 KiB of payload plus headers). A smaller bucket makes tbf cut
    every GSO packet back into MTU-sized segments in software (``tbf_segment``), which cost
    the shaped nodes more kernel CPU than the transfer itself."""
    return max(96 * 1024, int(rate_bps * 0.002))


def _tc_shape(
    netns: str, dev: str, rate_bps: float, delay_s: float, loss: float, netem: bool
) -> bool:
    """netem (delay/loss) at the root with a tbf (rate) child, on ``dev`` inside ``netns``;
    tbf alone when ``netem`` is False (kernel without sch_netem). Returns True if nested."""
    rate_bit = max(8_000, int(rate_bps * 8))
    burst = _burst_bytes(rate_bps)
    tc = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev]
    tbf = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "100ms"]
    if netem and (delay_s > 0 or loss > 0):
        args = ["netem", "limit", "100000"]
        if delay_s > 0:
            args += ["delay", f"{delay_s * 1e3:.3f}ms"]
        if loss > 0:
            args += ["loss", f"{loss * 100:.4f}%"]
        _run([*tc, "root", "handle", "1:", *args])
        _run([*tc, "parent", "1:1", "handle", "10:", *tbf])
        return True
    _run([*tc, "root", "handle", "1:", *tbf])
    return False


def _tc_rate(netns: str, dev: str, rate_bps: float, nested: bool) -> None:
    rate_bit = max(8_000, int(rate_bps * 8))
    burst = _burst_bytes(rate_bps)
    where = ["parent", "1:1", "handle", "10:"] if nested else ["root", "handle", "1:"]
    _run(
        [
            "ip",
            "netns",
            "exec",
            netns,
            "tc",
            "qdisc",
            "change",
            "dev",
            dev,
            *where,
            "tbf",
            "rate",
            f"{rate_bit}bit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        ]
    )


def _netem_works(netns: str) -> bool:
    """True if this kernel has sch_netem (probed on br0 of our bridge namespace)."""
    add = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "br0", "root", "netem"]
    if subprocess.run(add, capture_output=True, check=False).returncode != 0:
        return False
    _run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "br0", "root"], check=False)
    return True


_NAT_RULES = """
table ip nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "eth0" masquerade{masquerade_flags}
    }
}
table inet filter {
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "eth0" ct state established,related accept
        iifname "eth0" drop
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" accept
    }
}
"""


@dataclass(frozen=True)
class NatRouter:
    """A home router made by :meth:`Lab.add_nat_router`: its public ``port`` on the bridge and
    its LAN ``subnet`` (the first three octets)."""

    port: Port
    lan: int
    subnet: str


class Lab:
    """Namespaces + bridge + shaping for one emulation run (see module docstring).

    Use as a context manager: teardown runs on exit, whatever the exit.
    """

    def __init__(self, run_id: str | None = None, scratch: Path | None = None) -> None:
        self.id = run_id or secrets.token_hex(3)
        self.scratch = scratch
        """A temporary directory of the lab's owner (an emulation's keys, data and logs),
        removed by :func:`cleanup_stale` if the owner died (its own cleanup removes it
        otherwise)."""
        self.octet = int(self.id, 16) % 250 + 1
        self.bridge = f"{PREFIX}{self.id}-br"
        self.created: list[str] = []
        self.ports: dict[int, Port] = {}
        self._shape: dict[int, tuple[float, float, bool]] = {}
        self.netem = False  # probed in __enter__: sch_netem is missing from some kernels
        self.registry = REGISTRY / f"{self.id}.json"

    @property
    def bridge_network(self) -> str:
        """The bridge's IPv4 network (CIDR): the "internet" of this lab (routers' public ports
        and public nodes are on it, though its addresses are private)."""
        return f"10.211.{self.octet}.0/24"

    def _save(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        tmp = self.registry.with_suffix(".tmp")
        record: dict[str, object] = {"owner_pid": os.getpid(), "namespaces": self.created}
        if self.scratch is not None:
            record["scratch"] = str(self.scratch)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.registry)

    def _add_ns(self, name: str) -> None:
        self.created.append(name)
        self._save()  # recorded before it exists: a crash in between is still cleaned up
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def __enter__(self) -> Lab:
        self._add_ns(self.bridge)
        _run(["ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge, "addr", "add", f"10.211.{self.octet}.1/24", "dev", "br0"])
        _run(["ip", "-n", self.bridge, "link", "set", "br0", "up"])
        self.netem = _netem_works(self.bridge)
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def add_node(
        self, index: int, up_bps: float, down_bps: float, latency_s: float, loss: float
    ) -> Port:
        """A namespace for node ``index`` with its shaped access link."""
        if index > 250:
            raise NetnsError("a lab holds at most 251 nodes (one /24)")
        ns = f"{PREFIX}{self.id}-{index}"
        self._add_ns(ns)
        inner, outer = f"s{self.id}n{index}", f"s{self.id}b{index}"
        _run(
            [
                "ip",
                "link",
                "add",
                "name",
                inner,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                outer,
                "netns",
                self.bridge,
            ]
        )
        ip = f"10.211.{self.octet}.{index + 2}"
        _run(["ip", "-n", ns, "link", "set", inner, "name", "eth0"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", self.bridge, "link", "set", outer, "master", "br0", "up"])
        nested = _tc_shape(ns, "eth0", up_bps, latency_s, loss, self.netem)
        _tc_shape(self.bridge, outer, down_bps, latency_s, loss, self.netem)
        self._shape[index] = (up_bps, down_bps, nested)
        port = Port(index, ns, ip)
        self.ports[index] = port
        return port

    def add_nat_router(
        self,
        index: int,
        lan: int,
        shape: tuple[float, float, float, float],
        *,
        symmetric: bool = False,
    ) -> NatRouter:
        """A home router: node ``index`` on the bridge (its public side, shaped as ``shape``:
        the ``up_bps, down_bps, latency_s, loss`` of :meth:`add_node`)
        that also holds a LAN bridge ``lan0`` (``10.(212+lan).K.1/24``) and does source NAT
        for it (nftables ``masquerade`` out of ``eth0``, no port forwarding), drops every
        inbound packet that is not part of a connection a LAN host opened, and tracks TCP
        strictly (``nf_conntrack_tcp_loose=0``: a flushed connection is not picked up again
        mid-stream). ``symmetric``: each connection gets a random public port (``masquerade
        fully-random``; see the module docstring). Needs ``nft`` (Debian package
        ``nftables``).

        Raises:
            NetnsError: ``nft`` is missing or a command failed.
        """
        if shutil.which("nft") is None:
            raise NetnsError("nft (Debian package nftables) is not installed")
        if not 0 <= lan < 40:
            raise NetnsError("at most 40 LANs per lab")
        port = self.add_node(index, *shape)
        ns = port.netns
        subnet = f"10.{212 + lan}.{self.octet}"
        _run(["ip", "-n", ns, "link", "add", "lan0", "type", "bridge"])
        _run(["ip", "-n", ns, "addr", "add", f"{subnet}.1/24", "dev", "lan0"])
        _run(["ip", "-n", ns, "link", "set", "lan0", "up"])
        exec_ns = ["ip", "netns", "exec", ns]
        _run([*exec_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        flags = " fully-random" if symmetric else ""
        _run([*exec_ns, "nft", "-f", "-"], stdin=_NAT_RULES.replace("{masquerade_flags}", flags))
        _run([*exec_ns, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"])
        return NatRouter(port, lan, subnet)

    def add_lan_node(self, router: NatRouter, host: int) -> Port:
        """A namespace behind ``router`` (LAN address ``10.(212+lan).K.(host+2)``, default
        route through the router); not shaped. Returns its port (``index`` is -1)."""
        if not 0 <= host < 250:
            raise NetnsError("a LAN holds at most 250 hosts")
        ns = f"{PREFIX}{self.id}-l{router.lan}-{host}"
        self._add_ns(ns)
        inner, outer = f"s{self.id}l{router.lan}h{host}", f"s{self.id}m{router.lan}h{host}"
        _run(
            [
                *("ip", "link", "add", "name", inner, "netns", ns, "type", "veth"),
                *("peer", "name", outer, "netns", router.port.netns),
            ]
        )
        ip = f"{router.subnet}.{host + 2}"
        _run(["ip", "-n", ns, "link", "set", inner, "name", "eth0"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"{router.subnet}.1"])
        _run(["ip", "-n", router.port.netns, "link", "set", outer, "master", "lan0", "up"])
        return Port(-1, ns, ip)

    def flush_conntrack(self, router: NatRouter) -> None:
        """Forget every connection the router tracks (a NAT reboot): needs ``conntrack``.

        Raises:
            NetnsError: ``conntrack`` is missing.
        """
        if shutil.which("conntrack") is None:
            raise NetnsError("conntrack (Debian package conntrack) is not installed")
        _run(["ip", "netns", "exec", router.port.netns, "conntrack", "-F"], check=False)

    def set_rate(self, index: int, factor: float) -> None:
        """Multiply a node's up and down rate by ``factor`` (``slow`` events)."""
        up, down, nested = self._shape[index]
        _tc_rate(self.ports[index].netns, "eth0", up * factor, nested)
        _tc_rate(self.bridge, f"s{self.id}b{index}", down * factor, nested)
        self._shape[index] = (up * factor, down * factor, nested)

    def exec_prefix(self, index: int) -> list[str]:
        """argv prefix that runs a command inside node ``index``'s namespace."""
        return ["ip", "netns", "exec", self.ports[index].netns]

    def teardown(self) -> None:
        """Kill what runs in the lab's namespaces, delete them, drop the registry entry."""
        teardown_namespaces(self.created)
        self.created = []
        self.registry.unlink(missing_ok=True)


def teardown_namespaces(names: list[str]) -> None:
    """Kill the processes inside each namespace (ours: we created it), then delete it."""
    existing = set(namespaces())
    for ns in reversed(names):
        if ns not in existing:
            continue
        for _ in range(100):  # SIGKILL is final; wait (<= 2 s) until the kernel agrees
            pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        _run(["ip", "netns", "del", ns], check=False)


def _remove_scratch(path: object) -> None:
    """Remove a dead lab owner's scratch directory: only a ``shardnet-emulate-*`` directory
    right under the system's temporary directory (the registry is root's, but a path read
    back from disk is checked before a recursive delete)."""
    if not isinstance(path, str):
        return
    p = Path(path)
    if p.parent == Path(tempfile.gettempdir()) and p.name.startswith("shardnet-emulate-"):
        shutil.rmtree(p, ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Tear down labs whose owner process is gone; returns the lab ids removed."""
    removed: list[str] = []
    if not REGISTRY.is_dir():
        return removed
    for entry in REGISTRY.glob("*.json"):
        try:
            data = json.loads(entry.read_text())
            owner = int(data["owner_pid"])
        except (OSError, ValueError, KeyError):
            continue
        try:
            os.kill(owner, 0)
            continue  # owner alive: not stale
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        teardown_namespaces(list(data.get("namespaces", [])))
        _remove_scratch(data.get("scratch"))
        entry.unlink(missing_ok=True)
        removed.append(entry.stem)
    return removed
