"""A small library of verifiable rewards for dataset tasks.

Theory of operation
-------------------
A reward compares a completion's *text* with a row's *answer* and returns 1.0 or 0.0. The
text is the completion decoded with the checkpoint's tokenizer, a trailing stop token removed
and special tokens skipped (:func:`completion_text`), so the trainer, the validator and every
peer compute the same number from the same ids. A reward is named by a short spec string
(the ``task_reward`` setting), parsed once by :func:`parse_reward`:

==================  =====================================================================
spec                reward
==================  =====================================================================
``exact``           the stripped text equals ``str(answer)`` stripped
``numeric[:TOL]``   the last number in the text is within ``TOL * max(1, |answer|)`` of
                    the answer (default TOL 1e-6); ``answer`` must be a number
``regex:PATTERN``   ``PATTERN`` is searched in the text; with a group, group 1 must equal
                    ``str(answer)`` (stripped); with no group or a null answer, any match
``boxed``           the content of the last ``\\boxed{...}`` equals the answer, compared
                    as numbers when both parse (integers, decimals, ``a/b``, ``\\frac{a}{b}``),
                    else as strings with spaces and ``$`` removed
==================  =====================================================================

Each reward also says which answer types it accepts (:meth:`Reward.check_answer`), so a dataset
with an answer of the wrong type is refused when it is loaded, naming the row.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from p2p.errors import ConfigError

__all__ = ["Answer", "Reward", "completion_text", "parse_reward"]

Answer = str | int | float | None
"""A dataset row's answer: JSON string, number or null."""

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


@dataclass(frozen=True)
class Reward:
    """A named reward: ``score(text, answer) -> {0.0, 1.0}``.

    Attributes:
        spec: the spec it was parsed from (part of the task's identity).
        score: the pure scoring function.
        answer_types: the accepted Python types of ``answer`` (bool never counts as a number).
        answer_required: whether a null answer is refused.
    """

    spec: str
    score: Callable[[str, Answer], float]
    answer_types: tuple[type, ...]
    answer_required: bool = True

    def check_answer(self, answer: Any) -> str | None:
        """Why ``answer`` does not suit this reward (None: it does)."""
        if answer is None:
            return "answer is missing" if self.answer_required else None
        if isinstance(answer, bool) or not isinstance(answer, self.answer_types):
            want = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in self.answer_types))
            return f"answer {answer!r} is a {type(answer).__name__}, {self.spec} needs {want}"
        if isinstance(answer, float) and not math.isfinite(answer):
            return f"answer {answer!r} is not finite"
        return None


_TYPE_NAMES = {str: "a string", int: "a number", float: "a number"}


def completion_text(completion_ids: Sequence[int], tokenizer: Any) -> str:
    """The completion as text: a trailing eos dropped, special tokens skipped.

    Ids outside the tokenizer's vocabulary (a model padded beyond it) are dropped too, so
    decoding never fails on a sampled id.
    """
    ids = list(completion_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids.pop()
    size = len(tokenizer)
    return str(tokenizer.decode([t for t in ids if 0 <= t < size], skip_special_tokens=True))


def parse_reward(spec: str, field: str = "task_reward") -> Reward:
    """Parse a reward spec (see the module table).

    Raises:
        ConfigError: on ``field``: unknown kind, bad tolerance, or a regex that does not compile.
    """
    kind, _, arg = spec.partition(":")
    if kind == "exact" and not arg:
        return Reward(spec, _exact, (str, int, float))
    if kind == "numeric":
        try:
            tol = float(arg) if arg else 1e-6
        except ValueError:
            raise ConfigError(field, f"numeric tolerance {arg!r} is not a number") from None
        if not (math.isfinite(tol) and tol >= 0):
            raise ConfigError(field, f"numeric tolerance {arg!r} must be >= 0")
        return Reward(spec, lambda text, answer: _numeric(text, answer, tol), (int, float))
    if kind == "regex" and arg:
        try:
            pattern = re.compile(arg)
        except re.error as exc:
            raise ConfigError(field, f"regex {arg!r}: {exc}") from None
        return Reward(
            spec,
            lambda text, answer: _regex(pattern, text, answer),
            (str, int, float),
            answer_required=False,
        )
    if kind == "boxed" and not arg:
        return Reward(spec, _boxed, (str, int, float))
    raise ConfigError(
        field, f"{spec!r} is not a reward (exact, numeric[:TOL], regex:PATTERN, boxed)"
    )


def _exact(text: str, answer: Answer) -> float:
    return float(text.strip() == _answer_text(answer))


def _answer_text(answer: Answer) -> str:
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def _numeric(text: str, answer: Answer, tol: float) -> float:
    found = _NUMBER.findall(text)
    if not found or answer is None or isinstance(answer, str):
        return 0.0
    value = _to_number(found[-1])
    if value is None:
        return 0.0
    return float(abs(value - float(answer)) <= tol * max(1.0, abs(float(answer))))


def _regex(pattern: re.Pattern[str], text: str, answer: Answer) -> float:
    match = pattern.search(text)
    if match is None:
        return 0.0
    if pattern.groups == 0 or answer is None:
        return 1.0
    group = match.group(1)
    return float(group is not None and group.strip() == _answer_text(answer))


def _boxed(text: str, answer: Answer) -> float:
    content = last_boxed(text)
    if content is None or answer is None:
        return 0.0
    got, want = _normalize(content), _normalize(_answer_text(answer))
    a, b = _to_number(got), _to_number(want)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    return float(got == want)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$")


def _normalize(s: str) -> str:
    s = s.replace("$", "").replace("\\left", "").replace("\\right", "").replace("\\!", "")
    s = "".join(s.split()).rstrip(".")
    m = _FRAC.match(s)
    return f"{m.group(1)}/{m.group(2)}" if m else s


def _to_number(s: str) -> float | None:
    s = s.replace(",", "")
    try:
        if "/" in s:
            return float(Fraction(s))
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None
