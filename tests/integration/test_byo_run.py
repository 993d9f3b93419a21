"""Bring your own model, task and trainer: shardnet as the data plane of a real RL run.

Real processes on 127.0.0.1: an origin watching ``W`` with ``--rollouts-out R``, a relay,
``shardnet mirror export`` of the relay's store (every 0.3 s) served by Debian's nginx, two
peers given that mirror (``--mirror``), and ``docs/external_trainer.py`` starting from a
locally built Qwen2-architecture model directory with a BPE tokenizer trained here
(:mod:`tests.byo_models`), on the dataset task ``rollout/tasks/arithmetic.jsonl``.

The relay advertises an HTTP lane URL nobody listens on (it still carries announcements and
the run card over libp2p), so the shard bytes peers commit come from the mirror or from each
other: the mirror path carries a real run, deterministically.

Reward: ``regex:^\\s*\\d`` (1 when the completion starts with a digit). A few GRPO steps move
it on a tiny random Qwen2 (here, lr 1e-2 and 4-token answers, the peers' PeerIDs fixed: 0.19,
0.22, 0.30, 0.52, 0.59, 0.77, 0.77, 0.91, 0.92 for versions 0..8, the same on every run; with
random PeerIDs one CI run got 0.14 ... 0.48, 0.44; in-process, ``test_task_loop.py``, alike),
whereas the task's natural ``numeric`` reward (the right answer) stays flat near 0 for a model
this small, so no learning could be seen.

Checked: every version reaches both peers, which tokenize with the checkpoint's own tokenizer
(the prompts in the Parquet rows are the chat template rendered by the trained BPE tokenizer;
the tokenizer files in the peers' versions are the model directory's bytes); the trainer's own
rewards (``--task``/``--task-reward``) equal the validator's; the mirror served bytes of every
version the peers committed; the mean reward rises.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from p2p.identity import Identity
from rollout.model_dir import load_tokenizer
from rollout.parquet_out import read_rollouts
from tests.byo_models import write_model_dir
from tests.integration.procs import LOOPBACK_ANY, NEEDS_NGINX, Node, free_port, nginx, nodes

__all__ = ["nodes"]  # the fixture

pytestmark = NEEDS_NGINX

RUN = "byo"
STEPS = 8
LR = "1e-2"
ROOT = Path(__file__).resolve().parents[2]
TASK = ["--task", str(ROOT / "rollout" / "tasks" / "arithmetic.jsonl")]
TASK += ["--task-reward", r"regex:^\s*\d"]
ROWS = 4 * 8  # rows per batch: the origin's n_prompts x group_size (defaults)
SAMPLING = ["--max-new-tokens", "4"]  # the answer's first tokens are what the reward reads


def _seeded_key(path: Path, seed: str) -> None:
    """Write the node key of ``Identity.from_seed(seed)`` at ``path`` (mode 0600).

    A peer's prompts and sampling noise derive from its PeerID
    (:func:`rollout.batch.sample_seed`, :func:`rollout.gumbel.group_seed`), and the trainer
    waits for both peers' batches of each version, so fixed PeerIDs make the reward curve the
    same on every run here instead of a draw from the space of keys.
    """
    path.parent.mkdir(parents=True)
    path.write_bytes(Identity.from_seed(seed).key_pair.private_key.serialize())
    path.chmod(0o600)


def _mirror_bytes(peer: Node, url: str) -> dict[int, int]:
    """Bytes each committed version took from ``url`` (the peer's version_downloaded lines)."""
    out: dict[int, int] = {}
    for line in peer.drain():
        if m := re.search(r"version_downloaded step=(\d+) .* sources=(\S*)", line):
            srcs = [s.rsplit(":", 1) for s in m.group(2).split(",") if s]
            out[int(m.group(1))] = sum(int(n) for s, n in srcs if s == url)
    return out


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_byo_model_task_trainer_and_mirror(tmp_path: Path, nodes: list[Node]) -> None:
    logs, watch, out = tmp_path / "logs", tmp_path / "watch", tmp_path / "rollouts"
    model = write_model_dir(tmp_path / "qwen2", "qwen2", seed=0)
    odir, rdir, www = tmp_path / "origin", tmp_path / "relay", tmp_path / "www"
    origin_id = Identity.load_or_create(odir / "node.key").peer_id
    relay_id = Identity.load_or_create(rdir / "node.key").peer_id
    port, relay_port = free_port(), free_port()
    oaddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}"
    raddr = f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{relay_id}"
    with socket.socket() as dead, nginx(www, tmp_path / "nginx") as mirror:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
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
                *TASK,
                *SAMPLING,
            ],
            logs,
            {},
        )  # fmt: skip
        nodes.append(origin)
        origin.wait_for(r"node_ready role=origin")
        relay = Node(
            "relay",
            [
                "relay",
                "--data-dir", str(rdir),
                "--run-id", RUN,
                "--upstream", oaddr,
                "--trainer-id", origin_id,
                "--listen", f"/ip4/127.0.0.1/tcp/{relay_port}",
                "--http-host", "127.0.0.1", "--http-port", "0",
                "--public-url", f"http://127.0.0.1:{dead.getsockname()[1]}",
            ],
            logs,
            {},
        )  # fmt: skip
        nodes.append(relay)
        relay.wait_for(r"node_ready role=relay")
        with (tmp_path / "trainer.out").open("w") as so, (logs / "trainer.log").open("w") as se:
            trainer = subprocess.Popen(
                [
                    sys.executable, str(ROOT / "docs" / "external_trainer.py"),
                    "--watch", str(watch),
                    "--rollouts", str(out),
                    "--model", str(model),
                    *TASK,
                    "--steps", str(STEPS),
                    "--lr", LR,
                    "--min-batches", "2",
                    "--wait-s", "120",
                ],
                stdout=so,
                stderr=se,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        try:
            relay.wait_for(r"version_downloaded step=0 ", timeout_s=120)
            exporter = Node(
                "mirror-export",
                [
                    "mirror", "export",
                    "--data-dir", str(rdir),
                    "--out", str(www),
                    "--run-id", RUN,
                    "--trainer-id", origin_id,
                    "--every-s", "0.3",
                ],
                logs,
                {},
            )  # fmt: skip
            nodes.append(exporter)
            peers = []
            for i in range(2):
                _seeded_key(tmp_path / f"peer{i}" / "node.key", f"byo-peer{i}")
                peer = Node(
                    f"peer{i}",
                    [
                        "peer",
                        "--data-dir", str(tmp_path / f"peer{i}"),
                        "--bootstrap", raddr,
                        "--trainer-id", origin_id,
                        "--trainer-addr", oaddr,
                        "--mirror", mirror,
                        *TASK,
                        *LOOPBACK_ANY,
                    ],
                    logs,
                    {},
                )  # fmt: skip
                nodes.append(peer)
                peers.append(peer)
            assert trainer.wait(timeout=600) == 0, (logs / "trainer.log").read_text()[-3000:]
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        curve = [json.loads(line) for line in (tmp_path / "trainer.out").read_text().splitlines()]
        print("external trainer:", curve)
        assert [c["step"] for c in curve] == list(range(1, STEPS + 1))
        assert all(c["batches"] == 2 and c["rows"] == 2 * ROWS for c in curve), curve
        # the trainer's own reward (same --task/--task-reward) is the validator's, row by row
        assert all(c["reward_mismatches"] == 0 for c in curve), curve

        for peer in peers:
            peer.wait_for(rf"version_downloaded step={STEPS} ", timeout_s=120)
        # the last version's rollouts (nobody trains on them) show where the reward got to:
        # the origin logs each file it writes, one batch per peer
        origin.wait_for(rf"rollouts_written step={STEPS} ", timeout_s=120, count=2)
        by_step = {step: read_rollouts(out, step=step).to_pylist() for step in range(STEPS + 1)}
        mean = {s: sum(r["reward"] for r in rs) / len(rs) for s, rs in by_step.items() if rs}
        print("mean reward by version:", mean)
        # measured: 0.19 -> 0.92 (see the module docstring); a margin for other CPUs' arithmetic
        assert (mean[STEPS] + mean[STEPS - 1]) / 2 > (mean[0] + mean[1]) / 2 + 0.3, mean

        # peers tokenized with the checkpoint's tokenizer: the trained BPE one, chat template
        tok = load_tokenizer(model)
        for rows in by_step.values():
            assert {r["verdict"] for r in rows} == {"accepted"}
            assert len({r["submitter"] for r in rows}) == 2
            for r in rows:
                assert tok.decode(r["prompt_ids"]).startswith("<|im_start|>user\nWhat is ")
        for i in range(2):
            held = tmp_path / f"peer{i}" / "versions" / RUN / f"step-{STEPS}"
            for name in ("tokenizer.json", "tokenizer_config.json"):
                assert (held / name).read_bytes() == (model / name).read_bytes(), name

        # the mirror served bytes the peers committed (anonymous, ranged GETs)
        taken = [_mirror_bytes(p, mirror) for p in peers]
        print("bytes from the mirror by peer and step:", taken)
        assert all(set(t) >= set(range(STEPS + 1)) for t in taken), taken
        assert sum(sum(t.values()) for t in taken) > 0, taken
        access = (tmp_path / "nginx" / "access.log").read_text().splitlines()
        served = [ln for ln in access if re.search(r"/(files|shard)/.* status=20[06] ", ln)]
        assert served, access[:5]
        assert all(ln.endswith('auth="-"') for ln in access), access[:3]

        assert origin.stop(signal.SIGTERM) == 0
    report = json.loads((tmp_path / "origin.json").read_text())["rollouts"]
    print("origin rollouts report:", report)
    assert report["accepted_samples"] >= 2 * STEPS * ROWS
    assert sum(report["rejected_samples"].values()) == 0, report["rejected_samples"]
