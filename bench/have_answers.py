"""CPU of a source's held ``/have`` long-polls over one version, against the shard count.

Theory of operation
-------------------
A node serving a version it is still receiving holds its neighbours' ``/have`` long-polls
(:mod:`shardcast.wire.have`) and re-evaluates each held one whenever a shard starts or
completes (:meth:`shardcast.serve.server.VersionServer.progress`). Each evaluation needs the
version's have-bitmap. Built with one ``has()`` call per shard, that is O(shards) per
evaluation and so O(shards²) per poller and version: negligible for ``real-1b`` (85 shards of
16 MiB), not for INTELLECT-2's 62 GB (about 3,900 shards). A live version that keeps its
bitmap as shards arrive (:meth:`shardcast.store.partial.PartialVersion.have_bits`) answers
in O(shards / 8) bytes.

One process: a :class:`~shardcast.serve.server.VersionServer` serving a version being
received into a :class:`~shardcast.store.partial.PartialVersion` (files in a temporary
directory, ``--shard-kib`` shards: the bitmap's cost does not depend on their size);
``--pollers`` tasks each hold a ``/have`` long-poll naming the shards they lack (``?want=``,
as downloaders do) and poll again with each answer's token; then every shard is written and
announced to the server, one at a time. Per shard count it prints the process CPU-seconds
over the version (``time.process_time``) and the answers served, first with the partial's
kept bitmap (``kept``, what nodes do), then through a view of the same partial without it
(``per-shard``: one ``has()`` per shard, the cost before), and the ratio.

Measured (this machine, 2 cores, quiet; 4 pollers, 4 KiB shards; process CPU-seconds over
one version; every shard is news to every poller, as in a full version, so each poller gets
one answer per shard):

======  ===========  =====================  ===========
shards  kept bitmap  one has() per shard    ratio
======  ===========  =====================  ===========
85      0.015        0.021                  1.40
385     0.072        0.202                  2.83
1,500   0.389        2.311                  5.94
3,900   1.742        14.808                 8.50
======  ===========  =====================  ===========

85 and 385 are the shard counts of ``real-1b`` and ``real-6b`` in 16 MiB shards; 3,900 is
INTELLECT-2's 62 GB. What is left grows with the answers (4 per shard) times their
O(shards / 8) bytes of bitmap, token and want.

Usage::

    python bench/have_answers.py [--shards 85,385,3900] [--pollers 4] [--shard-kib 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import trio
import trio.testing

from p2p.http_server import HttpRequest
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.publish import build_manifest
from shardcast.serve import VersionServer
from shardcast.store import BlobRef, PartialVersion, VersionStore
from shardcast.wire import HAVE_TOKEN_HEADER, HOLD_HEADER, encode_want, have_url

RUN = "bench"


class PerShard:
    """A live version seen through ``has()`` only (no ``have_bits``): the server builds its
    bitmap with one call per shard, as before the bitmap was kept. It offers no
    ``prefixes()`` either, which the server then skips: if anything, this side's CPU is
    low."""

    def __init__(self, part: PartialVersion) -> None:
        self.part = part
        self.manifest = part.manifest
        self.dir = part.dir

    def has(self, index: int) -> bool:
        return self.part.has(index)

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        return self.part.blob_ref(index, encoding)


async def one_version(
    root: Path, n: int, shard: int, pollers: int, kept: bool
) -> tuple[float, int]:
    """Receive a version of ``n`` shards with ``pollers`` held ``/have`` long-polls on it;
    returns (process CPU-seconds, answers served)."""
    ck = root / f"ck-{n}-{kept}"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    data = os.urandom(n * shard)
    (ck / "model.safetensors").write_bytes(data)
    trainer = Identity.from_seed("have-bench")
    m = build_manifest(ck, RUN, 1, trainer, shard_size=shard, shards_per_part=max(1, n))
    store = VersionStore(root / f"store-{n}-{kept}", RUN, keep_last=2, durable=False)
    part = store.begin(m)
    server = VersionServer(store, TrustList(trainer=trainer.peer_id), wait_s=30.0)
    server.add_live(part if kept else PerShard(part))  # type: ignore[arg-type]
    path = have_url("http://x", RUN, 1, m.digest).removeprefix("http://x")
    want = encode_want(bytes(b"\xff" * ((n + 7) // 8)))
    answers = 0
    done = trio.Event()

    async def poll() -> None:
        nonlocal answers
        token = "-"
        while not done.is_set():
            query = {"known": token, "want": want or "", "wknown": token}
            resp = await server.handle(HttpRequest("GET", path, query, {HOLD_HEADER: "30"}, None))
            answers += 1
            token = dict(resp.headers)[HAVE_TOKEN_HEADER]

    files = {"config.json": b"{}", "model.safetensors": data}
    shard_bytes = [files[r.file][r.offset : r.offset + r.length] for r in m.header.shards]
    t0 = time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(pollers):
            nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(len(shard_bytes)):
            part.write_shard(i, shard_bytes[i])
            server.progress(1, i)
            await trio.testing.wait_all_tasks_blocked()
        done.set()
        nursery.cancel_scope.cancel()
    cpu = time.process_time() - t0
    part.abort()
    return cpu, answers


async def main(root: Path, shards: list[int], pollers: int, shard: int) -> None:
    print("shards  kept CPU-s  answers  per-shard CPU-s  answers   ratio")
    for n in shards:
        new, new_answers = await one_version(root, n, shard, pollers, kept=True)
        old, old_answers = await one_version(root, n, shard, pollers, kept=False)
        print(
            f"{n:>6} {new:>11.3f} {new_answers:>8} {old:>16.3f} {old_answers:>8} {old / new:>7.2f}"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="85,385,3900", help="comma-separated shard counts")
    ap.add_argument("--pollers", type=int, default=4, help="held /have long-polls")
    ap.add_argument("--shard-kib", type=int, default=4, help="shard size, KiB")
    a = ap.parse_args()
    shm = Path("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="have-bench-", dir=shm if shm.is_dir() else None))
    try:
        trio.run(main, tmp, [int(x) for x in a.shards.split(",")], a.pollers, a.shard_kib << 10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
