"""Write the committed fuzz corpus: ``python -m tests.fuzz.make_corpus [NAME ...]`` from the repo
root (names: only those decoders' folders, e.g. a new decoder's, leaving the others as they are).

Per decoder (tests/fuzz/corpus/<name>/): its valid seeds, inputs that once broke a decoder
(``regress-*``), and a few deterministic mutations of the seeds. Files are raw decoder input
(text decoders: latin-1 bytes), named by content digest so rewriting is idempotent.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path

import blake3

from tests.fuzz.harness import CBOR_VALUES, JSON_VALUES, Target, mutate_bytes, mutate_tree
from tests.fuzz.targets import BY_NAME, TARGETS

CORPUS = Path(__file__).parent / "corpus"
MUTATIONS_PER_TARGET = 12

REGRESSIONS: dict[str, dict[str, bytes]] = {
    # json.loads raised RecursionError (not a ManifestError / MalformedRunCard)
    "manifest": {"regress-deep-json": b'{"header":' + b"[" * 100_000},
    "manifest-part": {"regress-deep-json": b"[" * 100_000},
    "run-card": {"regress-deep-json": b'{"body":' + b"[" * 10_000},
    # urlsplit raised ValueError ("Invalid IPv6 URL") out of the connection task
    "http-request": {"regress-ipv6-target": b"GET //[x HTTP/1.1\r\nhost: a\r\n\r\n"},
    # parsedate_to_datetime raised OverflowError out of parse_retry_after
    "http-range": {"regress-huge-day": b"Wed, 2" + b"9" * 40 + b" Oct 2015 07:28:00 GMT"},
}


def _write(directory: Path, name: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)


def _raw(target: Target, data: object) -> bytes:
    return data.encode("latin-1") if isinstance(data, str) else bytes(data)  # type: ignore[arg-type]


def main(only: Sequence[str] = ()) -> None:
    """Write the corpus of every decoder, or of the decoders named in ``only``.

    Raises:
        KeyError: a name in ``only`` is not a decoder's.
    """
    for name in only:
        BY_NAME[name]
    for target in TARGETS:
        if only and target.name not in only:
            continue
        directory = CORPUS / target.name
        for data in target.seeds:
            _write(directory, "seed-" + blake3.blake3(data).hexdigest()[:16], data)
        for name, data in REGRESSIONS.get(target.name, {}).items():
            _write(directory, name, data)
        rnd = random.Random(target.name)
        values = JSON_VALUES if target.json_only else CBOR_VALUES
        for i in range(MUTATIONS_PER_TARGET):
            data: bytes | None = None
            if target.trees and i % 2:
                tree, encode = rnd.choice(target.trees)
                try:
                    data = _raw(target, encode(mutate_tree(tree, rnd, values)))
                except Exception:
                    data = None
            if data is None:
                seed = rnd.choice(target.seeds)
                data = mutate_bytes(seed, rnd, target.tokens, target.seeds)
            _write(directory, "mut-" + blake3.blake3(data).hexdigest()[:16], data)
    assert set(REGRESSIONS) <= set(BY_NAME)


if __name__ == "__main__":
    main(sys.argv[1:])
