"""Partial batches: the validator accepts the first ``k`` assigned prompts (in any order),
exactly once per (submitter, step); the packer refuses anything else (model-free checks)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from rollout.batch import SamplingConfig, pack_batch
from rollout.schema import Group, RolloutBatch, Sample
from rollout.task import DEFAULT_TASK
from rollout.verify import Validator, ValidatorConfig

N, GROUP, CAP = 4, 2, 3
DIGEST = "ab" * 32
ALICE = Identity.from_seed("partial-alice").peer_id
BOB = Identity.from_seed("partial-bob").peer_id
CFG = SamplingConfig(n_prompts=N, group_size=GROUP, max_new_tokens=CAP)


class Oracle:
    """Seeded prompts and a cheap reward; no model (the validator runs without model checks)."""

    vocab_size = 128
    eos_id = 1

    def manifest_digest(self, step: int) -> str | None:
        return DIGEST

    def prompt_ids(self, submitter: str, step: int, n: int) -> list[list[int]]:
        rng = random.Random(f"{submitter}:{step}")
        return [[rng.randrange(4, 100) for _ in range(3)] for _ in range(n)]

    def reward(self, completion_ids: Sequence[int], **_kw: Any) -> float:
        return (sum(completion_ids) % 5) / 4

    def prefill_batch(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise AssertionError("no model checks here")


def _groups(oracle: Oracle, submitter: str, step: int) -> list[Group]:
    rng = random.Random(f"groups:{submitter}:{step}")
    out = []
    for i, prompt in enumerate(oracle.prompt_ids(submitter, step, N)):
        samples = []
        for _ in range(GROUP):
            ids = tuple(rng.randrange(4, 100) for _ in range(CAP))
            samples.append(Sample(ids, (-1.0,) * CAP, oracle.reward(ids), "length", b""))
        out.append(Group(i, tuple(prompt), tuple(samples)))
    return out


def _batch(groups: Sequence[Group], submitter: str = ALICE, step: int = 0) -> RolloutBatch:
    return RolloutBatch(
        "r", submitter, step, DIGEST, DEFAULT_TASK.name, N, 1, 1.0, CAP, tuple(groups)
    )


def _validator() -> Validator:
    cfg = ValidatorConfig(
        run_id="r",
        task=DEFAULT_TASK.name,
        n_prompts=N,
        group_size=GROUP,
        max_new_tokens=CAP,
        temperature=1.0,
        check_model=False,
    )
    return Validator(cfg, Oracle())


def _check(v: Validator, b: RolloutBatch) -> str:
    return v.check(b, sender=b.submitter, current_step=b.policy_step).reason


@pytest.mark.parametrize("k", range(1, N + 1))
def test_the_first_k_prompts_are_accepted(k: int) -> None:
    groups = _groups(Oracle(), ALICE, 0)
    b = RolloutBatch.decode(_batch(groups[:k]).encode(), vocab_size=128)
    v = _validator()
    assert _check(v, b) == "ok"
    assert v.statistics().accepted_samples == k * GROUP


def test_anything_but_a_prefix_is_rejected() -> None:
    g = _groups(Oracle(), ALICE, 0)
    assert _check(_validator(), _batch([g[1], g[0]])) == "ok"  # order is free, as before
    for groups in ([], [g[1]], [g[0], g[2]], [g[0], g[0]], [*g, g[0]]):
        assert _check(_validator(), _batch(groups)) == "prompt", [x.prompt_index for x in groups]
    # another submitter's prompts, or a group of the wrong size
    assert _check(_validator(), _batch(_groups(Oracle(), BOB, 0)[:1])) == "prompt"
    short = dataclasses.replace(g[0], samples=g[0].samples[:1])
    assert _check(_validator(), _batch([short])) == "prompt"


def test_one_batch_per_submitter_and_step() -> None:
    """The rule: whatever its size, one batch per (submitter, step) is accepted, so no prompt
    of a step is trained on twice; the rest of a cut batch is never submitted."""
    g = _groups(Oracle(), ALICE, 0)
    v = _validator()
    assert _check(v, _batch(g[:2])) == "ok"
    for again in (g[:2], g[:1], g[:3], g, g[2:]):  # the same, a longer one, the rest
        assert _check(v, _batch(again)) == "duplicate"
    # other submitters and other steps are unaffected
    assert _check(v, _batch(_groups(Oracle(), BOB, 0)[:1], submitter=BOB)) == "ok"
    assert _check(v, _batch(_groups(Oracle(), ALICE, 1)[:1], step=1)) == "ok"
    assert v.statistics().accepted_samples == (2 + 1 + 1) * GROUP


def test_a_rejected_partial_batch_does_not_block_an_honest_one() -> None:
    g = _groups(Oracle(), ALICE, 0)
    v = _validator()
    forged = dataclasses.replace(
        g[0], samples=tuple(dataclasses.replace(s, reward=s.reward + 7) for s in g[0].samples)
    )
    assert _check(v, _batch([forged])) == "reward"
    assert _check(v, _batch(g[:1])) == "ok"
    assert _check(v, _batch(g)) == "duplicate"


def test_pack_batch_refuses_what_the_validator_would() -> None:
    g = _groups(Oracle(), ALICE, 0)
    kw: dict[str, Any] = {"peer_id": ALICE, "run_id": "r", "step": 0, "manifest_digest": DIGEST}
    b = pack_batch(g[:2], DEFAULT_TASK, cfg=CFG, **kw)
    assert [x.prompt_index for x in b.groups] == [0, 1]
    assert b.n_prompts == N
    assert len(pack_batch([g[1], g[0]], DEFAULT_TASK, cfg=CFG, **kw).groups) == 2
    for bad in ([], [g[1]], [g[0], g[2]], [g[0], g[0]], [*g, g[0]]):
        with pytest.raises(LocalProtocolError):
            pack_batch(bad, DEFAULT_TASK, cfg=CFG, **kw)
