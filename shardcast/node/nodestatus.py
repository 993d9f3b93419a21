"""node: the ``/status`` document of a node: what an operator asks first, as JSON.

Served on every node's HTTP lane (``GET /status``) and read by ``shardnet status``. Times are
wall-clock ISO-8601 (UTC); durations and sizes carry their unit in the key. Schema 1::

    {
      "schema": 1, "time": "2025-…Z", "role": "relay", "peer_id": "12D3KooW…",
      "run_id": "…", "version": "0.1.0", "http_url": "http://…", "multiaddrs": [...],
      "started_at": "…Z", "uptime_s": 12.3,
      "versions": {"committed": [3, 4], "latest": 4, "in_progress": [5],
                   "chained": {"4": 1}, "keep_last": 3, "beyond_keep_last": [],
                   "announced": {"step": 5, "manifest_digest": "…"} | null,
                   "finished": {"step": 5, "manifest_digest": "…"} | null},
      "http": {"requests": {"2xx": n, …}, "client_errors": {"404": n, …},
               "sent_bytes": n, "received_bytes": n, "open_connections": n},
      "libp2p": {"connected_peers": n, "mesh_peers": {"<topic>": n}},
      …sections added by the role (see below)
    }

``client_errors`` splits the ``4xx`` answers by code: in a healthy swarm they are mostly ``404``
(asked for a version or shard not held here yet) and ``429`` (super-seeding: fetch it from the
holder named in the answer); ``400``, ``409`` or ``416`` point at a confused or hostile asker.

``chained`` maps each committed version kept as a chain (:mod:`shardcast.store.chains`: its
base plus verified delta blobs, no full files) to its depth, the links down to a full version;
full versions are not listed. ``beyond_keep_last`` lists the versions held although older than
the newest ``keep_last`` (``--keep-last``): the bases newer chains are built from, or versions
pinned while read or served (:mod:`shardcast.core.retention`). ``finished`` is the trainer's
signed end of the run, while in force (a newer step or the trainer's continuation lifts it).

Role sections (added through :attr:`ShardcastNode.status_sections`):

- followers (relay, peer): ``downloads`` (per version in progress: ``step``,
  ``verified_bytes``, ``total_bytes``, ``percent``, ``rate_bytes_per_s``, ``eta_s``,
  ``corrupt_shards``, ``sources`` [{``peer_id``, ``kind``, ``bytes``}]), ``upstreams``
  [{``peer_id``, ``state``, ``role``, ``http_url``, ``latest_step``, ``last_heard``, ``error``}],
  ``known_nodes`` [{``peer_id``, ``role``, ``latest_step``, ``filling``, ``last_heard``}];
- trainer: ``network`` (per peer: latest reported step, lag in versions, last heard),
  ``rollouts`` (announced, pending, accepted, rejected by reason), ``reputation``;
- peer: ``rollouts`` (submitted, acknowledged by status, pending, retries, given up);
- standalone origin (``shardnet origin --watch``): ``watch`` (``dir``, ``ready_marker``,
  ``finished_marker``, ``finished_marker_present``, ``latest_published``, ``refused``: the
  steps refused and waiting for their files to change);
- ``run_card`` where the run card is known.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from shardcast.node.metrics import NodeMetrics, package_version
from shardcast.node.view import NodeView
from shardcast.wire import SignedRunCard


class StatusView(NodeView, Protocol):
    """A running node as the status document reads it: a :class:`NodeView` and its metrics."""

    @property
    def metrics(self) -> NodeMetrics:
        """Its metrics (request counts by class, bytes spent on observability)."""
        ...


SCHEMA = 1


def iso(unix_s: float) -> str:
    """``unix_s`` as ISO-8601 UTC with millisecond precision (``…Z``)."""
    t = datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds")
    return t.replace("+00:00", "Z")


def wall_of(clock_s: float, now_clock_s: float, now_unix_s: float) -> float:
    """The Unix time of ``clock_s``, a reading of a monotonic clock now at ``now_clock_s``."""
    return now_unix_s - (now_clock_s - clock_s)


def _chained(node: StatusView, steps: list[int]) -> dict[str, int]:
    """``{str(step): depth}`` of the committed versions kept as chains; a version pruned or
    quarantined while this reads is left out."""
    out: dict[str, int] = {}
    for step in steps:
        try:
            depth = node.store.chain_depth(step)
        except (OSError, ValueError):
            continue
        if depth:
            out[str(step)] = depth
    return out


def node_status(node: StatusView) -> dict[str, Any]:
    """The status document of ``node`` (see module docstring)."""
    now = time.time()
    http = node.http.statistics()
    steps = node.store.committed_steps()
    ann, fin = node.announcement, node.finished
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "time": iso(now),
        "role": node.config.role,
        "peer_id": node.identity.peer_id,
        "run_id": node.config.run_id,
        "version": package_version(),
        "http_url": node.http_url,  # advertised (the bound one can be 0.0.0.0)
        "multiaddrs": node.p2p.multiaddrs(),
        "started_at": iso(node.started_at),
        "uptime_s": round(now - node.started_at, 3),
        "versions": {
            "committed": steps,
            "latest": steps[-1] if steps else None,
            "in_progress": node.server.in_progress(),
            "chained": _chained(node, steps),
            "keep_last": node.config.keep_last,
            "beyond_keep_last": steps[: max(0, len(steps) - node.config.keep_last)],
            "announced": (
                {"step": ann.step, "manifest_digest": ann.manifest_digest}
                if ann is not None
                else None
            ),
            "finished": (
                {"step": fin.step, "manifest_digest": fin.manifest_digest}
                if fin is not None
                else None
            ),
        },
        "http": {
            "requests": dict(node.metrics.requests_by_class),
            "client_errors": {str(c): n for c, n in sorted(node.metrics.client_errors.items())},
            "sent_bytes": max(0, http.bytes_sent - node.metrics.observability_bytes),
            "received_bytes": node.client.statistics().bytes_received,
            "open_connections": http.open_connections,
        },
        "libp2p": {
            "connected_peers": len(node.p2p.connected_peers()),
            "mesh_peers": node.p2p.mesh_sizes(),
        },
    }
    for name, section in node.status_sections.items():
        out[name] = section()
    if node.card is not None:
        out["run_card"] = run_card_summary(node.card)
    return out


def run_card_summary(card: SignedRunCard) -> dict[str, Any]:
    """The ``run_card`` section: what a node follows (version, digest, signer, the rules)."""
    c = card.card
    out: dict[str, Any] = {
        "version": card.version,
        "digest": card.digest,
        "signer": card.signer,
        "run_id": c.run_id,
        "task": f"{c.task.name} v{c.task.version}",
        "sampling": {
            "prompts_per_step": c.sampling.prompts_per_step,
            "group_size": c.sampling.group_size,
            "max_new_tokens": c.sampling.max_new_tokens,
            "temperature": c.sampling.temperature,
        },
        "engines": ", ".join(e.id for e in c.engines),
        "async_level": c.async_level,
    }
    if c.mirrors:
        out["mirrors"] = ", ".join(c.mirrors)
    return out


def node_status_json(node: StatusView) -> bytes:
    """:func:`node_status` encoded as UTF-8 JSON."""
    return json.dumps(node_status(node), sort_keys=False).encode()
