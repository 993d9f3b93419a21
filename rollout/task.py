"""Tasks: where prompts come from and how completions are scored.

Theory of operation
-------------------
A task is two pure functions (the :class:`Task` protocol):

* ``prompts_for(peer_id, step, n)`` — the prompts a peer must answer at a policy step. They
  are a function of ``(peer_id, step, n)`` only, drawn from a ``random.Random`` seeded with
  the SHA-256 of the task name, the peer id and the step (never the global RNG), so a
  validator recomputes them and rejects rollouts whose prompts a peer chose itself.
* ``reward(completion_ids, tokenizer)`` — a verifiable reward in ``[0, 1]`` computed from
  token ids alone, so the trainer and any validator agree on it bit for bit.

The default :class:`DigitTask` rewards the share of completion tokens that are ASCII digits.
It is dense (every token counts) and an untrained model starts near ``10/128 ≈ 0.08`` with
the 128-token character vocabulary, so a tiny model visibly learns it within a few GRPO
steps. A trailing ``<eos>`` is the stop signal, not content: it is left out of the share.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import blake3

from p2p.errors import LocalProtocolError

if TYPE_CHECKING:  # annotations only: this module stays importable without torch
    from transformers import PreTrainedTokenizerFast

__all__ = ["DEFAULT_TASK", "DigitTask", "Task", "prompts_for", "reward", "task_data_digest"]


@runtime_checkable
class Task(Protocol):
    """A verifiable RL task. Implementations must be pure and deterministic."""

    name: str
    """Stable identifier; part of the prompt seed (``"digits/1"``)."""

    def prompts_for(self, peer_id: str, step: int, n: int) -> list[str]:
        """The ``n`` prompts assigned to ``peer_id`` at policy step ``step``."""
        ...

    def reward(self, completion_ids: Sequence[int], tokenizer: PreTrainedTokenizerFast) -> float:
        """Score one completion (token ids, as sampled) in ``[0, 1]``."""
        ...


_SUBJECTS = ("count", "list", "write", "spell", "sum", "sort", "pick", "show")
_OBJECTS = ("apples", "stars", "pages", "steps", "coins", "birds", "lines", "keys")


def _seed(*parts: str) -> int:
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class DigitTask:
    """Reward = share of completion tokens that decode to a single ASCII digit.

    Prompts look like ``"count 7 apples, then 3:"``: short (19–23 characters, so 20–24
    tokens with ``<bos>``) and varied, so groups differ.
    """

    name = "digits/1"
    family = "digits"
    version = 1

    def data_digest(self) -> str:
        """The task's data digest for the run card: :func:`task_data_digest` of this task."""
        return task_data_digest()

    def prompts_for(self, peer_id: str, step: int, n: int) -> list[str]:
        """Deterministic prompts for ``(peer_id, step)``.

        Args:
            peer_id: the submitting peer's PeerID string.
            step: the policy step the rollouts are for (>= 0).
            n: how many prompts (>= 0).

        Returns:
            ``n`` prompt strings; the first ``k`` of ``prompts_for(p, s, n)`` equal
            ``prompts_for(p, s, k)``.

        Raises:
            LocalProtocolError: negative ``step`` or ``n``.
        """
        if step < 0 or n < 0:
            raise LocalProtocolError(f"prompts_for needs step >= 0 and n >= 0, got {step}, {n}")
        rng = random.Random(_seed(self.name, peer_id, str(step)))
        prompts = []
        for _ in range(n):
            verb, noun = rng.choice(_SUBJECTS), rng.choice(_OBJECTS)
            prompts.append(f"{verb} {rng.randrange(10)} {noun}, then {rng.randrange(10)}:")
        return prompts

    def reward(self, completion_ids: Sequence[int], tokenizer: PreTrainedTokenizerFast) -> float:
        """Share of digit tokens in a completion, a trailing ``eos`` excluded.

        Args:
            completion_ids: sampled token ids (ids the tokenizer cannot decode count as
                non-digits).
            tokenizer: gives the ids of ``"0"``..``"9"`` and of ``eos``.

        Returns:
            ``digits / tokens`` in ``[0, 1]``; 0.0 for an empty completion.
        """
        ids = list(completion_ids)
        if ids and ids[-1] == tokenizer.eos_token_id:
            ids.pop()
        if not ids:
            return 0.0
        digits = _digit_ids(tokenizer)
        return sum(1 for t in ids if t in digits) / len(ids)


def _digit_ids(tokenizer: PreTrainedTokenizerFast) -> frozenset[int]:
    ids = [cast(int | None, tokenizer.convert_tokens_to_ids(c)) for c in "0123456789"]
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)


def task_data_digest() -> str:
    """BLAKE3 hex digest of everything that defines :class:`DigitTask`'s prompts and reward.

    The built-in task has no data file: its "data" are the word lists, the prompt template,
    the seed derivation and the reward rule. They are written out here as canonical JSON and
    hashed, so a change to any of them changes the digest (and must bump ``version``). The
    value is pinned by ``tests/unit/test_runcard.py``.
    """
    data = {
        "task": DigitTask.family,
        "version": DigitTask.version,
        "subjects": list(_SUBJECTS),
        "objects": list(_OBJECTS),
        "template": "{verb} {digit} {noun}, then {digit}:",
        "seed": "sha256(name 0x1f peer_id 0x1f step)[:8] big-endian; random.Random",
        "draws": "choice(subjects), choice(objects), randrange(10), randrange(10)",
        "reward": "share of completion tokens in '0'..'9', a trailing eos excluded",
    }
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return blake3.blake3(canonical.encode()).hexdigest()


DEFAULT_TASK: Task = DigitTask()


def prompts_for(peer_id: str, step: int, n: int) -> list[str]:
    """:meth:`DigitTask.prompts_for` of the default task."""
    return DEFAULT_TASK.prompts_for(peer_id, step, n)


def reward(completion_ids: Sequence[int], tokenizer: PreTrainedTokenizerFast) -> float:
    """:meth:`DigitTask.reward` of the default task."""
    return DEFAULT_TASK.reward(completion_ids, tokenizer)
