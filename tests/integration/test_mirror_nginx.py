"""Static mirrors: a relay's store exported and served by Debian's nginx on 127.0.0.1.

origin -> relay (libp2p announcements + HTTP lane) -> export -> nginx -> peer. The peer's
libp2p upstream is the relay (announcements, run state) but, in the first test, the relay
advertises an HTTP lane URL nobody listens on, so every byte the peer commits comes from the
mirror. In the second, the mirror serves corrupted files next to a working relay: the peer
commits the right bytes and blames the mirror.
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2p.http_server import HttpServerConfig
from p2p.identity import Identity
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.serve.mirror import PREFIX, export_mirror
from shardcast.wire.manifest import Manifest
from shardcast.wire.runcard import DEFAULT_ENGINE, RunCard, SamplingRules, TaskSpec, next_card
from tests.helpers import TRAINER, make_checkpoint, trust
from tests.integration.procs import NEEDS_NGINX, nginx

if TYPE_CHECKING:
    from trio_typing import TaskStatus

pytestmark = NEEDS_NGINX

SIZES = {"model-00001-of-00002.safetensors": 300_000, "model-00002-of-00002.safetensors": 90_001}
LOCAL = HttpServerConfig(host="127.0.0.1", port=0)


async def _node(
    ident: Identity,
    cfg: NodeConfig,
    *,
    task_status: TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with ShardcastNode.open(ident, trust(), cfg) as node:
        task_status.started(node)
        await trio.sleep_forever()


class _Commits:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.changed = trio.Event()

    async def hook(self, m: Manifest, path: Path, rec: VersionRecord) -> None:
        self.steps.append(m.step)
        self.changed.set()
        self.changed = trio.Event()

    async def wait(self, step: int) -> None:
        with trio.fail_after(60):
            while step not in self.steps:
                await self.changed.wait()


async def _origin_and_relay(
    tmp: Path, nursery: trio.Nursery, relay_url: str | None
) -> tuple[ShardcastNode, ShardcastNode, Callable[[int], Awaitable[None]]]:
    """An origin, a relay following it, and ``publish(step)``, which returns once the relay
    committed the version (the origin's store keeps the published bytes: the checkpoint
    directories are moved in)."""
    o = await nursery.start(_node, TRAINER, NodeConfig("trainer", "run", tmp / "o", http=LOCAL))
    r = await nursery.start(
        _node,
        Identity.from_seed("relay"),
        NodeConfig("relay", "run", tmp / "r", http=LOCAL, public_url=relay_url),
    )
    commits = _Commits()
    fr = Follower(
        r,
        FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.2, discovery=False),
        random.Random(1),
        on_commit=commits.hook,
    )
    await nursery.start(fr.run)
    origin = Origin(o, OriginConfig(shard_size=32 * 1024, shards_per_part=4))

    async def publish(step: int) -> None:
        await origin.publish(make_checkpoint(tmp / f"ck{step}", SIZES, seed=step), step)
        await commits.wait(step)

    return o, r, publish


async def _peer(
    tmp: Path, nursery: trio.Nursery, relay: ShardcastNode, mirror: str | None
) -> tuple[ShardcastNode, Follower, _Commits]:
    p = await nursery.start(
        _node, Identity.from_seed("peer"), NodeConfig("peer", "run", tmp / "p", http=LOCAL)
    )
    commits = _Commits()
    fp = Follower(
        p,
        FollowConfig(
            upstreams=(relay.p2p.multiaddrs()[0],),
            poll_interval_s=0.2,
            discovery=False,
            mirrors=(mirror,) if mirror is not None else (),
        ),
        random.Random(2),
        on_commit=commits.hook,
    )
    await nursery.start(fp.run)
    return p, fp, commits


def _same_files(a: Path, b: Path) -> None:
    for name in SIZES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


async def test_peer_commits_from_nginx_mirror_only(tmp_path: Path) -> None:
    www = tmp_path / "www"
    with socket.socket() as dead:  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        async with trio.open_nursery() as nursery:
            o, r, publish = await _origin_and_relay(tmp_path, nursery, dead_url)
            await publish(0)
            first = export_mirror(r.store, www)
            assert (first.steps, first.copied) == ([0], 0)
            with nginx(www, tmp_path / "nginx") as url:
                p, fp, commits = await _peer(tmp_path, nursery, r, url)
                await commits.wait(0)
                await publish(1)  # the relay commits it; the mirror is exported again
                second = export_mirror(r.store, www)
                assert (second.exported, second.unchanged) == ([1], [0])
                await commits.wait(1)
                # every byte came from the mirror: the relay's lane was never reachable
                for rec in fp.records:
                    assert rec.stats is not None
                    assert set(rec.stats.bytes_by_source) == {url}, rec.stats.bytes_by_source
                for step in (0, 1):
                    _same_files(p.store.version_dir(step), o.store.version_dir(step))
                assert fp.mirrors_status()[0]["committed"] == [0, 1]
                access = (tmp_path / "nginx" / "access.log").read_text()
                assert re.search(r"GET /shardnet/v1/run/1/[0-9a-f]{64}/files/", access)
                assert "GET /shardnet/v1/run/versions" in access
                assert re.search(r"GET /shardnet/v1/run/1/[0-9a-f]{64}/shard/", access)  # deltas
                lines = access.splitlines()
                assert lines
                assert all(line.endswith('auth="-"') for line in lines), lines[:3]
            nursery.cancel_scope.cancel()


async def test_corrupt_mirror_is_blamed_and_peer_commits_from_relay(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        o, r, publish = await _origin_and_relay(tmp_path, nursery, None)
        await publish(0)
        www = tmp_path / "www"
        export_mirror(r.store, www)
        (files,) = (www / PREFIX / "run" / "0").glob("*/files")  # <step>/<digest>/files
        for name in SIZES:  # replace (not edit: they are hard links to the relay's store)
            data = bytearray((files / name).read_bytes())
            for i in range(0, len(data), 4096):
                data[i] ^= 0xFF
            (files / name).unlink()
            (files / name).write_bytes(bytes(data))
        with nginx(www, tmp_path / "nginx") as url:
            p, fp, commits = await _peer(tmp_path, nursery, r, url)
            await commits.wait(0)
            _same_files(p.store.version_dir(0), o.store.version_dir(0))
            rec = fp.records[0]
            assert rec.stats is not None
            assert rec.stats.corrupt_by_source.get(url, 0) >= 1, rec.stats
            assert fp.downloader.bans.is_banned(url, trio.current_time())
            access = (tmp_path / "nginx" / "access.log").read_text()
            assert re.search(r"/shardnet/v1/run/0/[0-9a-f]{64}/files/", access)
        nursery.cancel_scope.cancel()


async def test_peer_takes_the_mirror_named_in_the_run_card(tmp_path: Path) -> None:
    """No --mirror on the peer: the trainer's signed card names the mirror; the relay's lane
    is dead, so the peer can only commit through the mirror it learned from the card."""
    www = tmp_path / "www"
    with socket.socket() as dead, nginx(www, tmp_path / "nginx") as url:
        dead.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        async with trio.open_nursery() as nursery:
            o, r, publish = await _origin_and_relay(tmp_path, nursery, dead_url)
            rules = RunCard(
                card_version=1,
                run_id="run",
                trainer=TRAINER.peer_id,
                task=TaskSpec("digits", 1, "ab" * 32),
                sampling=SamplingRules(2, 4, 8, 1.0),
                engines=(DEFAULT_ENGINE,),
                async_level=1,
                architecture_digest="cd" * 32,
                issued_at_ms=1_767_225_600_000,
                mirrors=(url,),
            )
            assert o.set_card(next_card(rules, o.card, TRAINER))
            await publish(0)
            export_mirror(r.store, www)
            p, fp, commits = await _peer(tmp_path, nursery, r, None)
            await commits.wait(0)
            assert p.card is not None
            assert p.card.card.mirrors == (url,)
            assert list(fp.mirrors) == [url]
            rec = fp.records[0]
            assert rec.stats is not None
            assert set(rec.stats.bytes_by_source) == {url}, rec.stats.bytes_by_source
            _same_files(p.store.version_dir(0), o.store.version_dir(0))
            nursery.cancel_scope.cancel()
