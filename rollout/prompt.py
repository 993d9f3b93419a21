"""One prompt of a task: what a task hands out and a reward reads back.

Apart from :mod:`rollout.task` so that tasks defined elsewhere (:mod:`rollout.dataset_task`)
import it without importing the task registry that loads them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prompt"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    Attributes:
        text: a plain-text prompt (used when ``messages`` is empty).
        messages: chat messages ``((role, content), ...)``, rendered with the tokenizer's
            chat template.
        answer: the reference answer a reward compares with (None for tasks without one).
        row: where it came from (a dataset row number, 1-based; 0 if none).
    """

    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    answer: str | int | float | None = None
    row: int = 0
