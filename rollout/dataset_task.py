"""Dataset tasks: prompts and answers from a JSONL or Parquet file, a reward from a library.

Theory of operation
-------------------
A dataset file holds one row per prompt. Each row is an object with

* ``prompt`` — a string, and/or
* ``messages`` — a list of ``{"role": str, "content": str}`` (rendered with the checkpoint's
  chat template; preferred over ``prompt`` when both are present and the tokenizer has a
  template, see :func:`rollout.task.encode_prompt`);
* ``answer`` — the reference answer, of the type the reward needs (see
  :mod:`rollout.rewards`); other fields are ignored.

The whole file is read and checked when the task is loaded; the first bad row raises a
:class:`~p2p.errors.ConfigError` naming the file and the row (1-based line of a JSONL file,
1-based row of a Parquet file). Parquet needs ``pyarrow``.

Prompts for ``(peer_id, step)`` are rows drawn with replacement by a ``random.Random`` seeded
from (task name, peer id, step), so the first ``k`` of ``n`` prompts equal the ``k``
prompts, and a validator holding the same file recomputes them. The task's name is
``<file stem>@<first 12 hex digits of its digest>``: a peer using another file (or another
reward) is refused as ``wrong_run``. The digest is the SHA-256 of the file's bytes followed by
the reward spec.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2p.errors import ConfigError, LocalProtocolError
from rollout.prompt import Prompt
from rollout.rewards import Reward, completion_text, parse_reward

__all__ = ["MAX_ROWS", "DatasetTask", "read_rows"]

MAX_ROWS = 10_000_000
"""Most rows a dataset file may have."""


class DatasetTask:
    """A task over the rows of a dataset file (see module docstring). Immutable once built.

    Args:
        path: the file (for messages and the name).
        rows: the checked prompts.
        reward: the reward.
        file_digest: SHA-256 hex of the file's bytes.
    """

    version = "1"

    def __init__(
        self, path: Path, rows: Sequence[Prompt], reward: Reward, file_digest: str
    ) -> None:
        if not rows:
            raise LocalProtocolError(f"{path}: a dataset task needs at least one row")
        self.path = path
        self.rows = tuple(rows)
        self.reward_fn = reward
        self._digest = hashlib.sha256(f"{file_digest}\x1f{reward.spec}".encode()).hexdigest()
        self.name = f"{path.stem}@{self._digest[:12]}"

    @classmethod
    def load(cls, path: Path, reward_spec: str, field: str = "task") -> DatasetTask:
        """Read and check a dataset file.

        Raises:
            ConfigError: on ``field`` (or ``task_reward`` for a bad spec): unreadable file,
                malformed row, wrong answer type, no rows — naming the file and row.
        """
        reward = parse_reward(reward_spec)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(field, f"{path}: {exc.strerror or exc}") from None
        rows = []
        for number, raw in read_rows(path, data, field):
            prompt = _check_row(raw, number, path, reward, field)
            rows.append(prompt)
        if not rows:
            raise ConfigError(field, f"{path}: no rows")
        return cls(path, rows, reward, hashlib.sha256(data).hexdigest())

    def digest(self) -> str:
        """SHA-256 hex of the file's bytes and the reward spec."""
        return self._digest

    def prompts_for(self, peer_id: str, step: int, n: int) -> list[Prompt]:
        """``n`` rows drawn for ``(peer_id, step)`` (see module docstring).

        Raises:
            LocalProtocolError: negative ``step`` or ``n``.
        """
        if step < 0 or n < 0:
            raise LocalProtocolError(f"prompts_for needs step >= 0 and n >= 0, got {step}, {n}")
        h = hashlib.sha256(f"{self.name}\x1f{peer_id}\x1f{step}".encode()).digest()
        rng = random.Random(int.from_bytes(h[:8], "big"))
        return [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]

    def reward(
        self, completion_ids: Sequence[int], tokenizer: Any, prompt: Prompt | None = None
    ) -> float:
        """The reward of one completion of ``prompt`` (0.0 without a prompt)."""
        if prompt is None:
            return 0.0
        return self.reward_fn.score(completion_text(completion_ids, tokenizer), prompt.answer)


def read_rows(path: Path, data: bytes, field: str = "task") -> list[tuple[int, Any]]:
    """``(row number, decoded row)`` of a ``.jsonl`` or ``.parquet`` file's bytes.

    Raises:
        ConfigError: unparseable line or file, too many rows, or pyarrow missing for Parquet.
    """
    if path.suffix.lower() == ".parquet":
        return _parquet_rows(path, data, field)
    out = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(field, f"{path}:{number}: not JSON ({exc})") from None
        if len(out) > MAX_ROWS:
            raise ConfigError(field, f"{path}: more than {MAX_ROWS} rows")
    return out


def _parquet_rows(path: Path, data: bytes, field: str) -> list[tuple[int, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            field, f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
        ) from None
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(field, f"{path}: not a Parquet file ({exc})") from None
    if table.num_rows > MAX_ROWS:
        raise ConfigError(field, f"{path}: more than {MAX_ROWS} rows")
    return list(enumerate(table.to_pylist(), start=1))


def _check_row(raw: Any, number: int, path: Path, reward: Reward, field: str) -> Prompt:
    where = f"{path}:{number}" if path.suffix.lower() == ".jsonl" else f"{path} row {number}"

    def bad(why: str) -> ConfigError:
        return ConfigError(field, f"{where}: {why}")

    if not isinstance(raw, dict):
        raise bad(f"a row must be an object, got {type(raw).__name__}")
    text = raw.get("prompt")
    messages = raw.get("messages")
    if text is not None and not isinstance(text, str):
        raise bad(f"prompt must be a string, got {type(text).__name__}")
    parsed: list[tuple[str, str]] = []
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list of {role, content}")
        for m in messages:
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise bad(f"message {m!r} is not {{role: str, content: str}}")
            parsed.append((m["role"], m["content"]))
    if not parsed and not text:
        raise bad("needs a non-empty prompt or messages")
    answer = raw.get("answer")
    problem = reward.check_answer(answer)
    if problem is not None:
        raise bad(problem)
    return Prompt(text=text or "", messages=tuple(parsed), answer=answer, row=number)
