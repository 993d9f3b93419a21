"""Adverts that cannot steer the swarm: URLs proven by the advertiser's key, scores that
survive across versions, one slot per URL."""

from __future__ import annotations

import random
from pathlib import Path

from p2p.http_client import HttpClient
from p2p.http_server import open_http_server
from p2p.identity import Identity
from shardcast.core.reachability import LaneCheck
from shardcast.download.discovery import NodeAdvert, SourceDirectory
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.lane_auth import check_whoami, sign_whoami, whoami_path
from tests.helpers import trust

A = Identity.from_seed("node-a")
B = Identity.from_seed("node-b")


def advert(pid: str, url: str, committed: tuple[int, ...] = (1,)) -> NodeAdvert:
    return NodeAdvert(pid, "peer", url, committed, ())


def directory(**kw: bool) -> SourceDirectory:
    return SourceDirectory("me", set(), ttl_s=10.0, max_entries=100, rng=random.Random(0), **kw)


def test_only_proven_urls_are_offered() -> None:
    d = directory(require_verified=True)
    d.offer(advert("a", "http://127.0.0.1:1"), 0.0)
    d.offer(advert("b", "http://127.0.0.1:2"), 0.0)
    assert d.sources_for(1, 1.0, 10) == []
    assert {a.peer_id for a in d.to_verify(1.0)} == {"a", "b"}
    d.verified("a", "http://127.0.0.1:1", LaneCheck.VERIFIED, 1.0)
    d.verified("b", "http://127.0.0.1:2", LaneCheck.UNREACHABLE, 1.0)
    assert [s.id for s in d.sources_for(1, 1.0, 10)] == ["a"]
    assert d.to_verify(2.0) == []  # b is not challenged again before its backoff
    d.offer(advert("a", "http://127.0.0.1:9"), 3.0)  # a moved: prove the new URL first
    assert d.sources_for(1, 3.0, 10) == []
    assert [a.peer_id for a in d.to_verify(3.0)] == ["a"]


def test_many_identities_behind_one_url_share_one_slot() -> None:
    d = directory(one_per_url=True)
    for k in range(20):
        d.offer(advert(f"fake-{k:02d}", "http://127.0.0.1:666"), 0.0)
    d.offer(advert("honest", "http://127.0.0.1:7"), 0.0)
    got = d.sources_for(1, 1.0, 16)
    assert len(got) == 2
    assert "honest" in {s.id for s in got}


def test_scores_survive_versions_and_recover_slowly() -> None:
    d = directory()
    d.offer(advert("bad", "http://127.0.0.1:1", committed=(1, 2, 3)), 0.0)
    d.offer(advert("good", "http://127.0.0.1:2", committed=(1, 2, 3)), 0.0)
    for t in (1.0, 1.1, 1.2, 1.3):  # four downloads in which "bad" was asked, sent nothing
        d.record("bad", delivered=False, now=t)
        d.record("good", delivered=True, now=t)
    assert [s.id for s in d.sources_for(3, 1.5, 10)] == ["good"]  # scored out
    d.offer(advert("bad", "http://127.0.0.1:1", committed=(4,)), 3.0)
    d.offer(advert("good", "http://127.0.0.1:2", committed=(4,)), 3.0)
    assert [s.id for s in d.sources_for(4, 3.5, 10)] == ["good"]  # a new version: still out
    assert d.score("bad", 13.5) > -3  # one point per ttl_s: it gets another chance
    d.offer(advert("bad", "http://127.0.0.1:1", committed=(4,)), 13.0)
    d.offer(advert("good", "http://127.0.0.1:2", committed=(4,)), 13.0)
    assert [s.id for s in d.sources_for(4, 13.5, 10)] == ["good", "bad"]  # best first


def test_whoami_answer_checks() -> None:
    nonce = "ab" * 16
    url = "http://127.0.0.1:5"
    answer = sign_whoami(A, nonce, url)
    assert check_whoami(answer, A.peer_id, nonce, url)
    assert not check_whoami(answer, B.peer_id, nonce, url)  # another advertiser's URL
    assert not check_whoami(answer, A.peer_id, "cd" * 16, url)  # a replayed answer
    assert not check_whoami(answer, A.peer_id, nonce, "http://127.0.0.1:6")
    assert not check_whoami(b"garbage", A.peer_id, nonce, url)


async def test_a_real_lane_proves_its_peer_id(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "s", "run", keep_last=1)
    server = VersionServer(store, trust(), identity=A)
    nonce = "0f" * 16
    async with open_http_server(server.handle) as http, HttpClient() as client:
        answer = await client.get_bytes(http.url + whoami_path(nonce), max_bytes=512, timeout_s=5)
    assert check_whoami(answer, A.peer_id, nonce, http.url)
    assert not check_whoami(answer, B.peer_id, nonce, http.url)  # B advertising A's lane
