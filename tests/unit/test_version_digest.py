"""A version is ``(step, manifest digest)``: the lane's URLs and answers, the store's lookups,
adverts, and a follower that never moves backwards (issue 15, item 1)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2p import wire
from p2p.errors import RemoteProtocolError
from p2p.http_server import HttpRequest
from shardcast.download.discovery import MAX_ADVERT_BYTES, NodeAdvert, SourceDirectory
from shardcast.download.follower import Follower
from shardcast.node.node import ShardcastNode
from shardcast.publish.plan import build_manifest
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.have import VERSIONS_HOLD_S
from shardcast.wire.lane_urls import (
    HELD_DIGEST_HEADER,
    LaneAnswer,
    file_url,
    have_url,
    lane_answer,
    manifest_url,
    part_url,
    version_url,
)
from shardcast.wire.manifest import Manifest
from shardcast.wire.messages import VersionAnnouncement
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model.safetensors": 3000}
A, B, C = "a" * 64, "b" * 64, "c" * 64


def _publish(store: VersionStore, root: Path, step: int, seed: int) -> Manifest:
    ck = make_checkpoint(root / f"ck{step}-{seed}", SIZES, seed=seed)
    m = build_manifest(ck, "run", step, TRAINER, shard_size=1000)
    store.adopt(ck, m)
    return m


def _get(path: str) -> HttpRequest:
    return HttpRequest("GET", path, {}, {}, None)


def test_urls_name_the_digest() -> None:
    assert version_url("http://h:1", "run", 3, A) == f"http://h:1/shardnet/v1/run/3/{A}"
    assert manifest_url("http://h:1", "run", 3, A).endswith(f"/3/{A}/manifest")
    assert part_url("http://h:1", "run", 3, A, 2).endswith(f"/3/{A}/manifest/part/2")
    assert have_url("http://h:1", "run", 3, A).endswith(f"/3/{A}/have")
    assert file_url("http://h:1", "run", 3, A, "x.bin").endswith(f"/3/{A}/files/x.bin")
    with pytest.raises(ValueError, match="64 lowercase hex"):
        version_url("http://h:1", "run", 3, "A" * 64)
    assert [lane_answer(s) for s in (404, 409, 503, 429)] == [
        LaneAnswer.NOT_HELD,
        LaneAnswer.OTHER_DIGEST,
        LaneAnswer.BUSY,
        LaneAnswer.BUSY,
    ]


async def test_the_lane_answers_by_step_and_digest(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", "run", keep_last=4)
    m = _publish(store, tmp_path, 1, seed=1)
    server = VersionServer(store, trust())
    name = m.header.files[0].name
    ok = await server.handle(_get(f"/shardnet/v1/run/1/{m.digest}/manifest"))
    assert ok.status == 200
    assert Manifest.decode(bytes(ok.body or b""), trust=trust()).digest == m.digest
    # the step held under another digest: 409, and which digest it holds; nobody's fault
    for tail in ("manifest", "have", f"files/{name}", "manifest/part/0"):
        other = await server.handle(_get(f"/shardnet/v1/run/1/{B}/{tail}"))
        assert other.status == 409, tail
        assert (HELD_DIGEST_HEADER, m.digest) in other.headers
    assert (await server.handle(_get(f"/shardnet/v1/run/2/{m.digest}/manifest"))).status == 404
    # an older node's step-only request: a clean 404 that says why
    old = await server.handle(_get(f"/shardnet/v1/run/1/files/{name}"))
    assert old.status == 404
    assert b"step and manifest digest" in bytes(old.body or b"")
    versions = await server.handle(_get("/shardnet/v1/run/versions"))
    doc = json.loads(bytes(versions.body or b""))
    assert doc == {
        "committed": [1],
        "in_progress": [],
        "digests": {"1": m.digest},
        "hold_s": VERSIONS_HOLD_S,  # it holds /versions long-polls
    }


async def test_a_replaced_step_is_served_under_its_new_digest_only(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", "run", keep_last=4)
    first = _publish(store, tmp_path, 1, seed=1)
    server = VersionServer(store, trust())
    assert (await server.handle(_get(f"/shardnet/v1/run/1/{first.digest}/have"))).status == 200
    assert store.holds(1, first.digest)
    store.discard(1)
    assert store.digest_of(1) is None
    second = _publish(store, tmp_path, 1, seed=2)  # the same step, other content
    assert second.digest != first.digest
    assert store.digest_of(1) == second.digest  # the cache follows the replacement
    assert not store.holds(1, first.digest)
    assert store.committed_versions() == [(1, second.digest)]
    old = await server.handle(_get(f"/shardnet/v1/run/1/{first.digest}/manifest"))
    assert (old.status, (HELD_DIGEST_HEADER, second.digest) in old.headers) == (409, True)
    new = await server.handle(_get(f"/shardnet/v1/run/1/{second.digest}/manifest"))
    assert new.status == 200
    assert Manifest.decode(bytes(new.body or b""), trust=trust()).digest == second.digest


def test_adverts_carry_the_digest_of_each_version() -> None:
    a = NodeAdvert.of("Qm-a", "relay", "http://127.0.0.1:1", [(1, A), (2, B)], [(3, C)])
    assert (a.committed, a.filling) == ((1, 2), (3,))
    assert NodeAdvert.decode(a.encode(), "Qm-a") == a
    assert (a.holds(2, B), a.holds(2, A)) == (True, False)
    assert (a.fills(3, C), a.fills(3, A)) == (True, False)
    full = NodeAdvert.of(
        "Qm-a", "relay", "http://127.0.0.1:65535", [(10**12 + s, A) for s in range(40)], []
    )
    assert len(full.committed) == 16
    assert len(full.encode()) < MAX_ADVERT_BYTES
    assert NodeAdvert.decode(full.encode(), "Qm-a") == full


@pytest.mark.parametrize(
    "digests",
    [
        {"committed_digests": [A]},  # one missing
        {"committed_digests": [A, "x"], "filling_digests": []},  # not a digest
        {"committed_digests": [A, A], "filling_digests": [A]},  # more than filling steps
    ],
)
def test_advert_digests_must_match_the_steps(digests: dict[str, object]) -> None:
    obj = {
        "v": 1,
        "peer_id": "Qm-a",
        "role": "peer",
        "http_url": "http://127.0.0.1:1",
        "committed": [1, 2],
        "filling": [],
        **digests,
    }
    with pytest.raises(RemoteProtocolError, match="digests"):
        NodeAdvert.decode(wire.encode(obj), "Qm-a")


def test_sources_are_offered_for_the_digest_they_hold() -> None:
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=16, rng=random.Random(0))
    d.offer(NodeAdvert.of("same", "peer", "http://127.0.0.1:1", [(5, A)], []), now=0.0)
    d.offer(NodeAdvert.of("other", "peer", "http://127.0.0.1:2", [(5, B)], []), now=0.0)
    d.offer(NodeAdvert.of("filling", "relay", "http://127.0.0.1:3", [], [(5, A)]), now=0.0)
    d.offer(NodeAdvert("old", "peer", "http://127.0.0.1:4", (5,), ()), now=0.0)  # no digests
    got = d.sources_for(5, now=1.0, limit=10, digest=A)
    assert [(s.id, s.complete) for s in got] == [("same", True), ("filling", False)]
    assert [s.id for s in d.sources_for(5, now=1.0, limit=10, digest=B)] == ["other"]


def _announce(step: int, digest: str) -> VersionAnnouncement:
    return VersionAnnouncement.create(TRAINER, "run", step, digest, ())


def test_a_follower_never_moves_backwards(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", "run", keep_last=4)
    for step in (1, 2):
        _publish(store, tmp_path, step, seed=step)
    held = store.digest_of(2)
    assert held is not None
    node = SimpleNamespace(announcement=None, store=store, report_once=lambda _key: True)
    follower = SimpleNamespace(node=node, held_digest=store.digest_of)

    def wanted(ann: VersionAnnouncement) -> VersionAnnouncement | None:
        node.announcement = ann
        return Follower._wanted(follower)  # type: ignore[arg-type]

    assert wanted(_announce(3, A)) is not None  # newer: fetch
    assert wanted(_announce(2, held)) is None  # the newest held, same digest: nothing to do
    assert wanted(_announce(2, A)) is not None  # the newest held, other digest: replace
    assert wanted(_announce(1, A)) is None  # older than the newest held: never backwards
    assert wanted(_announce(0, A)) is None


def test_a_replayed_same_step_announcement_on_gossip_does_not_flip_the_node() -> None:
    """Two trainer-signed announcements of one step (a republication): the replacement is
    taken from an upstream's info record, never from open gossip, where an old one can be
    replayed by anybody."""
    node = SimpleNamespace(announcement=None, config=SimpleNamespace(run_id="run"))
    node.report_once = lambda _key: True
    node.set_announcement = lambda ann, _sender: setattr(node, "announcement", ann)

    def keep(ann: VersionAnnouncement, *, upstream: bool) -> VersionAnnouncement | None:
        return ShardcastNode._keep_announcement(  # type: ignore[arg-type]
            node, ann, "Qm-sender", replace_same_step=upstream
        )

    new, old = _announce(4, A), _announce(4, B)
    assert keep(new, upstream=False) is new  # first news of step 4: from anywhere
    assert keep(old, upstream=False) is None  # a replay on gossip: ignored
    assert node.announcement is new
    assert keep(old, upstream=True) is old  # an upstream says so: taken
    assert keep(_announce(3, C), upstream=True) is None  # older: never
    assert keep(_announce(5, C), upstream=False) is not None  # newer: from anywhere
