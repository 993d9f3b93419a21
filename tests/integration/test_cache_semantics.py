"""The HTTP lane as an HTTP cache sees it: validators, immutability, If-Range, 503 at once.

An origin publishes a version on 127.0.0.1; an independent client (httpx) reads it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from p2p.http_server import HttpRequest
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.serve.server import IMMUTABLE, VersionServer
from shardcast.wire.have import HOLD_HEADER
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model.safetensors": 150_000}


async def test_committed_version_has_cache_validators(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "ckpt", SIZES)
    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as node, httpx.AsyncClient() as client:
        result = await Origin(node, OriginConfig(shard_size=64 * 1024)).publish(src, 0)
        m = result.manifest
        base = f"{node.http.url}/shardnet/v1/run/0/{m.digest}"
        url = f"{base}/files/model.safetensors"
        whole = await client.get(url)
        assert whole.status_code == 200
        etag = whole.headers["etag"]
        assert etag == f'"{m.file_digest("model.safetensors")}"'  # the signed digest
        assert whole.headers["cache-control"] == IMMUTABLE
        last_modified = whole.headers["last-modified"]
        assert last_modified.endswith("GMT")
        # If-Range: the same representation -> the range; another -> everything
        for cond, status in [
            (etag, 206),
            (last_modified, 206),
            ('"other"', 200),
            ("W/" + etag, 200),
        ]:
            r = await client.get(url, headers={"range": "bytes=0-9", "if-range": cond})
            assert r.status_code == status, cond
        r = await client.get(url, headers={"if-none-match": etag})
        assert (r.status_code, r.content) == (304, b"")
        # nginx's range decisions
        r = await client.get(url, headers={"range": "bytes=9-3"})
        assert (r.status_code, r.headers["content-range"]) == (416, f"bytes */{150_000}")
        assert (await client.get(url, headers={"range": "bytes="})).status_code == 200
        # documents: JSON, and one part as its signed envelope (CBOR)
        for path, ctype in (
            ("manifest", "application/json"),
            ("manifest/part/0", "application/cbor"),
            ("files/config.json", "application/json"),
        ):
            r = await client.get(f"{base}/{path}")
            assert r.headers["content-type"] == ctype, path
            assert r.headers["cache-control"] == IMMUTABLE, path
            assert r.headers["etag"].startswith('"'), path
        r = await client.get(f"{node.http.url}/shardnet/v1/run/versions")
        assert r.headers["cache-control"] == "no-store"


class _Live:
    """A live version whose shard 0 is not verified yet."""

    def __init__(self, manifest: object, directory: Path) -> None:
        self.manifest = manifest
        self.dir = directory
        self.ready = False

    def has(self, index: int) -> bool:
        return self.ready

    def blob_ref(self, index: int, encoding: str) -> None:
        return None


async def test_unverified_shard_is_503_at_once_unless_held(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    src = make_checkpoint(tmp_path / "ckpt", SIZES)
    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as node:
        m = (await Origin(node, OriginConfig(shard_size=64 * 1024)).publish(src, 0)).manifest
    server = VersionServer(node.store, trust(), wait_s=10.0)
    live = _Live(m, node.store.version_dir(0))
    server.add_live(live)  # type: ignore[arg-type]

    def req(headers: dict[str, str]) -> HttpRequest:
        path = f"/shardnet/v1/run/0/{m.digest}/files/model.safetensors"
        return HttpRequest("GET", path, {}, headers, None)

    start = trio.current_time()
    plain = await server.handle(req({}))
    assert plain.status == 503
    assert ("retry-after", "1") in plain.headers
    assert ("cache-control", "no-store") in plain.headers
    assert trio.current_time() == start  # answered at once

    held_for = 0.0

    async def held() -> None:
        nonlocal held_for
        resp = await server.handle(req({HOLD_HEADER: "5"}))
        held_for = trio.current_time() - start
        assert resp.status == 200

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held)
        await trio.sleep(2)
        live.ready = True
        server.progress(0)
    assert held_for == pytest.approx(2)  # served the moment it was verified
    live.ready = False
    before = trio.current_time()
    gave_up = await server.handle(req({HOLD_HEADER: "60"}))
    assert gave_up.status == 503
    assert trio.current_time() - before == pytest.approx(10.0)  # the hold is capped at wait_s
