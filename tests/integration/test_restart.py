"""Restart and resume with real processes on 127.0.0.1 (SIGKILL and SIGTERM).

* a trainer killed after version k resumes on its data directory at k+1 (never k again),
  and the peer that follows it (itself stopped and restarted before) re-introduces itself
  and follows through its relay; at the end both log the signed run end once, the peer
  exits by itself (``exit_on_finish``) and the relay keeps serving;
* a restarted origin re-announces its newest version at once (a relay that connects later
  gets it without a new step); a relay killed and restarted keeps its verified versions;
* a relay holding a step with another digest than the trainer's newest signed one replaces it.

Each node's stderr is read line by line in a thread, so a test waits for a log line as an
event, with a deadline; every process is stopped by the test.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.wire.manifest import MANIFEST_FILE, Manifest
from tests.helpers import make_checkpoint
from tests.integration.procs import LOOPBACK_ANY, Node, free_port, nodes

__all__ = ["nodes"]  # the fixture

RUN = "restart"
SAMPLING = ["--n-prompts", "2", "--group-size", "4", "--max-new-tokens", "8"]


class Lab(NamedTuple):
    """A trainer and a relay on 127.0.0.1: their keys (in ``<tmp>/trainer``, ``<tmp>/relay``),
    libp2p ports and ``/p2p/`` multiaddrs."""

    trainer_id: str
    port: int
    relay_port: int
    taddr: str
    raddr: str

    @classmethod
    def make(cls, tmp_path: Path) -> Lab:
        trainer_id = Identity.load_or_create(tmp_path / "trainer" / "node.key").peer_id
        relay_id = Identity.load_or_create(tmp_path / "relay" / "node.key").peer_id
        port, relay_port = free_port(), free_port()
        return cls(
            trainer_id,
            port,
            relay_port,
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{trainer_id}",
            f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{relay_id}",
        )


def digest_of(data_dir: Path, step: int, trainer: str) -> str:
    raw = (data_dir / "versions" / RUN / f"step-{step}" / MANIFEST_FILE).read_bytes()
    return Manifest.decode(raw, trust=TrustList(trainer=trainer)).digest


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_trainer_sigkill_resumes_at_next_step_and_peer_follows(
    tmp_path: Path, nodes: list[Node]
) -> None:
    tdir, pdir, logs = tmp_path / "trainer", tmp_path / "peer", tmp_path / "logs"
    trainer_id, port, relay_port, taddr, raddr = Lab.make(tmp_path)
    http_port = free_port()
    trainer_args = [
        "trainer",
        "--data-dir", str(tdir),
        "--run-id", RUN,
        "--steps", "5",
        "--preset", "tiny",
        *SAMPLING,
        "--no-check-model",
        "--listen", f"/ip4/127.0.0.1/tcp/{port}",
        "--http-host", "127.0.0.1",
        "--http-port", str(http_port),
        "--keep-last", "10",
        "--step-timeout-s", "120",
        "--shard-size-bytes", "262144",
    ]  # fmt: skip
    peer_args = [
        "peer",
        "--data-dir", str(pdir),
        "--run-id", RUN,
        "--bootstrap", raddr,
        "--trainer-id", trainer_id,
        "--trainer-addr", taddr,
        *LOOPBACK_ANY,
        "--report", str(tmp_path / "peer.json"),
    ]  # fmt: skip
    t1 = Node("trainer1", [*trainer_args, "--report", str(tmp_path / "t1.json")], logs, {})
    nodes.append(t1)
    t1.wait_for(r"node_ready role=trainer")
    relay_args = ["relay", "--data-dir", str(tmp_path / "relay"), "--run-id", RUN]
    relay = Node(
        "relay",
        [
            *relay_args,
            *("--upstream", taddr, "--trainer-id", trainer_id),
            *("--listen", f"/ip4/127.0.0.1/tcp/{relay_port}"),
            *("--http-host", "127.0.0.1", "--http-port", "0"),
        ],
        logs,
        {},
    )
    nodes.append(relay)
    relay.wait_for(r"node_ready role=relay")
    p1 = Node("peer1", peer_args, logs, {})
    nodes.append(p1)
    p1.wait_for(r"version_downloaded step=1 ", timeout_s=240)
    # a peer stopped (SIGTERM) and restarted on its data directory keeps its versions
    assert p1.stop(signal.SIGTERM) == 0
    peer = Node("peer2", peer_args, logs, {"SHARDNET_EXIT_ON_FINISH": "true"})
    nodes.append(peer)
    peer.wait_for(r"peer_resumed step=[12] ")
    t1.wait_for(r"version_published step=3 ", timeout_s=180)
    assert t1.stop(signal.SIGKILL) == -signal.SIGKILL
    d3 = digest_of(tdir, 3, trainer_id)
    assert (tdir / "trainer-state" / "step-3" / "state.json").is_file()

    t2 = Node("trainer2", [*trainer_args, "--report", str(tmp_path / "t2.json")], logs, {})
    nodes.append(t2)
    t2.wait_for(r"trainer_resumed plan=resume step=3 ")
    t2.wait_for(r"version_reannounced step=3 ")
    peer.wait_for(r"trainer_restarted", timeout_s=60)
    assert t2.proc.wait(timeout=300) == 0
    assert peer.proc.wait(timeout=120) == 0  # exit_on_finish: it left by itself
    # the relay followed the restarted trainer, logged the run's end once and keeps serving
    assert relay.count(r"run_finished run=") == 1
    assert relay.count(r"version_downloaded step=5 ") == 1
    assert relay.proc.poll() is None
    assert relay.stop(signal.SIGTERM) == 0

    lines2 = t2.drain()
    assert not any("version_published step=3 " in ln for ln in lines2)
    assert any("version_published step=4 " in ln for ln in lines2)
    assert any("version_published step=5 " in ln for ln in lines2)
    assert any("step_ready step=4 " in ln for ln in lines2)
    assert digest_of(tdir, 3, trainer_id) == d3  # step 3 was not published again
    report = json.loads((tmp_path / "t2.json").read_text())
    assert report["finished"] is True
    assert [s["step"] for s in report["steps"]] == [3, 4, 5]
    assert report["trained_samples"] > 0
    published = {s["step"]: s["manifest_digest"] for s in report["steps"]}
    peer_report = json.loads((tmp_path / "peer.json").read_text())
    got = {v["step"]: v["manifest_digest"] for v in peer_report["versions"]}
    assert got[4] == published[4]
    assert got[5] == published[5]
    assert peer.count(r"run_finished run=") == 1
    assert peer.count(r"peer_exiting reason=run_finished") == 1
    assert peer.count(r"version_downloaded step=[01] ") == 0  # kept from before its restart

    # stopped after saving the state of a version but before committing it: that version
    # is published from the saved weights; nothing earlier is touched
    shutil.rmtree(tdir / "versions" / RUN / "step-5")
    t3 = Node("trainer3", trainer_args, logs, {})
    nodes.append(t3)
    assert t3.proc.wait(timeout=120) == 0
    assert t3.count(r"trainer_resumed plan=republish step=5 ") == 1
    assert t3.count(r"version_published step=5 ") == 1
    assert digest_of(tdir, 4, trainer_id) == published[4]

    # a data directory whose trainer state is gone cannot be resumed: one line, exit 2
    shutil.rmtree(tdir / "trainer-state")
    bad = subprocess.run(
        [sys.executable, "-m", "shardnet.cli", *trainer_args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    assert "cannot resume" in bad.stderr


def _origin_args(data: Path, watch: Path, port: int, http_port: int) -> list[str]:
    return [
        "origin",
        "--watch", str(watch),
        "--data-dir", str(data),
        "--run-id", RUN,
        "--listen", f"/ip4/127.0.0.1/tcp/{port}",
        "--http-host", "127.0.0.1",
        "--http-port", str(http_port),
        "--shard-size-bytes", "65536",
    ]  # fmt: skip


def _publish_dir(watch: Path, step: int, seed: int) -> None:
    make_checkpoint(watch / f"step-{step}", {"model.safetensors": 300_000}, seed=seed)
    (watch / f"step-{step}" / "DONE").write_text("")


def test_origin_reannounces_and_relay_keeps_versions(tmp_path: Path, nodes: list[Node]) -> None:
    odir, rdir, watch, logs = (
        tmp_path / "origin",
        tmp_path / "relay",
        tmp_path / "w",
        tmp_path / "logs",
    )
    origin_id = Identity.load_or_create(odir / "node.key").peer_id
    port, http_port = free_port(), free_port()
    oaddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}"
    _publish_dir(watch, 0, seed=0)
    o1 = Node("origin1", _origin_args(odir, watch, port, http_port), logs, {})
    nodes.append(o1)
    o1.wait_for(r"version_published step=0 ")
    assert o1.stop(signal.SIGTERM) == 0

    o2 = Node("origin2", _origin_args(odir, watch, port, http_port), logs, {})
    nodes.append(o2)
    o2.wait_for(r"version_reannounced step=0 ")
    relay_args = [
        "relay",
        "--data-dir", str(rdir),
        "--run-id", RUN,
        "--upstream", oaddr,
        "--trainer-id", origin_id,
        *LOOPBACK_ANY,
    ]  # fmt: skip
    r1 = Node("relay1", relay_args, logs, {})
    nodes.append(r1)
    r1.wait_for(r"version_downloaded step=0 ")  # no new step was needed
    assert r1.stop(signal.SIGKILL) == -signal.SIGKILL

    r2 = Node("relay2", relay_args, logs, {})
    nodes.append(r2)
    r2.wait_for(r"store_recovered run=restart removed_steps=\[\]")
    r2.wait_for(r"upstream_ready")
    _publish_dir(watch, 1, seed=1)
    r2.wait_for(r"version_downloaded step=1 ")
    assert r2.count(r"version_downloaded step=0 ") == 0  # kept across the SIGKILL
    assert digest_of(rdir, 0, origin_id) == digest_of(odir, 0, origin_id)
    assert r2.stop(signal.SIGTERM) == 0
    assert o2.stop(signal.SIGTERM) == 0


def test_relay_replaces_a_step_held_with_another_digest(tmp_path: Path, nodes: list[Node]) -> None:
    logs = tmp_path / "logs"
    key = tmp_path / "origin.key"
    origin_id = Identity.load_or_create(key).peer_id
    port, http_port = free_port(), free_port()
    oaddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}"
    _publish_dir(tmp_path / "w1", 0, seed=0)
    _publish_dir(tmp_path / "w2", 0, seed=1)  # the same step, other content
    o1 = Node(
        "origin1",
        [*_origin_args(tmp_path / "o1", tmp_path / "w1", port, http_port), "--key", str(key)],
        logs,
        {},
    )
    nodes.append(o1)
    rdir = tmp_path / "relay"
    relay = Node(
        "relay",
        ["relay", "--data-dir", str(rdir), "--run-id", RUN, "--upstream", oaddr,
         "--trainer-id", origin_id, *LOOPBACK_ANY],
        logs,
        {},
    )  # fmt: skip
    nodes.append(relay)
    relay.wait_for(r"version_downloaded step=0 ")
    first = digest_of(rdir, 0, origin_id)
    assert o1.stop(signal.SIGTERM) == 0
    o2 = Node(
        "origin2",
        [*_origin_args(tmp_path / "o2", tmp_path / "w2", port, http_port), "--key", str(key)],
        logs,
        {},
    )
    nodes.append(o2)
    o2.wait_for(r"version_published step=0 ")
    relay.wait_for(r"version_replaced step=0 ")
    second = digest_of(tmp_path / "o2", 0, origin_id)
    relay.wait_for(r"version_committed run=restart step=0 .*digest=" + second[:16], timeout_s=60)
    assert digest_of(rdir, 0, origin_id) == second != first
    assert relay.stop(signal.SIGTERM) == 0
    assert o2.stop(signal.SIGTERM) == 0


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_trainer_restarted_after_its_last_step_finishes_at_once(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """A trainer started again on a finished run re-announces the end and exits 0 without
    waiting ``--start-wait-s`` for expected peers (peers that saw the run end stay silent)."""
    tdir, logs = tmp_path / "trainer", tmp_path / "logs"
    absent = Identity.from_seed("restart-absent-peer").peer_id
    args = [
        "trainer",
        "--data-dir", str(tdir),
        "--run-id", RUN,
        "--steps", "0",
        "--preset", "tiny",
        *SAMPLING,
        "--no-check-model",
        *LOOPBACK_ANY,
        "--expect-peer", absent,
        "--final-wait-s", "0",
    ]  # fmt: skip
    t1 = Node("trainer1", [*args, "--start-wait-s", "0"], logs, {})
    nodes.append(t1)
    assert t1.proc.wait(timeout=240) == 0
    t1.wait_for(r"run_finished_announced step=0 ")
    # the same command with a long start wait: the run is complete, nothing to wait for
    t2 = Node("trainer2", [*args, "--start-wait-s", "600"], logs, {})
    nodes.append(t2)
    t2.wait_for(r"run_already_complete step=0 steps=0", timeout_s=240)
    assert t2.proc.wait(timeout=60) == 0
    t2.wait_for(r"run_finished_announced step=0 ")
    assert t2.count(r"waiting_for_peers") == 0


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_a_finished_run_continues_when_the_trainer_is_restarted_with_more_steps(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """Finished at step 0, then started again with ``--steps 1``: the trainer signs that the
    run continues, the peer that holds the run's end takes it back, says hello, sends
    rollouts for version 0, and the trainer trains and publishes step 1, then ends again."""
    tdir, pdir, logs = tmp_path / "trainer", tmp_path / "peer", tmp_path / "logs"
    trainer_id, port, relay_port, taddr, raddr = Lab.make(tmp_path)
    peer_id = Identity.load_or_create(pdir / "node.key").peer_id
    trainer_args = [
        "trainer",
        "--data-dir", str(tdir),
        "--run-id", RUN,
        "--preset", "tiny",
        *SAMPLING,
        "--no-check-model",
        "--listen", f"/ip4/127.0.0.1/tcp/{port}",
        "--http-host", "127.0.0.1",
        "--http-port", "0",
        "--expect-peer", peer_id,
        "--start-wait-s", "120",
        "--step-timeout-s", "120",
    ]  # fmt: skip
    t1 = Node("trainer1", [*trainer_args, "--steps", "0"], logs, {})
    nodes.append(t1)
    t1.wait_for(r"node_ready role=trainer")
    relay_args = [
        *("relay", "--data-dir", str(tmp_path / "relay"), "--run-id", RUN),
        *("--upstream", taddr, "--trainer-id", trainer_id),
        *("--listen", f"/ip4/127.0.0.1/tcp/{relay_port}"),
        *("--http-host", "127.0.0.1", "--http-port", "0"),
    ]
    relay = Node("relay", relay_args, logs, {})
    nodes.append(relay)
    peer = Node(
        "peer",
        [
            *("peer", "--data-dir", str(pdir), "--run-id", RUN),
            *("--bootstrap", raddr, "--trainer-id", trainer_id, "--trainer-addr", taddr),
            *LOOPBACK_ANY,
        ],
        logs,
        {},
    )
    nodes.append(peer)
    assert t1.proc.wait(timeout=240) == 0
    peer.wait_for(r"run_finished run=restart step=0 ", timeout_s=60)
    relay.wait_for(r"run_finished run=restart step=0 ", timeout_s=60)
    # the relay restarted while the trainer is gone remembers that the run is over (and
    # takes the continuation below: by gossip through the peer, or by re-dialling the
    # trainer, whichever comes first; the re-dial of a peer never reached is in
    # tests/integration/test_keepalive.py)
    assert relay.stop(signal.SIGTERM) == 0
    relay = Node("relay2", relay_args, logs, {})
    nodes.append(relay)
    relay.wait_for(r"run_end_restored kind=run-finished step=0 seq=1", timeout_s=120)

    t2 = Node("trainer2", [*trainer_args, "--steps", "1"], logs, {})
    nodes.append(t2)
    t2.wait_for(r"run_continued_announced step=0 seq=2", timeout_s=240)
    peer.wait_for(r"run_continued run=restart step=0 lifted_end=True", timeout_s=120)
    t2.wait_for(r"version_published step=1 ", timeout_s=240)
    assert t2.proc.wait(timeout=240) == 0
    t2.wait_for(r"run_finished_announced step=1 ")
    peer.wait_for(r"run_finished run=restart step=1 ", timeout_s=120)
    assert peer.count(r"version_downloaded step=1 ") == 1
    assert relay.count(r"run_continued run=restart step=0 lifted_end=True") == 1
    # the trainer leaving after its run end is expected: no warning on the relay for it
    assert relay.count(r"WARNING .*all_kept_peers_lost") == 0
    # its batch for version 0 after the continuation was whole (no cut for staleness)
    assert peer.count(r"rollouts_submitted step=0 .*pace=complete") >= 1
    assert peer.count(r"batch_cut") == 0
    # a --steps below what was published ends the run again at once, and says why
    t3 = Node("trainer3", [*trainer_args, "--steps", "0"], logs, {})
    nodes.append(t3)
    assert t3.proc.wait(timeout=240) == 0
    t3.wait_for(r"WARNING .*run_already_complete step=1 steps=0 hint=--steps is below")
    assert t2.count(r"step_ready step=1 ") == 1
    # the relay's settled retries of the departed trainer (minutes apart) were cut short: it
    # fetched step 1 within seconds, and the trainer did not wait for its final broadcast
    relay.wait_for(r"polls_woken reason=run_resumed")
    assert t2.count(r"waiting_for_final_broadcast step=1 .* waited_s=(1[5-9]|[2-9]\d)") == 0
    assert peer.stop(signal.SIGTERM) == 0
    assert relay.stop(signal.SIGTERM) == 0
