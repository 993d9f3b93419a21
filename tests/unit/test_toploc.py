"""TOPLOC proofs: interoperability vectors (toploc 0.1.6), the TOPLOC.md worked examples,
fail-closed parsing, chunking, tie-breaking, the modulus search and Hypothesis properties."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.errors import ConfigError, LocalProtocolError, VerificationError
from rollout.toploc import (
    FIELD_PRIME,
    NO_MATCH_ERROR,
    ChunkResult,
    Proof,
    ToplocConfig,
    ToplocThresholds,
    ToplocVerdict,
    bf16_bits,
    build_chunk_proof,
    build_proofs,
    chunk_activations,
    decode_proof_base64,
    encode_proof_base64,
    judge,
    parse_proof,
    proof_size_bytes,
    topk_indices,
    verify_chunk,
    verify_proofs,
)
from rollout.toploc_field import evaluate, find_injective_modulus, interpolate

HERE = Path(__file__).resolve()
VECTOR_FILES = ("README.md", "vectors.json", "vectors.safetensors")
SHARED_VECTORS = HERE.parents[3] / "shared" / "toploc-vectors"
COMMITTED_VECTORS = HERE.parents[1] / "data" / "toploc-vectors"
CASES = ("main", "modcollide", "tiny")

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None)

Tensors = dict[str, np.ndarray]
Vectors = tuple[dict[str, Any], Tensors]


def _vector_dir() -> Path:
    override = os.environ.get("SHARDNET_TOPLOC_VECTORS")
    return Path(override) if override else COMMITTED_VECTORS


def _read_safetensors_bf16(path: Path) -> Tensors:
    """Read a safetensors file of BF16 tensors as uint16 bit patterns, without torch."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    base = 8 + header_len
    out: Tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "BF16", name
        start, end = info["data_offsets"]
        data = np.frombuffer(raw[base + start : base + end], dtype="<u2")
        out[name] = data.astype(np.uint16).reshape(info["shape"])
    return out


@pytest.fixture(scope="module")
def vectors() -> Vectors:
    root = _vector_dir()
    meta = json.loads((root / "vectors.json").read_text())
    blob = root / meta["tensors_file"]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == meta["tensors_sha256"]
    return meta, _read_safetensors_bf16(blob)


def _case(vectors: Vectors, name: str) -> dict[str, Any]:
    (case,) = (c for c in vectors[0]["cases"] if c["name"] == name)
    assert isinstance(case, dict)
    return case


def _cfg(case: dict[str, Any]) -> ToplocConfig:
    return ToplocConfig(case["topk"], case["decode_batching_size"], case["skip_prefill"])


def _bf16(values: list[float] | list[list[float]]) -> np.ndarray:
    """bf16 bit patterns of values that are exactly representable in bf16."""
    f32 = np.asarray(values, dtype=np.float32)
    bits32 = f32.view(np.uint32)
    assert not (bits32 & 0xFFFF).any(), "value not exact in bf16"
    return (bits32 >> 16).astype(np.uint16)


def _proof(modulus: int, coeffs: list[int]) -> bytes:
    return np.array([modulus, *coeffs], dtype=">u2").tobytes()


# --- interoperability vectors -------------------------------------------------------------


def test_committed_vectors_match_shared_copy() -> None:
    if not SHARED_VECTORS.is_dir():
        pytest.skip(f"no shared vector folder at {SHARED_VECTORS}")
    for name in VECTOR_FILES:
        assert (COMMITTED_VECTORS / name).read_bytes() == (SHARED_VECTORS / name).read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_vector_proofs_are_byte_identical(vectors: Vectors, name: str) -> None:
    case = _case(vectors, name)
    tensors = vectors[1]
    prefill = tensors.get(case.get("prefill_key", ""))
    proofs = build_proofs(prefill, tensors[case["decode_key"]], _cfg(case))
    assert [p.hex() for p in proofs] == case["proofs_hex"]
    assert [encode_proof_base64(p) for p in proofs] == case["proofs_base64"]
    chunks = chunk_activations(prefill, tensors[case["decode_key"]], _cfg(case))
    for chunk, meta, proof in zip(chunks, case["chunks"], proofs, strict=True):
        assert chunk.size == meta["numel"]
        assert parse_proof(proof, case["topk"]).modulus == meta["modulus"]
        idx = topk_indices(chunk, case["topk"])
        assert idx.tolist() == meta["topk_indices_sorted"]
        assert chunk[idx].tolist() == meta["topk_bf16_bits_by_sorted_index"]


def _verification_params() -> list[tuple[str, str]]:
    meta = json.loads((_vector_dir() / "vectors.json").read_text())
    return [
        (c["name"], v["name"])
        for c in meta["cases"]
        if c["name"] in CASES
        for v in c["verifications"]
    ]


@pytest.mark.parametrize(("name", "verifier"), _verification_params())
def test_vector_verification_matches_tensor_path(
    vectors: Vectors, name: str, verifier: str
) -> None:
    case = _case(vectors, name)
    (check,) = (v for v in case["verifications"] if v["name"] == verifier)
    if "results_cpp_path" in check:
        expected = check["results_cpp_path"]
    else:
        # tiny/identical records only the list path; on identical data with m = p both paths
        # give all zeros, which is what it records.
        expected = check["results_python_path"]
        assert all(r == [0, 0.0, 0.0] for r in expected)
    tensors = vectors[1]
    proofs = [bytes.fromhex(h) for h in case["proofs_hex"]]
    got = verify_proofs(
        tensors.get(check.get("prefill_key", "")), tensors[check["decode_key"]], proofs, _cfg(case)
    )
    assert len(got) == len(expected)
    for result, (exp, mean, median) in zip(got, expected, strict=True):
        assert result.exp_mismatches == exp
        assert result.mant_err_mean == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert result.mant_err_median == pytest.approx(median, rel=1e-12, abs=1e-12)


def test_vector_tiny_coefficients(vectors: Vectors) -> None:
    case = _case(vectors, "tiny")
    for hex_proof, coeffs in zip(case["proofs_hex"], case["coefficients"], strict=True):
        assert parse_proof(bytes.fromhex(hex_proof), 4) == Proof(FIELD_PRIME, tuple(coeffs))


def test_vector_null_proofs_are_rejected(vectors: Vectors) -> None:
    null = bytes.fromhex(_case(vectors, "null")["null_proof_hex"])
    assert null == bytes(258)
    with pytest.raises(VerificationError) as err:
        parse_proof(null, 128)
    assert err.value.reason == "proof_null"
    main = _case(vectors, "main")
    tensors = vectors[1]
    with pytest.raises(VerificationError) as err:
        verify_proofs(tensors["main/prefill"], tensors["main/decode"], [null] * 4, _cfg(main))
    assert err.value.reason == "proof_null"
    assert "chunk 0" in err.value.detail


def test_builder_never_emits_null_proofs_for_non_bf16_input(
    vectors: Vectors,
) -> None:
    # The reference returns null proofs for float32 activations; this builder refuses instead.
    tensors = vectors[1]
    as_f32 = tensors["main/decode"].astype(np.float32)
    with pytest.raises(LocalProtocolError):
        build_proofs(tensors["main/prefill"], as_f32, ToplocConfig())  # type: ignore[arg-type]


def test_vector_judgements(vectors: Vectors) -> None:
    case = _case(vectors, "main")
    tensors = vectors[1]
    proofs = [bytes.fromhex(h) for h in case["proofs_hex"]]

    def judged(prefix: str) -> ToplocVerdict:
        results = verify_proofs(
            tensors[f"{prefix}/prefill"], tensors[f"{prefix}/decode"], proofs, _cfg(case)
        )
        return judge(results)

    assert judged("main").passed
    assert judged("noisy").passed
    other = judged("other")
    assert not other.passed
    assert (other.reason, other.worst_chunk) == ("exp_mismatches", 1)


# --- TOPLOC.md §10 worked example, from the numbers in the spec -------------------------------

TINY_PREFILL = [[0.5, -3.0, 1.25, 0.0], [2.0, -0.75, 6.5, 1.0]]
TINY_COEFFS = (29997, 47451, 52560, 50202)


def test_worked_example_proof() -> None:
    chunk = _bf16(TINY_PREFILL).reshape(-1)
    assert topk_indices(chunk, 4).tolist() == [1, 2, 4, 6]
    assert chunk[[6, 1, 4, 2]].tolist() == [0x40D0, 0xC040, 0x4000, 0x3FA0]
    proof = build_chunk_proof(chunk, 4)
    assert proof.hex() == "ffd9752db95bcd50c41a"
    assert encode_proof_base64(proof) == "/9l1LblbzVDEGg=="
    assert parse_proof(proof, 4) == Proof(65497, TINY_COEFFS)
    coeffs = np.array(TINY_COEFFS)
    assert evaluate(coeffs, np.array([1, 2, 4, 6])).tolist() == [49216, 16288, 16384, 16592]


def test_worked_example_verification_with_drift() -> None:
    seen = _bf16([[0.5, -2.984375, 1.25, 0.0], [1.9921875, -0.75, 6.53125, 1.0]]).reshape(-1)
    result = verify_chunk(seen, bytes.fromhex("ffd9752db95bcd50c41a"), 4)
    assert result == ChunkResult(1, 2 / 3, 1.0)


def test_worked_example_median_is_upper_middle() -> None:
    prover = _bf16([0.125, -4.0, 0.375, 2.5, 1.5, 0.25, -0.625, 3.5])
    proof = build_chunk_proof(prover, 4)
    assert proof.hex() == "ffd96ae7d23f317051c3"
    verifier = _bf16([0.125, -4.0625, 0.375, 2.5, 1.5078125, 0.25, -0.625, 3.53125])
    assert verify_chunk(verifier, proof, 4) == ChunkResult(0, 1.25, 2.0)


def test_worked_example_modulus_search() -> None:
    assert find_injective_modulus(np.array([5, 1000])) == FIELD_PRIME
    assert find_injective_modulus(np.array([1000, 66497])) == 65496
    planted = np.array([1000, 66497, 2000, 67496, 3000, 68495, 7])
    assert find_injective_modulus(planted) == 65494
    chunk = np.zeros(70_000, dtype=np.uint16)
    chunk[planted] = _bf16([3.0, 5.0, -7.0, 9.0, 11.0, -13.0, 15.0])
    proof = build_chunk_proof(chunk, 7)
    assert proof[:2] == b"\xff\xd6"
    coeffs = np.array(parse_proof(proof, 7).coeffs)
    assert evaluate(coeffs, np.array([1003])).tolist() == [chunk[66497]]  # 66497 mod 65494


# --- strict parsing (fail closed) -----------------------------------------------------------

GOOD = _proof(FIELD_PRIME, [1] * 128)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (GOOD[:-1], "proof_malformed"),
        (GOOD + b"\x00", "proof_malformed"),
        (GOOD + b"\x00\x00", "proof_malformed"),
        (b"", "proof_malformed"),
        (b"\xff\xd9", "proof_malformed"),
        (bytes(258), "proof_null"),
        (_proof(0, [7] * 128), "proof_null"),
        (_proof(65498, [1] * 128), "proof_malformed"),
        (_proof(0xFFFF, [1] * 128), "proof_malformed"),
        (_proof(127, [1] * 128), "proof_malformed"),
        (_proof(FIELD_PRIME, [1] * 127 + [FIELD_PRIME]), "proof_malformed"),
        (_proof(FIELD_PRIME, [0xFFFF] + [1] * 127), "proof_malformed"),
    ],
    ids=[
        "short",
        "odd-trailing-byte",
        "extra-pair",
        "empty",
        "modulus-only",
        "null",
        "m0-nonzero-coeffs",
        "m-above-p",
        "m-0xffff",
        "m-below-k",
        "coeff-equals-p",
        "coeff-0xffff",
    ],
)
def test_malformed_proofs_are_rejected(data: bytes, reason: str) -> None:
    with pytest.raises(VerificationError) as err:
        parse_proof(data, 128)
    assert err.value.reason == reason
    chunk = np.arange(300, dtype=np.uint16)
    with pytest.raises(VerificationError) as err:
        verify_chunk(chunk, data, 128)
    assert err.value.reason == reason


def test_boundary_values_are_accepted() -> None:
    assert parse_proof(_proof(128, [FIELD_PRIME - 1] * 128), 128).modulus == 128
    assert parse_proof(bytearray(GOOD), 128).to_bytes() == GOOD
    assert parse_proof(memoryview(GOOD), 128).coeffs == (1,) * 128


def test_parse_rejects_non_bytes() -> None:
    with pytest.raises(LocalProtocolError):
        parse_proof(GOOD.hex(), 128)  # type: ignore[arg-type]


def test_proof_object_with_wrong_k_is_rejected() -> None:
    chunk = np.arange(300, dtype=np.uint16)
    with pytest.raises(VerificationError) as err:
        verify_chunk(chunk, Proof(FIELD_PRIME, (1,) * 4), 5)
    assert err.value.reason == "proof_malformed"


@pytest.mark.parametrize("count", [1, 3, 5])
def test_wrong_proof_count_is_rejected(vectors: Vectors, count: int) -> None:
    case = _case(vectors, "main")
    tensors = vectors[1]
    proofs = [bytes.fromhex(case["proofs_hex"][0])] * count
    with pytest.raises(VerificationError) as err:
        verify_proofs(tensors["main/prefill"], tensors["main/decode"], proofs, _cfg(case))
    assert err.value.reason == "proof_count"
    with pytest.raises(LocalProtocolError):  # one proof's bytes, not a list of proofs
        verify_proofs(tensors["main/prefill"], tensors["main/decode"], proofs[0], _cfg(case))  # type: ignore[arg-type]


def test_base64_round_trip() -> None:
    text = encode_proof_base64(GOOD)
    assert len(text) == 344
    assert not text.endswith("=")
    assert decode_proof_base64(text) == GOOD
    assert decode_proof_base64(text, topk=128) == GOOD
    assert decode_proof_base64("/9l1LblbzVDEGg==", topk=4).hex() == "ffd9752db95bcd50c41a"


@pytest.mark.parametrize(
    "text",
    [
        "/9l1LblbzVDEGg=",  # missing padding
        "/9l1LblbzVDEGg",  # no padding
        "/9l1LblbzVDEGh==",  # non-canonical: nonzero trailing bits
        "/9l1Lblb zVDEGg==",  # whitespace
        "/9l1LblbzVDEGg==\n",  # trailing newline
        "/9l1Lb=bzVDEGg==",  # padding inside
        "/9l1LblbzVDEGg==AAAA",  # data after padding
        "-9l1LblbzVDEGg==",  # urlsafe alphabet
        "/9l1LblbzVDEGg€=",  # non-ASCII
        "",
    ],
)
def test_bad_base64_is_rejected(text: str) -> None:
    with pytest.raises(VerificationError) as err:
        decode_proof_base64(text)
    assert err.value.reason == "proof_base64"


def test_base64_length_is_bounded_by_topk() -> None:
    with pytest.raises(VerificationError) as err:
        decode_proof_base64("A" * 10_000, topk=128)
    assert err.value.reason == "proof_base64"
    with pytest.raises(VerificationError):
        decode_proof_base64(encode_proof_base64(GOOD), topk=4)


# --- chunking and input validation --------------------------------------------------------


def test_chunking_layout(vectors: Vectors) -> None:
    prefill, decode = vectors[1]["main/prefill"], vectors[1]["main/decode"]
    chunks = chunk_activations(prefill, decode, ToplocConfig())
    assert [c.size for c in chunks] == [37 * 256, 32 * 256, 32 * 256, 6 * 256]
    assert np.array_equal(chunks[0], prefill.reshape(-1))
    assert np.array_equal(chunks[2], decode[32:64].reshape(-1))
    skipped = chunk_activations(None, decode, ToplocConfig(skip_prefill=True))
    assert [c.size for c in skipped] == [32 * 256, 32 * 256, 6 * 256]
    empty = np.empty((0, 256), dtype=np.uint16)
    assert [c.size for c in chunk_activations(prefill, empty, ToplocConfig())] == [37 * 256]
    assert chunk_activations(None, empty, ToplocConfig(skip_prefill=True)) == []
    assert len(build_proofs(None, decode[:64], ToplocConfig(skip_prefill=True))) == 2


def test_chunk_with_fewer_than_k_values() -> None:
    with pytest.raises(LocalProtocolError):
        build_chunk_proof(np.arange(127, dtype=np.uint16), 128)
    prefill = _bf16(TINY_PREFILL)
    decode = np.arange(1, 13, dtype=np.uint16).reshape(3, 4)
    with pytest.raises(LocalProtocolError):  # last decode chunk holds 4 values < k = 5
        build_proofs(prefill, decode, ToplocConfig(topk=5, decode_batching_size=2))
    with pytest.raises(VerificationError) as err:
        verify_chunk(np.arange(3, dtype=np.uint16), bytes.fromhex("ffd9752db95bcd50c41a"), 4)
    assert err.value.reason == "chunk_too_small"


@pytest.mark.parametrize(
    ("prefill", "decode", "cfg"),
    [
        (None, np.zeros((2, 4), np.uint16), ToplocConfig(topk=4)),
        (np.zeros((2, 4), np.float32), np.zeros((2, 4), np.uint16), ToplocConfig(topk=4)),
        (np.zeros((2, 4), np.uint16), np.zeros(8, np.uint16), ToplocConfig(topk=4)),
        (np.zeros((2, 4), np.uint16), np.zeros((2, 5), np.uint16), ToplocConfig(topk=4)),
        (None, [[1, 2, 3, 4]], ToplocConfig(topk=4, skip_prefill=True)),
    ],
    ids=["missing-prefill", "float32", "decode-1d", "hidden-mismatch", "list"],
)
def test_bad_activation_arrays(prefill: Any, decode: Any, cfg: ToplocConfig) -> None:
    with pytest.raises(LocalProtocolError):
        chunk_activations(prefill, decode, cfg)


def test_chunk_must_be_flat_uint16() -> None:
    with pytest.raises(LocalProtocolError):
        build_chunk_proof(np.zeros((2, 200), np.uint16), 4)
    with pytest.raises(LocalProtocolError):
        build_chunk_proof(np.zeros(400, np.int16), 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"topk": 0},
        {"topk": FIELD_PRIME + 1},
        {"topk": True},
        {"topk": 128.0},
        {"decode_batching_size": 0},
        {"decode_batching_size": 1.5},
        {"skip_prefill": 1},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ToplocConfig(**kwargs)


def test_proof_size() -> None:
    assert proof_size_bytes(128) == 258
    assert len(build_chunk_proof(np.arange(1000, dtype=np.uint16), 128)) == 258


# --- top-k tie-breaking ---------------------------------------------------------------------


def test_ties_break_by_lowest_index() -> None:
    ones = _bf16([1.0, -1.0] * 150)
    assert topk_indices(ones, 4).tolist() == [0, 1, 2, 3]
    ones[10] = _bf16([2.0])[0]
    ones[250] = _bf16([-2.0])[0]  # sign is ignored: ties with +2.0
    assert topk_indices(ones, 4).tolist() == [0, 1, 10, 250]
    assert topk_indices(ones, 1).tolist() == [10]
    assert build_chunk_proof(ones, 4) == build_chunk_proof(ones.copy(), 4)


def test_nan_ranks_above_infinity() -> None:
    chunk = _bf16([1.0] * 64)
    chunk[5] = 0x7F80  # +inf
    chunk[9] = 0xFFC0  # negative quiet NaN
    assert topk_indices(chunk, 1).tolist() == [9]
    assert topk_indices(chunk, 2).tolist() == [5, 9]


@PROPERTY
@given(
    chunk=st.lists(st.sampled_from([0, 1, 0x3F80, 0xBF80, 0x4000, 0x7F80]), min_size=1),
    k=st.integers(1, 8),
)
def test_topk_matches_sort_by_magnitude_then_index(chunk: list[int], k: int) -> None:
    bits = np.array(chunk, dtype=np.uint16)
    if bits.size < k:
        with pytest.raises(LocalProtocolError):
            topk_indices(bits, k)
        return
    expected = sorted(range(len(chunk)), key=lambda i: (-(chunk[i] & 0x7FFF), i))[:k]
    assert topk_indices(bits, k).tolist() == sorted(expected)


# --- GF(p) field math and the modulus search ------------------------------------------------


def _lagrange_reference(xs: list[int], ys: list[int]) -> list[int]:
    """Slow, obviously-correct Lagrange interpolation over GF(p) in pure Python."""
    p, k = FIELD_PRIME, len(xs)
    total = [0] * k
    for j in range(k):
        basis, denom = [1], 1
        for m in range(k):
            if m != j:
                basis = [
                    ((basis[i - 1] if i else 0) - xs[m] * (basis[i] if i < len(basis) else 0)) % p
                    for i in range(len(basis) + 1)
                ]
                denom = denom * (xs[j] - xs[m]) % p
        scale = ys[j] * pow(denom, p - 2, p) % p
        total = [(t + scale * b) % p for t, b in zip(total, basis, strict=True)]
    return total


@PROPERTY
@given(
    xs=st.lists(st.integers(0, FIELD_PRIME - 1), min_size=1, max_size=24, unique=True),
    data=st.data(),
)
def test_interpolation_matches_lagrange_and_evaluates_back(xs: list[int], data: Any) -> None:
    ys = data.draw(st.lists(st.integers(0, FIELD_PRIME - 1), min_size=len(xs), max_size=len(xs)))
    coeffs = interpolate(np.array(xs), np.array(ys))
    assert coeffs.tolist() == _lagrange_reference(xs, ys)
    assert evaluate(coeffs, np.array(xs)).tolist() == ys


def test_field_math_rejects_bad_input() -> None:
    with pytest.raises(LocalProtocolError):
        interpolate(np.array([1, 1]), np.array([2, 3]))
    with pytest.raises(LocalProtocolError):
        interpolate(np.array([1, FIELD_PRIME]), np.array([2, 3]))
    with pytest.raises(LocalProtocolError):
        evaluate(np.array([1, 2]), np.array([-1]))
    with pytest.raises(LocalProtocolError):
        find_injective_modulus(np.array([3, 3]))


@PROPERTY
@given(st.lists(st.integers(0, 400_000), min_size=1, max_size=12, unique=True))
def test_modulus_is_the_largest_injective(indices: list[int]) -> None:
    m = find_injective_modulus(np.array(indices))
    assert len({i % m for i in indices}) == len(indices)
    for larger in range(m + 1, FIELD_PRIME + 1):
        assert len({i % larger for i in indices}) < len(indices)


def test_modulus_search_with_dense_collisions() -> None:
    # Differences p, p-1, …, p-69 from the first index rule out every m in (p - 70, p].
    base = 100_000
    idx = [base] + [base + FIELD_PRIME - d for d in range(70)]
    m = find_injective_modulus(np.array(idx))
    assert m == FIELD_PRIME - 70
    assert len({i % m for i in idx}) == len(idx)


# --- end-to-end properties ------------------------------------------------------------------


def _no_reduced_nan(bits: np.ndarray) -> np.ndarray:
    # Negative NaNs with bits >= p are reduced mod p and cannot round-trip (TOPLOC.md §4.3).
    return np.where(bits >= FIELD_PRIME, bits & 0x7FFF, bits).astype(np.uint16)


@PROPERTY
@given(
    raw=st.lists(st.integers(0, 0xFFFF), min_size=32, max_size=400),
    k=st.integers(1, 32),
)
def test_round_trip_on_identical_data(raw: list[int], k: int) -> None:
    chunk = _no_reduced_nan(np.array(raw, dtype=np.uint16))
    proof = build_chunk_proof(chunk, k)
    assert verify_chunk(chunk, proof, k) == ChunkResult(0, 0.0, 0.0)
    parsed = parse_proof(proof, k)
    idx = topk_indices(chunk, k)
    assert evaluate(np.array(parsed.coeffs), idx % parsed.modulus).tolist() == chunk[idx].tolist()


@PROPERTY
@given(
    planted=st.lists(st.integers(0, 200_000), min_size=8, max_size=8, unique=True),
    values=st.lists(st.integers(0x4000, 0x7F7F), min_size=8, max_size=8),
)
def test_round_trip_beyond_the_field(planted: list[int], values: list[int]) -> None:
    chunk = np.zeros(200_001, dtype=np.uint16)
    chunk[planted] = values
    proof = build_chunk_proof(chunk, 8)
    parsed = parse_proof(proof, 8)
    assert parsed.modulus == find_injective_modulus(np.array(planted))
    assert verify_chunk(chunk, proof, 8) == ChunkResult(0, 0.0, 0.0)
    idx = np.array(planted)
    assert evaluate(np.array(parsed.coeffs), idx % parsed.modulus).tolist() == values


def test_unrelated_data_fails() -> None:
    rng = np.random.default_rng(7)
    prover = (rng.standard_normal(8192).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    other = (rng.standard_normal(8192).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    result = verify_chunk(other, build_chunk_proof(prover, 128), 128)
    assert result.exp_mismatches > 100
    assert not judge([result]).passed


@PROPERTY
@given(st.one_of(st.binary(max_size=20), st.binary(min_size=10, max_size=10)))
def test_parse_accepts_exactly_the_well_formed(data: bytes) -> None:
    fields = [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data) - 1, 2)]
    well_formed = (
        len(data) == 10 and 4 <= fields[0] <= FIELD_PRIME and max(fields[1:]) < FIELD_PRIME
    )
    if well_formed:
        assert parse_proof(data, 4).to_bytes() == data
        return
    with pytest.raises(VerificationError) as err:
        parse_proof(data, 4)
    null = len(data) == 10 and fields[0] == 0
    assert err.value.reason == ("proof_null" if null else "proof_malformed")


# --- judging --------------------------------------------------------------------------------

ZERO = ChunkResult(0, 0.0, 0.0)


def test_judge_thresholds_are_inclusive() -> None:
    limits = ToplocThresholds()
    assert (limits.max_exp_mismatches, limits.max_mant_err_mean) == (38, 10.0)
    assert limits.max_mant_err_median == 8.0
    verdict = judge([ZERO, ChunkResult(38, 10.0, 8.0)])
    assert (verdict.passed, verdict.reason, verdict.worst_chunk) == (True, "ok", None)
    assert verdict.results == (ZERO, ChunkResult(38, 10.0, 8.0))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (ChunkResult(39, 0.0, 0.0), "exp_mismatches"),
        (ChunkResult(0, 10.5, 0.0), "mant_err_mean"),
        (ChunkResult(0, 1.0, 9.0), "mant_err_median"),
        (ChunkResult(128, NO_MATCH_ERROR, NO_MATCH_ERROR), "exp_mismatches"),
        (ChunkResult(3, NO_MATCH_ERROR, NO_MATCH_ERROR), "mant_err_mean"),
    ],
)
def test_judge_rejects_each_limit(bad: ChunkResult, reason: str) -> None:
    verdict = judge([ZERO, bad, ZERO])
    assert (verdict.passed, verdict.reason, verdict.worst_chunk) == (False, reason, 1)


def test_judge_picks_worst_chunk_and_fails_closed_on_nothing() -> None:
    results = [ChunkResult(0, 11.0, 0.0), ChunkResult(50, 0.0, 0.0), ChunkResult(50, 2.0, 0.0)]
    verdict = judge(results)
    assert (verdict.reason, verdict.worst_chunk) == ("exp_mismatches", 2)
    assert judge([]).reason == "no_chunks"
    assert not judge([]).passed
    loose = ToplocThresholds(max_exp_mismatches=60, max_mant_err_mean=40, max_mant_err_median=40)
    assert judge(results, loose).passed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_exp_mismatches": -1},
        {"max_exp_mismatches": 1.5},
        {"max_mant_err_mean": -0.1},
        {"max_mant_err_median": math.nan},
        {"max_mant_err_mean": "10"},
    ],
)
def test_threshold_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ToplocThresholds(**kwargs)


# --- torch boundary -------------------------------------------------------------------------


def test_module_does_not_import_torch() -> None:
    code = "import sys, rollout.toploc; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bf16_bits_from_torch() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([[1.0, -2.0], [0.5, 6.5]], dtype=torch.bfloat16)
    bits = bf16_bits(tensor)
    assert bits.dtype == np.uint16
    assert bits.tolist() == [[0x3F80, 0xC000], [0x3F00, 0x40D0]]
    assert bf16_bits(tensor.t()).tolist() == [[0x3F80, 0x3F00], [0xC000, 0x40D0]]
    with pytest.raises(LocalProtocolError):
        bf16_bits(tensor.float())
    with pytest.raises(LocalProtocolError):
        bf16_bits(np.zeros(2, np.uint16))  # type: ignore[arg-type]
