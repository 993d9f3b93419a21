"""An external trainer drives a run through ``shardnet origin --watch W --rollouts-out R``.

Real processes on 127.0.0.1: an origin watching ``W`` with ``--rollouts-out R``, a relay,
two peers, and ``docs/external_trainer.py`` (plain PyTorch GRPO) writing ``W/step-<k>/``
after reading ``R/step-<k-1>/``. Checked: every version flows to the peers; every step's
Parquet files hold verified rollouts of both peers with the validator's rewards (the schema
of ``rollout/parquet_out.py``); the origin reports what it accepted and nothing rejected.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2p.identity import Identity
from rollout.parquet_out import SCHEMA, read_rollouts
from tests.integration.procs import LOOPBACK_ANY, Node, free_port, nodes
from tests.observability import BY_ROLE, families, promtool, promtool_check_metrics

__all__ = ["nodes"]

RUN = "external"
STEPS = 5
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_external_trainer_loop(tmp_path: Path, nodes: list[Node]) -> None:
    logs, watch, out = tmp_path / "logs", tmp_path / "watch", tmp_path / "rollouts"
    odir = tmp_path / "origin"
    origin_id = Identity.load_or_create(odir / "node.key").peer_id
    relay_id = Identity.load_or_create(tmp_path / "relay" / "node.key").peer_id
    port, relay_port = free_port(), free_port()
    oaddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}"
    raddr = f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{relay_id}"
    origin = Node(
        "origin",
        [
            "origin",
            "--data-dir", str(odir),
            "--run-id", RUN,
            "--watch", str(watch),
            "--rollouts-out", str(out),
            "--listen", f"/ip4/127.0.0.1/tcp/{port}",
            "--http-host", "127.0.0.1", "--http-port", "0",
            "--shard-size-bytes", "262144",
            "--keep-last", "10",
            "--report", str(tmp_path / "origin.json"),
        ],
        logs,
        {},
    )  # fmt: skip
    nodes.append(origin)
    origin_url = re.search(r"http_url=(\S+)", origin.wait_for(r"node_ready role=origin"))
    assert origin_url is not None
    relay = Node(
        "relay",
        [
            "relay",
            "--data-dir", str(tmp_path / "relay"),
            "--run-id", RUN,
            "--upstream", oaddr,
            "--trainer-id", origin_id,
            "--listen", f"/ip4/127.0.0.1/tcp/{relay_port}",
            "--http-host", "127.0.0.1", "--http-port", "0",
        ],
        logs,
        {},
    )  # fmt: skip
    nodes.append(relay)
    relay.wait_for(r"node_ready role=relay")
    peers = []
    peer_ids = {Identity.load_or_create(tmp_path / f"peer{i}" / "node.key").peer_id for i in (0, 1)}
    for i in range(2):
        peer = Node(
            f"peer{i}",
            [
                "peer",
                "--data-dir", str(tmp_path / f"peer{i}"),
                "--bootstrap", raddr,
                "--trainer-id", origin_id,
                "--trainer-addr", oaddr,
                *LOOPBACK_ANY,
            ],
            logs,
            {},
        )  # fmt: skip
        nodes.append(peer)
        peers.append(peer)
    trainer = _external_trainer(watch, out, STEPS, wait_s=300)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    curve = [json.loads(line) for line in trainer.stdout.splitlines()]
    print("external trainer:", curve)
    assert [c["step"] for c in curve] == list(range(1, STEPS + 1))
    assert all(c["batches"] == 2 and c["rows"] == 2 * 4 * 8 for c in curve), curve

    origin.wait_for(rf"version_published step={STEPS} ", timeout_s=120)
    for peer in peers:
        peer.wait_for(rf"version_downloaded step={STEPS} ", timeout_s=240)
    for step in range(STEPS):
        table = read_rollouts(out, step=step)
        assert table.schema == SCHEMA
        rows = table.to_pylist()
        assert {r["policy_step"] for r in rows} == {step}
        assert {r["verdict"] for r in rows} == {"accepted"}
        assert len({r["submitter"] for r in rows}) == 2
        assert all(len(r["logprobs"]) == len(r["completion_ids"]) > 0 for r in rows)
        assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
        assert len({r["group_id"] for r in rows}) == 2 * 4
    assert not list(out.rglob(".*.tmp"))  # nothing half-written left behind
    # the last version's rollouts (nobody trains on them) show where the reward got to: the
    # origin logs each file it writes, one batch per peer
    origin.wait_for(rf"rollouts_written step={STEPS} ", timeout_s=240, count=2)
    assert read_rollouts(out, step=STEPS).num_rows >= 2 * 32
    mean = {
        step: sum(r["reward"] for r in rows) / len(rows)
        for step in range(STEPS + 1)
        if (rows := read_rollouts(out, step=step).to_pylist())
    }
    print("mean reward by version:", mean)
    # measured: 0.072, 0.100, 0.170, 0.214, 0.238, 0.338 (test_grpo.py's loop: +0.18 by 5)
    assert mean[STEPS] > mean[0] + 0.1, mean
    # then the trainer wrote the finished marker: the origin signed the run's end at STEPS
    origin.wait_for(rf"run_finished_announced step={STEPS} ", timeout_s=60)
    for peer in peers:
        peer.wait_for(rf"run_finished run=\S+ step={STEPS} ", timeout_s=120)

    _check_origin_observability(origin_url.group(1), peer_ids)

    # started again with one more step: it goes on from W/step-STEPS (it rewrote step-1 and
    # failed), the origin continues the run, publishes the new step once, and ends it there
    again = _external_trainer(watch, out, STEPS + 1, wait_s=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [json.loads(line)["step"] for line in again.stdout.splitlines()] == [STEPS + 1]
    origin.wait_for(rf"version_published step={STEPS + 1} ", timeout_s=120)
    origin.wait_for(rf"run_finished_announced step={STEPS + 1} ", timeout_s=60)
    assert all(origin.count(rf"version_published step={k} ") == 1 for k in range(STEPS + 2))
    assert not list(watch.glob(".step-*"))  # no half-written step left behind

    assert origin.stop(signal.SIGTERM) == 0
    report = json.loads((tmp_path / "origin.json").read_text())["rollouts"]
    print("origin rollouts report:", report)
    assert report["started"] is True
    assert report["files"] >= 2 * STEPS
    assert report["accepted_samples"] >= 2 * STEPS * 32
    assert sum(report["rejected_samples"].values()) == 0, report["rejected_samples"]


def _external_trainer(
    watch: Path, out: Path, steps: int, wait_s: float
) -> subprocess.CompletedProcess[str]:
    """``docs/external_trainer.py`` on ``watch`` and ``out`` up to ``steps``, run to its end."""
    return subprocess.run(
        [
            sys.executable, str(ROOT / "docs" / "external_trainer.py"),
            "--watch", str(watch),
            "--rollouts", str(out),
            "--steps", str(steps),
            "--min-batches", "2",
            "--wait-s", str(wait_s),
        ],
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _check_origin_observability(url: str, peer_ids: set[str]) -> None:
    """The origin's ``/metrics`` and ``/status`` show the rollout side it runs for the external
    trainer, under the trainer's names (the alert rules in ``deploy/`` read them)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    fams = families(text)
    ours = {f for f in fams if f.startswith("shardnet_") and not f.endswith("_created")}
    want = BY_ROLE["origin_rollouts"]
    assert ours == {f for f in want if f.startswith("shardnet_")}, ours ^ set(want)
    assert all(fams[f] == kind for f, kind in want.items()), fams
    if promtool() is not None:
        promtool_check_metrics(text)
    samples = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["shardnet_rollout_samples_accepted_total[]"] >= 2 * STEPS * 32
    assert samples["shardnet_rollouts_out_files_total[]"] >= 2 * STEPS
    assert samples["shardnet_rollouts_out_rows_total[]"] >= 2 * STEPS * 32
    assert samples["shardnet_trainer_peers[('state', 'current')]"] == 2
    assert samples["shardnet_trainer_async_window_versions[]"] >= 1
    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        doc = json.loads(resp.read())
    assert {p["peer_id"] for p in doc["network"]} == peer_ids
    assert doc["rollouts"]["accepted_samples"] >= 2 * STEPS * 32
    assert doc["intake"]["files_written"] >= 2 * STEPS
    status = subprocess.run(
        [sys.executable, "-m", "shardnet.cli", "status", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    assert status.returncode == 0, status.stderr
    assert "network (peers reporting to the origin)" in status.stdout
    assert re.search(r"intake\s+async window \d+; rollouts to \S+: \d+ files", status.stdout)
