"""Capturing the TOPLOC activations inside vLLM, and sampling with seeded Gumbel-max noise.

A forward hook on the top-level vLLM model records, for every scheduled token of a step, its
request, position, input token and final-norm output (the LM-head input); a pre-hook on
``logits_processor`` checks each step that the LM head received exactly the captured last rows.
:meth:`Capture.rows` reassembles one sample's rows by position and fails closed if a row is
missing or its input token differs from the sequence. Relies on vLLM 0.32's model runner
(``input_batch``, ``query_start_loc``, ``requests``).

**Sampling.** A forward hook on ``logits_processor`` (:meth:`Capture.on_logits_out`) replaces
its output, the ``[rows, V]`` logits of the step (one row per scheduled request, in
``input_batch`` order, vocabulary padding already removed), by the sampler's decision: for the
row of sample ``i`` whose last scheduled token sits at sequence position ``p``, the next token
is at completion position ``j = p + 1 - L`` and is
:func:`rollout.gumbel.gumbel_argmax` of the row with ``NoiseKey(seed, i)`` — the sampler of
:class:`rollout.engine.TransformersEngine`, on the same float32 values, so both engines draw
the same token from the same logits. The row becomes 0 at that token and ``-inf`` elsewhere,
which every vLLM sampler (random at temperature ``T``, top-p 1, top-k off) turns into that
token with probability 1; the hook records ``(token, log_softmax(logits / T)[token])`` per
sample and position, and the engine reports these logprobs and checks that vLLM emitted exactly
the recorded tokens. Rows of a prompt still in chunked prefill (``j < 0``) are left alone.

**Teacher-forced passes** (``sample=False``, :meth:`rollout.engine_vllm.VllmEngine.teacher_forced`):
the validator submits ``prompt + completion[:-1]`` as the prompt with ``max_tokens=1``; the
same hooks capture every prefill row (the LM-head inputs that TOPLOC commits and that produce
the completion's tokens) and the logits are left alone (the single token vLLM then draws is
discarded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from p2p.errors import ShardnetError
from rollout.gumbel import NoiseKey, gumbel_argmax

__all__ = ["SAMPLE_KEY", "Capture", "VllmEngineError"]

SAMPLE_KEY = "shardnet_sample"
"""Key in ``SamplingParams.extra_args`` carrying a request's sample index."""


class VllmEngineError(ShardnetError):
    """vLLM failed: it could not start, a weight reload crashed, a generation call failed, or
    the captured activations were inconsistent. The message says what the engine did about it
    (rebuilt from the last good version, or left unloaded)."""


class Capture:
    """Activations of one ``generate`` call, gathered by the model hooks.

    ``chunks[i]`` holds ``(positions [m] int64, input_ids [m] int64, rows [m, H])`` triples of
    sample ``i``, one per forward pass that scheduled tokens of it.
    """

    def __init__(
        self,
        n: int,
        runner: Any,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        prompt_len: int = 0,
        sample: bool = True,
    ) -> None:
        self.runner = runner
        self.sample = sample
        self.seed = seed
        self.temperature = temperature
        self.prompt_len = prompt_len
        self.keys = [NoiseKey(seed, i) for i in range(n)]
        self.drawn: list[dict[int, tuple[int, float]]] = [{} for _ in range(n)]
        """``drawn[i][j] = (token, logprob)``: sample ``i``'s draw at completion position ``j``."""
        self.last_owners: list[tuple[int, int]] = []  # (sample, last position) per logits row
        self.chunks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(n)
        ]
        self.sample_of: dict[str, int] = {}
        self.last_rows: torch.Tensor | None = None
        self.error: str | None = None
        self.steps = 0

    def index(self, req_id: str) -> int:
        if req_id not in self.sample_of:
            params = self.runner.requests[req_id].sampling_params
            extra = getattr(params, "extra_args", None) or {}
            if SAMPLE_KEY not in extra:
                raise LookupError(f"request {req_id} is not one of this call's")
            self.sample_of[req_id] = int(extra[SAMPLE_KEY])
        return self.sample_of[req_id]

    def on_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.error is not None:
            return
        try:
            batch = self.runner.input_batch
            n_reqs = int(batch.num_reqs)
            starts = self.runner.query_start_loc.np[: n_reqs + 1].tolist()
            positions = kwargs["positions"] if "positions" in kwargs else args[1]
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            hidden = out if isinstance(out, torch.Tensor) else out[0]
            owners = []
            for j, req_id in enumerate(batch.req_ids[:n_reqs]):
                s, e = starts[j], starts[j + 1]
                self.chunks[self.index(req_id)].append(
                    (positions[s:e].clone(), input_ids[s:e].clone(), hidden[s:e].clone())
                )
                owners.append((self.index(req_id), int(positions[e - 1])))
            self.last_owners = owners
            self.last_rows = hidden[torch.tensor(starts[1:]) - 1].clone()
            self.steps += 1
        except (LookupError, IndexError, AttributeError, TypeError, RuntimeError) as exc:
            self.error = f"capture failed: {type(exc).__name__}: {exc}"

    def on_logits(self, args: tuple[Any, ...]) -> None:
        if self.error is not None:
            return
        rows, self.last_rows = self.last_rows, None
        if rows is None or len(args) < 2 or not torch.equal(args[1], rows):
            self.error = "LM-head input differs from the captured rows at the last positions"

    def on_logits_out(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The step's logits ``[rows, V]`` replaced by the seeded Gumbel-max draws (see the
        module docstring); ``None`` (leave them) after an error, which fails the call, or when
        this capture does not sample (a teacher-forced pass: vLLM's own draw is discarded)."""
        if self.error is not None or not self.sample:
            self.last_owners = []
            return None
        try:
            owners, self.last_owners = self.last_owners, []
            if logits.dim() != 2 or logits.shape[0] != len(owners):
                raise IndexError(f"logits of shape {tuple(logits.shape)} for {len(owners)} rows")
            z = logits.detach().float().cpu()
            logp = torch.log_softmax(z / self.temperature, dim=-1)
            forced = torch.full_like(logits, float("-inf"))
            for row, (sample, last) in enumerate(owners):
                position = last + 1 - self.prompt_len
                if position < 0:  # a prompt chunk: its row is not sampled
                    forced[row] = logits[row]
                    continue
                key = self.keys[sample]
                token = int(
                    gumbel_argmax(z[row : row + 1].numpy(), [key], position, self.temperature)[0]
                )
                self.drawn[sample][position] = (token, float(logp[row, token]))
                forced[row, token] = 0.0
            return forced
        except (IndexError, RuntimeError, ValueError, ShardnetError) as exc:
            self.error = f"sampling failed: {type(exc).__name__}: {exc}"
            return None

    def draws(self, index: int, completion: Sequence[int]) -> list[float]:
        """The logprobs of sample ``index``'s recorded draws, checking that ``completion`` is
        exactly the recorded tokens.

        Raises:
            VllmEngineError: a token was not drawn by the hook, or differs.
        """
        out = []
        for j, token in enumerate(completion):
            drawn = self.drawn[index].get(j)
            if drawn is None or drawn[0] != token:
                raise VllmEngineError(
                    f"sample {index}: token {token} at position {j} is not the Gumbel-max draw "
                    f"{drawn}"
                )
            out.append(drawn[1])
        return out

    def rows(self, index: int, sequence: Sequence[int], hidden_size: int) -> torch.Tensor:
        """Rows at positions ``0 .. len(sequence)-2`` of sample ``index``: ``[len-1, H]``."""
        need = len(sequence) - 1
        out = torch.empty(need, hidden_size, dtype=torch.bfloat16)
        seen = torch.zeros(need, dtype=torch.bool)
        tokens = torch.tensor(list(sequence[:need]), dtype=torch.long)
        for positions, ids, rows in self.chunks[index]:
            keep = positions < need
            pos = positions[keep].long()
            if not torch.equal(ids[keep].long(), tokens[pos]):
                raise VllmEngineError(f"sample {index}: captured input tokens differ from output")
            out[pos] = rows[keep].to(torch.bfloat16)
            seen[pos] = True
        if not bool(seen.all()):
            missing = torch.nonzero(~seen)[:5, 0].tolist()
            raise VllmEngineError(f"sample {index}: no captured row at positions {missing}")
        return out
