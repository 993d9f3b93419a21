"""core: what a node knows of one static mirror from its ``/versions`` polls (sans-IO).

A follower (:mod:`shardcast.download.follower`) polls each mirror's ``/versions`` document
(written by :mod:`shardcast.serve.mirror`) and feeds the answer, or the failure, to a
:class:`MirrorPoll`, which says whether what the mirror lists changed and counts failures in
a row for the retry backoff.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shardcast.wire import DIGEST_RE, loads_untrusted

__all__ = ["MirrorPoll"]


@dataclass
class MirrorPoll:
    """What this node knows of one mirror from its ``/versions`` polls (sans-IO).

    Attributes:
        url: the mirror's base URL (its source id).
        steps: the committed steps it listed in its latest valid answer.
        digests: the manifest digest of each listed step (a mirror is a source only of the
            versions ``(step, digest)`` it lists; an older export, without digests, of none).
        heard: Unix time of its latest valid answer (None: never).
        error: why the latest poll failed (None: it answered).
        failures: polls failed in a row (drives the retry backoff).
    """

    url: str
    steps: frozenset[int] = frozenset()
    digests: Mapping[int, str] = field(default_factory=dict)
    heard: float | None = None
    error: str | None = None
    failures: int = 0

    def answered(self, body: bytes, now_unix_s: float) -> bool:
        """Take a ``/versions`` body; returns True if the listed steps changed.

        A body that is not ``{"committed": [int, ...], ...}`` counts as a failed poll (the
        mirror keeps the steps it listed before: they are verified anyway when used).
        """
        try:
            doc = loads_untrusted(body)
            committed = doc["committed"]
            if not isinstance(committed, list) or len(committed) > _MAX_LISTED:
                raise ValueError("committed is not a list of at most 100000 steps")
            steps = frozenset(committed)
            if not all(type(s) is int and 0 <= s < 1 << 62 for s in steps):
                raise ValueError("committed holds something other than step numbers")
            named = doc.get("digests", {})
            if not isinstance(named, dict) or len(named) > _MAX_LISTED:
                raise ValueError("digests is not a map of at most 100000 steps")
            digests = {}
            for key, digest in named.items():
                if not key.isdigit() or not isinstance(digest, str) or not DIGEST_RE.match(digest):
                    raise ValueError("digests must map step numbers to 64-hex digests")
                if int(key) in steps:
                    digests[int(key)] = digest
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self.failed(f"bad versions document: {exc}")
        changed = steps != self.steps or digests != self.digests or self.error is not None
        self.steps, self.digests = steps, digests
        self.heard, self.error, self.failures = now_unix_s, None, 0
        return changed

    def holds(self, step: int, digest: str) -> bool:
        """True if the mirror listed version ``(step, digest)``."""
        return self.digests.get(step) == digest

    def failed(self, error: str) -> bool:
        """A poll failed; returns True if this is the first failure in a row."""
        self.failures += 1
        self.error = error
        return self.failures == 1


_MAX_LISTED = 100_000
