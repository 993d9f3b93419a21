"""Pure tests of p2p.http_range: Range grammar, resolution, Content-Range, Retry-After, bucket."""

from __future__ import annotations

import email.utils

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.http_range import (
    ByteRange,
    ContentRange,
    InvalidRange,
    MultipleRanges,
    RangeError,
    RangeSpec,
    SuffixRange,
    TokenBucket,
    UnsatisfiableRange,
    choose_range,
    format_content_range,
    format_range,
    format_unsatisfied_range,
    if_range_holds,
    parse_content_range,
    parse_range,
    parse_retry_after,
    resolve_range,
)

BIG = 1 << 48
offsets = st.integers(min_value=0, max_value=BIG)


@st.composite
def byte_ranges(draw: st.DrawFn) -> ByteRange:
    first = draw(offsets)
    last = draw(st.none() | st.integers(min_value=first, max_value=first + BIG))
    return ByteRange(first, last)


specs: st.SearchStrategy[RangeSpec] = byte_ranges() | st.builds(SuffixRange, offsets)


@given(specs)
def test_format_then_parse_round_trips(spec: RangeSpec) -> None:
    assert parse_range(format_range(spec)) == spec


@given(specs, st.sampled_from(["bytes", "BYTES", "Bytes"]), st.sampled_from(["", " ", "\t "]))
def test_unit_is_case_insensitive_and_ows_is_ignored(spec: RangeSpec, unit: str, ows: str) -> None:
    value = ows + format_range(spec).replace("bytes", unit, 1) + ows
    assert parse_range(value) == spec


@given(st.text(max_size=40))
def test_parse_range_on_any_text_returns_or_raises_range_error(value: str) -> None:
    try:
        parse_range(value)
    except RangeError:
        pass


@given(st.binary(max_size=30).map(lambda b: "bytes=" + b.decode("latin-1")))
def test_parsed_ranges_are_well_formed(value: str) -> None:
    try:
        spec = parse_range(value)
    except RangeError:
        return
    if isinstance(spec, ByteRange):
        assert spec.first >= 0
        assert spec.last is None or spec.last >= spec.first
    elif isinstance(spec, SuffixRange):
        assert spec.length >= 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bytes=0-0", ByteRange(0, 0)),
        ("bytes=10-", ByteRange(10, None)),
        ("bytes=-5", SuffixRange(5)),
        ("bytes=-0", SuffixRange(0)),
        ("bytes=0-99, ,", ByteRange(0, 99)),  # empty list elements are ignored (RFC 9110 §5.6.1)
        ("items=0-1", None),  # unknown unit: ignore
        ("bytes", None),
        ("", None),
    ],
)
def test_parse_range_examples(value: str, expected: RangeSpec | None) -> None:
    assert parse_range(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "bytes=",
        "bytes=5-3",
        "bytes=x-",
        "bytes=-",
        "bytes=1_0-20",
        "bytes=١-2",
        "bytes=+1-2",
        "=0-1",
    ],
)
def test_malformed_ranges_raise_invalid_range(value: str) -> None:
    with pytest.raises(InvalidRange):
        parse_range(value)


@pytest.mark.parametrize("value", ["bytes=0-1,5-6", "bytes=-1,0-", "bytes=0-1,0-1"])
def test_multiple_ranges_are_refused(value: str) -> None:
    with pytest.raises(MultipleRanges):
        parse_range(value)


@given(specs, st.integers(min_value=0, max_value=BIG))
def test_resolved_ranges_lie_inside_the_representation(spec: RangeSpec, total: int) -> None:
    if isinstance(spec, SuffixRange):
        unsatisfiable = spec.length == 0 or total == 0
    else:
        unsatisfiable = spec.first >= total
    if unsatisfiable:
        with pytest.raises(UnsatisfiableRange) as info:
            resolve_range(spec, total)
        assert info.value.total_size == total
        return
    offset, length = resolve_range(spec, total)
    assert 0 <= offset
    assert 1 <= length
    assert offset + length <= total


@st.composite
def small_specs(draw: st.DrawFn) -> RangeSpec:
    if draw(st.booleans()):
        return SuffixRange(draw(st.integers(0, 70)))
    first = draw(st.integers(0, 70))
    return ByteRange(first, draw(st.none() | st.integers(first, first + 70)))


@given(small_specs(), st.integers(0, 60))
def test_resolve_matches_a_slicing_model(spec: RangeSpec, total: int) -> None:
    data = list(range(total))
    if isinstance(spec, SuffixRange):
        model = data[-spec.length :] if spec.length else []
    else:
        model = data[spec.first : None if spec.last is None else spec.last + 1]
    if not model:
        with pytest.raises(UnsatisfiableRange):
            resolve_range(spec, total)
        return
    offset, length = resolve_range(spec, total)
    assert data[offset : offset + length] == model


@given(offsets, st.integers(1, BIG), st.integers(0, BIG))
def test_content_range_round_trips(offset: int, length: int, extra: int) -> None:
    total = offset + length + extra
    value = format_content_range(offset, length, total)
    assert parse_content_range(value) == ContentRange(offset, offset + length - 1, total)
    assert parse_content_range(value).length == length


def test_content_range_with_unknown_total() -> None:
    assert parse_content_range("bytes 0-9/*") == ContentRange(0, 9, None)


@pytest.mark.parametrize(
    "value", ["bytes */100", "bytes 5-3/10", "bytes 0-10/10", "items 0-1/2", "bytes 0-1", ""]
)
def test_bad_content_ranges_raise(value: str) -> None:
    with pytest.raises(InvalidRange):
        parse_content_range(value)


def test_format_content_range_rejects_caller_bugs() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        format_content_range(5, 0, 10)
    with pytest.raises(ValueError, match="does not fit"):
        format_content_range(5, 6, 10)
    assert format_unsatisfied_range(10) == "bytes */10"


def test_format_range_rejects_caller_bugs() -> None:
    with pytest.raises(ValueError, match="invalid"):
        format_range(ByteRange(5, 4))
    with pytest.raises(ValueError, match="negative"):
        format_range(SuffixRange(-1))


def test_retry_after_forms() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("120", now_unix_s=now) == 120.0
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now_unix_s=now) == 30.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now_unix_s=now) == 0.0
    assert parse_retry_after("soon", now_unix_s=now) is None
    assert parse_retry_after("-5", now_unix_s=now) is None


def test_token_bucket_validates() -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 10, now=0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(10, 0, now=0)


def test_token_bucket_grants_whole_requests_up_to_the_burst() -> None:
    bucket = TokenBucket(1000.0, 100, now=0.0)
    assert bucket.take(500, 0.0) == 100  # capped at the burst
    assert bucket.take(10, 0.0) == 0
    assert bucket.wait_s(50, 0.0) == pytest.approx(0.05)
    assert bucket.take(50, 0.049) == 0  # never a partial grant
    assert bucket.take(50, 0.05) == 50
    bucket.refund(30)
    assert bucket.take(30, 0.05) == 30


def test_token_bucket_wait_is_enough_on_a_large_clock() -> None:
    # Found by Hypothesis: at now = 16 s a 1.2 ns wait at 831 MB/s lost low bits when added
    # to the clock and refilled 0.9999985 of the one token asked for.
    bucket = TokenBucket(831345783.0, 1, now=0.0)
    assert bucket.take(1, 16.0) == 1
    now = 16.0 + bucket.wait_s(1, 16.0)
    assert now > 16.0
    assert bucket.take(1, now) == 1


@given(
    st.floats(1.0, 1e9),
    st.integers(1, 1 << 20),
    st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(0, 1 << 21)), max_size=60),
)
def test_token_bucket_never_exceeds_rate_plus_burst(
    rate: float, burst: int, steps: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(rate, burst, now=0.0)
    now, granted = 0.0, 0
    for dt, want in steps:
        now += dt
        got = bucket.take(want, now)
        assert got in (0, min(want, burst))
        if got == 0 and want > 0:
            # After waiting as told, the same request is granted.
            now += bucket.wait_s(want, now)
            got = bucket.take(want, now)
            assert got == min(want, burst)
        granted += got
    assert granted <= burst + rate * now + 1


@pytest.mark.parametrize(
    ("value", "size", "expected"),
    [
        (None, 100, None),
        ("bytes=0-9", 100, (0, 10)),
        ("bytes=90-200", 100, (90, 10)),
        ("bytes=-10", 100, (90, 10)),
        ("bytes=-200", 100, (0, 100)),
        ("items=0-9", 100, None),  # another unit: ignored
        ("bytes=", 100, None),  # shorter than "bytes=" + 1: ignored
        ("BYTES=0-0", 100, (0, 1)),
        ("bytes=0-1,5-6", 100, None),  # several ranges: ignored (max_ranges 1)
        ("bytes=200-,300-", 100, "416"),  # several, none satisfiable
        ("bytes=9-3", 100, "416"),  # malformed: nginx rejects
        ("bytes=x-", 100, "416"),
        ("bytes=100-", 100, "416"),
        ("bytes=-0", 100, "416"),
        ("bytes=0-", 0, None),  # empty representation, range at 0: ignored
        ("bytes=-5", 0, None),
        ("bytes=3-", 0, "416"),
    ],
)
def test_choose_range_matches_nginx(
    value: str | None, size: int, expected: tuple[int, int] | str | None
) -> None:
    if expected == "416":
        with pytest.raises(UnsatisfiableRange):
            choose_range(value, size)
    else:
        assert choose_range(value, size) == expected


def test_if_range_holds() -> None:
    date = "Tue, 01 Dec 2026 12:00:00 GMT"
    assert if_range_holds('"abc"', '"abc"', date)
    assert not if_range_holds('"abd"', '"abc"', date)
    assert not if_range_holds('W/"abc"', '"abc"', date)
    assert not if_range_holds('"abc"', None, date)
    assert if_range_holds(date, '"abc"', date)
    assert not if_range_holds("Tue, 01 Dec 2026 12:00:01 GMT", '"abc"', date)
    assert not if_range_holds(date, '"abc"', None)


def test_retry_after_with_an_absurd_date_is_ignored() -> None:
    """Regression (found by the decoder fuzzer): OverflowError escaped parse_retry_after."""
    value = "Wed, 2" + "9" * 40 + " Oct 2015 07:28:00 GMT"
    assert parse_retry_after(value, now_unix_s=1.7e9) is None
