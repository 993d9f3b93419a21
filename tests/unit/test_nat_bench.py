"""bench/nat.py's table, ratios and targets, and the path of a byte (tests/deploy/natrun.py)."""

from __future__ import annotations

import pytest

from bench.nat import render, table, targets
from tests.deploy.natrun import ModeResult, Path, path_of

T, R = "trainer-id", "relay-id"


def result(mode: str, times: list[float | None], by_path: dict[str, int]) -> ModeResult:
    return ModeResult(mode, times, True, 10, by_path, {"started": 2, "direct": 1})


@pytest.mark.parametrize(
    ("source", "receiver_router", "source_router", "relay", "want"),
    [
        (T, "r", None, False, Path.ORIGIN),
        (R, "r", None, False, Path.PUBLIC),
        ("d", None, "r", True, Path.OUTBOUND),
        ("d", "r", "r", False, Path.LAN),
        ("d", "s", "r", False, Path.PUNCHED),
        ("d", None, "r", False, Path.PUNCHED),  # a public peer from a NATed one
    ],
)
def test_path_of(
    source: str, receiver_router: str | None, source_router: str | None, relay: bool, want: Path
) -> None:
    got = path_of(
        source,
        trainer=T,
        receiver_router=receiver_router,
        source_router=source_router,
        receiver_is_relay=relay,
    )
    assert got is want


def test_table_ratios_shares_and_targets() -> None:
    rows = table(
        [
            result("all-public", [2.0, 1.0, 3.0, 2.0], {"public": 100}),
            result("endpoint-independent", [3.0, 1.2, 1.1, 1.3], {"public": 60, "punched": 40}),
            result("symmetric", [3.0, 2.0, 2.0, None], {"public": 90, "lan": 10}),
            result("download-only", [3.0, 1.5, 1.5, 1.5], {"public": 100, "origin": 50}),
        ]
    )
    by = {r["mode"]: r for r in rows}
    assert by["all-public"]["later_median_s"] == 2.0
    assert by["all-public"]["later_ratio"] == 1.0
    assert by["endpoint-independent"]["first_ratio"] == 1.5
    assert by["endpoint-independent"]["later_ratio"] == pytest.approx(0.6)
    assert by["endpoint-independent"]["shares"]["nated"] == pytest.approx(0.4)
    assert by["download-only"]["shares"]["public"] == 1.0  # origin bytes are not peers'
    assert by["symmetric"]["later_median_s"] is None  # a version some peer never committed
    assert targets(rows) == {
        "eim_within_1.2x_public": True,
        "symmetric_not_slower_than_download_only": None,
    }
    assert len(render(rows).splitlines()) == 5


def test_no_baseline_no_ratio() -> None:
    rows = table([result("symmetric", [1.0, 2.0], {})])
    assert rows[0]["later_ratio"] is None
    assert rows[0]["shares"]["nated"] == 0.0
    assert targets(rows)["eim_within_1.2x_public"] is None
