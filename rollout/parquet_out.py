"""Verified rollouts as Parquet files, for a trainer outside shardnet (``--rollouts-out``).

Theory of operation
-------------------
An origin started with ``--rollouts-out DIR`` verifies every rollout batch peers send it with
the same pipeline as ``shardnet trainer`` (:mod:`trainer.dataplane`) and writes each accepted
batch as one Parquet file::

    DIR/step-<N>/<batch_id>.parquet

where ``N`` is the batch's policy step (the version whose weights generated it). A file is
written to a hidden temporary name in the same directory, flushed and fsynced, then renamed
(and the directory fsynced): a reader never sees a half-written file, and a name that exists
is complete. Files are never rewritten; a trainer consumes ``step-<N>/`` when it has enough
of them (e.g. one per peer) and may delete them after.

Schema (one row per completion; a batch holds ``n_prompts`` groups of ``group_size`` rows):

==================  ==============  ==========================================================
field               type            meaning
==================  ==============  ==========================================================
policy_step         int64           version whose weights sampled the completion
submitter           string          PeerID of the peer that generated and signed the batch
batch_id            string          32 hex chars, the announced id (binds submitter + bytes)
manifest_digest     string          digest of that version's signed manifest
prompt_index        int32           index of the prompt among the peer's assigned prompts
group_id            string          ``<batch_id>/<prompt_index>``: rows of one GRPO group
prompt_ids          list<int32>     the prompt's token ids (the version's own tokenizer)
completion_ids      list<int32>     the sampled token ids (EOS included when finished)
logprobs            list<float32>   per completion token, log-probability under the sampling
                                    policy at ``temperature`` (natural log)
reward              float64         the task's reward, recomputed by the validator (never the
                                    peer's number)
finish_reason       string          ``stop`` (ended on EOS) or ``length`` (hit the cap)
temperature         float64         sampling temperature of the run
verdict             string          the validator's verdict: always ``accepted`` here
received_at_ms      int64           wall-clock time the origin accepted the batch, ms
==================  ==============  ==========================================================

Group-relative advantages are left to the trainer (the rewards of one ``group_id`` are the
inputs); rejected batches are not written, only counted by reason in the origin's report.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.schema import RolloutBatch

__all__ = ["SCHEMA", "batch_table", "read_rollouts", "steps_present", "write_batch"]

SCHEMA = pa.schema(
    [
        ("policy_step", pa.int64()),
        ("submitter", pa.string()),
        ("batch_id", pa.string()),
        ("manifest_digest", pa.string()),
        ("prompt_index", pa.int32()),
        ("group_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("finish_reason", pa.string()),
        ("temperature", pa.float64()),
        ("verdict", pa.string()),
        ("received_at_ms", pa.int64()),
    ]
)
"""The Parquet schema of a rollouts file (see module docstring)."""

_STEP_DIR = re.compile(r"step-(\d+)")


def batch_table(
    batch: RolloutBatch,
    batch_id: str,
    rewards: Sequence[Sequence[float]],
    received_at_ms: int,
) -> pa.Table:
    """The rows of one accepted batch.

    Args:
        batch: the verified batch.
        batch_id: its announced id.
        rewards: recomputed rewards, ``rewards[g][i]`` for sample ``i`` of group ``g``
            (same order as ``batch.groups``).
        received_at_ms: wall-clock acceptance time, ms.
    """
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for g, group_rewards in zip(batch.groups, rewards, strict=True):
        for s, r in zip(g.samples, group_rewards, strict=True):
            cols["policy_step"].append(batch.policy_step)
            cols["submitter"].append(batch.submitter)
            cols["batch_id"].append(batch_id)
            cols["manifest_digest"].append(batch.manifest_digest)
            cols["prompt_index"].append(g.prompt_index)
            cols["group_id"].append(f"{batch_id}/{g.prompt_index}")
            cols["prompt_ids"].append(list(g.prompt_ids))
            cols["completion_ids"].append(list(s.completion_ids))
            cols["logprobs"].append(list(s.logprobs))
            cols["reward"].append(float(r))
            cols["finish_reason"].append(s.finish_reason)
            cols["temperature"].append(batch.temperature)
            cols["verdict"].append("accepted")
            cols["received_at_ms"].append(received_at_ms)
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def write_batch(out_dir: Path, table: pa.Table, step: int, batch_id: str) -> Path:
    """Write ``table`` atomically as ``out_dir/step-<step>/<batch_id>.parquet``.

    Temporary file in the same directory, flush + fsync, rename, fsync of the directory.
    Blocking (call from a worker thread in async code). An existing file of the same name
    is replaced by identical content (batch ids bind the bytes).

    Returns:
        The final path.

    Raises:
        OSError: the directory cannot be written (the temporary file is removed).
    """
    directory = out_dir / f"step-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{batch_id}.parquet"
    tmp = directory / f".{batch_id}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def steps_present(out_dir: Path) -> list[int]:
    """Policy steps that have a ``step-<N>/`` directory under ``out_dir``, ascending."""
    if not out_dir.is_dir():
        return []
    return sorted(
        int(m.group(1)) for e in os.scandir(out_dir) if (m := _STEP_DIR.fullmatch(e.name))
    )


def read_rollouts(out_dir: str | Path, step: int | None = None) -> pa.Table:
    """All rows under ``out_dir`` (or only policy step ``step``), as one table.

    Files are read in (step, name) order; hidden temporary files are skipped. Returns an
    empty table with :data:`SCHEMA` when there is nothing. ``.to_pylist()`` gives one dict
    per row.

    Raises:
        OSError, pyarrow.ArrowInvalid: a file cannot be read.
    """
    out_dir = Path(out_dir)
    steps = steps_present(out_dir) if step is None else [step]
    tables = []
    for s in steps:
        directory = out_dir / f"step-{s}"
        if not directory.is_dir():
            continue
        for name in sorted(os.listdir(directory)):
            if name.endswith(".parquet") and not name.startswith("."):
                tables.append(pq.read_table(directory / name, schema=SCHEMA))
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables(tables)
