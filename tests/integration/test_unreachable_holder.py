"""Super-seeding rule 11 on real HTTP on 127.0.0.1: the origin's ``429`` names the holder
(``X-Shardnet-Holder``), a downloader that cannot reach it (its ``unreachable`` hook: the
follower's ``SourceDirectory.holder_reach``) asks again at once naming it
(``X-Shardnet-Unreachable``) and is served, instead of waiting out the window; one without the
hook (an older node) is refused as before."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, open_http_server
from p2p.identity import Identity
from shardcast.download import DownloadConfig, Downloader, Source
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.store.store import VersionStore
from shardcast.wire import HOLDER_HEADER, UNREACHABLE_HEADER, RequestSigner
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, check_committed, make_checkpoint, trust

RUN = "run"
NAT = Identity.from_seed("holder-behind-nat")
SYM = Identity.from_seed("peer-behind-symmetric-nat")


async def test_a_downloader_that_cannot_reach_the_holder_is_served_at_once(
    tmp_path: Path,
) -> None:
    cfg = NodeConfig("trainer", RUN, tmp_path / "o", serve_once_s=30.0)
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        ck = make_checkpoint(tmp_path / "ck", {"model-00001-of-00001.safetensors": 190_000})
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, shards_per_part=2))
        m0 = (await origin.publish(ck, 0)).manifest
        seen: list[tuple[int, str, str]] = []

        async def lane(req: HttpRequest) -> HttpResponse:
            resp = await o.server.handle(req)
            named = dict(resp.headers).get(HOLDER_HEADER, "")
            seen.append((resp.status, named, req.headers.get(UNREACHABLE_HEADER, "")))
            return resp

        asked: list[tuple[str, ...]] = []

        def unreachable(holders: Sequence[str]) -> tuple[str, ...]:
            asked.append(tuple(holders))
            return tuple(h for h in holders if h == NAT.peer_id)

        async def fetch(who: Identity, name: str, hook: bool) -> None:
            store = VersionStore(tmp_path / name, RUN, keep_last=2)
            signer = RequestSigner(who, time.time)
            async with HttpClient(sign=signer) as client:
                dl = Downloader(client, store, DownloadConfig(), random.Random(1), trust())
                if hook:
                    dl.unreachable = unreachable
                with trio.fail_after(20):  # well within the 30 s window
                    path, stats = await dl.download(
                        Manifest.decode(m0.encode(), trust=trust()), [Source("origin", url)]
                    )
            check_committed(path, m0)
            if hook:
                assert stats.refused_unreachable >= 1

        async with open_http_server(lane) as http:
            url = http.url
            await fetch(NAT, "nat", hook=False)  # first: holds every shard for 30 s
            assert o.server.refused_once == 0
            await fetch(SYM, "sym", hook=True)  # cannot reach NAT: served at once
    shards = len(m0.header.shards)
    assert shards == 4  # 3 of weights, config.json: within the rule-11 share (at least 4)
    refusals = [s for s in seen if s[0] == 429]
    assert refusals
    assert all(named == NAT.peer_id for _, named, _ in refusals)  # the holder, by PeerID
    assert all(holders == (NAT.peer_id,) for holders in asked)
    served = [s for s in seen if s[0] in (200, 206) and s[2] == NAT.peer_id]
    assert served  # asked again naming the holder, and answered
    assert o.server._seeding.unreachable_served == shards  # every shard, once, by rule 11
