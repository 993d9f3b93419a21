"""Consecutive checkpoints by a real Adam step: few bf16 elements change, layout is kept."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.model import build_model, build_tokenizer, load_model
from trainer.checkpoint import save_checkpoint
from trainer.evolve import changed_fraction, evolve


def test_evolve_changes_few_elements_and_keeps_layout(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    save_checkpoint(build_model("tiny", 0), build_tokenizer(), tmp_path / "v0", 1 << 19)
    st = evolve(tmp_path / "v0", tmp_path / "v1", lr=1e-6, max_shard_bytes=1 << 19)
    st2 = evolve(tmp_path / "v0", tmp_path / "v1b", lr=3e-6, max_shard_bytes=1 << 19)
    assert 0.0 < st.changed_fraction < st2.changed_fraction < 0.2
    assert abs(changed_fraction(tmp_path / "v0", tmp_path / "v1") - st.changed_fraction) < 1e-3
    assert sorted(p.name for p in (tmp_path / "v0").iterdir()) == sorted(
        p.name for p in (tmp_path / "v1").iterdir()
    )
    for f in (tmp_path / "v0").glob("*.safetensors"):
        assert f.stat().st_size == (tmp_path / "v1" / f.name).stat().st_size
    a, b = load_model(tmp_path / "v0"), load_model(tmp_path / "v1")
    diffs = [
        float((x.float() - y.float()).abs().max())
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    ]
    assert 0 < max(diffs) < 1e-2  # small steps, not noise
