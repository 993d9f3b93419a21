"""Waits on a version's path from the trainer's ready marker to the last peer (issue 16):
the origin's WATCH scan period, the part size that gates the first bytes, the follower's
manifest retry and run-card fetch, and the per-stage timeline tool (``bench/timeline.py``)
that measures them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import trio

from bench import timeline
from p2p.errors import LocalProtocolError
from shardcast.download import cards
from shardcast.download.follower import MANIFEST_RETRY_MAX_S, manifest_retry_s
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig, parts_of
from shardcast.publish.plan import make_header
from shardcast.wire import VersionAnnouncement
from shardnet.config import OriginSettings, TrainerSettings
from tests.helpers import TRAINER, make_checkpoint, trust


def test_manifest_retry_doubles_from_20_ms_and_is_capped_at_250_ms() -> None:
    waits = [manifest_retry_s(k) for k in range(8)]
    assert waits[:4] == [0.02, 0.04, 0.08, 0.16]
    assert waits[4:] == [MANIFEST_RETRY_MAX_S] * 4 == [0.25] * 4
    assert manifest_retry_s(10_000) == 0.25  # no overflow however long it waits
    # the old schedule (50 ms doubling to 1 s) overshot a relay going live at 0.7 s by up
    # to 0.75 s; this one by at most 0.25 s
    waited, k = 0.0, 0
    while waited < 0.7:
        waited += manifest_retry_s(k)
        k += 1
    assert waited - 0.7 <= 0.25


def test_origin_defaults_scan_often_and_sign_small_parts(tmp_path: Path) -> None:
    fields = OriginSettings.model_fields
    assert fields["poll_interval_s"].default == 0.1
    for settings in (OriginSettings, TrainerSettings):
        assert settings.model_fields["shards_per_part"].default == 4
    # a 10-shard version: its first part (the first bytes' gate) covers 4 shards, not 10
    ck = make_checkpoint(tmp_path / "ck", {"model.safetensors": 10 * 4096})
    header = make_header(ck, "run", 0, 4096, fields["shards_per_part"].default)
    assert len(header.shards) >= 10
    assert list(header.part_range(0)) == [0, 1, 2, 3]


def test_parts_grow_only_when_a_version_would_have_too_many() -> None:
    assert parts_of(10, 4, 32) == 4  # 3 parts
    assert parts_of(128, 4, 32) == 4  # exactly 32 parts
    assert parts_of(129, 4, 32) == 5  # 26 parts, not 33
    assert parts_of(4200, 4, 32) == 132  # a 140 GB version at 32 MiB shards: 32 parts
    assert parts_of(1, 4, 32) == 4
    for n in range(1, 300):
        k = parts_of(n, 4, 32)
        assert -(-n // k) <= 32  # at most 32 parts
        assert k == 4 or -(-n // (k - 1)) > 32  # and the smallest parts that allow it
    with pytest.raises(LocalProtocolError):
        OriginConfig(max_parts=0)


async def test_origin_caps_the_part_count_of_a_large_version(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", {"model.safetensors": 40 * 4096})
    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as node:
        origin = Origin(node, OriginConfig(shard_size=4096, shards_per_part=2, max_parts=8))
        header = (await origin.publish(ck, 0)).manifest.header
    n = len(header.shards)
    assert n >= 40
    assert header.shards_per_part == -(-n // 8) > 2
    assert header.n_parts <= 8


async def test_a_delta_version_gets_its_own_larger_parts(tmp_path: Path) -> None:
    """A delta version's bytes are few: its parts cover ``delta_shards_per_part`` shards (each
    part costs every follower a part request and a blob batch); a full version, an anchor
    and a version published without deltas keep ``shards_per_part``."""
    for settings in (OriginSettings, TrainerSettings):
        assert settings.model_fields["delta_shards_per_part"].default == 16
    v0 = make_checkpoint(tmp_path / "v0", {"model.safetensors": 24 * 4096}, seed=0)
    v1 = make_checkpoint(tmp_path / "v1", {"model.safetensors": 24 * 4096}, seed=1)
    v2 = make_checkpoint(tmp_path / "v2", {"model.safetensors": 24 * 4096}, seed=2)
    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    oc = OriginConfig(shard_size=4096, shards_per_part=2, delta_shards_per_part=8, anchor_every=2)
    async with ShardcastNode.open(TRAINER, trust(), cfg) as node:
        origin = Origin(node, oc)
        full = (await origin.publish(v0, 0)).manifest.header
        delta = (await origin.publish(v1, 1)).manifest.header
        anchor = (await origin.publish(v2, 2)).manifest.header
    assert (full.shards_per_part, delta.shards_per_part, anchor.shards_per_part) == (2, 8, 2)
    assert (delta.base_step, full.base_step, anchor.base_step) == (0, None, None)
    assert delta.n_parts == -(-len(delta.shards) // 8) < full.n_parts
    with pytest.raises(LocalProtocolError):
        OriginConfig(delta_shards_per_part=0)


LOG = """\
2026-12-01T18:54:18.600Z INFO origin shardcast.node.node version_announced run=bench step=1 digest=ab
2026-12-01T18:54:18.655Z INFO relay shardcast.node.node announcement_received run=bench step=1 from=x
2026-12-01T18:54:18.700Z INFO relay shardcast.node.node announcement_received run=bench step=1 from=y
2026-12-01T18:54:18.900Z INFO relay shardcast.download.follower download_started step=1 digest=ab sources=2
2026-12-01T18:54:19.000Z DEBUG relay shardcast.download.downloader first_byte step=1 shard=3 source=*a
2026-12-01T18:54:19.100Z DEBUG relay shardcast.node.metrics shard_fetched source=*a codec=sparse \
size_bytes=10 fetch_s=0.100
2026-12-01T18:54:19.300Z DEBUG relay shardcast.node.metrics shard_checked source=*a verify_s=0.200
2026-12-01T18:54:19.300Z DEBUG relay shardcast.download.downloader shard_verified step=1 shard=3 source=*a
2026-12-01T18:54:19.500Z DEBUG relay shardcast.download.downloader shard_verified step=1 shard=0 source=*a
2026-12-01T18:54:19.700Z INFO relay shardcast.store.store version_committed run=bench step=1 files=1
2026-12-01T18:54:19.800Z INFO relay shardcast.store.store version_committed run=bench step=12 files=1
not a log line step=1
"""  # noqa: E501 (log lines as the nodes write them)


def test_timeline_reads_each_stage_of_one_step() -> None:
    t = timeline.parse_log(LOG.replace("\\\n", ""), 1)
    base = t["announced"]
    rel = {k: round(v - base, 3) for k, v in t.items()}
    assert rel == {
        "announced": 0.0,
        "learned": 0.055,  # the first announcement heard, not the second
        "started": 0.3,
        "first_byte": 0.4,
        "first_shard": 0.7,
        "last_shard": 0.9,
        "committed": 1.1,  # step=12 is another step
    }
    assert timeline.parse_log(LOG, 2) == {}


def test_timeline_sums_shard_costs_in_the_window() -> None:
    text = LOG.replace("\\\n", "")
    start = timeline._ts("2026-12-01T18:54:19.000Z")
    got = timeline.shard_costs(text, start, start + 1.0)
    assert got == {
        "fetches": 1,
        "fetch_s": 0.1,
        "checks": 1,
        "verify_s": 0.2,
        "max_verify_s": 0.2,
    }
    assert timeline.shard_costs(text, start + 0.5, start + 1.0)["checks"] == 0


def test_cpu_window_and_medians() -> None:
    s = int(1e9)
    samples: timeline.Samples = [
        (10.0, {"relay1": (1 * s, 2 * s, s)}),
        (11.0, {"relay1": (2 * s, 5 * s, 2 * s)}),
        (12.0, {"relay1": (4 * s, 9 * s, 4 * s)}),
    ]
    assert timeline.cpu_window(samples, 10.5, 11.5) == {
        "relay1": {"on_cpu_s": 3.0, "runq_wait_s": 7.0, "loop_runq_s": 3.0}
    }
    assert timeline.cpu_window(samples, 9.0, 11.0) == {}  # no sample before the start
    runs = [{"t": {1: {"peer1": {"committed": x}}}} for x in (3.0, 1.0, 2.0)]
    assert timeline.median_of(runs, "t", 1) == {"peer1": {"committed": 2.0}}


class _CardNode:
    """The part of a node that :mod:`shardcast.download.cards` uses: its card's version."""

    def __init__(self) -> None:
        self.version = 0
        self.changed = trio.Event()

    @property
    def card(self) -> SimpleNamespace | None:
        return SimpleNamespace(version=self.version) if self.version else None

    def set(self, version: int) -> None:
        self.version = version
        self.changed.set()
        self.changed = trio.Event()

    async def wait_card(self, at_least: int = 1) -> None:
        while self.version < at_least:
            await self.changed.wait()


class _CardFollower:
    """A follower stand-in: upstream ``pid`` answers after ``delays[pid]`` seconds, with the
    card if ``gives[pid]`` (else the fetch fails)."""

    def __init__(
        self, delays: dict[str, float], gives: dict[str, bool], from_s: float = 0.0
    ) -> None:
        self.node = _CardNode()
        self.upstreams = dict.fromkeys(delays)
        self.delays, self.gives = delays, gives
        self.from_s = from_s  # upstreams hold the card only from this time on
        self.asked: list[str] = []

    def _superseded(self, step: int) -> bool:
        return False

    async def adopt(self, pid: str) -> bool:
        self.asked.append(pid)
        await trio.sleep(self.delays[pid])
        gives = self.gives[pid] and trio.current_time() >= self.from_s
        if gives:
            self.node.set(1)
        return gives

    async def fetch_any(self, version: int) -> None:
        node = cast(ShardcastNode, self.node)
        await cards.adopt_from_any(node, sorted(self.upstreams), version, self.adopt)

    async def ensure(self, card_version: int) -> None:
        ann = cast(VersionAnnouncement, SimpleNamespace(step=1, card_version=card_version))
        node = cast(ShardcastNode, self.node)
        await cards.ensure_card(node, self.upstreams.keys, ann, self._superseded, self.adopt)


async def test_run_card_is_taken_from_the_first_upstream_that_answers(
    autojump_clock: trio.abc.Clock,
) -> None:
    # "a" stalls for 30 s (a loaded relay), "b" answers in 0.1 s: the wait is 0.1 s, not 30
    f = _CardFollower({"a": 30.0, "b": 0.1}, {"a": False, "b": True})
    t0 = trio.current_time()
    await f.fetch_any(1)
    assert trio.current_time() - t0 == pytest.approx(0.1)
    assert sorted(f.asked) == ["a", "b"]
    assert f.node.version == 1


async def test_run_card_wait_ends_when_another_path_brought_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    # both upstreams stall; the info poll adopts the card at 0.4 s: the wait ends then
    f = _CardFollower({"a": 30.0, "b": 30.0}, {"a": False, "b": False})
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(f.fetch_any, 1)
        await trio.sleep(0.4)
        f.node.set(1)
    assert trio.current_time() - t0 == pytest.approx(0.4)


async def test_run_card_fetch_returns_once_every_upstream_failed(
    autojump_clock: trio.abc.Clock,
) -> None:
    f = _CardFollower({"a": 0.2, "b": 0.5}, {"a": False, "b": False})
    t0 = trio.current_time()
    await f.fetch_any(1)
    assert trio.current_time() - t0 == pytest.approx(0.5)
    assert f.node.version == 0


async def test_version_waits_for_its_run_card_at_most_a_short_retry_longer(
    autojump_clock: trio.abc.Clock,
) -> None:
    # the upstream relays hold the new card only from 0.6 s on (they fetch it from the
    # origin): the version goes on within one capped retry of that, not a poll second later
    f = _CardFollower({"a": 0.01, "b": 0.01}, {"a": True, "b": True}, from_s=0.6)
    t0 = trio.current_time()
    await f.ensure(1)
    waited = trio.current_time() - t0
    assert 0.6 <= waited <= 0.6 + MANIFEST_RETRY_MAX_S + 0.02
    assert f.node.version == 1
