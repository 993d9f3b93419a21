"""Tasks as data and code: the reward library, dataset files, entry points, identities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2p.errors import ConfigError
from rollout.dataset_task import DatasetTask
from rollout.model import build_tokenizer
from rollout.rewards import completion_text, last_boxed, parse_reward
from rollout.task import DEFAULT_TASK, Prompt, Task, load_task, task_identity, task_prompts
from rollout.tasks import arithmetic

TOK = build_tokenizer()


def _ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    ("spec", "text", "answer", "expected"),
    [
        ("exact", " 7 ", 7, 1.0),
        ("exact", "7.", 7, 0.0),
        ("exact", "Paris", "Paris", 1.0),
        ("exact", "3", 3.0, 1.0),
        ("numeric", "the answer is 42", 42, 1.0),
        ("numeric", "41 then 42", 41, 0.0),  # the last number counts
        ("numeric", "1,234.5", 1234.5, 1.0),
        ("numeric", "3/4", 0.75, 1.0),
        ("numeric", "no number", 1, 0.0),
        ("numeric:0.01", "99.5", 100, 1.0),
        ("numeric:0.001", "99.5", 100, 0.0),
        ("regex:answer: (\\w+)", "so answer: blue.", "blue", 1.0),
        ("regex:answer: (\\w+)", "so answer: red", "blue", 0.0),
        ("regex:^\\s*\\d", " 5 apples", None, 1.0),
        ("regex:^\\s*\\d", "five", 5, 0.0),
        ("boxed", "so \\boxed{\\frac{1}{2}}", 0.5, 1.0),
        ("boxed", "\\boxed{12} then \\boxed{13}", 13, 1.0),
        ("boxed", "\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("boxed", "\\boxed{$3$}.", "3", 1.0),
        ("boxed", "no box 3", 3, 0.0),
        ("boxed", "\\boxed{4", 4, 0.0),
    ],
)
def test_reward_library(spec: str, text: str, answer: object, expected: float) -> None:
    assert parse_reward(spec).score(text, answer) == expected  # type: ignore[arg-type]


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("none") is None


@pytest.mark.parametrize(
    "spec", ["", "fuzzy", "numeric:abc", "numeric:-1", "regex:", "regex:(", "exact:1"]
)
def test_bad_reward_spec(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_reward(spec)
    assert err.value.field == "task_reward"


def test_completion_text_drops_eos_and_foreign_ids() -> None:
    assert completion_text([*_ids("12"), TOK.eos_token_id], TOK) == "12"
    assert completion_text([*_ids("1"), 31999], TOK) == "1"


def test_shipped_dataset_is_the_generated_one(tmp_path: Path) -> None:
    assert arithmetic.write(tmp_path / "a.jsonl").read_bytes() == arithmetic.DATASET.read_bytes()
    task = load_task(str(arithmetic.DATASET), arithmetic.REWARD)
    assert isinstance(task, DatasetTask)
    assert len(task.rows) == 110
    name, version, digest = task_identity(task)
    assert name == f"arithmetic@{digest[:12]}"
    assert version == "1"
    assert len(digest) == 64
    # another reward is another task (the validator refuses batches of the other)
    assert task_identity(load_task(str(arithmetic.DATASET), "exact"))[2] != digest


def test_dataset_prompts_are_deterministic(tmp_path: Path) -> None:
    task = load_task(str(arithmetic.DATASET), "numeric")
    first = task_prompts(task, "peer-a", 3, 8)
    assert first == task_prompts(task, "peer-a", 3, 8)
    assert first[:3] == task_prompts(task, "peer-a", 3, 3)
    assert first != task_prompts(task, "peer-b", 3, 8)
    assert first != task_prompts(task, "peer-a", 4, 8)
    assert all(p.row >= 1 and isinstance(p.answer, int) for p in first)
    p = first[0]
    assert task.reward([*_ids(f"= {p.answer}"), TOK.eos_token_id], TOK, p) == 1.0
    assert task.reward(_ids("x"), TOK, p) == 0.0


def _write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("lines", "reward", "where", "why"),
    [
        (['{"prompt": "a", "answer": 1}', "{oops"], "numeric", ":2:", "not JSON"),
        (
            ['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": "2"}'],
            "numeric",
            ":2:",
            "needs a number",
        ),
        (['{"prompt": "a", "answer": true}'], "numeric", ":1:", "needs a number"),
        (['{"prompt": "a", "answer": [1]}'], "exact", ":1:", "is a list"),
        (['{"prompt": "a"}'], "exact", ":1:", "answer is missing"),
        (['{"answer": 1}'], "exact", ":1:", "non-empty prompt or messages"),
        (['{"prompt": 5, "answer": 1}'], "exact", ":1:", "prompt must be a string"),
        (['{"messages": [{"role": "user"}], "answer": 1}'], "exact", ":1:", "is not {role"),
        (["[1, 2]"], "exact", ":1:", "must be an object"),
        ([""], "exact", "", "no rows"),
    ],
)
def test_bad_dataset_is_one_line_naming_file_and_row(
    tmp_path: Path, lines: list[str], reward: str, where: str, why: str
) -> None:
    path = _write(tmp_path, lines)
    with pytest.raises(ConfigError) as err:
        load_task(str(path), reward)
    msg = str(err.value)
    assert err.value.field == "task"
    assert f"{path}{where}" in msg
    assert why in msg
    assert "\n" not in msg


def test_missing_dataset_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.jsonl"):
        load_task(str(tmp_path / "missing.jsonl"))


def test_parquet_dataset(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in arithmetic.DATASET.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    task = load_task(str(tmp_path / "a.parquet"), "numeric")
    jsonl = load_task(str(arithmetic.DATASET), "numeric")
    assert isinstance(task, DatasetTask)
    assert isinstance(jsonl, DatasetTask)
    assert task.rows == jsonl.rows  # same rows; the names differ (digest of the file's bytes)
    assert task.name != jsonl.name
    bad = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "x"}]  # typed column
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match=r"b\.parquet row 1: answer '1' is a str"):
        load_task(str(tmp_path / "b.parquet"), "numeric")


def test_entry_point_task() -> None:
    task = load_task("tests.entry_tasks:Echo")
    assert isinstance(task, Task)
    prompt = task_prompts(task, "p", 0, 1)[0]
    assert prompt == Prompt(text="say w0", answer="w0")
    assert task.reward(_ids("w0"), TOK, prompt) == 1.0
    name, version, digest = task_identity(task)
    assert (name, version) == ("echo/1", "1")
    assert digest == task_identity(load_task("tests.entry_tasks:Echo"))[2]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("tests.entry_tasks:Raises", "tests.entry_tasks:Raises: RuntimeError: no GPU here"),
        ("tests.entry_tasks:BadPrompts", "BadPrompts.prompts_for raised ValueError"),
        ("tests.entry_tasks:NOT_A_TASK", "not a Task"),
        ("tests.entry_tasks:Missing", "AttributeError"),
        ("tests.no_such_module:Task", "ModuleNotFoundError"),
        ("sums", "is not digits"),
    ],
)
def test_bad_entry_point_is_one_line_naming_the_object(spec: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_task(spec)
    assert why in str(err.value)
    assert "\n" not in str(err.value)


def test_digits_identity() -> None:
    assert load_task("digits") is DEFAULT_TASK
    assert task_identity(DEFAULT_TASK)[:2] == ("digits/1", "1")
