"""A ``/have`` long-poll that names the shards its poller lacks (``?want=``, ``?wknown=``):
the wire encoding (:mod:`shardcast.wire.have`) and what a download names
(:meth:`shardcast.core.session.Session.lacking`: not verified, and not a delta blob already on
its way)."""

from __future__ import annotations

import random

import pytest

from shardcast.core.liveness import Answer
from shardcast.core.session import Check, Fetch, Offer, Outcome, Session, SessionConfig, Verdict
from shardcast.wire.codecs import XOR_ZSTD
from shardcast.wire.have import (
    MAX_PREFIX_ENTRIES,
    WANT_MAX_CHARS,
    decode_have,
    decode_want,
    encode_prefixes,
    encode_want,
    full_bits,
    has_bit,
    have_token,
    shard_bits,
    wanted_token,
)


def _bits(n: int, shards: set[int]) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in shards:
        out[i // 8] |= 0x80 >> (i % 8)
    return bytes(out)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100])
def test_shard_bits_lays_out_a_have_bitmap_msb_first(n: int) -> None:
    rng = random.Random(n)
    shards = {i for i in range(n) if rng.random() < 0.5}
    bits = shard_bits(n, shards.__contains__)
    assert bits == _bits(n, shards)
    assert {i for i in range(n + 9) if has_bit(bits, i)} == shards  # nothing past the end
    assert shard_bits(9, lambda i: True) == b"\xff\x80"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100, 3900])
def test_decode_have_reads_every_bit_and_none_past_the_shards(n: int) -> None:
    rng = random.Random(n)
    shards = {i for i in range(n) if rng.random() < 0.5}
    bits = _bits(n, shards)
    assert decode_have(bits, n) == (sorted(shards), {})
    if n % 8:  # the padding bits of the last byte name no shard
        padded = bits[:-1] + bytes([bits[-1] | (0xFF >> (n % 8))])
        assert decode_have(padded, n)[0] == sorted(shards)
    assert decode_have(bits[: len(bits) // 2], n)[0] == sorted(
        i for i in shards if i < 8 * (len(bits) // 2)
    )


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100])
def test_full_bits_is_the_bitmap_of_every_shard(n: int) -> None:
    assert full_bits(n) == shard_bits(n, lambda i: True)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1000])
def test_want_round_trips_for_any_number_of_shards(n: int) -> None:
    rng = random.Random(n)
    bits = _bits(n, {i for i in range(n) if rng.random() < 0.5})
    text = encode_want(bits)
    assert text is not None
    assert "=" not in text
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert decode_want(text, n) == bits


def test_a_want_that_is_not_this_versions_bitmap_is_refused() -> None:
    good = encode_want(_bits(20, {3}))
    assert good is not None
    with pytest.raises(ValueError, match="bytes for 30 shards"):
        decode_want(good, 30)
    with pytest.raises(ValueError, match="base64url"):
        decode_want("a+b/", 20)  # standard base64, not base64url
    with pytest.raises(ValueError, match="base64url"):
        decode_want("A", 20)  # not a whole byte
    with pytest.raises(ValueError, match="characters"):
        decode_want("A" * (WANT_MAX_CHARS + 1), 6 * (WANT_MAX_CHARS + 1) // 8)


def test_a_version_too_large_for_a_want_sends_none() -> None:
    most = WANT_MAX_CHARS * 6 // 8  # bytes whose base64url fits
    assert encode_want(bytes(most)) is not None
    assert encode_want(bytes(most + 1)) is None


def test_the_wanted_token_changes_only_with_the_shards_wanted() -> None:
    """Two answers that differ in a shard the poller holds have one wanted token; a shard it
    lacks completing, or starting (a verified prefix), changes it; prefix growth does not."""
    n = 12
    want = _bits(n, {2, 9})
    before = wanted_token(_bits(n, {0}), {5: 100}, want)
    assert wanted_token(_bits(n, {0, 1, 3}), {5: 900, 6: 10, 11: 4}, want) == before
    assert wanted_token(_bits(n, {0, 9}), {5: 100}, want) != before  # 9 completed
    started = wanted_token(_bits(n, {0}), {2: 10}, want)
    assert started != before  # 2 started
    assert wanted_token(_bits(n, {0}), {2: 20000}, want) == started  # and grew
    everything = _bits(n, set(range(n)))
    assert wanted_token(_bits(n, {0}), {5: 1}, everything) == have_token(_bits(n, {0}), {5: 1})


def test_server_and_client_compute_one_wanted_token_past_the_prefix_limit() -> None:
    """The server takes the token from every prefix it holds; the poller from the answer,
    which lists only the first ``MAX_PREFIX_ENTRIES``: both must agree."""
    n = MAX_PREFIX_ENTRIES + 40
    prefixes = {i: 7 for i in range(n)}
    bits = bytes((n + 7) // 8)
    _, listed = decode_have(bits + encode_prefixes(prefixes), n)
    assert len(listed) == MAX_PREFIX_ENTRIES < len(prefixes)
    for want in (_bits(n, {n - 1}), _bits(n, {0, n - 1}), _bits(n, set(range(n)))):
        assert wanted_token(bits, prefixes, want) == wanted_token(bits, listed, want)


def _session(delta: bool) -> Session:
    """Ten shards of 8 bytes in one part, 0 and 1 verified; with ``delta``, every offer also
    has a 3-byte delta blob (fetched as a light, batched request)."""
    sizes = {XOR_ZSTD: 3} if delta else {}
    offers = [Offer(i, 8, sizes) for i in range(10)]
    cfg = SessionConfig(use_base=delta)
    return Session(3, [8] * 10, 1, [0], offers, [0, 1], random.Random(1), cfg, 0.0)


def _lacking(s: Session) -> set[int]:
    bits = s.lacking()
    assert len(bits) == 2
    return {i for i in range(10) if bits[i // 8] & (0x80 >> i % 8)}


@pytest.mark.parametrize("delta", [False, True])
def test_a_download_wants_news_of_what_it_lacks_but_not_of_a_delta_on_its_way(
    delta: bool,
) -> None:
    """A raw shard in flight is still wanted (another holder may serve it sooner, or in an
    endgame); a delta blob in flight is not: its batch is held at the source it asked, and a
    neighbour completing it at about the same time is no news. One that fails is wanted
    again; one verified never is."""
    s = _session(delta)
    assert _lacking(s) == set(range(2, 10))
    s.add_source("relay", True, 0.0, extra=True)  # discovered: it assures nothing
    fetches = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    assert fetches
    flying = {f.shard for f in fetches}
    assert _lacking(s) == set(range(2, 10)) - (flying if delta else set())
    done, failed = fetches[0], fetches[-1]
    assert done is not failed
    out = s.transfer_ended(done.req, Outcome.OK, done.length, 0.1)
    assert [type(a) for a in out] == [Check]
    s.shard_checked(done.req, Verdict.VERIFIED, 0.1)
    s.transfer_ended(failed.req, Outcome.BROKEN, 0, 0.1)
    left = set(range(2, 10)) - {done.shard} - (flying - {failed.shard} if delta else set())
    assert _lacking(s) == left


def _upstream_session() -> Session:
    """Ten shards of 8 bytes in two parts, part 0 (shards 0-6) known, shard 0 verified:
    1-5 offered as delta blobs, 6 raw only."""
    offers = [Offer(i, 8, {XOR_ZSTD: 3} if i < 6 else {}) for i in range(7)]
    cfg = SessionConfig(use_base=True)
    return Session(3, [8] * 10, 2, [0], offers, [0], random.Random(1), cfg, 0.0)


def test_an_upstream_counts_as_holding_every_delta_blob_so_none_is_wanted_from_others() -> None:
    """A source given to the download (a relay) is asked for every delta blob of a known
    part at once, with no ``/have`` answer (it holds the batch until it has the blobs), and
    while one is usable nobody's news of a delta blob is wanted, nor of a shard whose part is
    not known yet (this node holds the base: most likely a delta blob too); raw shards of
    known parts stay wanted."""
    s = _upstream_session()
    assert _lacking(s) == set(range(1, 10))  # no upstream yet
    s.add_source("peer", False, 0.0, extra=True)
    assert _lacking(s) == set(range(1, 10))  # a discovered peer assures nothing
    s.add_source("relay", False, 0.0)
    assert _lacking(s) == {6}  # raw shard 6 (the missing part's shards: deltas, most likely)
    fetched = {f.shard: f.source for f in s.poll(0.0) if isinstance(f, Fetch)}
    assert fetched == dict.fromkeys(range(1, 6), "relay")  # asked at once, no /have answer
    s.part_arrived(1, [Offer(7, 8, {}), *(Offer(i, 8, {XOR_ZSTD: 3}) for i in (8, 9))], 0.1)
    assert _lacking(s) == {6, 7}  # a raw shard of the new part is wanted
    fetched = {f.shard: f.source for f in s.poll(0.1) if isinstance(f, Fetch)}
    assert fetched == dict.fromkeys((8, 9), "relay")  # the new part's blobs too


def test_a_banned_or_gone_upstream_assures_nothing() -> None:
    """Without a usable upstream the delta blobs are wanted from everyone again."""
    gone = _upstream_session()
    gone.add_source("relay", False, 0.0)
    assert _lacking(gone) == {6}
    gone.probed("relay", Answer.GONE, 0.1)
    assert _lacking(gone) == set(range(1, 10))
    gone.probed("relay", Answer.PRESENT, 0.2)  # back
    assert _lacking(gone) == {6}
    banned = _upstream_session()
    banned.add_source("relay", False, 0.0, banned=True)
    assert _lacking(banned) == set(range(1, 10))
    assert not [a for a in banned.poll(0.0) if isinstance(a, Fetch)]  # never asked
