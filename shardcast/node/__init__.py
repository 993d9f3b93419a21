"""node: one running shardcast node: libp2p host, HTTP lane, store and info protocol
(:mod:`.node`), run-card keeping (:mod:`.cardsync`), Prometheus metrics (:mod:`.metrics`) and the
``/status`` document (:mod:`.nodestatus`).
"""

from __future__ import annotations

from shardcast.node.cardsync import bootstrap_card, check_data_dir, fetch_card, save_card
from shardcast.node.dialback import challenge_lane, keep_reachability
from shardcast.node.metrics import DownloadMetrics, source_kind
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.node.nodestatus import iso, wall_of
from shardcast.node.portmap import PortMapping, tcp_port
from shardcast.node.view import NodeView, RoleView

__all__ = [
    "DownloadMetrics",
    "NodeConfig",
    "NodeView",
    "PortMapping",
    "RoleView",
    "ShardcastNode",
    "bootstrap_card",
    "challenge_lane",
    "check_data_dir",
    "fetch_card",
    "iso",
    "keep_reachability",
    "save_card",
    "source_kind",
    "tcp_port",
    "wall_of",
]
