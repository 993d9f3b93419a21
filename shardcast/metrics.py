"""Prometheus metrics of a shardcast node, served at ``/metrics`` on its HTTP lane.

Names follow the Prometheus conventions (``shardnet_`` prefix, base units, ``_total`` for
counters). Values are read from the node's ``statistics()`` objects at scrape time, so there
is no second bookkeeping to drift; each node has its own registry (no process-wide state).

=============================================  ===========================================
metric                                         meaning
=============================================  ===========================================
``shardnet_http_sent_bytes_total``             body bytes the HTTP lane sent
``shardnet_http_requests_total``               responses started
``shardnet_http_open_connections``             connections open now
``shardnet_served_bytes_total{step}``          bytes handed out for one version
``shardnet_origin_refused_total``              super-seeding refusals (origin only)
``shardnet_versions_committed``                committed versions kept on disk
``shardnet_latest_committed_step``             newest committed step (-1: none)
``shardnet_versions_in_progress``              versions being filled
``shardnet_http_received_bytes_total``         body bytes this node downloaded
=============================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from shardcast.node import ShardcastNode

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeCollector(Collector):
    """Reads a node's counters at scrape time."""

    def __init__(self, node: ShardcastNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families (see module docstring)."""
        node = self.node
        http = node.http.statistics()
        client = node.client.statistics()
        yield CounterMetricFamily(
            "shardnet_http_sent_bytes", "HTTP lane body bytes sent", value=http.bytes_sent
        )
        yield CounterMetricFamily(
            "shardnet_http_requests", "HTTP responses started", value=http.requests
        )
        yield GaugeMetricFamily(
            "shardnet_http_open_connections", "open HTTP connections", value=http.open_connections
        )
        yield CounterMetricFamily(
            "shardnet_http_received_bytes",
            "HTTP body bytes downloaded",
            value=client.bytes_received,
        )
        served = CounterMetricFamily(
            "shardnet_served_bytes", "bytes served per version", labels=["step"]
        )
        for step, n in sorted(node.server.bytes_by_step.items()):
            served.add_metric([str(step)], n)
        yield served
        yield CounterMetricFamily(
            "shardnet_origin_refused", "super-seeding refusals", value=node.server.refused_once
        )
        steps = node.store.committed_steps()
        yield GaugeMetricFamily(
            "shardnet_versions_committed", "committed versions kept", value=len(steps)
        )
        yield GaugeMetricFamily(
            "shardnet_latest_committed_step",
            "newest committed step",
            value=steps[-1] if steps else -1,
        )
        yield GaugeMetricFamily(
            "shardnet_versions_in_progress",
            "versions being filled",
            value=len(node.server.in_progress()),
        )


def registry_for(node: ShardcastNode) -> CollectorRegistry:
    """A fresh registry holding this node's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(node))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry``."""
    return generate_latest(registry)
