"""A chain of tiny-preset versions committed as sparse deltas, as a follower keeps them (for
the in-place update tests of every engine)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from p2p.identity import Identity
from rollout.delta_plan import read_layout
from rollout.engine import Engine
from rollout.model import build_model, build_tokenizer, tensor_files
from shardcast.publish.plan import Base, build_manifest
from shardcast.store.store import BLOB_DIR, VersionStore
from shardcast.wire import codecs
from shardcast.wire.manifest import MANIFEST_FILE, Manifest
from shardnet.engine_update import HeldVersion, SwapResult, swap_weights
from trainer.checkpoint import save_checkpoint

RUN = "run-inplace"
TRAINER = Identity.from_seed("test-trainer")
SHARD_BYTES = 4096  # many shards, most crossing tensor boundaries


def evolve(src: Path, dst: Path, rng: random.Random, fraction: float, small: bool = False) -> None:
    """Copy a checkpoint, moving ``fraction`` of each tensor's 16-bit words by a random
    non-zero amount, plus the first and last word of every tensor (edge positions). With
    ``small``, each moves by +-1 (one ulp of a bf16, as an RL step does; a zero moves up):
    the weights stay finite, so a kernel's read-back stays exact."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(BLOB_DIR, MANIFEST_FILE))
    for path in tensor_files(dst):
        data = bytearray(path.read_bytes())
        words = np.frombuffer(data, dtype="<u2")
        for t in read_layout(path).tensors:
            lo, hi = t.start // 2, t.end // 2
            picks = sorted({lo, hi - 1, *rng.sample(range(lo, hi), int((hi - lo) * fraction))})
            if small:
                moves = [1 if words[i] & 0x7FFF == 0 else rng.choice((1, 0xFFFF)) for i in picks]
            else:
                moves = [rng.randrange(1, 1 << 16) for _ in picks]
            words[np.array(picks)] += np.array(moves, np.uint16)  # modulo 2**16
        path.write_bytes(data)


def publish(store: VersionStore, directory: Path, step: int, base: Manifest | None) -> Manifest:
    """Commit ``directory`` as ``step``, offering sparse deltas against ``base`` (its blobs
    kept as a follower keeps them)."""
    m = build_manifest(
        directory,
        RUN,
        step,
        TRAINER,
        SHARD_BYTES,
        encodings=(codecs.SPARSE,) if base else (),
        base=Base(base.step, base.digest, store.version_dir(base.step)) if base else None,
        blob_dir=directory / BLOB_DIR,
    )
    store.adopt(directory, m)
    return m


class Chain:
    """Versions 0..n of the tiny preset as sparse deltas in a store."""

    def __init__(
        self, tmp: Path, dtype: torch.dtype, steps: int, seed: int = 0, small: bool = False
    ) -> None:
        self.store = VersionStore(tmp / "store", RUN, keep_last=steps + 2, durable=False)
        rng = random.Random(seed)
        src = tmp / "src-0"
        save_checkpoint(build_model("tiny", seed, torch.float32), build_tokenizer(), src, 1 << 19,
                        dtype=dtype)  # fmt: skip
        self.manifests = [publish(self.store, src, 0, None)]
        for step in range(1, steps + 1):
            nxt = tmp / f"src-{step}"
            evolve(self.store.version_dir(step - 1), nxt, rng, 0.016, small)
            self.manifests.append(publish(self.store, nxt, step, self.manifests[-1]))

    def swap(self, engine: Engine, step: int, held: HeldVersion | None) -> SwapResult:
        return swap_weights(
            engine, self.store, self.manifests[step], self.store.version_dir(step), held
        )


def receive_as_chain(src: VersionStore, m: Manifest, dst: VersionStore) -> None:
    """Commit ``m`` (held in full by ``src``) in ``dst`` as a follower keeps it by default: a
    chain over its base (every offered sparse blob kept, unread), raw shards elsewhere."""
    from shardcast.download.receive import ShardSink, verify_and_write

    part = dst.begin(m, m.header.base_step)
    for ref in m.header.shards:
        entry = m.shard(ref.index)
        if entry.offered(codecs.SPARSE) is not None:
            blob = src.blob_ref(m.step, ref.index, codecs.SPARSE)
            assert blob is not None
            enc, data = codecs.SPARSE, blob.read()
        else:
            enc, data = codecs.RAW, bytes(src.read_shard(m.step, ref.index))
        sink = ShardSink(bytearray(data), len(data))
        sink.advance(len(data))
        verify_and_write(part, entry, enc, sink, None, "test")
    part.commit()
