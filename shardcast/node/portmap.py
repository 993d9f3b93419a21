"""node: the trio side of port mapping (the decisions are in :mod:`shardcast.core.portmap`).

:func:`keep_port_mappings` asks the LAN's UPnP Internet Gateway Device to forward the node's
ports (its libp2p TCP port and its HTTP lane port) whenever
:class:`~shardcast.core.portmap.PortMapPolicy` says an attempt is due: a first mapping, a retry
after the backoff, a renewal at half the lease. Each attempt discovers the gateway again (SSDP,
bounded by :attr:`~shardcast.core.portmap.PortMapConfig.discovery_delay_s`), so a router that
rebooted or changed its external address is followed. It asks for the internal port as the
external one and, if another host holds it (``ConflictInMappingEntry``), for any free port
(IGDv2 ``AddAnyPortMapping``). When the external address or a port changes it calls
``on_change()``: the caller hands the external URL to the dial-back check as a candidate (it
is advertised only once proven reachable). When cancelled (shutdown) it deletes its mappings,
shielded but bounded by :attr:`~shardcast.core.portmap.PortMapConfig.delete_timeout_s`: a
gateway that does not answer never holds shutdown up (the lease then ends the mapping).

:class:`PortMapping` ties this to a node: it maps the node's libp2p TCP port and its HTTP lane
port, and runs the node's dial-back check (:func:`~shardcast.node.dialback.keep_reachability`)
on the external lane URL ``http://<external address>:<external lane port>`` as a candidate,
afresh each time the mapping changes; :meth:`PortMapping.advertised` offers that URL only once
a dial-back reached it. The mapped libp2p port is shown in ``/status`` but not advertised:
nodes learn each other's libp2p addresses from their configuration (upstreams, bootstrap), not
from adverts, so there is nothing to hand it to yet.

The protocol is the ``miniupnpc`` library's (the miniupnp project's own client, UPnP IGD v1/v2
over SSDP); its calls block, so each runs in a worker thread
(``trio.to_thread.run_sync(..., abandon_on_cancel=True)``). ``miniupnpc`` does not speak
NAT-PMP or PCP (RFC 6886, RFC 6887): gateways that offer only those are not used.
:class:`Gateway` is the narrow blocking interface the driver needs; :class:`MiniupnpcGateway`
implements it, tests use a fake.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from p2p.addresses import host_url
from p2p.errors import ConfigError
from p2p.lanes import Host
from shardcast.core import (
    MapFailure,
    Mapping,
    MapState,
    PortMapConfig,
    PortMapPolicy,
    Reach,
    Reachability,
    ReachabilityConfig,
)
from shardcast.node.dialback import keep_reachability

log = logging.getLogger(__name__)

# UPnP IGD error strings (miniupnpc's strupnperror) that mean "the gateway will not map this":
# 606 Action not authorized, 718 ConflictInMappingEntry, 728 NoPortMapsAvailable,
# 729 ConflictWithOtherMechanisms, 401 Invalid Action (port mapping disabled), 501 Action
# Failed (miniupnpd's answer when its allow/deny rules refuse a port).
_REFUSALS = (
    "not authorized",
    "conflict",
    "noportmapsavailable",
    "invalid action",
    "action failed",
)
_CONFLICT = "conflictinmappingentry"
_PERMANENT_ONLY = "onlypermanentleasessupported"
_ATTEMPT_SLACK_S = 10.0  # an attempt's bound beyond discovery: the SOAP exchanges, seconds


RunSync = Callable[..., Awaitable[Any]]
"""How a blocking gateway call is run: ``await run_sync(fn, *args)``; by default
``trio.to_thread.run_sync`` with ``abandon_on_cancel=True`` (tests run calls inline)."""


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a worker thread; cancelling the wait abandons the thread (a
    gateway that does not answer cannot hold the caller up)."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)  # type: ignore[call-arg]


class GatewayError(Exception):
    """An attempt with the gateway failed.

    Args:
        reason: the kind of failure.
        message: the gateway's or the library's words.
    """

    def __init__(self, reason: MapFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Gateway(Protocol):
    """A port-mapping gateway, blocking calls (run them in a worker thread). Not safe for
    concurrent use."""

    def open(self, delay_s: float) -> tuple[str, str]:
        """Discover the gateway (waiting at most ``delay_s`` seconds for answers); its
        external address and this host's LAN address towards it.

        Raises:
            GatewayError: none answered (``NO_GATEWAY``), or it failed (``ERROR``)."""
        ...

    def add(
        self, external_port: int, internal_port: int, lan: str, lease_s: int, description: str
    ) -> tuple[int, int]:
        """Map TCP ``external_port`` (or, if taken, any port the gateway gives) to
        ``lan:internal_port``; the external port mapped and the lease granted (seconds, 0:
        permanent).

        Raises:
            GatewayError: ``REFUSED`` or ``ERROR``."""
        ...

    def delete(self, external_port: int) -> None:
        """Delete the TCP mapping of ``external_port``.

        Raises:
            GatewayError: it failed."""
        ...


def _classify(exc: Exception) -> GatewayError:
    text = str(exc) or type(exc).__name__
    low = text.lower()
    reason = MapFailure.REFUSED if any(r in low for r in _REFUSALS) else MapFailure.ERROR
    return GatewayError(reason, text)


class MiniupnpcGateway:
    """:class:`Gateway` over ``miniupnpc`` (UPnP IGD). ``miniupnpc`` raises plain
    ``Exception`` with the UPnP error text; it is translated to :class:`GatewayError` here."""

    @staticmethod
    def check_installed() -> None:
        """Raise unless ``miniupnpc`` can be imported.

        Raises:
            ConfigError: it is not installed (a broken install: it is a dependency)."""
        if importlib.util.find_spec("miniupnpc") is None:
            raise ConfigError(
                "port_mapping", "needs the miniupnpc package (pip install miniupnpc==2.3.3)"
            )

    def __init__(self) -> None:
        import miniupnpc  # type: ignore[import-not-found,unused-ignore]

        self._upnp: Any = miniupnpc.UPnP()

    def open(self, delay_s: float) -> tuple[str, str]:
        upnp = self._upnp
        upnp.discoverdelay = max(1, int(delay_s * 1000))
        try:
            found = upnp.discover()
        except Exception as exc:  # miniupnpc raises bare Exception
            raise _classify(exc) from exc
        if not found:
            raise GatewayError(MapFailure.NO_GATEWAY, "no UPnP device answered discovery")
        try:
            upnp.selectigd()
        except Exception as exc:  # miniupnpc raises bare Exception
            raise GatewayError(MapFailure.NO_GATEWAY, f"no Internet Gateway Device: {exc}") from exc
        try:
            external = upnp.externalipaddress()
        except Exception as exc:  # miniupnpc raises bare Exception
            raise _classify(exc) from exc
        if not external:
            raise GatewayError(MapFailure.ERROR, "the gateway has no external address")
        return str(external), str(upnp.lanaddr)

    def add(
        self, external_port: int, internal_port: int, lan: str, lease_s: int, description: str
    ) -> tuple[int, int]:
        upnp = self._upnp
        try:
            try:
                upnp.addportmapping(
                    external_port, "TCP", lan, internal_port, description, "", lease_s
                )
            except Exception as exc:  # miniupnpc raises bare Exception
                low = str(exc).lower()
                if _PERMANENT_ONLY in low and lease_s:
                    lease_s = 0
                    upnp.addportmapping(
                        external_port, "TCP", lan, internal_port, description, "", 0
                    )
                elif _CONFLICT in low:
                    # IGDv2 AddAnyPortMapping; miniupnpc's binding takes no lease here (the
                    # one granted is read back below)
                    external_port = int(
                        upnp.addanyportmapping(
                            external_port, "TCP", lan, internal_port, description, ""
                        )
                    )
                else:
                    raise
        except GatewayError:
            raise
        except Exception as exc:  # miniupnpc raises bare Exception
            raise _classify(exc) from exc
        return external_port, self._lease(external_port, lease_s)

    def _lease(self, external_port: int, asked_s: int) -> int:
        """The lease the gateway granted (it may cut the one asked for), else ``asked_s``."""
        try:
            entry = self._upnp.getspecificportmapping(external_port, "TCP")
        except Exception:  # miniupnpc raises bare Exception; the asked lease is then used
            return asked_s
        if isinstance(entry, tuple) and len(entry) >= 5 and isinstance(entry[4], int):
            return entry[4] if entry[4] >= 0 else asked_s
        return asked_s

    def delete(self, external_port: int) -> None:
        try:
            self._upnp.deleteportmapping(external_port, "TCP")
        except Exception as exc:  # miniupnpc raises bare Exception
            raise _classify(exc) from exc


async def _map_all(
    gateway: Gateway, policy: PortMapPolicy, ports: dict[str, int], run_sync: RunSync
) -> tuple[str, list[Mapping], int]:
    cfg = policy.config
    external, lan = await run_sync(gateway.open, cfg.discovery_delay_s)
    done: list[Mapping] = []
    leases: list[int] = []
    try:
        for name, port in ports.items():
            want = policy.external_port(name) or port
            got, granted = await run_sync(
                gateway.add, want, port, lan, cfg.lease_s, cfg.description
            )
            done.append(Mapping(name, port, got))
            leases.append(granted)
    except GatewayError:
        await _delete(gateway, done, cfg.delete_timeout_s, run_sync)  # no half-mapped node
        raise
    timed = [s for s in leases if s > 0]  # 0: permanent; renew at the shortest lease
    return external, done, min(timed) if timed else 0


async def _delete(
    gateway: Gateway, mappings: list[Mapping], timeout_s: float, run_sync: RunSync
) -> None:
    """Delete ``mappings``, shielded from cancellation but bounded by ``timeout_s``."""
    if not mappings:
        return
    with trio.CancelScope(deadline=trio.current_time() + timeout_s, shield=True) as scope:
        for m in mappings:
            try:
                await run_sync(gateway.delete, m.external_port)
            except GatewayError as exc:
                log.info("port_mapping_delete_failed port=%d error=%s", m.external_port, exc)
    if scope.cancelled_caught:
        log.info("port_mapping_delete_timed_out timeout_s=%g", timeout_s)


async def keep_port_mappings(
    gateway_factory: Callable[[], Gateway],
    policy: PortMapPolicy,
    ports: dict[str, int],
    on_change: Callable[[], None],
    run_sync: RunSync = in_thread,
) -> None:
    """Keep ``ports`` (name -> this host's TCP port) mapped on the LAN's gateway, forever
    (see the module docstring); deletes the mappings when cancelled (at most
    ``policy.config.delete_timeout_s`` seconds). ``gateway_factory()`` is called once, with
    ``run_sync`` like every gateway call (discovery state lives in the object). Failures are
    logged (one WARNING per streak of refusals, see :meth:`PortMapPolicy.failed`) and
    retried; nothing is raised for a gateway's fault."""
    cfg = policy.config
    gateway = await run_sync(gateway_factory)
    try:
        while True:
            await trio.sleep(policy.next_due(trio.current_time()))
            try:
                with trio.fail_after(cfg.discovery_delay_s + _ATTEMPT_SLACK_S):
                    external, mappings, lease = await _map_all(gateway, policy, ports, run_sync)
            except (GatewayError, trio.TooSlowError) as exc:
                if isinstance(exc, GatewayError):
                    reason, text = exc.reason, str(exc)
                else:
                    reason, text = MapFailure.ERROR, "the gateway did not answer in time"
                lost = policy.state is MapState.MAPPED
                warn = policy.failed(reason, text, trio.current_time())
                (log.warning if warn else log.info)(
                    "port_mapping_failed reason=%s error=%s retry_in_s=%.0f",
                    reason.value,
                    text,
                    policy.next_due(trio.current_time()),
                )
                if lost:
                    on_change()
                continue
            changed = policy.mapped(external, mappings, lease, trio.current_time())
            if changed:
                log.info(
                    "port_mapping_mapped external_host=%s ports=%s lease_s=%d",
                    external,
                    ",".join(f"{m.name}:{m.internal_port}->{m.external_port}" for m in mappings),
                    lease,
                )
                on_change()
    finally:
        await _delete(gateway, list(policy.mappings.values()), cfg.delete_timeout_s, run_sync)


def tcp_port(multiaddrs: list[str]) -> int | None:
    """The TCP port of the first ``/tcp/<port>`` multiaddr in ``multiaddrs`` (None: none)."""
    for addr in multiaddrs:
        parts = addr.split("/")
        if "tcp" in parts:
            i = parts.index("tcp")
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1])
    return None


class PortMapping:
    """A node's port mappings and the dial-back check of the external lane URL they give
    (see the module docstring). Only valid inside the node; :meth:`run` until cancelled.

    Args:
        host: the node's libp2p host (dial-back asks go over it).
        ports: name -> this host's TCP port to map (``"http"`` is the lane, checked and
            advertised; others, such as ``"libp2p"``, are mapped and shown only).
        config: when and how to map.
        reachability: the dial-back check's settings (as for the node's own URL).
        askers: connected PeerIDs to ask for a dial-back, best first.
        on_change: called when :meth:`advertised` may have changed (re-advertise).
        gateway_factory: the gateway (default: :class:`MiniupnpcGateway`).
        run_sync: how blocking gateway calls run (default: :func:`in_thread`).

    Raises:
        ConfigError: the default gateway's library, ``miniupnpc``, is not installed.
    """

    def __init__(
        self,
        host: Host,
        ports: dict[str, int],
        config: PortMapConfig,
        reachability: ReachabilityConfig,
        askers: Callable[[], list[str]],
        on_change: Callable[[], None],
        gateway_factory: Callable[[], Gateway] = MiniupnpcGateway,
        run_sync: RunSync = in_thread,
    ) -> None:
        if gateway_factory is MiniupnpcGateway:
            MiniupnpcGateway.check_installed()
        self.host = host
        self.ports = dict(ports)
        self.policy = PortMapPolicy(config)
        self.reachability = reachability
        self.candidate: Reachability | None = None
        """The dial-back state of the external lane URL (None: nothing mapped)."""
        self._askers = askers
        self._on_change = on_change
        self._gateway_factory = gateway_factory
        self._run_sync = run_sync
        self._mapping_changed = trio.Event()
        self._checking: trio.CancelScope | None = None

    def candidate_url(self) -> str:
        """The external lane URL the mapping gives ("" if the lane is not mapped)."""
        port = self.policy.external_port("http")
        host = self.policy.external_host
        if port is None or not host:
            return ""
        return host_url(host, port)

    def advertised(self) -> str:
        """The external lane URL once a dial-back reached it, else ""."""
        c = self.candidate
        if c is not None and c.state is Reach.REACHABLE and c.url == self.candidate_url():
            return c.url
        return ""

    def _mapped(self) -> None:
        self._mapping_changed.set()
        if self._checking is not None:
            self._checking.cancel()
        self._on_change()

    async def run(self) -> None:
        """Map, renew and check until cancelled; deletes the mappings then (bounded)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    keep_port_mappings,
                    self._gateway_factory,
                    self.policy,
                    self.ports,
                    self._mapped,
                    run_sync=self._run_sync,
                )
            )
            while True:
                url = self.candidate_url()
                self.candidate = Reachability(url, self.reachability) if url else None
                if self.candidate is not None:
                    with trio.CancelScope() as self._checking:
                        await keep_reachability(
                            self.host, self.candidate, self._askers, self._on_change
                        )
                    self._checking = None
                await self._mapping_changed.wait()
                self._mapping_changed = trio.Event()

    def status(self, now: float, wall_of: Callable[[float], str]) -> dict[str, Any]:
        """The ``port_mapping`` section of ``/status``: the policy's (state, external address,
        lease left, last error) and the candidate URL's dial-back state."""
        out = self.policy.status(now, wall_of)
        c = self.candidate
        out["candidate_url"] = c.url if c is not None else ""
        out["candidate_state"] = c.state.value if c is not None else None
        out["advertised"] = bool(self.advertised())
        return out
