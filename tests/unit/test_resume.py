"""The trainer's resumable state (trainer.resume): plan, atomic save, load, prune."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2p.errors import ConfigError
from trainer.resume import (
    STATE_DIR,
    ResumeKind,
    load_state,
    plan_resume,
    prune_states,
    save_state,
    saved_steps,
)

META = {"run_id": "r", "preset": "tiny", "seed": 0, "optimizer": "adamw"}


@pytest.mark.parametrize(
    ("published", "states", "kind", "step"),
    [
        (None, [], ResumeKind.FRESH, -1),
        (None, [0], ResumeKind.REPUBLISH, 0),
        (4, [4], ResumeKind.RESUME, 4),
        (4, [3, 4], ResumeKind.RESUME, 4),
        (4, [5], ResumeKind.REPUBLISH, 5),
        (4, [], ResumeKind.INCONSISTENT, -1),
        (4, [3], ResumeKind.INCONSISTENT, -1),
        (4, [6], ResumeKind.INCONSISTENT, -1),
        (None, [2], ResumeKind.INCONSISTENT, -1),
    ],
)
def test_plan_resume(published: int | None, states: list[int], kind: ResumeKind, step: int) -> None:
    plan = plan_resume(published, states)
    assert plan.kind is kind
    assert plan.step == step
    if kind is ResumeKind.INCONSISTENT:
        assert plan.detail


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    return m, opt


def test_save_load_roundtrip_and_prune(tmp_path: Path) -> None:
    m, opt = _model(1)
    save_state(tmp_path, 0, m, opt, META)
    save_state(tmp_path, 1, m, opt, META)
    assert saved_steps(tmp_path) == [0, 1]
    m2, opt2 = _model(2)
    load_state(tmp_path, 1, m2, opt2, META)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert torch.equal(s1[0]["exp_avg"], s2[0]["exp_avg"])
    assert prune_states(tmp_path, 1) == [0]
    assert saved_steps(tmp_path) == [1]


def test_interrupted_save_leaves_no_state(tmp_path: Path) -> None:
    (tmp_path / STATE_DIR / ".tmp-step-3-999").mkdir(parents=True)
    (tmp_path / STATE_DIR / ".tmp-step-3-999" / "state.pt").write_bytes(b"partial")
    assert saved_steps(tmp_path) == []
    assert not (tmp_path / STATE_DIR / ".tmp-step-3-999").exists()


def test_state_of_another_run_is_refused(tmp_path: Path) -> None:
    m, opt = _model(1)
    save_state(tmp_path, 0, m, opt, META)
    with pytest.raises(ConfigError, match="run_id"):
        load_state(tmp_path, 0, m, opt, {**META, "run_id": "other"})
    (tmp_path / STATE_DIR / "step-0" / "state.pt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="cannot load trainer state"):
        load_state(tmp_path, 0, m, opt, META)
