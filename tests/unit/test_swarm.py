"""Sub-shard chunks (issue 16, "a swarm that swarms"): chunk lists in manifest parts, the
receiving sink that checks them as bytes arrive, the store's verified prefixes and the
scheduler that takes ranges from peers' prefixes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import blake3
import pytest

from shardcast.core.failure import FailureKind
from shardcast.core.select import Scheduler, SchedulerConfig
from shardcast.core.session import ended_at_hold
from shardcast.download.receive import ChunkCorrupt, ShardSink, verify_and_write
from shardcast.publish.plan import build_manifest
from shardcast.store.store import VersionStore
from shardcast.wire.have import decode_have, encode_prefixes
from shardcast.wire.manifest import (
    CHUNK_BYTES,
    Manifest,
    ManifestError,
    Part,
    ShardEntry,
    chunk_digests,
    sign_part,
)
from tests.helpers import TRAINER, make_checkpoint, trust

CHUNK = 4096
MB = 1_000_000


def _entry(data: bytes, chunk: int = CHUNK) -> ShardEntry:
    return ShardEntry(
        0, "f", 0, len(data), blake3.blake3(data).hexdigest(), (), chunk, chunk_digests(data, chunk)
    )


# --- manifest ---------------------------------------------------------------------------


def test_parts_carry_signed_chunk_lists_and_parts_without_them_still_read(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    make_checkpoint(src, {"model.safetensors": 5 * 8192 + 100}, seed=3)
    m = build_manifest(src, "run", 1, TRAINER, shard_size=8192, shards_per_part=2)
    for i, ref in enumerate(m.header.shards):
        data = (src / ref.file).read_bytes()
        e = m.shard(i)
        assert e.chunk_bytes == CHUNK_BYTES  # 8 KiB shards: one chunk each
        assert e.chunks == chunk_digests(data[ref.offset : ref.offset + ref.length], CHUNK_BYTES)
    back = Manifest.decode(m.encode(), trust=trust())
    assert back.shard(3).chunks == m.shard(3).chunks
    # a part without chunk lists (written before) still reads, and its shards list none
    old = Part(**{**m.parts[0].part.__dict__, "chunk_bytes": 0, "chunks": ()})
    assert len(old.to_obj()["shards"][0]) == 2  # [digest, encodings]
    signed = sign_part(old, TRAINER)
    again = Manifest(m.signed_header)
    again.add_part(signed)
    assert again.shard(0).chunks == ()
    # a list of the wrong length, or a chunk size that is not a power of two, is refused
    body = m.parts[0].part.to_obj()
    body["shards"][0][2] = [CHUNK_BYTES, body["shards"][0][2][1] * 2]
    with pytest.raises(ManifestError, match="must list 1 chunks"):
        Part.from_obj(body, m.header)
    body = m.parts[0].part.to_obj()
    body["shards"][0][2][0] = 3000
    with pytest.raises(ManifestError, match="power of two"):
        Part.from_obj(body, m.header)


# --- the receiving sink -----------------------------------------------------------------


def test_each_chunk_is_checked_and_handed_over_as_it_completes() -> None:
    data = os.urandom(3 * CHUNK + 1000)
    entry = _entry(data)
    written: list[tuple[int, bytes]] = []
    sink = ShardSink(bytearray(len(data)), len(data))
    assert sink.expect_chunks(entry, lambda start, b: written.append((start, bytes(b))))
    for pos in range(0, len(data), 1500):  # pieces that straddle chunk boundaries
        n = min(1500, len(data) - pos)
        sink.window(n)[:] = data[pos : pos + n]
        sink.advance(n)
        assert sink.verified == min(len(data), (sink.pos // CHUNK) * CHUNK) or sink.full
    assert [s for s, _ in written] == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert b"".join(b for _, b in written) == data
    assert sink.digest() == entry.digest  # the signed digest: no second hash of the shard


def test_a_corrupt_chunk_is_never_handed_over_and_the_sink_keeps_only_verified_chunks() -> None:
    data = os.urandom(3 * CHUNK)
    entry = _entry(data)
    bad = bytearray(data)
    bad[CHUNK + 7] ^= 1
    written: list[int] = []
    sink = ShardSink(bytearray(len(data)), len(data))
    sink.expect_chunks(entry, lambda start, b: written.append(start))
    sink.window(CHUNK + 100)[:] = bad[: CHUNK + 100]
    sink.advance(CHUNK + 100)
    sink.parts.append(("a", 0, CHUNK + 100))
    assert sink.rewind() == 100  # the transfer broke: the half chunk is dropped
    assert (sink.pos, sink.verified, sink.parts) == (CHUNK, CHUNK, [("a", 0, CHUNK)])
    sink.window(2 * CHUNK)[:] = bad[CHUNK:]
    with pytest.raises(ChunkCorrupt) as err:
        sink.advance(2 * CHUNK)
    assert (err.value.chunk, err.value.start, err.value.end) == (1, CHUNK, 2 * CHUNK)
    assert written == [0]  # chunk 1 never handed over (never written, never served)
    assert (sink.pos, sink.verified) == (CHUNK, CHUNK)
    sink.window(2 * CHUNK)[:] = data[CHUNK:]  # the next source resends from the chunk
    sink.advance(2 * CHUNK)
    assert written == [0, CHUNK, 2 * CHUNK]
    assert sink.digest() == entry.digest


def test_a_shard_that_came_chunk_by_chunk_is_written_once(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    make_checkpoint(src, {"model.safetensors": 3 * 8192}, seed=4)
    m = build_manifest(src, "run", 1, TRAINER, shard_size=8192, shards_per_part=1)
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    part = store.begin(m)
    entry = m.shard(1)
    data = (src / entry.file).read_bytes()
    chunk = data[entry.offset : entry.offset + entry.length]
    assert part.prefix(1) == 0
    assert part.write_prefix(1, 0, chunk[:4096])
    assert (part.prefix(1), part.prefixes()) == (4096, {1: 4096})
    assert not part.has(1)
    assert part.write_prefix(1, 4096, chunk[4096:])
    sink = ShardSink(bytearray(chunk), len(chunk), pos=len(chunk))
    sink._hasher.update(chunk)
    assert verify_and_write(part, entry, "raw", sink, None, "peer")
    assert part.has(1)
    assert part.prefix(1) == 8192
    assert part.prefixes() == {}
    fd = os.open(part.dir / entry.file, os.O_RDONLY)
    assert os.pread(fd, 8192, entry.offset) == chunk
    os.close(fd)
    part.abort()


# --- have answers -----------------------------------------------------------------------


def test_have_answers_carry_verified_prefixes() -> None:
    bits = bytes([0b10100000])
    held, prefixes = decode_have(bits + encode_prefixes({1: 4096, 3: 8192}), 5)
    assert (held, prefixes) == ([0, 2], {1: 4096, 3: 8192})
    assert decode_have(bits, 5) == ([0, 2], {})  # a plain bitmap (an older node)
    with pytest.raises(ValueError, match="suffix"):
        decode_have(bits + b"\x00" * 5, 5)
    with pytest.raises(ValueError, match="of 5"):
        decode_have(bits + encode_prefixes({9: 1}), 5)


# --- the scheduler ----------------------------------------------------------------------


def test_a_peer_still_receiving_a_shard_serves_it_past_our_offset() -> None:
    cfg = SchedulerConfig(explore=0.0)
    sched = Scheduler([4 * MB] * 2, random.Random(0), cfg)
    sched.add_source("peer", ())
    assert sched.next_request(0.0) is None  # it holds nothing yet
    sched.set_prefixes("peer", {1: MB})
    req = sched.next_request(0.0)
    assert req is not None
    assert (req.shard, req.source, req.start) == (1, "peer", 0)
    sched.on_failure(req.id, 1.0, kind=FailureKind.BROKEN, received=MB)  # got its prefix, then cut
    assert sched.resume_offset(1) == MB
    sched.source_back("peer", 1.0)
    assert sched.next_request(1.0) is None  # its prefix does not reach past our offset
    sched.set_prefixes("peer", {1: 2 * MB})
    req = sched.next_request(1.0)
    assert req is not None
    assert (req.shard, req.start) == (1, MB)


def test_a_corrupt_chunk_keeps_the_verified_chunks_before_it() -> None:
    sched = Scheduler([4 * MB], random.Random(0), SchedulerConfig(explore=0.0, max_corrupt=2))
    sched.add_source("a")
    req = sched.next_request(0.0)
    assert req is not None
    sched.on_failure(req.id, 1.0, kind=FailureKind.CORRUPT, received=2 * MB, kept=True)
    assert sched.resume_offset(0) == 2 * MB
    assert sched.statistics().corrupt == 1


def _rated(sched: Scheduler, source: str, rate_bps: float) -> None:
    st = next(s for s in sched.sources() if s.source == source)
    st.rate_bps, st.samples = rate_bps, 1


@pytest.mark.parametrize(("peer_rate", "expect"), [(9 * MB, "peer"), (7 * MB, "relay")])
def test_measured_peers_take_ranges_as_readily_as_relays(peer_rate: float, expect: str) -> None:
    """A peer measured within ``complete_cost_factor`` (1.25) of the relay's rate takes the
    shard it holds; a slower one does not."""
    sched = Scheduler([MB] * 2, random.Random(0), SchedulerConfig(explore=0.0))
    sched.add_source("relay")
    sched.add_source("peer", {0, 1})
    _rated(sched, "relay", 10 * MB)
    _rated(sched, "peer", peer_rate)
    req = sched.next_request(0.0)
    assert req is not None
    assert req.source == expect


def test_unmeasured_peer_does_not_get_the_bonus() -> None:
    sched = Scheduler([MB] * 2, random.Random(0), SchedulerConfig(explore=0.0))
    sched.add_source("relay")
    sched.add_source("a-peer", {0, 1})
    _rated(sched, "relay", 10 * MB)
    req = sched.next_request(0.0)
    assert req is not None
    assert req.source == "relay"


@pytest.mark.parametrize("seed", range(6))
def test_shards_peers_are_receiving_count_as_held_so_relays_serve_the_rare_ones(seed: int) -> None:
    cfg = SchedulerConfig(explore=0.0, max_inflight=1)
    sched = Scheduler([MB] * 4, random.Random(seed), cfg)
    sched.add_source("relay")
    sched.add_source("peer-a", {0})
    sched.add_source("peer-b", ())
    sched.set_prefixes("peer-b", {1: 4096, 2: 4096})
    _rated(sched, "relay", 10 * MB)
    req = sched.next_request(0.0)
    assert req is not None
    assert (req.source, req.shard) == ("relay", 3)


@pytest.mark.parametrize(
    ("received", "dropped", "chunked", "hold"),
    [
        (2 * 4096, 0, True, True),  # two whole chunks, the close right after: the hold
        (2 * 4096, 100, True, False),  # a close inside the third chunk: broken
        (0, 0, True, False),  # nothing arrived: broken
        (0, 100, True, False),
        (2 * 4096, 0, False, False),  # no chunk list: a source serves only whole shards
    ],
)
def test_a_close_is_the_sources_hold_only_right_after_a_whole_chunk(
    received: int, dropped: int, chunked: bool, hold: bool
) -> None:
    assert ended_at_hold(received, dropped, chunked=chunked) is hold
