"""Super-seeding that is authenticated and lets go: signed lane requests, anonymous share,
failing holders released, a short persistence window."""

from __future__ import annotations

from pathlib import Path

from p2p.http_checks import HOLDER_HEADER, parse_holders
from p2p.http_range import ByteRange
from p2p.http_server import HttpRequest
from p2p.identity import Identity
from shardcast.publish.origin import _Publishing
from shardcast.publish.plan import build_manifest
from shardcast.serve.server import VersionServer, offered_bytes
from shardcast.serve.superseeding import Decision, Refusal, Requester, SuperSeeding
from shardcast.store.store import VersionStore
from shardcast.wire.have import full_bits, shard_bits
from shardcast.wire.lane_auth import (
    AUTH_HEADER,
    FAILED_HEADER,
    UNREACHABLE_HEADER,
    RequestSigner,
    holder_header,
    parse_unreachable,
    sign_request,
    unreachable_header,
    verify_request,
)
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, make_checkpoint, trust

A = Identity.from_seed("relay-a")
B = Identity.from_seed("relay-b")
C = Identity.from_seed("peer-c")
D = Identity.from_seed("peer-d")
PATH = "/shardnet/v1/run/1/files/model.safetensors"


def test_signed_request_names_its_peer_for_that_path_and_window_only() -> None:
    value = sign_request(A, PATH, 1000.0)
    assert verify_request(value, PATH, 1000.0) == A.peer_id
    assert verify_request(value, PATH, 1040.0) == A.peer_id  # the next window (skew)
    assert verify_request(value, PATH, 1100.0) is None  # stale
    assert verify_request(value, PATH + "x", 1000.0) is None  # another path
    forged = value.replace(A.peer_id, B.peer_id)  # someone else's PeerID, A's signature
    assert verify_request(forged, PATH, 1000.0) is None
    for junk in (None, "", "x", "a 1 !!", B.peer_id + " 33 AAAA", "a " * 300):
        assert verify_request(junk, PATH, 1000.0) is None


def test_signer_caches_per_path_and_window() -> None:
    now = [100.0]
    signer = RequestSigner(A, lambda: now[0], cache=2)
    first = signer(PATH)
    assert signer(PATH) == first
    now[0] = 200.0
    assert signer(PATH) != first
    assert verify_request(signer(PATH)[0][1], PATH, 200.0) == A.peer_id


def test_anonymous_requests_never_hold_a_shard_and_have_a_bounded_share() -> None:
    s = SuperSeeding(window_s=5.0)
    assert s.allow(None, 0, [0, 1], 0.0, total_shards=4)  # curl fetches first
    assert s.allow("relay-b", 0, [0], 0.1, total_shards=4)  # ... and delays nobody
    assert s.allow(None, 0, [2, 3], 0.2, total_shards=4)
    assert not s.allow(None, 0, [0], 0.3, total_shards=4)  # share (1 copy) used up
    assert s.anonymous_served == 4


def test_a_download_only_requester_is_served_but_never_holds_a_shard() -> None:
    """Rule 10: a peer that serves nobody (behind a NAT, no stream lane) gets a shard nobody
    holds but delays nobody; it is still refused a shard a serving node holds (it fetches it
    there), like any requester."""
    s = SuperSeeding(window_s=5.0)
    nat = Requester.DOWNLOAD_ONLY
    assert s.allow("peer-d", 0, [0, 1], 0.0, total_shards=4, kind=nat)
    assert s.allow("peer-e", 0, [0, 1], 0.1, total_shards=4, kind=nat)  # nobody holds them
    assert s.allow("peer-c", 0, [0], 0.2, total_shards=4)  # the first serving node: holds 0
    assert not s.allow("peer-g", 0, [0], 0.3, total_shards=4)  # ... so others wait for it
    assert not s.allow("peer-d", 0, [0], 0.4, total_shards=4, kind=nat)  # again: fetch at C
    assert s.unheld_served == 4
    # the same requests from serving nodes: the first one holds both shards
    t = SuperSeeding(window_s=5.0)
    assert t.allow("peer-d", 0, [0, 1], 0.0, total_shards=4)
    assert not t.allow("peer-c", 0, [0], 0.2, total_shards=4)


def test_a_sibling_relay_is_never_super_seeded_and_holds_nothing() -> None:
    s = SuperSeeding(window_s=5.0)
    assert s.allow("peer-c", 0, [0], 0.0, total_shards=4)
    assert s.allow("relay-b", 0, [0, 1], 0.1, total_shards=4, kind=Requester.SIBLING)
    assert s.allow("peer-g", 0, [1], 0.2, total_shards=4)  # the sibling holds nothing
    assert s.refused == 0


def test_a_holder_reported_failing_is_released_at_once() -> None:
    s = SuperSeeding(window_s=5.0, report_share=0.1)
    assert s.allow("relay-a", 0, range(40), 0.0, total_shards=40)  # takes everything
    assert not s.allow("relay-b", 0, [0], 1.0, total_shards=40)  # reserved for relay-a
    assert s.allow("relay-b", 0, [0], 1.5, total_shards=40, failed=["relay-a"])
    assert s.released == 1
    # relay-b now holds shard 0: a report naming relay-a no longer releases it
    assert not s.allow("relay-c", 0, [0], 2.0, total_shards=40, failed=["relay-a"])
    # each requester may release at most max(4, 10 % of the shards) per step
    for i in range(1, 4):
        assert s.allow("relay-b", 0, [i], 2.0, total_shards=40, failed=["relay-a"])
    assert not s.allow("relay-b", 0, [4], 2.0, total_shards=40, failed=["relay-a"])


def test_a_withholding_holder_costs_at_most_window_plus_three_windows() -> None:
    s = SuperSeeding(window_s=5.0, repeat_budget=0.0)
    assert s.allow("relay-a", 0, [0], 0.0, total_shards=10)
    assert not s.allow("relay-b", 0, [0], 5.0, total_shards=10)  # over budget: persist
    assert not s.allow("relay-b", 0, [0], 19.0, total_shards=10)
    assert s.allow("relay-b", 0, [0], 20.0, total_shards=10)  # 5 s + 3 x 5 s, not 150 s


def test_a_refusal_names_the_holders_and_why() -> None:
    s = SuperSeeding(window_s=5.0, repeat_budget=0.0)
    assert s.decide("peer-a", 0, [0, 1], 0.0, total_shards=10) == Decision(True)
    assert s.decide("peer-b", 0, [2, 3], 0.0, total_shards=10).allowed
    refused = s.decide("peer-c", 0, [0, 1, 2, 9], 1.0, total_shards=10)
    assert refused == Decision(False, Refusal.WINDOW, ("peer-a", "peer-b"))  # distinct, in order
    assert s.refused == 1
    over = s.decide("peer-c", 0, [0], 6.0, total_shards=10)  # past the window, no budget
    assert over == Decision(False, Refusal.BUDGET, ("peer-a",))
    many = SuperSeeding(window_s=5.0)
    for i in range(6):
        assert many.allow(f"peer-{i}", 0, [i], 0.0, total_shards=6)
    assert len(many.decide("peer-x", 0, range(6), 0.1, total_shards=6).holders) == 4  # bounded
    anonymous = SuperSeeding(window_s=5.0, anonymous_share=0.0)
    assert anonymous.decide(None, 0, [0], 0.0, total_shards=4) == Decision(
        False, Refusal.ANONYMOUS_SHARE
    )


def test_a_holder_named_unreachable_is_bypassed_within_the_requesters_share() -> None:
    """Rule 11: a requester that cannot reach the holder is served at once (it need not wait
    out the window), becomes the holder, and may do so for at most its share of the step."""
    s = SuperSeeding(window_s=5.0, repeat_budget=0.0, unreachable_share=0.25)
    assert s.allow("nat-a", 0, range(40), 0.0, total_shards=40)  # took every shard first
    refused = s.decide("sym-b", 0, [0], 0.5, total_shards=40)
    assert refused.holders == ("nat-a",)
    assert s.allow("sym-b", 0, [0], 0.5, total_shards=40, unreachable=refused.holders)
    assert s.unreachable_served == 1
    assert s.released == 0  # not rule 6's report: its own count
    # sym-b holds shard 0 now: naming nat-a no longer helps another requester
    assert s.decide("peer-c", 0, [0], 0.6, total_shards=40, unreachable=["nat-a"]).holders == (
        "sym-b",
    )
    # a holder not named stays reserved: naming someone else releases nothing
    assert not s.allow("sym-b", 0, [1], 0.7, total_shards=40, unreachable=["nat-z"])
    # the share: 25 % of 40 = 10 shards per requester and step, then the window as before
    assert s.allow("sym-b", 0, range(1, 10), 0.8, total_shards=40, unreachable=["nat-a"])
    assert not s.allow("sym-b", 0, [10], 0.9, total_shards=40, unreachable=["nat-a"])
    assert s.unreachable_served == 10
    assert s.allow("sym-b", 1, [10], 0.9, unreachable=["nat-a"])  # another step: a fresh share
    # at least 4 whatever the share, and unbounded budgets do not bypass it
    tiny = SuperSeeding(window_s=5.0, unreachable_share=0.0)
    assert tiny.allow("nat-a", 0, range(8), 0.0, total_shards=8)
    assert tiny.allow("sym-b", 0, range(4), 0.1, total_shards=8, unreachable=["nat-a"])
    assert not tiny.allow("sym-b", 0, [4], 0.1, total_shards=8, unreachable=["nat-a"])


def test_rules_6_and_11_have_separate_shares() -> None:
    s = SuperSeeding(window_s=5.0, report_share=0.0, unreachable_share=0.0)
    assert s.allow("nat-a", 0, range(10), 0.0, total_shards=10)
    assert s.allow("sym-b", 0, range(4), 0.1, total_shards=10, failed=["nat-a"])  # rule 6: 4
    assert s.allow("sym-b", 0, range(4, 8), 0.1, total_shards=10, unreachable=["nat-a"])
    assert not s.allow("sym-b", 0, [8], 0.1, total_shards=10, unreachable=["nat-a"])
    assert (s.released, s.unreachable_served) == (4, 4)


def test_holder_headers_are_bounded_both_ways() -> None:
    ids = [f"12D3KooW{c}" for c in "abcdef"]
    assert holder_header(ids) == [(HOLDER_HEADER, ",".join(ids[:4]))]  # the first 4
    assert holder_header([]) == []  # none: no header, as an older server
    assert unreachable_header(ids) == [(UNREACHABLE_HEADER, ",".join(ids[-4:]))]  # the last 4
    assert unreachable_header(["http://mirror:80"]) == []  # URLs are not nodes
    assert parse_holders(",".join(ids)) == tuple(ids[:4])
    for junk in (None, "", ",,", "a" * 600, "http://x:1", "a b"):
        assert parse_holders(junk) == ()
    assert parse_holders("a,http://x:1, b ") == ("a", "b")
    assert parse_unreachable("x" * 129 + ",y") == ("y",)


def _one_version(tmp_path: Path) -> tuple[VersionStore, Manifest]:
    """A store holding step 1 of run ``run``: one 4,000-byte file in 1,000-byte shards."""
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    ck = make_checkpoint(tmp_path / "c1", {"model-00001-of-00001.safetensors": 4000}, seed=1)
    m = build_manifest(ck, "run", 1, TRAINER, shard_size=1000)
    store.adopt(ck, m)
    return store, m


async def test_the_origin_lane_believes_signatures_not_claims(tmp_path: Path) -> None:
    store, m = _one_version(tmp_path)
    now = 5000.0
    server = VersionServer(store, trust(), serve_once_s=5.0, clock=lambda: now)
    path = f"/shardnet/v1/run/1/{m.digest}/files/{m.header.files[0].name}"

    async def get(headers: dict[str, str]) -> int:
        asked = {**headers, "range": "bytes=0-999"}
        resp = await server.handle(HttpRequest("GET", path, {}, asked, ByteRange(0, 999)))
        if resp.body is not None and hasattr(resp.body, "on_done") and resp.body.on_done:
            resp.body.on_done()
        return resp.status

    claim = {"x-shardnet-peer": A.peer_id}  # the old unauthenticated header: anonymous now
    assert await get(claim) == 206
    assert await get({AUTH_HEADER: sign_request(B, path, now)}) == 206  # not delayed by it
    assert await get({AUTH_HEADER: sign_request(A, path, now)}) == 429  # reserved for B: refused
    report = {AUTH_HEADER: sign_request(A, path, now), FAILED_HEADER: B.peer_id}
    assert await get(report) == 206  # B failed it for A: released


async def test_the_lane_names_the_holder_and_serves_one_who_cannot_reach_it(
    tmp_path: Path,
) -> None:
    store, m = _one_version(tmp_path)
    now = 5000.0
    server = VersionServer(store, trust(), serve_once_s=5.0, clock=lambda: now)
    path = f"/shardnet/v1/run/1/{m.digest}/files/{m.header.files[0].name}"

    async def get(who: Identity | None, **extra: str) -> tuple[int, dict[str, str]]:
        asked = {"range": "bytes=0-999", **{k.replace("_", "-"): v for k, v in extra.items()}}
        if who is not None:
            asked[AUTH_HEADER] = sign_request(who, path, now)
        resp = await server.handle(HttpRequest("GET", path, {}, asked, ByteRange(0, 999)))
        if resp.body is not None and hasattr(resp.body, "on_done") and resp.body.on_done:
            resp.body.on_done()
        return resp.status, dict(resp.headers)

    assert (await get(B))[0] == 206  # B holds shard 0
    status, headers = await get(A)
    assert status == 429
    assert parse_holders(headers.get(HOLDER_HEADER)) == (B.peer_id,)
    status, _ = await get(A, **{UNREACHABLE_HEADER: B.peer_id})
    assert status == 206  # A cannot reach B: served at once, and A holds it now
    status, headers = await get(C, **{UNREACHABLE_HEADER: B.peer_id})
    assert (status, parse_holders(headers.get(HOLDER_HEADER))) == (429, (A.peer_id,))
    anonymous = await get(None, **{UNREACHABLE_HEADER: A.peer_id})
    assert anonymous[0] == 206  # anonymous: its own share, no holder named or recorded


def test_a_holder_that_left_holds_nothing() -> None:
    s = SuperSeeding(window_s=5.0, repeat_budget=0.0)
    assert s.allow("relay-a", 0, [0, 1], 0.0, total_shards=10)
    assert not s.allow("relay-b", 0, [0], 1.0, total_shards=10)  # reserved for relay-a
    s.holder_gone("relay-a", 2.0)  # its connection closed (killed mid-broadcast)
    assert s.allow("relay-b", 0, [0], 2.1, total_shards=10)  # at once, no persistence wait
    assert s.allow("relay-b", 0, [1], 2.1, total_shards=10)
    # relay-a comes back: what it is served from now on is reserved for it again
    assert s.allow("relay-a", 0, [2], 3.0, total_shards=10)
    assert not s.allow("relay-b", 0, [2], 3.5, total_shards=10)


def test_a_small_version_is_served_to_everyone_without_holders() -> None:
    s = SuperSeeding(window_s=5.0, repeat_budget=0.0, small_version_bytes=1000)
    for who in ("relay-a", "relay-b", "relay-a", "relay-c"):  # a 900-byte delta: no refusal
        assert s.allow(who, 1, [0, 1], 0.0, total_shards=2, version_bytes=900)
    assert (s.refused, s.repeats, s.small_served) == (0, 0, 4)
    # it recorded no holder: a full version of the same size rules is super-seeded as before
    assert s.allow("relay-a", 2, [0], 0.0, total_shards=2, version_bytes=1001)
    assert not s.allow("relay-b", 2, [0], 0.1, total_shards=2, version_bytes=1001)
    assert not s.allow("relay-b", 2, [0], 0.2, total_shards=2)  # size unknown: rules apply
    assert SuperSeeding(window_s=5.0).small_version_bytes == 0  # off unless asked


async def test_the_lane_does_not_super_seed_a_version_smaller_than_its_bound(
    tmp_path: Path,
) -> None:
    store, m = _one_version(tmp_path)
    now = 5000.0
    path = f"/shardnet/v1/run/1/{m.digest}/files/{m.header.files[0].name}"

    async def statuses(min_bytes: int) -> list[int]:
        server = VersionServer(
            store, trust(), serve_once_s=5.0, clock=lambda: now, serve_once_min_bytes=min_bytes
        )
        out = []
        for who in (A, B):
            asked = {AUTH_HEADER: sign_request(who, path, now), "range": "bytes=0-999"}
            resp = await server.handle(HttpRequest("GET", path, {}, asked, ByteRange(0, 999)))
            if resp.body is not None and hasattr(resp.body, "on_done") and resp.body.on_done:
                resp.body.on_done()
            out.append(resp.status)
        return out

    total = offered_bytes(m)  # raw only: every shard's smallest form is its bytes
    assert total == m.total_bytes
    assert await statuses(total) == [206, 206]  # small: both served
    assert await statuses(total - 1) == [206, 429]  # larger than the bound: super-seeded


def test_offered_bytes_of_a_version_still_published_follows_its_known_parts(
    tmp_path: Path,
) -> None:
    ck = make_checkpoint(tmp_path / "c1", {"model-00001-of-00001.safetensors": 8000}, seed=1)
    full = build_manifest(
        ck, "run", 1, TRAINER, 1000, 2, encodings=["zstd"], blob_dir=tmp_path / "blobs"
    )
    live = Manifest(full.signed_header)  # a node that has the header only
    lengths = [ref.length for ref in full.header.shards]
    assert offered_bytes(live) == sum(lengths)  # nothing known: raw lengths
    live.add_part(full.parts[0])
    known = sum(lengths[i] for i in full.header.part_range(0))
    smallest = sum(
        min([full.shard(i).length, *(e.size for e in full.shard(i).encodings)])
        for i in full.header.part_range(0)
    )
    rest = sum(lengths) - known
    assert offered_bytes(live) == smallest + -(-rest * smallest // known)  # extrapolated
    assert offered_bytes(full) == sum(
        min([e.length, *(x.size for x in e.encodings)])
        for e in (full.shard(i) for i in range(len(lengths)))
    )


def test_a_servers_offered_bytes_follow_the_parts_as_they_arrive(tmp_path: Path) -> None:
    """:meth:`VersionServer._offered_bytes` keeps its O(shards) sum per version and number
    of parts known: a new part gives a new figure, not the cached one."""
    ck = make_checkpoint(tmp_path / "c1", {"model-00001-of-00001.safetensors": 0})
    (ck / "model-00001-of-00001.safetensors").write_bytes(bytes(8000))  # zstd: tiny
    full = build_manifest(
        ck, "run", 1, TRAINER, 1000, 2, encodings=["zstd"], blob_dir=tmp_path / "blobs"
    )
    live = Manifest(full.signed_header)
    server = VersionServer(_one_version(tmp_path / "s")[0], trust())
    total = full.total_bytes  # nothing known: raw lengths
    assert server._offered_bytes(live) == server._offered_bytes(live) == total
    live.add_part(full.parts[0])
    assert server._offered_bytes(live) == offered_bytes(live) < total - 4000
    for k in range(1, full.header.n_parts):
        live.add_part(full.parts[k])
    assert server._offered_bytes(live) == offered_bytes(full) < total - 7000


def test_the_origins_have_bitmap_follows_the_parts_it_signed(tmp_path: Path) -> None:
    """While publishing, the origin serves the shards of the parts signed so far; its kept
    bitmap is rebuilt when a part is added, never stale."""
    ck = make_checkpoint(tmp_path / "c1", {"model-00001-of-00001.safetensors": 8000}, seed=2)
    full = build_manifest(ck, "run", 1, TRAINER, 1000, 2)
    live = Manifest(full.signed_header)
    publishing = _Publishing(live, tmp_path)
    n = len(full.header.shards)
    assert publishing.have_bits() == bytes((n + 7) // 8)
    for k in range(full.header.n_parts):
        live.add_part(full.parts[k])
        assert publishing.have_bits() == shard_bits(n, live.known)
    assert publishing.have_bits() == full_bits(n)


async def test_the_lane_asks_what_a_requester_is(tmp_path: Path) -> None:
    """A relay does not super-seed to its sibling relays (``VersionServer.requester_kind``,
    set by the follower from adverts): the sibling gets a shard already served to a peer at
    once, instead of asking the origin again or a peer's uplink; the peers are still
    refused; a download-only peer served first does not make the others wait."""
    store, m = _one_version(tmp_path)
    now = 5000.0
    server = VersionServer(store, trust(), serve_once_s=5.0, clock=lambda: now)
    kinds = {A.peer_id: Requester.SIBLING, D.peer_id: Requester.DOWNLOAD_ONLY}
    server.requester_kind = lambda peer_id: kinds.get(peer_id, Requester.SERVING)
    path = f"/shardnet/v1/run/1/{m.digest}/files/{m.header.files[0].name}"

    async def get(who: Identity) -> int:
        asked = {AUTH_HEADER: sign_request(who, path, now), "range": "bytes=0-999"}
        resp = await server.handle(HttpRequest("GET", path, {}, asked, ByteRange(0, 999)))
        if resp.body is not None and hasattr(resp.body, "on_done") and resp.body.on_done:
            resp.body.on_done()
        return resp.status

    assert await get(D) == 206  # download-only: served, holds nothing
    assert await get(B) == 206  # the first serving peer holds the shard now
    assert await get(A) == 206  # the sibling relay: served anyway
    assert await get(C) == 429  # another peer: refused, as before


def test_shards_nobody_holds_are_spread_over_the_askers() -> None:
    """Rule 12: among veterans (served an earlier step), an asker holding its share
    (ceil(shards / askers within the window)) is refused a shard nobody holds, naming no
    holder; another asker takes it. A lone asker's share is the whole version; a shard asked
    for over the window is served anyway; a new asker turns the rule off for the step."""
    s = SuperSeeding(window_s=5.0)
    a, b, c = "peer-a", "peer-b", "peer-c"
    # step 0: a and b are new here (their lanes may not be known yet): first come, first served
    assert s.decide(b, 0, [2], 0.0, 3).allowed
    assert s.decide(a, 0, [0, 1], 0.0, 3).allowed  # 2 > ceil(3 / 2), but both are new
    assert s.decide(a, 1, [0], 0.0, 6).allowed  # lone asker: share 6
    assert s.decide(b, 1, [0], 0.1, 6) == Decision(False, Refusal.WINDOW, (a,))  # b asks too
    assert s.decide(a, 1, [1], 0.2, 6).allowed
    assert s.decide(a, 1, [2], 0.3, 6).allowed  # a holds 3 = ceil(6 / 2)
    assert s.decide(a, 1, [3], 0.4, 6) == Decision(False, Refusal.SPREAD)
    assert s.decide(b, 1, [3], 0.5, 6).allowed  # b takes it
    assert s.decide(a, 1, [3], 0.6, 6) == Decision(False, Refusal.WINDOW, (b,))
    assert s.spread_refused == 1
    # a download-only asker neither counts as an asker nor is refused for its share
    assert s.decide(c, 1, [4, 5], 0.7, 6, kind=Requester.DOWNLOAD_ONLY).allowed
    assert s.decide(a, 1, [4], 0.8, 6) == Decision(False, Refusal.SPREAD)  # still 2 askers
    # b keeps asking; a has asked for shard 4 for the window: served
    assert s.decide(b, 1, [3], 5.7, 6).allowed  # its own shard again (rule 2)
    assert s.decide(a, 1, [5], 5.75, 6) == Decision(False, Refusal.SPREAD)
    assert s.decide(a, 1, [4], 5.8, 6).allowed
    # alone again (b silent for the window): a's share is the whole version
    assert s.decide(a, 1, [5], 10.8, 6).allowed
    # step 2: a over its share is refused until a newcomer asks; then first come again
    assert s.decide(b, 2, [0], 20.0, 5).allowed
    assert s.decide(a, 2, [1, 2, 3, 4], 20.0, 5) == Decision(False, Refusal.SPREAD)
    # c was served before only as download-only (never a holder): new here
    assert s.decide(c, 2, [0], 20.1, 5) == Decision(False, Refusal.WINDOW, (b,))
    assert s.decide(a, 2, [1, 2, 3, 4], 20.2, 5).allowed
    off = SuperSeeding(window_s=5.0, spread=False)
    assert off.decide(a, 1, [0], 0.0, 2).allowed
    assert not off.decide(b, 1, [0], 0.1, 2).allowed
    assert off.decide(a, 1, [1], 0.2, 2).allowed  # first come, first served


def test_the_origin_sends_no_repeat_while_first_copies_go_out() -> None:
    """Rule 13, the origin's: a repeat waits while a first copy of its step went out less than
    the window ago, unless its requester kept asking (rule 5) or names the holder failing
    (rule 6); without the rule (relays) the repeat comes out of the budget at once."""

    def world(first_copies_first: bool) -> SuperSeeding:
        s = SuperSeeding(window_s=5.0, spread=False, first_copies_first=first_copies_first)
        assert s.allow("relay-a", 0, [0], 0.0, total_shards=10)
        assert s.allow("relay-b", 0, [1], 4.0, total_shards=10)  # a first copy at 4 s
        return s

    assert world(False).allow("relay-b", 0, [0], 6.0, total_shards=10)  # rule 4
    origin = world(True)
    refused = origin.decide("relay-b", 0, [0], 6.0, total_shards=10)
    assert refused == Decision(False, Refusal.FIRST_COPIES, ("relay-a",))
    assert origin.first_copies_refused == 1
    assert not origin.allow("relay-b", 0, [0], 8.9, total_shards=10)
    assert origin.allow("relay-b", 0, [0], 9.0, total_shards=10)  # 5 s after the first copy
    assert origin.repeats == 1
    assert world(True).allow("relay-b", 0, [0], 6.0, total_shards=10, failed=["relay-a"])
    assert world(True).allow("relay-b", 1, [0], 6.0, total_shards=10)  # another step: fresh

    # first copies all along: the requester that keeps asking is served after persist_s
    s = SuperSeeding(window_s=5.0, spread=False, first_copies_first=True)
    assert s.allow("relay-a", 0, [0], 0.0, total_shards=100)
    t = 6.0
    while True:
        assert s.allow(f"peer-{t:g}", 0, [int(t)], t, total_shards=100)  # one a second
        if s.allow("relay-b", 0, [0], t + 0.5, total_shards=100):
            break
        t += 1.0
    assert t + 0.5 == 6.5 + s.persist_s == 21.5  # refused first at 6.5 s
