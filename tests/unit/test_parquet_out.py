"""rollout/parquet_out.py: rows of a batch, atomic files per policy step, the reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout.parquet_out import SCHEMA, batch_table, read_rollouts, steps_present, write_batch
from rollout.schema import Group, RolloutBatch, Sample


def _batch(step: int, submitter: str = "peer-a") -> RolloutBatch:
    groups = tuple(
        Group(
            p,
            (1, 2, 3 + p),
            tuple(Sample((4, 5, i), (-0.5, -0.25, -1.0), 0.9, "length", b"") for i in range(2)),
        )
        for p in range(2)
    )
    return RolloutBatch("run", submitter, step, "d" * 64, "digits/1", 2, 7, 1.0, 3, groups)


def test_rows_carry_the_recomputed_rewards_and_the_group(tmp_path: Path) -> None:
    table = batch_table(_batch(3), "b" * 32, [[0.0, 1.0], [0.5, 0.25]], 1234)
    assert table.schema == SCHEMA
    path = write_batch(tmp_path, table, 3, "b" * 32)
    assert path == tmp_path / "step-3" / f"{'b' * 32}.parquet"
    rows = read_rollouts(tmp_path, step=3).to_pylist()
    assert [r["reward"] for r in rows] == [0.0, 1.0, 0.5, 0.25]  # not the peer's 0.9
    assert [r["group_id"] for r in rows] == [f"{'b' * 32}/0"] * 2 + [f"{'b' * 32}/1"] * 2
    assert rows[2]["prompt_ids"] == [1, 2, 4]
    assert rows[1]["completion_ids"] == [4, 5, 1]
    assert rows[0]["logprobs"] == pytest.approx([-0.5, -0.25, -1.0])
    assert {r["verdict"] for r in rows} == {"accepted"}
    assert {(r["policy_step"], r["submitter"], r["received_at_ms"]) for r in rows} == {
        (3, "peer-a", 1234)
    }


def test_reader_skips_temporary_files_and_reads_every_step(tmp_path: Path) -> None:
    assert read_rollouts(tmp_path).num_rows == 0
    assert read_rollouts(tmp_path / "missing", step=0).schema == SCHEMA
    for step, sub in ((0, "a"), (0, "b"), (2, "a")):
        t = batch_table(_batch(step, sub), sub * 32, [[1.0, 0.0], [0.0, 0.0]], 0)
        write_batch(tmp_path, t, step, sub * 32)
    (tmp_path / "step-2" / ".half.123.tmp").write_bytes(b"PAR1 half")  # a writer mid-way
    assert steps_present(tmp_path) == [0, 2]
    assert read_rollouts(tmp_path, step=0).num_rows == 8
    assert read_rollouts(tmp_path).num_rows == 12
    assert [n for n in os.listdir(tmp_path / "step-0") if n.startswith(".")] == []


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = batch_table(_batch(1), "c" * 32, [[0.0, 0.0], [0.0, 0.0]], 0)

    def boom(*_a: object, **_k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("rollout.parquet_out.os.fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_batch(tmp_path, table, 1, "c" * 32)
    assert os.listdir(tmp_path / "step-1") == []
