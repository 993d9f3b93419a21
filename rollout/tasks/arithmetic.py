"""Generate ``arithmetic.jsonl``: one-digit sums and differences, for the dataset-task demo.

Every row is ``{"prompt": "3 + 4 =", "messages": [...], "answer": 7}`` with a one-digit
answer (0..9), so that a tiny model can learn it with GRPO and the ``numeric`` reward in a few
steps. The file is a pure function of this script (no randomness), so its digest is stable:
``python -m rollout.tasks.arithmetic`` rewrites it byte for byte, and a test checks that the
shipped file equals the generated one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["DATASET", "REWARD", "rows", "write"]

DATASET = Path(__file__).with_name("arithmetic.jsonl")
"""The shipped file."""
REWARD = "numeric:0"
"""The reward this dataset is meant for (the ``task_reward`` setting)."""


def rows() -> list[dict[str, object]]:
    """All rows: ``a + b`` and ``a - b`` for one-digit ``a, b`` whose result is in 0..9."""
    out: list[dict[str, object]] = []
    for a in range(10):
        for b in range(10):
            for op, value in (("+", a + b), ("-", a - b)):
                if 0 <= value <= 9:
                    text = f"{a} {op} {b} ="
                    out.append(
                        {
                            "prompt": text,
                            "messages": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
                            "answer": value,
                        }
                    )
    return out


def write(path: Path = DATASET) -> Path:
    """Write the dataset as JSON lines (sorted keys, ``\\n`` endings)."""
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows()))
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else DATASET))
