"""core: when to ask the home router for port mappings, and what came of it (pure part).

A node behind a home router (source NAT) cannot be dialled from outside. Most home routers
accept port-mapping requests from their LAN: UPnP Internet Gateway Device (UPnP Forum,
*WANIPConnection:2*, ``AddPortMapping``/``AddAnyPortMapping``/``DeletePortMapping``), found by
SSDP multicast discovery. With a mapping, the router forwards ``<its external address>:<external
port>`` to this host's port, and the node's lane may be reachable at that address. The trio
driver (:mod:`shardcast.node.portmap`) does the protocol through ``miniupnpc``; this module only
decides:

- **When to try.** :meth:`PortMapPolicy.due` / :meth:`PortMapPolicy.next_due`: at once when
  the node starts (``UNTRIED``); after a failure, again after
  :attr:`PortMapConfig.backoff_initial_s`, doubling up to :attr:`PortMapConfig.backoff_max_s`
  (exponential backoff, so a router that refuses is asked a few times an hour at most); a
  mapping is renewed at half its granted lease (a permanent one, lease 0, is refreshed every
  :attr:`PortMapConfig.permanent_refresh_s`, which also finds a router that rebooted and
  forgot it).
- **When to give up quietly.** A LAN with no gateway answering discovery
  (:attr:`MapFailure.NO_GATEWAY`) is the common case (cloud hosts, hosts with public
  addresses, routers with UPnP off): after :attr:`PortMapConfig.no_gateway_attempts` such
  attempts in a row the state is ``NO_GATEWAY``, discovery runs again only every
  :attr:`PortMapConfig.no_gateway_retry_s` (a laptop may move to another network), and nothing
  is logged above INFO.
- **What to tell the operator.** :meth:`PortMapPolicy.failed` returns True when the failure is
  worth one WARNING line: the first refusal of a streak (a conflict, "not authorized": the
  router has UPnP on but will not map for us), never a missing gateway.

A mapping is only a *candidate*: the node advertises the external URL only once the dial-back
check (:mod:`shardcast.core.reachability`) proved it reachable. A gateway whose external
address is itself private (a carrier-grade NAT behind the home router) maps ports that no one
outside can reach; the check finds that too.

Everything here is a pure function of its arguments (``now`` in trio seconds); no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2p.errors import ConfigError


class MapState(enum.Enum):
    """Where port mapping stands (value: the status string)."""

    UNTRIED = "untried"
    """Not asked yet."""
    MAPPED = "mapped"
    """Every port is mapped; renewed at half the lease."""
    FAILED = "failed"
    """The latest attempt failed; retried after the backoff."""
    NO_GATEWAY = "no_gateway"
    """No gateway answered discovery several times in a row; retried rarely, quietly."""


class MapFailure(enum.Enum):
    """Why an attempt failed (value: the status/metric string)."""

    NO_GATEWAY = "no_gateway"
    """No UPnP IGD answered SSDP discovery within the delay (or none is connected)."""
    REFUSED = "refused"
    """The gateway answered but would not map: a conflict with another host's mapping, "not
    authorized" (``secure_mode``, a port range its rules deny), UPnP actions disabled."""
    ERROR = "error"
    """Any other failure of the exchange (a malformed answer, a timeout mid-exchange)."""


@dataclass(frozen=True)
class PortMapConfig:
    """Port mapping of one node (see the module docstring).

    Attributes:
        enabled: ask the LAN's gateway for mappings at all. Off by default: discovery sends
            SSDP multicast on the LAN and a mapping opens a port on the router (go-libp2p's
            ``NATPortMap`` is opt-in too).
        discovery_delay_s: how long SSDP discovery waits for gateways' answers, seconds.
        lease_s: the lease asked for, seconds (0: permanent; gateways may grant less).
        backoff_initial_s: after a failed attempt, the next one waits this long, seconds;
            doubled after each further failure in a row ...
        backoff_max_s: ... up to this, seconds.
        no_gateway_attempts: attempts in a row with no gateway answering before the state
            is ``NO_GATEWAY``.
        no_gateway_retry_s: in ``NO_GATEWAY``, discovery runs again after this, seconds.
        permanent_refresh_s: a permanent mapping (granted lease 0) is refreshed this often,
            seconds.
        delete_timeout_s: at shutdown, deleting the mappings is given at most this long,
            seconds (a gateway that does not answer never holds shutdown up).
        description: the mapping's description, shown in the router's UPnP table.

    Raises:
        ConfigError: a field is out of range (names the field).
    """

    enabled: bool = False
    discovery_delay_s: float = 2.0
    lease_s: int = 3600
    backoff_initial_s: float = 30.0
    backoff_max_s: float = 1800.0
    no_gateway_attempts: int = 2
    no_gateway_retry_s: float = 3600.0
    permanent_refresh_s: float = 1800.0
    delete_timeout_s: float = 2.0
    description: str = "shardnet"

    def __post_init__(self) -> None:
        for name in (
            "discovery_delay_s",
            "backoff_initial_s",
            "no_gateway_retry_s",
            "permanent_refresh_s",
            "delete_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"port_mapping.{name}", "must be > 0")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError("port_mapping.backoff_max_s", "must be >= backoff_initial_s")
        if self.lease_s < 0:
            raise ConfigError("port_mapping.lease_s", "must be >= 0 (0: permanent)")
        if self.no_gateway_attempts < 1:
            raise ConfigError("port_mapping.no_gateway_attempts", "must be >= 1")


@dataclass(frozen=True)
class Mapping:
    """One port mapped on the gateway.

    Attributes:
        name: what the port is for (``"libp2p"``, ``"http"``).
        internal_port: this host's port (TCP).
        external_port: the gateway's port forwarded to it (the internal one if it was free).
    """

    name: str
    internal_port: int
    external_port: int


@dataclass
class PortMapPolicy:
    """What this node knows of its port mappings and when to act (pure; ``now`` in trio
    seconds). The driver calls :meth:`mapped` or :meth:`failed` after each attempt, and
    attempts again when :meth:`due`.

    Attributes:
        state: where mapping stands.
        external_host: the gateway's external address ("" before a mapping).
        mappings: the ports mapped, by name (empty unless ``MAPPED``).
        lease_s: the lease granted, seconds (0: permanent).
        mapped_at: when the latest mapping or renewal succeeded (None: never).
        failures: failed attempts in a row.
        last_failure: the latest failure's reason and the gateway's words (None: none yet).
        attempts: attempts made, by outcome (``mapped`` or a :class:`MapFailure` value).
    """

    config: PortMapConfig = field(default_factory=PortMapConfig)
    state: MapState = MapState.UNTRIED
    external_host: str = ""
    mappings: dict[str, Mapping] = field(default_factory=dict)
    lease_s: int = 0
    mapped_at: float | None = None
    failures: int = 0
    last_failure: tuple[MapFailure, str] | None = None
    attempts: dict[str, int] = field(default_factory=dict)
    _next_at: float = 0.0
    _no_gateway_streak: int = 0

    def due(self, now: float) -> bool:
        """True if an attempt (a first mapping, a retry or a renewal) should run at ``now``."""
        return now >= self._next_at

    def next_due(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`due` (0 if due)."""
        return max(0.0, self._next_at - now)

    def mapped(self, external_host: str, mappings: list[Mapping], lease_s: int, now: float) -> bool:
        """Record a successful attempt: every port in ``mappings`` is mapped for ``lease_s``
        seconds (0: permanent) at ``external_host``. Returns True if what the node may
        advertise changed (the external host or a port), so the driver hands the new
        candidates on.

        Raises:
            ValueError: ``lease_s`` is negative or ``mappings`` is empty (a driver bug).
        """
        if lease_s < 0 or not mappings:
            raise ValueError("a mapping needs ports and a lease >= 0")
        before = (self.external_host, dict(self.mappings))
        self.state = MapState.MAPPED
        self.external_host = external_host
        self.mappings = {m.name: m for m in mappings}
        self.lease_s = lease_s
        self.mapped_at = now
        self.failures = 0
        self._no_gateway_streak = 0
        self.attempts["mapped"] = self.attempts.get("mapped", 0) + 1
        renew_s = lease_s / 2 if lease_s > 0 else self.config.permanent_refresh_s
        self._next_at = now + renew_s
        return (self.external_host, self.mappings) != before

    def failed(self, reason: MapFailure, error: str, now: float) -> bool:
        """Record a failed attempt (``error``: the gateway's or library's words, for
        ``/status``). Any mapping held is considered lost (a failed renewal: the router may
        have rebooted). Returns True if it deserves one WARNING line: a failure that is not a
        missing gateway, and the first of its reason in a streak of failures (the caller logs
        the rest at INFO).

        See the module docstring for the backoff and the quiet ``NO_GATEWAY`` state."""
        previous = self.last_failure[0] if self.failures and self.last_failure else None
        self.failures += 1
        self.last_failure = (reason, error)
        self.attempts[reason.value] = self.attempts.get(reason.value, 0) + 1
        self.mappings = {}
        self.external_host = ""
        self.lease_s = 0
        if reason is MapFailure.NO_GATEWAY:
            self._no_gateway_streak += 1
        else:
            self._no_gateway_streak = 0
        if self._no_gateway_streak >= self.config.no_gateway_attempts:
            self.state = MapState.NO_GATEWAY
            self._next_at = now + self.config.no_gateway_retry_s
            return False
        self.state = MapState.FAILED
        cfg = self.config
        wait = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2.0 ** (self.failures - 1))
        self._next_at = now + wait
        return reason is not MapFailure.NO_GATEWAY and reason is not previous

    def lease_left_s(self, now: float) -> float | None:
        """Seconds until the granted lease ends (None: nothing mapped, or permanent)."""
        if self.state is not MapState.MAPPED or self.mapped_at is None or self.lease_s == 0:
            return None
        return max(0.0, self.mapped_at + self.lease_s - now)

    def external_port(self, name: str) -> int | None:
        """The external port mapped for ``name`` (None: not mapped)."""
        m = self.mappings.get(name)
        return m.external_port if m is not None else None

    def status(self, now: float, wall_of: Callable[[float], str]) -> dict[str, Any]:
        """The ``port_mapping`` section of ``/status``; ``wall_of(t)`` turns a trio time into
        an ISO wall-clock string."""
        left = self.lease_left_s(now)
        return {
            "state": self.state.value,
            "external_host": self.external_host,
            "mappings": {
                m.name: {"internal_port": m.internal_port, "external_port": m.external_port}
                for m in self.mappings.values()
            },
            "lease_s": self.lease_s,
            "lease_left_s": round(left, 1) if left is not None else None,
            "mapped_at": wall_of(self.mapped_at) if self.mapped_at is not None else None,
            "next_attempt_at": wall_of(self._next_at),
            "failures": self.failures,
            "last_error": (
                f"{self.last_failure[0].value}: {self.last_failure[1]}"
                if self.last_failure is not None
                else None
            ),
            "attempts": dict(self.attempts),
        }
