"""The trainer's half of the origin: hash and delta-encode each version from the tensors it holds.

Theory of operation
-------------------
After an optimizer step the trainer holds the new weights (cast to the published dtype for
writing) and keeps, from its previous publish, the tensors of that version. Instead of writing
the files and then diffing them against the previous version's files (re-reading both from
disk on the critical path), :class:`TensorEncoder` hashes and encodes every weight file from
those tensors (:func:`shardcast.publish.pre_encode_bytes`) in a worker thread while another
thread writes the files. ``Origin.publish(..., pre_encoded=...)`` then signs the parts of those
files at once and reads only the small files (config, tokenizer).

Exactness: the blobs and digests come from the same code as the file path
(:func:`shardcast.publish.encode.encode_views`) fed the same bytes: each file's bytes are its
predicted safetensors header followed by the tensors at the header's offsets, and a result is
used only if the header on disk equals the predicted one (:func:`usable`). The delta base is
the previous version *this process published* (:attr:`TensorEncoder.previous`), the same bytes
as the base in the store; after a restart there is none, so the first version's deltas come
from the files as before. Memory: one extra copy of the published weights (bf16: a quarter of
the fp32 master weights), held until the next publish.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardcast.publish import (
    ENCODE_WORKERS,
    Base,
    EncodeSettings,
    FileBytes,
    PreEncoded,
    header_matches,
    pre_encode_bytes,
)

log = logging.getLogger(__name__)

__all__ = ["ENCODE_WORKERS", "Layouts", "TensorEncoder", "usable"]


@dataclass(frozen=True)
class Layouts:
    """A version's weight files as held in memory.

    Attributes:
        step: the version.
        files: file name -> its bytes (:func:`trainer.checkpoint.file_bytes`).
        headers: file name -> its predicted safetensors header (length prefix and JSON).
    """

    step: int
    files: Mapping[str, FileBytes]
    headers: Mapping[str, bytes]


class TensorEncoder:
    """Encodes each version's weight files from memory against the previous one (module
    docstring), shards on ``workers`` threads. Not safe to call concurrently; :meth:`encode`
    blocks (run it in a thread)."""

    def __init__(self, workers: int = ENCODE_WORKERS) -> None:
        self.previous: Layouts | None = None
        self.workers = workers

    def base_for(self, base: Base | None) -> Mapping[str, FileBytes] | None:
        """The previous version's files if they are ``base`` (None: no delta wanted, or the
        base is not the version held: ``encode`` then leaves the weight files to the disk
        path). Pure."""
        if base is None or self.previous is None or self.previous.step != base.step:
            return None
        return self.previous.files

    def encode(
        self, layouts: Layouts, settings: EncodeSettings, base: Base | None, cache_dir: Path
    ) -> dict[str, PreEncoded]:
        """Hash and encode every file of ``layouts`` with ``settings`` against ``base``, blobs
        into ``cache_dir``; empty if ``base`` is wanted but not held (see :meth:`base_for`).

        Raises:
            OSError: a blob cannot be written.
        """
        old = self.base_for(base)
        if base is not None and old is None:
            # after a restart: the base's tensors are no longer in memory; the origin then
            # encodes the delta from the files (the standalone path), as before
            log.info(
                "tensor_encode_skipped step=%d reason=base_not_in_memory fallback=file_diff",
                layouts.step,
            )
            return {}
        return {
            name: pre_encode_bytes(
                f, None if old is None else old.get(name), settings, cache_dir, self.workers
            )
            for name, f in sorted(layouts.files.items())
        }

    def published(self, layouts: Layouts) -> None:
        """``layouts`` is the version just published: the next one's delta base."""
        self.previous = layouts


def usable(
    directory: Path, layouts: Layouts, results: Mapping[str, PreEncoded]
) -> dict[str, PreEncoded]:
    """The results whose file in ``directory`` begins with the predicted header (reads only the
    headers); a file whose header differs is logged and left to the disk path.

    Raises:
        OSError: a file cannot be read.
    """
    out = {}
    for name, pre in results.items():
        if header_matches(directory / name, layouts.headers[name]):
            out[name] = pre
        else:
            log.warning("tensor_encode_unused step=%d file=%s reason=header", layouts.step, name)
    return out
