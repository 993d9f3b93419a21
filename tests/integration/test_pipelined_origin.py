"""Pipelined origin encoding with real processes on 127.0.0.1: ``shardnet origin --watch``
hashes and delta-encodes each file of a step while the "trainer" (this test) still writes the
others — one in place, one as temp + rename — uses only results whose file did not change
afterwards, and stays correct across a SIGKILL restart mid-step. A relay downloads every
version (deltas included) and holds exactly the bytes written.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

from p2p.identity import Identity
from tests.helpers import committed_bytes
from tests.integration.procs import LOOPBACK_ANY, Node, free_port, nodes

__all__ = ["nodes"]  # the fixture

RUN = "piped"
W1, W2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
SIZE = 300_000


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
        "--poll-interval-s", "0.1",
        "--pre-encode-settle-s", "0.3",
    ]  # fmt: skip


def _next(data: bytes, rng: random.Random, changes: int = 300) -> bytes:
    """``data`` with ``changes`` random 16-bit words replaced (a training step's delta)."""
    out = bytearray(data)
    for _ in range(changes):
        i = rng.randrange(0, len(out) // 2) * 2
        out[i : i + 2] = rng.randbytes(2)
    return bytes(out)


def _small_files(d: Path, step: int) -> None:
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "step": step}))
    wm = {"layer.0.weight": W1, "layer.1.weight": W2}
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * SIZE}, "weight_map": wm})
    )


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _held(data_dir: Path, step: int) -> Path:
    return data_dir / "versions" / RUN / f"step-{step}"


def test_origin_encodes_files_while_the_trainer_writes(tmp_path: Path, nodes: list[Node]) -> None:
    odir, rdir, watch, logs = (tmp_path / n for n in ("origin", "relay", "watch", "logs"))
    origin_id = Identity.load_or_create(odir / "node.key").peer_id
    port, http_port = free_port(), free_port()
    rng = random.Random(5)
    content = {W1: rng.randbytes(SIZE), W2: rng.randbytes(SIZE)}

    # step 0, written whole (the origin is not running yet)
    s0 = watch / "step-0"
    s0.mkdir(parents=True)
    for name, data in content.items():
        (s0 / name).write_bytes(data)
    _small_files(s0, 0)
    (s0 / "DONE").touch()
    o1 = Node("origin1", _origin_args(odir, watch, port, http_port), logs, {})
    nodes.append(o1)
    o1.wait_for(r"version_published step=0 ")
    relay = Node(
        "relay",
        ["relay", "--data-dir", str(rdir), "--run-id", RUN, "--trainer-id", origin_id,
         "--upstream", f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}", *LOOPBACK_ANY],
        logs,
        {},
    )  # fmt: skip
    nodes.append(relay)
    relay.wait_for(r"version_downloaded step=0 ")

    # step 1, file by file: W1 in place, encoded ahead, then rewritten (that result must not
    # be used); W2 as temp + rename, encoded ahead and used
    s1 = watch / "step-1"
    s1.mkdir()
    content = {n: _next(d, rng) for n, d in content.items()}
    (s1 / W1).write_bytes(content[W1])
    o1.wait_for(rf"pre_encoded step=1 file={W1} ")
    _atomic(s1 / W2, content[W2])
    o1.wait_for(rf"pre_encoded step=1 file={W2} ")
    assert o1.count(r"pre_encoded step=1 file=\S+\.tmp") == 0  # temp names are never taken
    content[W1] = _next(content[W1], rng, 10)
    with (s1 / W1).open("r+b") as fh:  # same size, in place
        fh.write(content[W1])
    _small_files(s1, 1)
    (s1 / "DONE").touch()
    line = o1.wait_for(r"version_published step=1 ")
    assert "base=0" in line
    used = o1.wait_for(r"pre_encoded_used step=1 ")
    assert int(used.split("files=")[1].split()[0]) >= 1
    relay.wait_for(r"version_downloaded step=1 ")
    for name, data in content.items():
        assert committed_bytes(_held(rdir, 1), RUN, name) == data
        assert (_held(odir, 1) / name).read_bytes() == data

    # step 2: W1 written and encoded ahead, then the origin is SIGKILLed and restarted
    s2 = watch / "step-2"
    s2.mkdir()
    content = {n: _next(d, rng) for n, d in content.items()}
    (s2 / W1).write_bytes(content[W1])
    o1.wait_for(rf"pre_encoded step=2 file={W1} ")
    assert o1.stop(signal.SIGKILL) == -signal.SIGKILL
    o2 = Node("origin2", _origin_args(odir, watch, port, http_port), logs, {})
    nodes.append(o2)
    o2.wait_for(rf"pre_encoded step=2 file={W1} ")  # its cache was emptied: encoded again
    _atomic(s2 / W2, content[W2])
    _small_files(s2, 2)
    (s2 / "DONE").touch()
    o2.wait_for(r"version_published step=2 ")
    relay.wait_for(r"version_downloaded step=2 ")
    for name, data in content.items():
        assert committed_bytes(_held(rdir, 2), RUN, name) == data  # a chain
    assert not any((odir / "staging" / ".pre").glob("step-*"))  # published: cache removed
    assert relay.stop(signal.SIGTERM) == 0
    assert o2.stop(signal.SIGTERM) == 0
