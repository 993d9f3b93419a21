"""Tasks: where prompts come from and how completions are scored.

Theory of operation
-------------------
A task is two pure functions (the :class:`Task` protocol) and an identity:

* ``prompts_for(peer_id, step, n)`` — the prompts a peer must answer at a policy step
  (strings, or :class:`Prompt` objects carrying chat messages and a reference answer). They
  are a function of ``(peer_id, step, n)`` only, drawn from a ``random.Random`` seeded with
  the SHA-256 of the task name, the peer id and the step (never the global RNG), so a
  validator recomputes them and rejects rollouts whose prompts a peer chose itself.
* ``reward(completion_ids, tokenizer, prompt)`` — a verifiable reward in ``[0, 1]`` computed
  from token ids and the prompt alone, so the trainer and any validator agree on it bit for
  bit.
* ``name`` (what rollout batches carry; the validator refuses another) and, through
  :func:`task_identity`, ``(name, version, digest)`` for the run card.

Three kinds of task, all loaded by :func:`load_task` from one spec string (the ``task``
setting), by trainer, validator and peers alike:

* ``digits`` — the built-in demo task below;
* a dataset file (``*.jsonl`` or ``*.parquet``) with a reward from :mod:`rollout.rewards`
  (:mod:`rollout.dataset_task`);
* a Python entry point ``package.module:Name`` — a class (called with no arguments) or an
  object implementing :class:`Task`.

Prompts become token ids with the checkpoint's tokenizer in :func:`encode_prompt`: chat
messages are rendered with the tokenizer's chat template and a generation prompt when the
tokenizer has a template (or the prompt has no text); otherwise the text is tokenized as is
(the tokenizer adds its special tokens, e.g. ``<bos>``). Both sides use the same checkpoint's
tokenizer, so they pick the same form.

The default :class:`DigitTask` rewards the share of completion tokens that are ASCII digits.
It is dense (every token counts) and an untrained model starts near ``10/128 ≈ 0.08`` with
the 128-token character vocabulary, so a tiny model visibly learns it within a few GRPO
steps. A trailing ``<eos>`` is the stop signal, not content: it is left out of the share.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import blake3

from p2p.errors import ConfigError, LocalProtocolError
from rollout.dataset_task import DatasetTask
from rollout.prompt import Prompt

if TYPE_CHECKING:  # annotations only: this module stays importable without torch
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_REWARD_SPEC",
    "DEFAULT_TASK",
    "DEFAULT_TASK_SPEC",
    "DigitTask",
    "Prompt",
    "Task",
    "as_prompt",
    "encode_prompt",
    "load_task",
    "prompts_for",
    "reward",
    "task_data_digest",
    "task_identity",
    "task_prompts",
    "task_spec",
]


@runtime_checkable
class Task(Protocol):
    """A verifiable RL task. Implementations must be pure and deterministic.

    ``version`` (a string) and ``digest()`` (hex) are optional; see :func:`task_identity`.
    """

    name: str
    """Stable identifier carried by rollout batches; part of the prompt seed (``"digits/1"``)."""

    def prompts_for(self, peer_id: str, step: int, n: int) -> Sequence[str | Prompt]:
        """The ``n`` prompts assigned to ``peer_id`` at policy step ``step``."""
        ...

    def reward(
        self,
        completion_ids: Sequence[int],
        tokenizer: PreTrainedTokenizerFast,
        prompt: Prompt | None = None,
    ) -> float:
        """Score one completion (token ids, as sampled) of ``prompt`` in ``[0, 1]``."""
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

    def digest(self) -> str:
        """The task's data digest for the run card: :func:`task_data_digest`."""
        return task_data_digest()

    def reward(
        self,
        completion_ids: Sequence[int],
        tokenizer: PreTrainedTokenizerFast,
        prompt: Prompt | None = None,
    ) -> float:
        """Share of digit tokens in a completion, a trailing ``eos`` excluded.

        Args:
            completion_ids: sampled token ids (ids the tokenizer cannot decode count as
                non-digits).
            tokenizer: gives the ids of ``"0"``..``"9"`` and of ``eos``.
            prompt: unused (the reward does not depend on the prompt).

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


DEFAULT_TASK = DigitTask()

DEFAULT_TASK_SPEC = "digits"
"""The task a run uses unless told otherwise (the spec of :data:`DEFAULT_TASK`)."""

DEFAULT_REWARD_SPEC = "exact"
"""The reward of a dataset task unless told otherwise (:mod:`rollout.rewards`)."""


def prompts_for(peer_id: str, step: int, n: int) -> list[str]:
    """:meth:`DigitTask.prompts_for` of the default task."""
    return DEFAULT_TASK.prompts_for(peer_id, step, n)


def reward(completion_ids: Sequence[int], tokenizer: PreTrainedTokenizerFast) -> float:
    """:meth:`DigitTask.reward` of the default task."""
    return DEFAULT_TASK.reward(completion_ids, tokenizer)


def as_prompt(item: str | Prompt) -> Prompt:
    """A task's prompt item as a :class:`Prompt` (a string is a plain-text prompt).

    Raises:
        LocalProtocolError: neither a string nor a Prompt.
    """
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(text=item)
    raise LocalProtocolError(f"a task prompt must be str or Prompt, got {type(item).__name__}")


def task_prompts(task: Task, peer_id: str, step: int, n: int) -> list[Prompt]:
    """``task.prompts_for(peer_id, step, n)`` as exactly ``n`` :class:`Prompt` objects.

    Raises:
        LocalProtocolError: the task returned the wrong number or kind of prompts.
    """
    items = list(task.prompts_for(peer_id, step, n))
    if len(items) != n:
        raise LocalProtocolError(f"task {task.name} returned {len(items)} prompts, asked {n}")
    return [as_prompt(p) for p in items]


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    """Token ids of ``prompt`` with ``tokenizer`` (see module docstring).

    Raises:
        LocalProtocolError: chat messages but the tokenizer has no chat template, or an
            empty encoding.
    """
    if prompt.messages and (getattr(tokenizer, "chat_template", None) or not prompt.text):
        if not getattr(tokenizer, "chat_template", None):
            raise LocalProtocolError("a chat prompt needs a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in prompt.messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = list(tokenizer(str(text), add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt.text)["input_ids"])
    if not ids:
        raise LocalProtocolError(f"prompt {prompt.text[:40]!r} encodes to no tokens")
    return [int(i) for i in ids]


def task_identity(task: Task) -> tuple[str, str, str]:
    """``(name, version, digest)`` of a task, for the run card.

    ``version`` is ``task.version`` (``"0"`` if absent). ``digest`` is ``task.digest()`` when
    the task has one (a dataset: SHA-256 of the file's bytes and of the reward spec), else the
    SHA-256 of the source file of the task's class, so a validator with other code is told
    apart.
    """
    version = str(getattr(task, "version", "0"))
    digest_fn = getattr(task, "digest", None)
    if callable(digest_fn):
        return task.name, version, str(digest_fn())
    try:
        source = Path(inspect.getfile(type(task))).read_bytes()
    except (OSError, TypeError):
        source = type(task).__qualname__.encode()
    return task.name, version, hashlib.sha256(source).hexdigest()


def load_task(spec: str, reward_spec: str = DEFAULT_REWARD_SPEC, field: str = "task") -> Task:
    """The task a spec names: ``digits``, a ``.jsonl``/``.parquet`` file, or ``pkg.mod:Name``.

    The task is tried once (``prompts_for("check", 0, 2)``) so that a broken entry point fails
    here, before the run starts.

    Args:
        spec: the ``task`` setting.
        reward_spec: the ``task_reward`` setting (dataset tasks only; see
            :mod:`rollout.rewards`).
        field: the setting named in errors.

    Raises:
        ConfigError: on ``field``: an unknown built-in, a dataset file with a malformed row
            (naming file and row), an entry point that cannot be imported, raises, or does not
            implement :class:`Task` (naming the object).
    """
    if spec in ("digits", DigitTask.name):
        return DEFAULT_TASK
    suffix = Path(spec).suffix.lower()
    if suffix in (".jsonl", ".parquet"):
        return DatasetTask.load(Path(spec), reward_spec, field=field)
    if ":" in spec and "/" not in spec:
        return _entry_point(spec, field)
    raise ConfigError(
        field, f"{spec!r} is not digits, a .jsonl/.parquet file or a package.module:Task"
    )


def _entry_point(spec: str, field: str) -> Task:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        task = obj() if inspect.isclass(obj) else obj
    except Exception as exc:  # any error in user code is the operator's to fix: one line
        raise ConfigError(field, f"{spec}: {type(exc).__name__}: {_line(exc)}") from None
    missing = [m for m in ("name", "prompts_for", "reward") if not hasattr(task, m)]
    if missing or not isinstance(getattr(task, "name", None), str):
        raise ConfigError(field, f"{spec}: not a Task (lacks {missing or ['str name']})")
    try:
        task_prompts(cast(Task, task), "check", 0, 2)
    except Exception as exc:  # user code: report it as one line naming the object
        raise ConfigError(
            field, f"{spec}.prompts_for raised {type(exc).__name__}: {_line(exc)}"
        ) from None
    return cast(Task, task)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def task_spec(task: Task) -> tuple[str, int, str]:
    """``(name, version, digest)`` of ``task`` as the run card names it.

    ``name`` is the task's family (``digits``; a dataset task's ``<stem>@<digest>``), without
    the version that :attr:`Task.name` may carry; ``version`` is an integer >= 1;
    ``digest`` is :func:`task_identity`'s.
    """
    name, version, digest = task_identity(task)
    family = str(getattr(task, "family", name))
    return family, max(1, int(version)) if version.isdigit() else 1, digest
