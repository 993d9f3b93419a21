"""Fuzz every untrusted decoder: only typed errors, bounded memory, on any input.

Run with ``pytest -m fuzz`` (excluded from the default suite). ``SHARDNET_FUZZ_CASES`` sets the
cases per decoder (default 100,000); each Hypothesis example runs ``VARIANTS`` cases (its own
random bytes, then mutations of valid encodings driven by a seed it drew), so Hypothesis's
example count is ``cases / VARIANTS``. The run is deterministic (``derandomize``) unless
``SHARDNET_FUZZ_RANDOM=1``. The committed corpus (tests/fuzz/corpus) replays in the default
suite (test_corpus.py).
"""

from __future__ import annotations

import math
import os
import resource

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz.harness import CASES, Target, run_cases
from tests.fuzz.targets import TARGETS

pytestmark = pytest.mark.fuzz

CASES_PER_DECODER = int(os.environ.get("SHARDNET_FUZZ_CASES", "100000"))
VARIANTS = 8
RSS_GROWTH_BOUND_BYTES = 256 << 20
"""Peak resident memory a decoder's whole fuzz run may add (inputs are at most a few KiB)."""


def _settings() -> settings:
    return settings(
        max_examples=math.ceil(CASES_PER_DECODER / VARIANTS),
        deadline=None,
        database=None,
        derandomize=os.environ.get("SHARDNET_FUZZ_RANDOM") != "1",
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_decoder_raises_only_typed_errors(target: Target) -> None:
    before_cases, before_rss = CASES[target.name], _max_rss_bytes()

    @_settings()
    @given(raw=st.binary(max_size=target.max_random_bytes), rnd_seed=st.integers(0, 2**32))
    def fuzz(raw: bytes, rnd_seed: int) -> None:
        run_cases(target, raw, rnd_seed, VARIANTS)

    fuzz()
    ran = CASES[target.name] - before_cases
    assert ran >= CASES_PER_DECODER, f"{target.name}: only {ran} cases ran"
    grown = _max_rss_bytes() - before_rss
    assert grown < RSS_GROWTH_BOUND_BYTES, f"{target.name}: peak RSS grew {grown >> 20} MiB"
