"""An idle follower watches its upstream's ``/versions`` with a long-poll instead of polling
its info record every second: the server holds a request naming the last answer's token until
the list changes (``shardcast.serve.server``); the pure ``VersionWatch`` decides when to wake
the info poll and when to ask again (``shardcast.core.pollpolicy``); ``parse_versions``
reads an answer (``shardcast.download.versionwatch``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.errors import RemoteProtocolError
from p2p.http_server import HttpRequest, HttpResponse
from shardcast.core import PollPolicy, VersionWatch, poll_delay
from shardcast.download.versionwatch import parse_versions
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire import VERSIONS_HOLD_S, versions_token, versions_url
from shardcast.wire.have import HOLD_HEADER
from tests.faults import RUN, make_version
from tests.helpers import trust

POLICY = PollPolicy()


# --- the pure decisions ------------------------------------------------------------------------


def test_a_watched_upstream_is_polled_seldom_unless_settled_or_failing() -> None:
    assert poll_delay(POLICY, 0, settled=False) == POLICY.poll_interval_s
    assert poll_delay(POLICY, 0, settled=False, watched=True) == POLICY.watched_poll_interval_s
    assert poll_delay(POLICY, 0, settled=True, watched=True) == POLICY.finished_poll_interval_s
    assert poll_delay(POLICY, 3, settled=False, watched=True) == POLICY.max_backoff_s


def test_the_watch_wakes_the_poller_when_the_list_changes_only() -> None:
    w = VersionWatch(POLICY)
    first = w.answered("t1", holds=True)
    assert (first.wake, w.watching, w.token) == (False, True, "t1")  # nothing to compare yet
    assert w.answered("t1", holds=True).wake is False  # the hold ran out, no change
    again = w.answered("t2", holds=True)
    assert again.wake is True
    assert again.again_s == w.min_gap_s  # the next request at once (bounded rate)


def test_an_upstream_that_does_not_hold_ends_the_watch() -> None:
    w = VersionWatch(POLICY)
    step = w.answered("t1", holds=False)
    assert (step.again_s, w.watching) == (None, False)


def test_a_failed_watch_wakes_the_poller_once_and_backs_off() -> None:
    w = VersionWatch(POLICY)
    w.answered("t1", holds=True)
    first = w.failed(settled=False)
    assert (first.wake, w.watching, first.again_s) == (True, False, POLICY.poll_interval_s)
    second = w.failed(settled=False)
    assert (second.wake, second.again_s) == (False, 2 * POLICY.poll_interval_s)
    assert w.answered("t1", holds=True).wake is False  # back, unchanged: watching again
    assert w.watching


def test_parse_versions_reads_the_token_and_the_hold_and_rejects_garbage() -> None:
    digests = {"1": "ab" * 32}
    body = json.dumps({"committed": [1], "digests": digests, "hold_s": 10.0}).encode()
    assert parse_versions(body) == (versions_token(digests), True)
    older = json.dumps({"committed": [1], "digests": digests}).encode()
    assert parse_versions(older) == (versions_token(digests), False)
    for bad in (b"not json", b"[]", b'{"digests": {"1": 2}}', b'{"digests": []}'):
        with pytest.raises(RemoteProtocolError):
            parse_versions(bad, "src")


# --- the server's long-poll ---------------------------------------------------------------------


def _get(known: str | None, hold: bool = True) -> HttpRequest:
    path = versions_url("http://x", RUN).removeprefix("http://x")
    query = {"known": known} if known is not None else {}
    return HttpRequest("GET", path, query, {HOLD_HEADER: "30"} if hold else {}, None)


def _token(resp: HttpResponse) -> str:
    assert resp.status == 200
    assert isinstance(resp.body, bytes)
    token, holds = parse_versions(resp.body)
    assert holds
    return token


async def test_versions_is_held_until_a_version_is_added(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    version = make_version(tmp_path, {"model.safetensors": 4096}, 4096)
    store = VersionStore(tmp_path / "store", RUN, keep_last=2)
    server = VersionServer(store, trust(), wait_s=60.0)
    token = _token(await server.handle(_get(None)))
    got: list[HttpResponse] = []

    async def poll(known: str, hold: bool = True) -> None:
        got.append(await server.handle(_get(known, hold)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll, token)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # nothing changed: held
        server.add_live(store.begin(version.signed))  # a version starts filling
        await trio.testing.wait_all_tasks_blocked()
    assert len(got) == 1
    new = _token(got[0])
    assert new != token
    body = json.loads(got[0].body)  # type: ignore[arg-type]
    assert body["in_progress"] == [version.signed.step]
    # unchanged: held for at most VERSIONS_HOLD_S, then answered with the same token
    t0 = trio.current_time()
    assert _token(await server.handle(_get(new))) == new
    assert trio.current_time() - t0 == pytest.approx(VERSIONS_HOLD_S)
    # without the hold header (a plain client), at once
    t0 = trio.current_time()
    assert _token(await server.handle(_get(new, hold=False))) == new
    assert trio.current_time() == t0
