"""The ``/status`` document: advertised lane URL and the run card section (no network)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from rich.console import Console

from p2p.errors import short_id
from p2p.identity import Identity
from shardcast.core.portmap import MapFailure, Mapping, PortMapPolicy
from shardcast.node.nodestatus import node_status
from shardcast.wire.finish import RunFinished
from shardcast.wire.runcard import EngineSpec, RunCard, SamplingRules, TaskSpec, sign_card
from shardnet.status import render

TRAINER = Identity.from_seed("status-trainer")


def _node(card: object) -> Any:
    """The attributes :func:`node_status` reads, bound to 0.0.0.0 and advertised elsewhere."""
    stats = SimpleNamespace(bytes_sent=10, open_connections=1)
    return SimpleNamespace(
        config=SimpleNamespace(role="relay", run_id="run-1", keep_last=3),
        identity=TRAINER,
        http=SimpleNamespace(url="http://0.0.0.0:8002", statistics=lambda: stats),
        http_url="http://10.1.2.3:8002",
        p2p=SimpleNamespace(
            multiaddrs=lambda: ["/ip4/10.1.2.3/tcp/4002"],
            connected_peers=lambda: [],
            mesh_sizes=lambda: {},
        ),
        store=SimpleNamespace(committed_steps=lambda: [3], chain_depth=lambda step: 0),
        server=SimpleNamespace(in_progress=lambda: []),
        announcement=None,
        finished=None,
        metrics=SimpleNamespace(
            requests_by_class={"2xx": 1}, client_errors={}, observability_bytes=0
        ),
        client=SimpleNamespace(statistics=lambda: SimpleNamespace(bytes_received=5)),
        started_at=time.time() - 5,
        status_sections={},
        card=card,
    )


def test_status_names_the_advertised_url_and_the_run_card() -> None:
    card = sign_card(
        RunCard(
            card_version=2,
            run_id="run-1",
            trainer=TRAINER.peer_id,
            task=TaskSpec("digits", 1, "ab" * 32),
            sampling=SamplingRules(4, 8, 16, 0.7),
            engines=(EngineSpec("transformers", "bf16"),),
            async_level=2,
            architecture_digest="cd" * 32,
            issued_at_ms=1_767_225_600_000,
        ),
        TRAINER,
    )
    doc = node_status(_node(card))
    assert doc["http_url"] == "http://10.1.2.3:8002"  # what others dial, not the bind address
    rc = doc["run_card"]
    assert rc["version"] == 2
    assert rc["digest"] == card.digest
    assert rc["signer"] == TRAINER.peer_id
    assert rc["engines"] == "transformers-bf16"
    assert rc["sampling"]["group_size"] == 8
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "run card" in text
    assert "http://10.1.2.3:8002" in text
    assert "0.0.0.0" not in text


def test_status_without_a_card_has_no_card_section() -> None:
    assert "run_card" not in node_status(cast(Any, _node(None)))


def test_status_renders_rollout_acceptance_as_text() -> None:
    acc = {
        "decided": 10,
        "accepted": 8,
        "trained": 6,
        "late": 0,
        "acceptance_rate": 0.8,
        "trained_rate": 0.6,
    }
    doc = node_status(_node(None))
    doc["rollouts"] = {
        "announced": 52,
        "duplicates": 0,
        "redelivered": 26,
        "acceptance": {
            "by_submitter": {TRAINER.peer_id: acc},
            "by_length": {"<=256": acc, "257-1024": {**acc, "late": 2, "decided": 0}},
        },
    }
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "<=256: 10 decided, 8 admitted, 6 trained (80% admitted)" in text
    assert "257-1024: 0 decided, 8 admitted, 6 trained, 2 late" in text
    assert "acceptance by submitter" in text
    assert TRAINER.peer_id[-8:] in text
    assert re.search(r"also by 2nd route\s+│ 26 ", text)  # a clean run's gossip copies
    assert "redelivered" not in text
    assert "{" not in text
    assert "acceptance_rate" not in text


def test_status_renders_a_standalone_origins_intake() -> None:
    """An origin for an external trainer: its intake line, and the peers reporting to it
    judged against its newest version and the run's async window."""
    doc = node_status(_node(None))
    doc["role"] = "origin"
    doc["intake"] = {
        "async_window_versions": 1,
        "rollouts_out": "/data/rollouts",
        "started": True,
        "files_written": 12,
        "rows_written": 384,
        "reputation": {"scores": {TRAINER.peer_id: 0.75}, "refused": [], "rate_limited": 0},
    }
    doc["network"] = [
        {"peer_id": TRAINER.peer_id, "latest_step": 1, "lag_versions": 2, "last_heard": None}
    ]
    doc["rollouts"] = {"announced": 3}
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "async window 1; rollouts to /data/rollouts: 12 files, 384 samples" in text
    assert "network (peers reporting to the origin)" in text
    assert f"{short_id(TRAINER.peer_id)}=0.75" in text
    doc["intake"] = {"async_window_versions": 2, "rollouts_out": None}
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "async window 2; rollouts not taken (no --rollouts-out)" in console.export_text()


def test_status_brackets_an_ipv6_lane() -> None:
    doc = node_status(_node(None))
    doc["http_url"] = "http://[fd77::2]:8002"
    doc["upstreams"] = [
        {"peer_id": TRAINER.peer_id, "state": "down", "error": "GET http://[fd77::3]:8001 failed"}
    ]
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "http://[fd77::2]:8002" in text  # the brackets are not read as a style tag
    assert "http://[fd77::3]:8001" in text


def test_a_long_upstream_error_is_clipped_at_the_terminal_width() -> None:
    doc = node_status(_node(None))
    long = "request/response exchange failed: " + "x" * 80
    doc["upstreams"] = [{"peer_id": TRAINER.peer_id, "state": "down", "error": long}]
    wide = Console(width=300, record=True)
    wide.print(render(doc))
    assert long in wide.export_text()  # room for all of it
    narrow = Console(width=80, record=True)
    narrow.print(render(doc))
    text = narrow.export_text()
    assert long not in text
    line = next(ln for ln in text.splitlines() if "error: request/response" in ln)
    assert line.rstrip().endswith("\u2026")
    assert len(line.rstrip()) == 80
    # the table's columns keep their width in 80 columns (the error squeezed them before)
    head = next(ln for ln in text.splitlines() if "peer" in ln and "last heard" in ln)
    for col in ("peer", "state", "role", "latest", "last heard"):
        assert col in head


def test_status_shows_own_reachability_and_each_known_lane() -> None:
    doc = node_status(_node(None))
    doc["reachability"] = {
        "http_url": "http://10.78.0.2:8003",
        "state": "unreachable",
        "advertised": False,
        "since": "2026-01-01T00:00:05Z",
        "checked_at": "2026-01-01T00:00:05Z",
        "last_answers": ["mismatch"],
        "relays": ["12D3KooWRRRRRRRRRRRRRRRRRRRRR"],
        "punches": {"started": 3, "ahead": 2, "direct": 2, "failed": 1},
    }
    node = {"role": "peer", "latest_step": 3, "filling": [], "last_heard": None}
    doc["known_nodes"] = [
        {**node, "peer_id": "12D3KooWAAAAAAAAAAAAAAAAAAAAA", "lane": "verified"},
        {
            **node,
            "peer_id": "12D3KooWBBBBBBBBBBBBBBBBBBBBB",
            "lane": "unreachable",
            "lane_failures": 2,
        },
        {
            **node,
            "peer_id": "12D3KooWCCCCCCCCCCCCCCCCCCCCC",
            "lane": "unreachable",
            "lane_failures": 4,
            "lane_dropped": True,
        },
        {**node, "peer_id": "12D3KooWDDDDDDDDDDDDDDDDDDDDD", "lane": "none"},
    ]
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "unreachable since 00:00:05; not advertised (download-only)" in text
    assert "reserved on 1 relay(s); punches 3 started (2 ahead of need), 2 direct, 1 failed" in text
    assert "(mismatch)" in text
    for want in ("verified", "unreachable x2", "dropped (unreachable)", "none"):
        assert want in text


def test_status_lists_versions_kept_as_chains_with_their_depth() -> None:
    node = _node(None)
    depths = {3: 0, 4: 1, 5: 2}

    def depth(step: int) -> int:
        if step == 6:
            raise FileNotFoundError(step)  # pruned while the document was built
        return depths[step]

    node.store = SimpleNamespace(committed_steps=lambda: [3, 4, 5, 6], chain_depth=depth)
    doc = node_status(node)
    assert doc["versions"]["chained"] == {"4": 1, "5": 2}  # full versions are not listed
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "4 (depth 1), 5 (depth 2)" in console.export_text()
    assert doc["versions"]["beyond_keep_last"] == [3]


def test_a_long_chain_is_summed_up_and_says_why_more_than_keep_last_are_held() -> None:
    """keep-last 3 on a relay with a chain of 8 deltas on full version 0: all 9 are held,
    and the status says why (the chains need their bases), in 80 columns."""
    node = _node(None)
    node.store = SimpleNamespace(committed_steps=lambda: list(range(9)), chain_depth=lambda s: s)
    doc = node_status(node)
    assert doc["versions"]["beyond_keep_last"] == [0, 1, 2, 3, 4, 5]
    console = Console(width=80, record=True)
    console.print(render(doc))
    text = console.export_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("chains"))
    assert line.rstrip().endswith("8 (steps 1…8), up to 8 links; +6 bases beyond keep-last 3")


def test_status_renders_port_mapping() -> None:
    policy = PortMapPolicy()
    policy.mapped("203.0.113.7", [Mapping("http", 8003, 8003)], 3600, now=0.0)
    policy.failed(MapFailure.REFUSED, "ConflictInMappingEntry", now=1800.0)
    policy.mapped("203.0.113.7", [Mapping("http", 8003, 40001)], 3600, now=1830.0)
    doc = node_status(_node(None))
    doc["port_mapping"] = {
        **policy.status(2430.0, str),
        "candidate_url": "http://203.0.113.7:40001",
        "candidate_state": "reachable",
        "advertised": True,
    }
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "port map" in text
    assert "mapped http 8003->203.0.113.7:40001; lease left 50m00s" in text
    assert "lane reachable (advertised)" in text
    assert "last error refused: ConflictInMappingEntry" in text


def test_status_says_when_the_run_finished() -> None:
    node = _node(None)
    doc = node_status(node)
    assert doc["versions"]["finished"] is None
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "finished" not in console.export_text()
    node.finished = RunFinished.create(TRAINER, "run-1", 3, "ab" * 32, seq=1)
    doc = node_status(node)
    assert doc["versions"]["finished"] == {"step": 3, "manifest_digest": "ab" * 32}
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "run finished at step 3" in console.export_text()


def test_status_says_none_for_no_requests() -> None:
    doc = node_status(_node(None))
    doc["http"]["requests"] = {"2xx": 0}
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert re.search(r"^requests +none *$", console.export_text(), re.M)


def test_the_traffic_lines_fit_80_columns_with_large_counts() -> None:
    doc = node_status(_node(None))
    doc["http"].update(sent_bytes=1_320_000_000_000, received_bytes=1_320_000_000_000)
    doc["http"]["requests"] = {"2xx": 1_234_567, "3xx": 0, "4xx": 21_000, "5xx": 17}
    doc["http"]["client_errors"] = {"404": 6_000, "429": 15_000}
    doc["libp2p"]["connected_peers"] = 120
    console = Console(width=80, record=True)
    console.print(render(doc))
    lines = console.export_text().splitlines()
    traffic = next(i for i, ln in enumerate(lines) if ln.startswith("traffic"))
    assert lines[traffic + 1].startswith("requests  2xx=1234567 4xx=21000 5xx=17")
    assert "(429 sent elsewhere 15000, 404 not held 6000)" in " ".join(" ".join(lines).split())


def test_an_upstream_that_left_after_the_run_end_is_no_fault() -> None:
    doc = node_status(_node(None))
    up = {
        "peer_id": TRAINER.peer_id,
        "state": "unreachable",
        "role": None,
        "latest_step": None,
        "last_heard": "2026-01-01T00:00:05Z",
        "error": "connection closed",
    }
    doc["upstreams"] = [{**up, "expected": "run_finished"}, {**up, "expected": None}]
    console = Console(width=80, record=True)
    console.print(render(doc))
    rows = [ln for ln in console.export_text().splitlines() if short_id(TRAINER.peer_id) in ln]
    assert "left (run over)" in rows[0]
    assert "unreachable" in rows[1]
    assert all(len(r.rstrip()) <= 80 for r in rows)


def test_the_standalone_origin_says_what_it_waits_for_in_watch() -> None:
    doc = node_status(_node(None))
    doc["watch"] = {
        "dir": "ckpts",
        "ready_marker": "DONE",
        "finished_marker": "FINISHED",
        "finished_marker_present": False,
        "latest_published": 3,
        "refused": [4],
    }
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "ckpts: published 3; refused 4 (see checkpoint_refused in the log)" in text
    doc["watch"].update(refused=[], finished_marker_present=True)
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "published 3; waiting for step-<N>/DONE; FINISHED present: run ended" in (
        console.export_text()
    )
    doc["watch"].update(latest_published=None, finished_marker_present=False, dir_present=False)
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert (
        "ckpts: published -; the directory does not exist (waiting for the trainer to create it)"
        in console.export_text()
    )


def test_watching_into_a_file_prints_one_view_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live view draws nothing when the output is not a terminal (``status --watch >
    file``): each refresh is printed whole instead."""
    import io

    from shardnet import status

    doc = node_status(_node(None))
    answers = iter([doc, status.StatusError("connection refused")])

    async def fetch(target: str) -> dict[str, Any]:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(status, "fetch_status", fetch)
    buf = io.StringIO()
    out = Console(file=buf, width=100)
    assert not out.is_terminal
    rc = status.run_status(
        "http://127.0.0.1:1", watch=True, interval_s=0.01, console=out, max_refreshes=2
    )
    text = buf.getvalue()
    assert rc == 0
    assert "held step 3" in text
    assert "connection refused (retrying every 0.01s)" in text
