"""Task entry points for tests (``tests.entry_tasks:Name``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.task import Prompt


class Echo:
    """A valid task: asks to repeat a word; reward 1 if the completion contains it."""

    name = "echo/1"
    version = "1"

    def prompts_for(self, peer_id: str, step: int, n: int) -> list[Prompt]:
        return [
            Prompt(text=f"say w{(step + i) % 7}", answer=f"w{(step + i) % 7}") for i in range(n)
        ]

    def reward(
        self, completion_ids: Sequence[int], tokenizer: Any, prompt: Prompt | None = None
    ) -> float:
        text = tokenizer.decode(list(completion_ids), skip_special_tokens=True)
        return float(prompt is not None and str(prompt.answer) in text)


class Raises:
    """Its constructor fails."""

    name = "raises"

    def __init__(self) -> None:
        raise RuntimeError("no GPU here")


class BadPrompts(Echo):
    """prompts_for raises."""

    def prompts_for(self, peer_id: str, step: int, n: int) -> list[Prompt]:
        raise ValueError("dataset shard missing")


NOT_A_TASK = object()
