"""A follower's run-end record: kept across restarts, and trusted only if it verifies."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from p2p.identity import Identity
from shardcast.node.endrecord import END_RECORD_FILE, MAX_RECORD_BYTES, load_end, save_end
from shardcast.wire.finish import RunContinued, RunFinished
from shardcast.wire.messages import VersionAnnouncement
from tests.helpers import TRAINER, trust

DIGEST = "cd" * 32


def test_a_run_end_and_a_continuation_survive_a_restart(tmp_path: Path) -> None:
    end = RunFinished.create(TRAINER, "run-1", 4, DIGEST, seq=2)
    assert save_end(tmp_path, end)
    assert load_end(tmp_path, trust(), "run-1", 4) == end
    cont = RunContinued.create(TRAINER, "run-1", 4, 3)
    assert save_end(tmp_path, cont)  # the newer replaces the older
    assert load_end(tmp_path, trust(), "run-1", 7) == cont  # kept past newer versions


def test_no_record_is_none(tmp_path: Path) -> None:
    assert load_end(tmp_path, trust(), "run-1", None) is None


def test_a_run_end_below_the_newest_version_held_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    save_end(tmp_path, RunFinished.create(TRAINER, "run-1", 4, DIGEST))
    assert load_end(tmp_path, trust(), "run-1", 5) is None
    assert "run_end_record_stale" in caplog.text
    assert load_end(tmp_path, trust(), "run-1", None) is not None


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (
            RunFinished.create(Identity.from_seed("not-the-trainer"), "run-1", 4, DIGEST).encode(),
            "not trusted",
        ),
        (RunFinished.create(TRAINER, "run-2", 4, DIGEST).encode(), "is of run 'run-2'"),
        (VersionAnnouncement.create(TRAINER, "run-1", 4, DIGEST, ()).encode(), "not a run end"),
        (RunFinished.create(TRAINER, "run-1", 4, DIGEST).encode()[:-3], ""),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "larger than"),
    ],
    ids=["other-signer", "other-run", "announcement", "truncated", "oversized"],
)
def test_a_record_that_does_not_verify_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, data: bytes, why: str
) -> None:
    (tmp_path / END_RECORD_FILE).write_bytes(data)
    assert load_end(tmp_path, trust(), "run-1", None) is None
    [line] = [r.getMessage() for r in caplog.records if "run_end_record_ignored" in r.getMessage()]
    assert why in line


def test_an_unwritable_record_is_a_warning_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    assert not save_end(blocker / "run", RunFinished.create(TRAINER, "run-1", 4, DIGEST))
    assert "run_end_record_unwritable" in caplog.text
