"""Mutation engine and property check of the decoder fuzz tests (pure, seeded).

A *case* is one call of a decoder on one input. The property (:func:`check`): on any input a
decoder returns, or raises a subclass of :class:`~p2p.errors.ShardnetError`; anything else
(``KeyError``, ``RecursionError``, ``MemoryError``, a library's own exception) is a bug.

Inputs come from three places: random bytes Hypothesis draws, byte-level mutations of valid
encodings (bit flips, interesting integers, deletions, duplications, splices, truncations,
dictionary tokens), and, for structured formats, mutations of the decoded tree (a value
replaced by an interesting one, a key dropped or added, a list grown or emptied) re-encoded,
and re-signed where a signature would otherwise stop the decoder before the parser. Every
mutation is driven by a ``random.Random`` seeded from a Hypothesis draw, so a failure
reproduces from the example Hypothesis prints.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2p.errors import ShardnetError

CASES = Counter[str]()
"""Decoder name → cases run in this process (reported at the end of a fuzz run)."""
SECONDS = Counter[str]()
"""Decoder name → seconds spent in its fuzz tests."""
FUZZED: set[str] = set()
"""Decoders whose fuzz test ran in this process (the end-of-run report lists these)."""

_INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x0A, 0x0D, 0x22, 0x5B, 0x7B, 0x9F, 0xBF)
_INTERESTING_INTS = (
    0,
    1,
    2,
    7,
    8,
    15,
    16,
    255,
    256,
    65535,
    65536,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
)

JSON_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**62,
    2**62 + 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    0.5,
    -0.0,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "a",
    "0" * 64,
    "g" * 64,
    "../x",
    "x" * 300,
    "\u0000",
    "\udcff",
    "é",
    [],
    {},
    [[[[[]]]]],
    {"": None},
    [0] * 50,
)
"""JSON-reachable values a tree mutation substitutes (``json.loads`` produces NaN and
infinities from ``NaN``/``Infinity``)."""
CBOR_VALUES: tuple[Any, ...] = (
    *JSON_VALUES,
    b"",
    b"\x00" * 64,
    b"\xff" * 300,
    2**100,
    -(2**100),
    frozenset(),
    (1, 2),
)
"""CBOR-reachable values (bytes, big integers, sets and tuples as cbor2 decodes them)."""


@dataclass(frozen=True)
class Target:
    """One untrusted decoder under fuzz.

    Attributes:
        name: the decoder's name in reports and corpus folders.
        decode: calls the decoder on one input (bytes, or str for text formats).
        seeds: valid encodings to mutate.
        tokens: dictionary tokens the byte mutator inserts.
        max_random_bytes: size cap of Hypothesis's random inputs.
        text: inputs are ``str`` (decoded latin-1 from the mutated bytes).
        trees: ``(tree, encode)`` pairs: a decoded valid message and a function turning a
            mutated tree back into decoder input (re-signing where needed); empty when the
            format is not a tree.
        json_only: tree values are limited to JSON types.
    """

    name: str
    decode: Callable[[Any], object]
    seeds: Sequence[bytes]
    tokens: Sequence[bytes] = ()
    max_random_bytes: int = 2048
    text: bool = False
    trees: Sequence[tuple[Any, Callable[[Any], Any]]] = ()
    json_only: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


class DecoderBug(AssertionError):
    """A decoder raised something other than a ShardnetError (the fuzz property failed)."""


def check(target: Target, data: Any) -> None:
    """Run ``target``'s decoder on ``data``; fail unless it returns or raises ShardnetError.

    Raises:
        DecoderBug: any other exception, chained, with the input's repr.
    """
    CASES[target.name] += 1
    try:
        target.decode(data)
    except ShardnetError:
        pass
    except (Exception, RecursionError, MemoryError) as exc:
        raise DecoderBug(
            f"{target.name}: {type(exc).__name__}: {exc} on input {data[:400]!r} ({len(data)} long)"
        ) from exc


def as_input(target: Target, raw: bytes) -> Any:
    """Bytes → what the decoder takes (latin-1 text for text targets)."""
    return raw.decode("latin-1") if target.text else raw


def mutate_bytes(
    seed: bytes, rnd: random.Random, tokens: Sequence[bytes], others: Sequence[bytes]
) -> bytes:
    """Apply 1-4 random byte-level mutations to ``seed``."""
    b = bytearray(seed)
    for _ in range(rnd.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rnd.randrange(10)
        pos = rnd.randrange(len(b) + 1)
        if op == 0 and b:  # flip one bit
            p = min(pos, len(b) - 1)
            b[p] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:  # an interesting byte
            b[min(pos, len(b) - 1)] = rnd.choice(_INTERESTING_BYTES)
        elif op == 2:  # an interesting integer, 1-8 bytes, either endianness
            width = rnd.choice((1, 2, 4, 8))
            val = rnd.choice(_INTERESTING_INTS) & ((1 << (8 * width)) - 1)
            b[pos : pos + width] = val.to_bytes(width, rnd.choice(("little", "big")))
        elif op == 3:  # delete a range
            b[pos : pos + rnd.randrange(1, 33)] = b""
        elif op == 4:  # truncate
            del b[pos:]
        elif op == 5 and b:  # duplicate a range elsewhere
            start = rnd.randrange(len(b))
            chunk = b[start : start + rnd.randrange(1, 65)]
            b[pos:pos] = chunk * rnd.choice((1, 2, 16))
        elif op == 6 and tokens:  # a dictionary token
            b[pos:pos] = rnd.choice(tokens)
        elif op == 7 and others:  # splice with another seed
            other = rnd.choice(others)
            cut = rnd.randrange(len(other) + 1)
            b = b[:pos] + bytearray(other[cut:])
        elif op == 8:  # random bytes
            b[pos:pos] = rnd.randbytes(rnd.randrange(1, 17))
        else:  # overwrite a run with one byte
            b[pos : pos + rnd.randrange(1, 9)] = bytes([rnd.choice(_INTERESTING_BYTES)]) * 8
    return bytes(b)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _tweak(value: Any, rnd: random.Random, values: Sequence[Any]) -> Any:
    if isinstance(value, bool) or value is None:
        return rnd.choice(values)
    if isinstance(value, int):
        return rnd.choice((value + 1, value - 1, -value, value * 2**32, rnd.choice(values)))
    if isinstance(value, str) and value:
        i = rnd.randrange(len(value))
        return value[:i] + rnd.choice(("A", "0", "/", " ", "", value[i] * 2)) + value[i + 1 :]
    if isinstance(value, bytes) and value:
        i = rnd.randrange(len(value))
        return value[:i] + bytes([value[i] ^ 0xFF]) + value[i + 1 :]
    return rnd.choice(values)


def mutate_tree(tree: Any, rnd: random.Random, values: Sequence[Any]) -> Any:
    """Apply 1-3 random structural mutations to a copy of a decoded message."""
    tree = _copy(tree)
    for _ in range(rnd.choice((1, 1, 2, 3))):
        paths = _paths(tree)
        path = rnd.choice(paths)
        node = _get(tree, path)
        op = rnd.randrange(6)
        if not path:
            if op == 0:
                tree = rnd.choice(values)
            continue
        parent = _get(tree, path[:-1])
        key = path[-1]
        if op in (0, 1):  # tweak or replace
            parent[key] = _copy(_tweak(node, rnd, values))
        elif op == 2:
            parent[key] = _copy(rnd.choice(values))
        elif op == 3:  # drop the key or item
            del parent[key]
        elif op == 4:  # add a key, or grow a list
            if isinstance(parent, dict):
                parent[rnd.choice(("x", "v", "", str(key) + "_"))] = _copy(rnd.choice(values))
            else:
                parent.insert(key, _copy(node if rnd.random() < 0.5 else rnd.choice(values)))
        else:  # a value from elsewhere in the tree
            parent[key] = _copy(_get(tree, rnd.choice(paths)))
            if _paths_count(tree) > 10_000:
                parent[key] = None
    return tree


def _paths_count(tree: Any) -> int:
    return len(_paths(tree))


def run_cases(target: Target, raw: bytes, rnd_seed: int, variants: int) -> None:
    """One Hypothesis example: ``raw`` itself, then ``variants - 1`` mutations of seeds.

    Mutations alternate between byte-level mutations of a valid encoding and, for tree
    targets, tree mutations re-encoded by the target.
    """
    start = time.perf_counter()
    FUZZED.add(target.name)
    try:
        check(target, as_input(target, raw))
        rnd = random.Random(rnd_seed)
        values = JSON_VALUES if target.json_only else CBOR_VALUES
        for i in range(variants - 1):
            data = None
            if target.trees and i % 2 == 1:
                tree, encode = rnd.choice(target.trees)
                try:
                    data = encode(mutate_tree(tree, rnd, values))
                except Exception:  # the mutated tree has no encoding (NaN in canonical JSON...)
                    pass  # mutate bytes instead
            if data is None:
                seed = rnd.choice(target.seeds)
                data = as_input(target, mutate_bytes(seed, rnd, target.tokens, target.seeds))
            check(target, data)
    finally:
        SECONDS[target.name] += time.perf_counter() - start
