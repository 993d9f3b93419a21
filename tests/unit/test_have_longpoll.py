"""``/have`` as a long-poll (issue 16): a request naming the last answer's token is held until
the source's bitmap or the set of shards it serves a prefix of changes, at most
``HAVE_HOLD_S``; a request without it (or a committed version) is answered at once. One that
also names the shards its poller lacks is held until a change among those."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from p2p.http_server import HttpRequest, HttpResponse
from shardcast.serve.server import VersionServer
from shardcast.store import PartialVersion
from shardcast.store.store import VersionStore
from shardcast.wire.have import (
    HAVE_HOLD_S,
    HAVE_TOKEN_HEADER,
    HOLD_HEADER,
    decode_have,
    encode_want,
    have_token,
    wanted_token,
)
from shardcast.wire.lane_urls import have_url
from shardcast.wire.manifest import Manifest
from tests.faults import RUN, make_version
from tests.helpers import trust

SHARD = 16 * 1024
CHUNK = 4096
FILE = "model.safetensors"


def _get(path: str, known: str | None, hold: bool = True) -> HttpRequest:
    query = {"prefix": "1", **({"known": known} if known is not None else {})}
    headers = {HOLD_HEADER: "10"} if hold else {}
    return HttpRequest("GET", path, query, headers, None)


def _token(resp: HttpResponse, n: int) -> str:
    assert isinstance(resp.body, bytes)
    _, prefixes = decode_have(resp.body, n)
    token = have_token(resp.body[: (n + 7) // 8], prefixes)
    assert dict(resp.headers)[HAVE_TOKEN_HEADER] == token  # the client computes the same
    return token


def _filling(tmp_path: Path, n: int) -> tuple[Manifest, bytes, PartialVersion, VersionServer, str]:
    """A version of ``n`` shards being received (nothing held yet) and served live: its
    manifest, its bytes, the partial version, the server and the ``/have`` path."""
    version = make_version(tmp_path, {FILE: n * SHARD}, SHARD, chunk_bytes=CHUNK)
    m, data = version.signed, version.files[FILE]
    store = VersionStore(tmp_path / "filling", RUN, keep_last=2)
    part = store.begin(m)
    server = VersionServer(store, trust(), wait_s=10.0)
    server.add_live(part)
    path = have_url("http://x", RUN, m.step, m.digest).removeprefix("http://x")
    return m, data, part, server, path


async def test_have_is_held_until_a_shard_starts_or_completes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    m, data, part, server, path = _filling(tmp_path, 2)
    first = await server.handle(_get(path, None))
    token = _token(first, 2)
    got: list[HttpResponse] = []

    async def poll(known: str, hold: bool = True) -> None:
        got.append(await server.handle(_get(path, known, hold)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll, token)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # nothing changed: held
        part.write_prefix(1, 0, data[SHARD : SHARD + CHUNK])  # shard 1 starts: a change
        server.progress(m.step)
    assert decode_have(got[0].body, 2) == ([], {1: CHUNK})  # type: ignore[arg-type]
    token = _token(got.pop(), 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll, token)
        part.write_prefix(1, CHUNK, data[SHARD + CHUNK : SHARD + 2 * CHUNK])  # grows: no change
        server.progress(m.step)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        part.write_shard(0, data[:SHARD])  # shard 0 whole: the bitmap changed
        server.progress(m.step)
    assert decode_have(got[0].body, 2) == ([0], {1: 2 * CHUNK})  # type: ignore[arg-type]
    token = _token(got.pop(), 2)

    await poll("stale")  # a token of another state: answered at once
    await poll(token, hold=False)  # not asking to be held: answered at once
    assert [_token(r, 2) for r in got] == [token, token]
    got.clear()
    t0 = trio.current_time()
    await poll(token)  # nothing changes: answered, unchanged, after HAVE_HOLD_S
    assert trio.current_time() - t0 >= HAVE_HOLD_S
    assert _token(got.pop(), 2) == token
    part.abort()


def _want(path: str, known: str, want: bytes, wknown: str) -> HttpRequest:
    query = {"prefix": "1", "known": known, "want": encode_want(want) or "", "wknown": wknown}
    return HttpRequest("GET", path, query, {HOLD_HEADER: "10"}, None)


async def test_a_poll_naming_what_it_lacks_is_held_until_news_for_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A poller that lacks only shard 2 (``want``) is not answered when the source completes
    shard 0, which it holds, nor when a prefix it does not want grows; it is when shard 2
    starts here. A poll naming only ``known`` is answered on any change, as before; a
    ``want`` that is not a bitmap of the version is a ``400``."""
    m, data, part, server, path = _filling(tmp_path, 3)
    part.write_prefix(1, 0, data[SHARD : SHARD + CHUNK])
    first = await server.handle(_get(path, None))
    assert isinstance(first.body, bytes)
    _, prefixes = decode_have(first.body, 3)
    token, bits = _token(first, 3), first.body[:1]
    want = bytes([0b0010_0000])  # the poller lacks shard 2 only
    wknown = wanted_token(bits, prefixes, want)
    got: dict[str, HttpResponse] = {}

    async def poll(name: str, req: HttpRequest) -> None:
        got[name] = await server.handle(req)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll, "want", _want(path, token, want, wknown))
        nursery.start_soon(poll, "known", _get(path, token))
        await trio.testing.wait_all_tasks_blocked()
        part.write_shard(0, data[:SHARD])  # shard 0 whole: news for the plain poll only
        part.write_prefix(1, CHUNK, data[SHARD + CHUNK : SHARD + 2 * CHUNK])
        server.progress(m.step)
        await trio.testing.wait_all_tasks_blocked()
        assert list(got) == ["known"]
        assert decode_have(got["known"].body, 3)[0] == [0]  # type: ignore[arg-type]
        t0 = trio.current_time()
        await trio.sleep(0.5)
        part.write_prefix(2, 0, data[2 * SHARD : 2 * SHARD + CHUNK])  # shard 2 starts
        server.progress(m.step)
    assert trio.current_time() - t0 < HAVE_HOLD_S  # answered on the news, not the hold
    assert decode_have(got["want"].body, 3) == ([0], {1: 2 * CHUNK, 2: CHUNK})  # type: ignore[arg-type]
    assert dict(got["want"].headers)[HAVE_TOKEN_HEADER] == _token(got["want"], 3)

    bad = await server.handle(_want(path, token, b"\x00\x00", wknown))  # 2 bytes for 3 shards
    assert bad.status == 400
    part.abort()
