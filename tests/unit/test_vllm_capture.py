"""The vLLM sampling hook (rollout/vllm_capture.py) without vLLM: a fake model runner.

The hook must draw, for each logits row, the seeded Gumbel-max token of the row's own sample
at the right completion position (the same sampler as TransformersEngine), force it, leave
rows of prompts still in chunked prefill alone, and record the logprobs the engine reports.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout.gumbel import NoiseKey, gumbel_argmax
from rollout.vllm_capture import SAMPLE_KEY, Capture, VllmEngineError

V, H, L = 50, 8, 5  # vocabulary, hidden size, prompt length


def _runner(req_ids: list[str], starts: list[int]) -> SimpleNamespace:
    requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={SAMPLE_KEY: int(r[1:])}))
        for r in req_ids
    }
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids)),
        query_start_loc=SimpleNamespace(np=np.array(starts)),
        requests=requests,
    )


def _step(capture: Capture, positions: list[int], logits: torch.Tensor) -> torch.Tensor | None:
    n = len(positions)
    hidden = torch.randn(n, H)
    capture.on_forward(
        (), {"positions": torch.tensor(positions), "input_ids": torch.zeros(n)}, hidden
    )
    starts = capture.runner.query_start_loc.np.tolist()
    capture.on_logits((None, hidden[torch.tensor(starts[1:]) - 1]))
    return capture.on_logits_out(logits)


def test_rows_are_drawn_with_their_own_key_and_position() -> None:
    # step 1: sample 1 finishes its prompt (positions 0..4), sample 0 has prompt rows 0..2 only
    runner = _runner(["s1", "s0"], [0, 5, 8])
    capture = Capture(2, runner, seed=77, temperature=0.8, prompt_len=L)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = _step(capture, [0, 1, 2, 3, 4, 0, 1, 2], logits)
    assert capture.error is None
    assert out is not None
    token = int(gumbel_argmax(logits[:1].float().numpy(), [NoiseKey(77, 1)], 0, 0.8)[0])
    assert torch.isneginf(out[0]).sum() == V - 1
    assert out[0, token] == 0
    assert torch.equal(out[1], logits[1])  # still in prefill: not sampled
    lp = float(torch.log_softmax(logits[0].float() / 0.8, -1)[token])
    assert capture.drawn[1] == {0: (token, pytest.approx(lp))}
    assert capture.drawn[0] == {}
    # step 2, rows reordered: sample 0 ends its prompt (3, 4), sample 1 decodes position 1
    runner.input_batch.req_ids = ["s0", "s1"]
    runner.query_start_loc.np = np.array([0, 2, 3])
    logits2 = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    out2 = _step(capture, [3, 4, 5], logits2)
    assert out2 is not None
    t0 = int(gumbel_argmax(logits2[:1].numpy(), [NoiseKey(77, 0)], 0, 0.8)[0])
    t1 = int(gumbel_argmax(logits2[1:].numpy(), [NoiseKey(77, 1)], 1, 0.8)[0])
    assert int(out2[0].argmax()) == t0
    assert int(out2[1].argmax()) == t1
    assert capture.draws(1, [token, t1]) == pytest.approx(
        [lp, float(torch.log_softmax(logits2[1] / 0.8, -1)[t1])]
    )
    with pytest.raises(VllmEngineError):
        capture.draws(1, [token, (t1 + 1) % V])  # vLLM emitted another token
    with pytest.raises(VllmEngineError):
        capture.draws(0, [t0, 3])  # a token the hook never drew


def test_shape_mismatch_fails_the_call() -> None:
    capture = Capture(1, _runner(["s0"], [0, 5]), prompt_len=L)
    assert _step(capture, [0, 1, 2, 3, 4], torch.randn(3, V)) is None
    assert capture.error is not None
