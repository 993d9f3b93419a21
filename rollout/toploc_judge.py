"""Per-chunk TOPLOC statistics and the acceptance policy applied to them (TOPLOC.md §6, §9).

:class:`ChunkResult` carries the three error statistics that verification produces for one
chunk; :func:`judge` turns a rollout's results into a :class:`ToplocVerdict` under
:class:`ToplocThresholds`. A chunk passes when each statistic is at or below its limit; a rollout
passes when every chunk passes. Judging fails closed: a rollout with no chunks is rejected. The
production "forgiveness" rule reported for INTELLECT-2 (some chunks may exceed the exponent
limit) is deliberately not implemented (TOPLOC.md §9: second-hand, unverified).

Pure functions over frozen dataclasses; thread-safe.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from p2p.errors import ConfigError

__all__ = [
    "NO_MATCH_ERROR",
    "ChunkResult",
    "ToplocReason",
    "ToplocThresholds",
    "ToplocVerdict",
    "judge",
]

#: Mantissa error reported when no selected position has a matching exponent (TOPLOC.md §6.6).
NO_MATCH_ERROR = float(2**64)


@dataclass(frozen=True)
class ChunkResult:
    """Verification statistics of one chunk (TOPLOC.md §6); each measures an error.

    Attributes:
        exp_mismatches: selected positions whose bf16 exponent differs, ``0 .. k``.
        mant_err_mean: mean ``|M(claimed) - M(mine)|`` over exponent matches, in mantissa ulps
            (``0 .. 127``), or ``2**64`` if no exponent matched.
        mant_err_median: element ``n // 2`` of the sorted mantissa errors, or ``2**64``.
    """

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float


@dataclass(frozen=True)
class ToplocThresholds:
    """Per-chunk acceptance limits; a chunk passes when every statistic is at or below its limit.

    Defaults are the TOPLOC paper's (arXiv 2501.16007; ``toploc-experiments``
    ``vllm_validate_poly.py``: ``TEXP = 90`` exponent *matches*, ``TMEAN = 10``, ``TMEDIAN = 8``),
    for ``k = 128`` values per chunk, restated as mismatches (128 − 90 = 38) in TOPLOC.md §9.
    INTELLECT-2's production validator reportedly used much looser limits (60 / 40 / 40, with
    "forgiven" exponent failures); those numbers are second-hand and unverified (TOPLOC.md §9).
    Calibrate on the project's own prover/verifier pair, and scale with ``k`` if it differs.

    Attributes:
        max_exp_mismatches: most exponent mismatches allowed per chunk (of ``k``), ``>= 0``.
        max_mant_err_mean: largest mean mantissa error allowed, in mantissa ulps, ``>= 0``.
        max_mant_err_median: largest median mantissa error allowed, in mantissa ulps, ``>= 0``.

    Raises:
        ConfigError: a field is negative, NaN or of the wrong type.
    """

    max_exp_mismatches: int = 38
    max_mant_err_mean: float = 10.0
    max_mant_err_median: float = 8.0

    def __post_init__(self) -> None:
        e = self.max_exp_mismatches
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ConfigError("toploc.max_exp_mismatches", f"must be an int >= 0, got {e!r}")
        for name in ("max_mant_err_mean", "max_mant_err_median"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"toploc.{name}", f"must be a number >= 0, got {value!r}")


class ToplocReason(enum.StrEnum):
    """How :func:`judge` decided (the value is the log string)."""

    OK = "ok"  # every chunk within every limit
    NO_CHUNKS = "no_chunks"  # nothing was proven
    EXP_MISMATCHES = "exp_mismatches"  # too many exponent mismatches in the worst chunk
    MANT_ERR_MEAN = "mant_err_mean"  # mean mantissa error over its limit
    MANT_ERR_MEDIAN = "mant_err_median"  # median mantissa error over its limit


@dataclass(frozen=True)
class ToplocVerdict:
    """Outcome of :func:`judge` for one rollout.

    Attributes:
        passed: every chunk met every threshold (and there was at least one chunk).
        reason: :attr:`ToplocReason.OK`, :attr:`ToplocReason.NO_CHUNKS`, or the first limit
            the worst chunk broke.
        worst_chunk: index of the worst failing chunk (most exponent mismatches, then highest
            mean, then highest median, then lowest index); ``None`` when passed or no chunks.
        results: the per-chunk results that were judged.
    """

    passed: bool
    reason: ToplocReason
    worst_chunk: int | None
    results: tuple[ChunkResult, ...]


def _violation(result: ChunkResult, limits: ToplocThresholds) -> ToplocReason | None:
    if result.exp_mismatches > limits.max_exp_mismatches:
        return ToplocReason.EXP_MISMATCHES
    if not result.mant_err_mean <= limits.max_mant_err_mean:
        return ToplocReason.MANT_ERR_MEAN
    if not result.mant_err_median <= limits.max_mant_err_median:
        return ToplocReason.MANT_ERR_MEDIAN
    return None


def judge(
    results: Sequence[ChunkResult], thresholds: ToplocThresholds | None = None
) -> ToplocVerdict:
    """Accept a rollout only if every chunk is within ``thresholds`` (fails closed).

    Args:
        results: per-chunk results from :func:`verify_proofs`.
        thresholds: limits; the paper's defaults if ``None``.

    Returns:
        A :class:`ToplocVerdict`. An empty ``results`` is rejected with
        :attr:`ToplocReason.NO_CHUNKS`: nothing was proven.
    """
    limits = thresholds if thresholds is not None else ToplocThresholds()
    frozen = tuple(results)
    if not frozen:
        return ToplocVerdict(False, ToplocReason.NO_CHUNKS, None, frozen)
    failing = [
        (n, r, reason)
        for n, r in enumerate(frozen)
        if (reason := _violation(r, limits)) is not None
    ]
    if not failing:
        return ToplocVerdict(True, ToplocReason.OK, None, frozen)
    n, _, reason = max(
        failing,
        key=lambda f: (f[1].exp_mismatches, f[1].mant_err_mean, f[1].mant_err_median, -f[0]),
    )
    return ToplocVerdict(False, reason, n, frozen)
