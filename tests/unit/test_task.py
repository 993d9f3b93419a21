"""The default digit task: deterministic prompts and a bounded, verifiable reward."""

from __future__ import annotations

import random

import pytest

from p2p.errors import LocalProtocolError
from rollout.model import build_tokenizer
from rollout.task import DEFAULT_TASK, DigitTask, Task, prompts_for, reward

TOK = build_tokenizer()


def _ids(text: str) -> list[int]:
    ids: list[int] = TOK(text, add_special_tokens=False)["input_ids"]
    return ids


def test_prompts_deterministic_and_local_rng() -> None:
    state = random.getstate()
    first = prompts_for("12D3KooWpeerA", 3, 8)
    assert random.getstate() == state  # the global RNG is never touched
    assert first == prompts_for("12D3KooWpeerA", 3, 8)
    assert first == DigitTask().prompts_for("12D3KooWpeerA", 3, 8)
    assert first[:3] == prompts_for("12D3KooWpeerA", 3, 3)
    assert first != prompts_for("12D3KooWpeerB", 3, 8)
    assert first != prompts_for("12D3KooWpeerA", 4, 8)
    assert len(set(first)) > 4
    assert all(19 <= len(p) <= 23 and p.endswith(":") for p in first)
    assert prompts_for("p", 0, 0) == []


def test_prompts_pinned() -> None:
    """The validator recomputes prompts: a change here is a protocol change."""
    assert prompts_for("peer-0", 0, 2) == ["show 1 coins, then 8:", "sum 2 apples, then 8:"]


def test_prompts_reject_negative() -> None:
    with pytest.raises(LocalProtocolError):
        prompts_for("p", -1, 1)
    with pytest.raises(LocalProtocolError):
        prompts_for("p", 0, -1)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("0123456789", 1.0),
        ("abcd", 0.0),
        ("a1b2", 0.5),
        ("7", 1.0),
        ("", 0.0),
        (" 42 ", 0.5),
    ],
)
def test_reward_share_of_digits(completion: str, expected: float) -> None:
    assert reward(_ids(completion), TOK) == pytest.approx(expected)


def test_reward_eos_and_foreign_ids() -> None:
    eos = TOK.eos_token_id
    assert reward([*_ids("12"), eos], TOK) == 1.0  # trailing eos is the stop, not content
    assert reward([eos], TOK) == 0.0
    assert reward([*_ids("1"), eos, *_ids("a")], TOK) == pytest.approx(1 / 3)  # eos inside counts
    assert reward([*_ids("1"), 31999], TOK) == 0.5  # ids beyond the vocabulary: non-digits
    assert 0.0 <= reward(list(range(128)), TOK) <= 1.0


def test_task_protocol() -> None:
    assert isinstance(DEFAULT_TASK, Task)
    assert isinstance(DigitTask(), Task)
    assert DEFAULT_TASK.name == "digits/1"
