"""A step held under another manifest digest, over real sockets on 127.0.0.1 (issue 15).

An honest node that holds step N of a version the trainer has since republished (an origin
restarted on a rewritten directory) answers the new version's URLs with ``409``. The
downloader takes that as "not held here" — it fetches from a source that has the version,
never blames, scores down or bans the other, and fails as ``gone`` (not ``no source``, not a
ban) when no source has it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from shardcast.core.liveness import Abandon
from shardcast.core.select import SchedulerConfig
from shardcast.download.downloader import Downloader
from shardcast.download.types import DownloadConfig, DownloadFailed, Source
from shardcast.store.store import VersionStore
from shardcast.wire.lane_urls import LaneAnswer, lane_answer, manifest_url
from tests.faults import RUN, Version, honest_source, make_version
from tests.helpers import trust

SHARD = 16 * 1024
FILE = "model.safetensors"


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.05)


def _versions(tmp_path: Path) -> tuple[Version, Version]:
    """The trainer's step 1 and another node's older copy of step 1 (other content)."""
    new = make_version(tmp_path / "new", {FILE: 4 * SHARD}, SHARD, step=1, seed=1)
    old = make_version(tmp_path / "old", {FILE: 4 * SHARD}, SHARD, step=1, seed=9, nonce=7)
    assert new.signed.digest != old.signed.digest
    return new, old


def _config() -> DownloadConfig:
    return DownloadConfig(
        stall_timeout_s=10.0,
        deadline_s=60.0,
        no_source_grace_s=30.0,
        gone_grace_s=2.0,
        scheduler=SchedulerConfig(explore=0.0, penalty_s=1.0),
    )


async def test_a_source_with_another_digest_is_skipped_and_never_blamed(
    tmp_path: Path,
) -> None:
    new, old = _versions(tmp_path)
    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        honest_source(old) as (other, other_asks),
        honest_source(new) as (honest, _),
        HttpClient() as client,
    ):
        with pytest.raises(NotAvailable) as info:  # the typed outcome, not a protocol error
            await client.get_bytes(
                manifest_url(other.url, RUN, 1, new.signed.digest), max_bytes=1 << 20, timeout_s=5
            )
        assert lane_answer(info.value.status) is LaneAnswer.OTHER_DIGEST
        # "a-…" sorts first: with exploration off it is asked first
        sources = [Source("a-other", other.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, _config(), random.Random(1), trust())
        with trio.fail_after(30):
            path, stats = await dl.download(new.signed, sources)
    assert (path / FILE).read_bytes() == new.files[FILE]
    assert store.holds(1, new.signed.digest)
    assert other_asks  # it was asked, and answered 409 ...
    assert stats.other_digest_by_source.get("a-other", 0) >= 1
    assert stats.corrupt_by_source == {}  # ... which is nobody's fault
    assert dl.bans.banned(trio.current_time()) == []
    assert stats.bytes_by_source == {"b-honest": 4 * SHARD}


async def test_only_other_digests_fail_as_gone_without_a_ban(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    new, old = _versions(tmp_path)
    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with honest_source(old) as (other, _), HttpClient() as client:
        dl = Downloader(client, store, _config(), random.Random(1), trust())
        with pytest.raises(DownloadFailed) as info:
            await dl.download(new.signed, [Source("a-other", other.url)])
    assert info.value.reason is Abandon.GONE
    assert dl.bans.banned(trio.current_time()) == []
    assert dl.last_stats is not None
    assert dl.last_stats.corrupt_by_source == {}
    assert sorted(p.name for p in store.run_dir.iterdir()) == []  # nothing left behind
