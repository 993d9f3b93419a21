"""The ``/versions`` long-poll on a real lane (127.0.0.1): ``watch_versions`` is held by a
node's server until its list of versions changes, then wakes the follower's info poll; an
older node (no ``hold_s``) ends the watch; so does a URL the client cannot use."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, open_http_server
from shardcast.core import PollPolicy, VersionWatch
from shardcast.download.versionwatch import watch_versions
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.have import HOLD_HEADER
from tests.faults import RUN, make_version
from tests.helpers import trust

HOLD = {HOLD_HEADER: "10"}  # what a node's client sends with every request


async def test_the_watch_is_held_until_a_version_appears_then_wakes_the_poller(
    tmp_path: Path,
) -> None:
    version = make_version(tmp_path, {"model.safetensors": 4096}, 4096)
    store = VersionStore(tmp_path / "store", RUN, keep_last=2)
    server = VersionServer(store, trust(), wait_s=60.0)
    held = trio.Event()
    woken = trio.Event()
    asked: list[str] = []

    async def handler(req: HttpRequest) -> HttpResponse:
        asked.append(req.query.get("known", ""))
        if "known" in req.query:
            held.set()  # the watch's long-poll arrived
        return await server.handle(req)

    watch = VersionWatch(PollPolicy())
    async with open_http_server(handler) as http, HttpClient(headers=HOLD) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                watch_versions, client, "up", http.url, RUN, watch, woken.set, lambda: False
            )
            with trio.fail_after(30):
                await held.wait()
                assert watch.watching
                assert not woken.is_set()  # held: nothing changed yet
                server.add_live(store.begin(version.signed))  # a version starts filling
                await woken.wait()
            nursery.cancel_scope.cancel()
    assert asked[0] == ""  # the first request names no token; the long-polls do
    assert all(asked[1:])


async def test_an_older_node_ends_the_watch_and_a_bad_url_too(tmp_path: Path) -> None:
    async def older(req: HttpRequest) -> HttpResponse:  # answers at once, no hold_s
        body = json.dumps({"committed": [], "in_progress": [], "digests": {}}).encode()
        return HttpResponse(200, [("content-type", "application/json")], body)

    woken: list[int] = []
    async with open_http_server(older) as http, HttpClient(headers=HOLD) as client:
        watch = VersionWatch(PollPolicy())
        with trio.fail_after(30):
            await watch_versions(
                client, "up", http.url, RUN, watch, lambda: woken.append(1), lambda: False
            )  # returns
        assert (watch.watching, woken) == (False, [])
        bad = VersionWatch(PollPolicy())
        with trio.fail_after(30):
            await watch_versions(client, "up", "http://", RUN, bad, lambda: None, lambda: False)
        assert not bad.watching
