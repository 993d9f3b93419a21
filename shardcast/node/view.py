"""node: what the ``/metrics`` and ``/status`` readers see of a running node (a Protocol).

:class:`~shardcast.node.node.ShardcastNode` owns its :class:`~shardcast.node.metrics.NodeMetrics`
and serves :func:`~shardcast.node.nodestatus.node_status`; both read the node back. They read
it through :class:`NodeView`, which names only what they use, so that neither imports the
node module that imports them (no import cycle). ``ShardcastNode`` satisfies it structurally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from p2p.identity import Identity
from p2p.lanes import Host, HttpLaneClient, HttpLaneServer
from shardcast.serve import VersionServer
from shardcast.store import VersionStore
from shardcast.wire import RunFinished, SignedRunCard, VersionAnnouncement

__all__ = ["NodeView", "RoleView"]


class RoleView(Protocol):
    """The settings a reader names the node by."""

    @property
    def role(self) -> str:
        """``origin``, ``relay``, ``peer`` or ``trainer``."""
        ...

    @property
    def run_id(self) -> str:
        """The run this node serves."""
        ...

    @property
    def keep_last(self) -> int:
        """How many of the newest committed versions retention keeps (``--keep-last``)."""
        ...


class NodeView(Protocol):
    """A running node as the metrics collector and the status document read it."""

    @property
    def identity(self) -> Identity:
        """The node's key and PeerID."""
        ...

    @property
    def config(self) -> RoleView:
        """Its role and run."""
        ...

    @property
    def p2p(self) -> Host:
        """Its libp2p host."""
        ...

    @property
    def http(self) -> HttpLaneServer:
        """Its HTTP lane server."""
        ...

    @property
    def client(self) -> HttpLaneClient:
        """Its HTTP lane client."""
        ...

    @property
    def store(self) -> VersionStore:
        """Its version store."""
        ...

    @property
    def server(self) -> VersionServer:
        """What its HTTP lane serves."""
        ...

    @property
    def announcement(self) -> VersionAnnouncement | None:
        """The newest version announcement it knows (None: none)."""
        ...

    @property
    def finished(self) -> RunFinished | None:
        """The trainer's run end, while in force (None: the run goes on)."""
        ...

    @property
    def http_url(self) -> str:
        """Its advertised HTTP lane URL."""
        ...

    @property
    def started_at(self) -> float:
        """Wall-clock start time, Unix seconds."""
        ...

    @property
    def status_sections(self) -> dict[str, Callable[[], Any]]:
        """Extra ``/status`` sections added by the role running on the node."""
        ...

    @property
    def card(self) -> SignedRunCard | None:
        """The run card it holds (None: none yet)."""
        ...
