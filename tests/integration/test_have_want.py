"""A downloader's ``/have`` long-polls name the shards it lacks (``?want=``) and the last
answer's token under them (``?wknown=``), on 127.0.0.1 in virtual time: a source then holds
the poll until it has news for this downloader (:func:`shardcast.wire.have.wanted_token`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.http_client import HttpClient
from p2p.http_range import ByteRange
from p2p.http_server import HttpRequest, HttpResponse, open_http_server
from shardcast.download.downloader import Downloader
from shardcast.download.types import Source
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.have import HAVE_HOLD_S, HOLD_HEADER, decode_have, decode_want, wanted_token
from tests.faults import RUN, make_version
from tests.helpers import trust
from tests.integration.test_downloader_faults import assert_committed, config

SHARD = 16 * 1024
N = 20
LATE = {18, 19}  # shards the origin serves only from LATE_AT_S on
LATE_AT_S = 3.0
FILE = "model.safetensors"


def _shards(bits: bytes) -> set[int]:
    return {i for i in range(N) if bits[i // 8] & (0x80 >> i % 8)}


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    """Jumps after 50 ms of real idleness, not at once: shards are verified in worker
    threads, which trio cannot see (``test_late_parts.jump_clock``)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def test_have_polls_name_what_the_downloader_lacks_and_the_token_under_it(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """The origin serves shards 0-17 at once and 18-19 only at 3 s; a peer that is still
    receiving, once polled, gains a shard every 0.1 s, each one the downloader verified
    already. Every long-poll of the peer names as ``want`` no shard the downloader had
    verified when it asked, and as ``wknown`` the wanted token of the peer's previous answer:
    the peer holds such a poll while it only gains shards the downloader has: each answer
    has news for the poller, or comes when the hold runs out, never on such a change."""
    version = make_version(tmp_path, {FILE: N * SHARD}, SHARD)
    m, data = version.signed, version.files[FILE]
    filling = VersionStore(tmp_path / "peer", RUN, keep_last=2)
    part = filling.begin(m)
    peer = VersionServer(filling, trust(), wait_s=10.0)
    peer.add_live(part)
    origin = VersionServer(version.store, trust(), wait_s=10.0)
    verified: set[int] = set()
    answers: list[tuple[bytes, dict[int, int], set[int]]] = []  # and what was verified then
    polls: list[tuple[set[int], set[int], str, str]] = []  # want, verified, wknown, ours
    ends: list[tuple[bool, float]] = []  # per long-poll: news for the poller?, seconds held
    changes = 0
    polled = trio.Event()

    async def origin_handler(req: HttpRequest) -> HttpResponse:
        if isinstance(req.range, ByteRange) and req.range.first // SHARD in LATE:
            await trio.sleep_until(LATE_AT_S)
        return await origin.handle(req)

    async def peer_handler(req: HttpRequest) -> HttpResponse:
        if req.path.endswith("/have"):
            polled.set()
            want = None
            if "known" in req.query:
                want = decode_want(req.query["want"], N)
                bits, prefixes, had = answers[-1]  # the poll follows the last answer
                ours = wanted_token(bits, prefixes, want)
                polls.append((_shards(want), had, req.query["wknown"], ours))
            t0 = trio.current_time()
            resp = await peer.handle(req)
            assert isinstance(resp.body, bytes)
            bits, prefixes = resp.body[: (N + 7) // 8], decode_have(resp.body, N)[1]
            answers.append((bits, prefixes, set(verified)))
            if want is not None:
                news = wanted_token(bits, prefixes, want) != req.query["wknown"]
                ends.append((news, trio.current_time() - t0))
            return resp
        return await peer.handle(req)

    async def fill() -> None:  # the peer gets each shard after the downloader has it
        nonlocal changes
        await polled.wait()
        while len(part_shards := {i for i in range(N) if part.has(i)}) < N:
            for i in sorted(verified - part_shards):
                part.write_shard(i, data[i * SHARD : (i + 1) * SHARD])
                peer.progress(m.step)
                changes += 1
                await trio.sleep(0.1)
            await trio.sleep(0.05)

    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        open_http_server(origin_handler) as origin_http,
        open_http_server(peer_handler) as peer_http,
        HttpClient(headers={HOLD_HEADER: "10"}) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(fill)
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(
            m,
            [Source("a-origin", origin_http.url, complete=True)],
            extra_sources=lambda: [Source("b-peer", peer_http.url, complete=False)],
            on_shard=lambda i: verified.add(i) if i >= 0 else None,
        )
        nursery.cancel_scope.cancel()
    assert_committed(store, version, path)
    assert stats.bytes_by_source == {"a-origin": N * SHARD}
    assert changes >= len(set(range(N)) - LATE)  # the peer gained the early shards
    assert polls, "the peer was never long-polled"
    for want, had, wknown, ours in polls:
        assert not want & had  # never asks for news of a shard it had before it asked
        assert wknown == ours  # the token the peer compares with
    # each long-poll was answered with news for the poller or when its hold ran out, never
    # on a change of shards it had (the peer made one every 0.1 s)
    assert ends
    for news, held_s in ends:
        assert news or held_s >= HAVE_HOLD_S - 1e-6
    part.abort()
