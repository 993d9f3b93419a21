"""Published versions as the model sees them, and stand-ins for the catch-up planner.

A :class:`SimVersion` is one published step: shard lengths (one file cut into
``shard_size_bytes`` pieces, as :mod:`shardcast.publish.plan` cuts each file), the delta base,
when the origin published it and hashed each manifest part, and a digest. A delta version
(base set) moves ``ceil(delta_ratio * length)`` bytes per shard (``delta_ratio`` from the
topology: given, or from ``changed_fraction`` and the cost model's bytes per change) to a node
that holds the base, the raw length otherwise — what
:class:`~shardcast.download.downloader.Downloader` fetches as a delta.

:func:`manifest_stub` gives :func:`shardcast.core.catchup.plan` the few manifest attributes it reads
(``step``, ``digest``, ``complete``, ``total_bytes``, ``header.base_step``,
``header.base_digest``, ``header.shards``, ``shard(i).length``, ``shard(i).offered(enc)``), so
the model plans catch-ups with the real planner without signing real manifests;
:func:`announcement_stub` gives a :class:`~shardcast.core.tracker.VersionTracker` the announcement
of a version (unsigned: the tracker takes announcements already verified).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import blake3

from shardcast.wire import SPARSE, VersionAnnouncement
from simulations.topology import CheckpointSpec


def shard_token(run: str, step: int, index: int) -> int:
    """A 64-bit stand-in for the content digest of one shard (what verification compares)."""
    return int.from_bytes(blake3.blake3(f"{run}:{step}:{index}".encode()).digest()[:8], "big")


@dataclass
class SimVersion:
    """One published version (see module docstring)."""

    run: str
    step: int
    lengths: list[int]
    base: int | None
    t_pub: float
    delta_ratio: float
    shards_per_part: int
    digest: str
    tokens: list[int] = field(default_factory=list)
    part_time: list[float] = field(default_factory=list)
    listeners: list[Any] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        run: str,
        step: int,
        ck: CheckpointSpec,
        base: int | None,
        t_pub: float,
        delta_ratio: float,
    ) -> SimVersion:
        """Cut ``ck.size_bytes`` into shards; the digest is the XOR of the shard tokens.
        ``delta_ratio``: blob bytes per raw byte of a delta (the topology's
        :attr:`~simulations.topology.TopologyFile.delta_ratio`)."""
        n = math.ceil(ck.size_bytes / ck.shard_size_bytes)
        lengths = [ck.shard_size_bytes] * (n - 1)
        lengths.append(ck.size_bytes - ck.shard_size_bytes * (n - 1))
        tokens = [shard_token(run, step, i) for i in range(n)]
        acc = 0
        for t in tokens:
            acc ^= t
        return cls(
            run,
            step,
            lengths,
            base,
            t_pub,
            delta_ratio,
            ck.shards_per_part,
            f"{acc:016x}",
            tokens,
        )

    @property
    def n_parts(self) -> int:
        """Signed manifest parts."""
        return math.ceil(len(self.lengths) / self.shards_per_part)

    @property
    def total_bytes(self) -> int:
        """Raw bytes of the version."""
        return sum(self.lengths)

    @functools.cached_property
    def offered_bytes(self) -> int:
        """Bytes a follower holding the base fetches (each shard's delta blob, or its raw
        bytes): what super-seeding's small-version rule weighs
        (:func:`shardcast.serve.server.offered_bytes`)."""
        return sum(self.enc_len(i, True) for i in range(len(self.lengths)))

    def part_range(self, k: int) -> range:
        """Shard indices described by part ``k``."""
        return range(
            k * self.shards_per_part, min(len(self.lengths), (k + 1) * self.shards_per_part)
        )

    def enc_len(self, i: int, use_base: bool) -> int:
        """Bytes a download of shard ``i`` moves."""
        if use_base and self.base is not None and self.delta_ratio < 1:
            return max(1, math.ceil(self.lengths[i] * self.delta_ratio))
        return self.lengths[i]


@dataclass(frozen=True)
class _Offered:
    size: int
    encoding: str = SPARSE


@dataclass(frozen=True)
class _Shard:
    length: int
    delta_size: int | None

    def offered(self, encoding: str) -> _Offered | None:
        return self.delta() if encoding == SPARSE else None

    def delta(self) -> _Offered | None:
        return _Offered(self.delta_size) if self.delta_size is not None else None


@dataclass(frozen=True)
class _Header:
    base_step: int | None
    base_digest: str | None
    shards: tuple[int, ...]


@dataclass(frozen=True)
class ManifestStub:
    """The manifest attributes :func:`shardcast.core.catchup.plan` reads."""

    step: int
    digest: str
    total_bytes: int
    header: _Header
    _shards: tuple[_Shard, ...]
    complete: bool = True

    def shard(self, i: int) -> _Shard:
        """Shard entry ``i``."""
        return self._shards[i]


def manifest_stub(v: SimVersion, base_digest: str | None = None) -> ManifestStub:
    """A stand-in manifest of ``v`` (``base_digest``: the digest of its base version)."""
    shards = tuple(
        _Shard(ln, v.enc_len(i, True) if v.base is not None else None)
        for i, ln in enumerate(v.lengths)
    )
    return ManifestStub(
        v.step,
        v.digest,
        v.total_bytes,
        _Header(v.base, base_digest, tuple(range(len(shards)))),
        shards,
    )


def announcement_stub(v: SimVersion) -> VersionAnnouncement:
    """The trainer's announcement of ``v``, unsigned (what a tracker reads: run, step, digest)."""
    return VersionAnnouncement(v.run, v.step, v.digest, (), "sim-trainer", b"")
