"""deploy/: the alert rules and scrape config pass promtool; every metric the rules and the
Grafana dashboard query is one the nodes export (tests/observability.py, which the live
scrape test checks against real nodes)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability import promtool, sample_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# a metric name in PromQL: an identifier not followed by "(" (a function), not a label name
# (followed by =, !=, =~ or inside by/on/without lists), not a keyword
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    "by",
    "on",
    "without",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "le",
}


def metric_names(expr: str) -> set[str]:
    """Metric names used in a PromQL expression (label matchers and functions excluded)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[-+]?\d+)?", "", expr)  # numbers
    out = set()
    for m in _IDENT.finditer(expr):
        name = m.group()
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or name in _KEYWORDS or re.fullmatch(r"\d.*", name):
            continue
        if re.fullmatch(r"\d+(e\d+)?", name):
            continue
        out.add(name)
    return out


def rule_exprs() -> list[str]:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "shardnet.json").read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_metric_names_parser() -> None:
    assert metric_names(
        'sum by (le) (rate(a_total{job="x"}[5m])) > scalar(max(b)) and on(instance) c == 0'
    ) == {"a_total", "b", "c"}


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_queried_metric_is_exported(source: str) -> None:
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    assert exprs
    exported = sample_names()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, (expr, names - exported)


def test_dashboard_covers_the_families() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    for family in (
        "shardnet_received_bytes_total",
        "shardnet_rollout_samples_rejected_total",
        "shardnet_version_commit_latency_seconds_bucket",
        "shardnet_trainer_peers",
    ):
        assert family in used


def test_promtool_accepts_rules_and_config() -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        proc = subprocess.run([tool, *args], cwd=DEPLOY, capture_output=True, timeout=60)
        assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
