"""What a node's CPU, disk and engine cost per version: the model's cost model.

Theory of operation
-------------------
The flow model (:mod:`simulations.model`) moves bytes; this module says what a node spends on
them besides the network, in one place, so that a next version (a delta of its base) costs in
the model what it costs a real follower. Every figure is a default of :class:`CostModel`; a
topology's ``[costs]`` table (:class:`simulations.topology.CostsSpec`) overrides them.

Per shard, when its bytes have arrived, a node runs a *check* on one of its ``check_workers``
(the real follower's :func:`shardcast.download.driver.check_limiter`: one worker thread per
core); the shard counts as verified, and is served onward, when its check ends:

- a raw shard (a full version, or a delta version's shard fetched without the base): hash it
  and write it, ``(hash + write) x shard bytes``;
- a delta blob kept as a **chain** (issue 24: the version committed as its base plus the
  verified blobs): hash the blob and write it, ``(hash + write) x blob bytes``: what the change
  costs, not the checkpoint;
- a delta blob **materialized** (today's follower, :func:`shardcast.download.receive.
  verify_and_write`: read the base range, patch it, hash the result, write a full new shard):
  ``hash x blob bytes + materialize x shard bytes``: grows with the checkpoint.

Then the commit: materializing (and a full version) syncs the whole version, ``commit x
version bytes``; a chain writes a manifest and a journal record, ``chain_commit_s``. A peer
then updates its engine: in place from the blobs, ``engine_update x changed elements`` (a
chain), or a reload of the whole checkpoint, ``engine_reload x version bytes`` (a full
version, or a materialized one).

The origin hashes each new version at the topology's ``hash_bytes_per_s``: all of it
(``origin_digest = "rehash"``: a trainer that signs each resulting shard's digest, as today),
or only the change (``"incremental"``: an LtHash-style digest updated from the change, issue
24 item 2; not built: what it would buy).

Not modelled: disk bandwidth (the figures were measured with the page cache holding the
files, so a materializing follower's time is a lower bound), the receive loop's own CPU (it
overlaps the network), memory pressure, and CPU shared between nodes on one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

GB = 1e9


class CommitMode(StrEnum):
    """How a follower commits a delta version (value: the topology's ``costs.commit``)."""

    CHAIN = "chain"  # the verified base plus the verified delta blobs (issue 24)
    MATERIALIZE = "materialize"  # a full new copy of every file, hashed (the follower today)


class OriginDigest(StrEnum):
    """What the origin hashes for a delta version (value: ``costs.origin_digest``)."""

    REHASH = "rehash"  # every byte of the new version
    INCREMENTAL = "incremental"  # only the change (an LtHash-style digest; not built)


@dataclass(frozen=True)
class CostModel:
    """Per-node costs besides the network (see module docstring); all times are seconds on
    one worker, ``_per_gb`` per 10^9 bytes.

    Defaults are measured on the project's 2-core development machine:

    - ``hash_cpu_s_per_gb`` 0.22: BLAKE3 (the ``blake3`` package, one thread) over a 256 MiB
      buffer in memory, measured for this model (0.22 CPU-s/GB; ``bench/datapath.py`` reports
      0.16-0.20 for the hash stage of a full version, ``bench/results/
      issue16-datapath-s8-ext4-held.txt``);
    - ``write_cpu_s_per_gb`` 0.31, ``commit_cpu_s_per_gb`` 0.06: the write and commit stages of
      a full version in that file ("full new": 0.311, 0.065; the next version's commit 0.059);
    - ``materialize_cpu_s_per_gb`` 0.89: the apply stage of a next version in that file
      ("next new": 0.887 CPU-s per GB of checkpoint, 2 % of words changed: read the base
      range, patch it, hash it, write it);
    - ``blob_bytes_per_change`` 1.32: the ``sparse`` blob (zstd-compressed) of ``real-1b``'s
      next version, 13,970,884 bytes for 10,553,620 changed bf16 elements
      (``bench/results/issue24-engine-update.json``; ``bench/results/issue16-deltas.txt``:
      1.48 at 1.755 % changed);
    - ``engine_update_s_per_mchange`` 0.0342: the in-place engine update of that next version
      (same file): 0.361 s wall for 10.55 M changed elements, transformers engine on CPU;
    - ``engine_reload_s_per_gb`` 0.164: that engine's full reload of ``real-1b`` (0.216 s for
      1.319 GB) from the page cache: a lower bound for a peer that reloads from disk;
    - ``chain_commit_s`` 0.05: a chain commit of a 512 MiB file's next version (4.07 MB of
      sparse blobs) took 0.02-0.04 s wall, 0.012-0.017 CPU-s, on this 2-core machine under
      load (issue 24, the chains work); rounded up.

    ``commit`` defaults to ``chain``: the real follower keeps delta versions as chains
    (``DownloadConfig.keep_chains``); ``materialize`` models the follower before issue 24.
    """

    commit: CommitMode = CommitMode.CHAIN
    origin_digest: OriginDigest = OriginDigest.REHASH
    check_workers: int = 2
    element_bytes: int = 2
    blob_bytes_per_change: float = 1.32
    hash_cpu_s_per_gb: float = 0.22
    write_cpu_s_per_gb: float = 0.31
    materialize_cpu_s_per_gb: float = 0.89
    commit_cpu_s_per_gb: float = 0.06
    chain_commit_s: float = 0.05
    engine_update_s_per_mchange: float = 0.0342
    engine_reload_s_per_gb: float = 0.164

    def delta_ratio(self, changed_fraction: float) -> float:
        """Blob bytes per checkpoint byte when ``changed_fraction`` of the elements change
        (at most 1: a delta never moves more than the raw bytes)."""
        return min(1.0, changed_fraction * self.blob_bytes_per_change / self.element_bytes)

    def changed_elements(self, version_bytes: float, delta_ratio: float) -> float:
        """Elements a delta of ``delta_ratio`` (blob bytes / raw bytes) changes."""
        return version_bytes * delta_ratio / self.blob_bytes_per_change

    def check_s(self, received_bytes: float, shard_bytes: float, delta: bool) -> float:
        """One worker's time to check (and keep) one shard once its bytes arrived, seconds.

        Args:
            received_bytes: bytes that arrived (the blob for a delta, else the shard).
            shard_bytes: the shard's raw length.
            delta: the bytes are a delta blob applied to the held base.
        """
        if not delta:
            return (self.hash_cpu_s_per_gb + self.write_cpu_s_per_gb) * shard_bytes / GB
        blob = self.hash_cpu_s_per_gb * received_bytes / GB
        if self.commit is CommitMode.CHAIN:
            return blob + self.write_cpu_s_per_gb * received_bytes / GB
        return blob + self.materialize_cpu_s_per_gb * shard_bytes / GB

    def commit_s(self, version_bytes: float, delta: bool) -> float:
        """Time to commit a version whose shards are all checked, seconds."""
        if delta and self.commit is CommitMode.CHAIN:
            return self.chain_commit_s
        return self.commit_cpu_s_per_gb * version_bytes / GB

    def engine_s(self, version_bytes: float, changed_elements: float, delta: bool) -> float:
        """A peer's time to have the committed version in its engine, seconds: in place from
        the blobs for a chained delta, a full reload otherwise."""
        if delta and self.commit is CommitMode.CHAIN:
            return self.engine_update_s_per_mchange * changed_elements / 1e6
        return self.engine_reload_s_per_gb * version_bytes / GB

    def origin_hash_bytes(self, version_bytes: float, delta_bytes: float, delta: bool) -> float:
        """Bytes the origin hashes before a version's manifest is complete."""
        if delta and self.origin_digest is OriginDigest.INCREMENTAL:
            return delta_bytes
        return version_bytes
