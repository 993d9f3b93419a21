"""The untrusted decoders under fuzz, each with valid seed encodings (deterministic).

Every decoder here reads bytes a remote node chose: signed envelopes (p2p/envelope.py, under
which every signed message travels), manifests and parts (new and old formats; from the origin
or a relay), version announcements, node info and adverts (gossip, info protocol), run cards,
rollout batches and their announcements (from peers), TOPLOC proofs, shard codecs (zstd,
xor-zstd, sparse; the bytes are only checked against their digest *after* decoding), the HTTP
request head and the Range, Content-Range and Retry-After headers, and the safetensors header
of a received checkpoint.
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import torch
from safetensors.torch import save as save_safetensors

from p2p import envelope
from p2p.envelope import ANY_SIGNER, Kind
from p2p.errors import ShardnetError
from p2p.http_range import (
    ByteRange,
    SuffixRange,
    parse_content_range,
    parse_range,
    parse_retry_after,
    resolve_range,
)
from p2p.http_server import parse_request_head
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.model import read_tensor_shapes
from rollout.schema import Group, RolloutAnnouncement, RolloutBatch, Sample
from rollout.toploc_codec import decode_proof_base64, encode_proof_base64, parse_proof
from shardcast.download.discovery import NodeAdvert
from shardcast.wire import codecs
from shardcast.wire.canonical import canonical_json
from shardcast.wire.finish import RunContinued, RunFinished, decode_versions_message
from shardcast.wire.manifest import (
    HEADER_DOMAIN,
    PART_DOMAIN,
    Encoded,
    FileEntry,
    Header,
    Manifest,
    Part,
    decode_part,
    sign_header,
    sign_part,
)
from shardcast.wire.messages import NodeInfo, VersionAnnouncement
from shardcast.wire.runcard import (
    CARD_DOMAIN,
    EngineSpec,
    RunCard,
    SamplingRules,
    SignedRunCard,
    TaskSpec,
    sign_card,
)
from shardcast.wire.sparse import decode_sparse, encode_sparse
from tests.fuzz.harness import Target

TRAINER = Identity.from_seed("fuzz-trainer")
PEER = Identity.from_seed("fuzz-peer")
TRUST = TrustList(trainer=TRAINER.peer_id)
RUN = "run-fuzz"
VOCAB = 128
TOPK = 8
_rng = random.Random(15)


def _all(*calls: Callable[[], object]) -> None:
    """Run every call; re-raise the first ShardnetError after all ran (others propagate)."""
    first: ShardnetError | None = None
    for call in calls:
        try:
            call()
        except ShardnetError as exc:
            first = first or exc
    if first is not None:
        raise first


def _cbor(tree: Any) -> bytes:
    return cbor2.dumps(tree, canonical=True)


def _json(tree: Any) -> bytes:
    return json.dumps(tree, allow_nan=True).encode()


def _seal_json(kind: Kind, body: Any, identity: Identity) -> str:
    """Seal a (mutated) JSON body so that the parser behind the signature check sees it,
    base64 as documents carry it; a body without a canonical form is sealed as its repr."""
    try:
        raw = canonical_json(body)
    except (TypeError, ValueError, RecursionError):
        raw = repr(body).encode()[:4096]
    return base64.b64encode(envelope.seal(kind, raw, identity.key)).decode()


def _seal_cbor(kind: Kind, identity: Identity) -> Callable[[Any], bytes]:
    def encode(tree: Any) -> bytes:
        return envelope.seal(kind, _cbor(tree), identity.key)

    return encode


def _resign(env: Any, domain: str, identity: Identity) -> None:
    """Re-sign an old-format JSON envelope's (mutated) body in place so that the parser behind
    the signature check sees it; bodies without a canonical form keep their old signature."""
    if isinstance(env, dict) and "body" in env:
        try:
            env["signature"] = identity.sign(domain, canonical_json(env["body"])).hex()
        except (TypeError, ValueError, RecursionError):
            pass


# --- manifests -----------------------------------------------------------------------------


def _digest() -> str:
    return _rng.randbytes(32).hex()


def _manifest(base: bool) -> Manifest:
    files = (FileEntry("a.safetensors", 3000), FileEntry("b.bin", 1000), FileEntry("c", 0))
    header = Header(
        RUN,
        7 if base else 3,
        1024,
        files,
        3,
        base_step=3 if base else None,
        base_digest=_digest() if base else None,
        nonce=_rng.randbytes(16).hex(),
    )
    m = Manifest(sign_header(header, TRAINER))
    for k in range(header.n_parts):
        rng = header.part_range(k)
        encs = []
        for i in rng:
            offered = [Encoded(codecs.ZSTD, 500 + i, _digest())]
            if base:
                offered.append(Encoded(codecs.XOR_ZSTD, 40 + i, _digest()))
            encs.append(tuple(offered))
        part = Part(
            RUN,
            header.step,
            header.digest(),
            k,
            tuple(_digest() for _ in rng),
            tuple(encs),
            tuple((n, _digest()) for n in header.files_ending_in(k)),
        )
        m.add_part(sign_part(part, TRAINER))
    return m


MANIFESTS = (_manifest(False), _manifest(True))


def _legacy_env(body: bytes, domain: str) -> dict[str, Any]:
    sig = TRAINER.sign(domain, body)
    return {"body": json.loads(body), "signer": TRAINER.peer_id, "signature": sig.hex()}


LEGACY_DOCS = tuple(
    canonical_json(
        {
            "header": _legacy_env(m.header.canonical_bytes(), HEADER_DOMAIN),
            "parts": [
                _legacy_env(m.parts[k].part.canonical_bytes(), PART_DOMAIN) for k in sorted(m.parts)
            ],
        }
    )
    for m in MANIFESTS
)
LEGACY_PARTS = tuple(
    canonical_json(_legacy_env(p.part.canonical_bytes(), PART_DOMAIN))
    for m in MANIFESTS
    for p in m.parts.values()
)


def _bodies(m: Manifest) -> dict[str, Any]:
    """The signed bodies of a manifest document, as a tree to mutate and re-seal."""
    return {
        "v": 3,
        "header": m.header.to_obj(),
        "parts": [m.parts[k].part.to_obj() for k in sorted(m.parts)],
    }


def _seal_document(tree: Any) -> bytes:
    if isinstance(tree, dict):
        tree = dict(tree)
        if "header" in tree:
            tree["header"] = _seal_json(Kind.MANIFEST_HEADER, tree["header"], TRAINER)
        if isinstance(tree.get("parts"), list):
            tree["parts"] = [_seal_json(Kind.MANIFEST_PART, p, TRAINER) for p in tree["parts"]]
    return _json(tree)


def _seal_part(tree: Any) -> bytes:
    return base64.b64decode(_seal_json(Kind.MANIFEST_PART, tree, TRAINER))


def _resign_document(tree: Any) -> bytes:
    if isinstance(tree, dict):
        _resign(tree.get("header"), HEADER_DOMAIN, TRAINER)
        parts = tree.get("parts")
        if isinstance(parts, list):
            for p in parts:
                _resign(p, PART_DOMAIN, TRAINER)
    return _json(tree)


def _resign_part(tree: Any) -> bytes:
    _resign(tree, PART_DOMAIN, TRAINER)
    return _json(tree)


CBOR_TOKENS = (
    b"\x9f",
    b"\xbf",
    b"\xff",
    b"\x81" * 3000,
    b"\xa1\x61a" * 2000,
    b"\xc2\x58\x40",
    b"\xd9\x01\x02",
    b"\x5b\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x9b\x00\x00\x00\xff\xff\xff\xff\xff",
    b"\xfb\x7f\xf8\x00\x00\x00\x00\x00\x00",
    b"\xf9\x7c\x00",
    b"\xd8\x1c",
    b"\xd8\x1d\x00",
    b"\x61v\x01",
)


JSON_TOKENS = (
    b"{",
    b"}",
    b"[",
    b"]",
    b'"',
    b",",
    b":",
    b"null",
    b"true",
    b"-0",
    b"1e999",
    b"NaN",
    b"Infinity",
    b"\\u0000",
    b"\\ud800",
    b"[" * 3000,
    b'{"a":' * 3000,
    b"18446744073709551616",
    b'"v":2',
    b'"body":',
    b'"signature":"',
)
MANIFEST_DOC = Target(
    "manifest",
    lambda data: Manifest.decode(data, trust=TRUST, source="fuzz"),
    [*(m.encode() for m in MANIFESTS), *LEGACY_DOCS],
    JSON_TOKENS,
    trees=[
        *((_bodies(m), _seal_document) for m in MANIFESTS),
        *((json.loads(d), _resign_document) for d in LEGACY_DOCS),
    ],
)
MANIFEST_PART = Target(
    "manifest-part",
    lambda data: _all(
        *((lambda m=m: decode_part(data, m.header, trust=TRUST, source="fuzz")) for m in MANIFESTS)
    ),
    [*(p.encode() for m in MANIFESTS for p in m.parts.values()), *LEGACY_PARTS],
    CBOR_TOKENS + JSON_TOKENS,
    trees=[
        *((p.part.to_obj(), _seal_part) for m in MANIFESTS for p in m.parts.values()),
        *((json.loads(p), _resign_part) for p in LEGACY_PARTS),
    ],
)


# --- node messages -------------------------------------------------------------------------


ANNOUNCEMENTS = (
    VersionAnnouncement.create(TRAINER, RUN, 3, _digest(), ("/ip4/127.0.0.1/tcp/4001",)),
    VersionAnnouncement.create(TRAINER, RUN, 9, _digest(), (), card=(2, _digest())),
)
VERSION_ANNOUNCEMENT = Target(
    "version-announcement",
    lambda data: VersionAnnouncement.decode(data, trust=TRUST, sender="fuzz"),
    [a.encode() for a in ANNOUNCEMENTS],
    CBOR_TOKENS,
    trees=[
        (cbor2.loads(a._body()), _seal_cbor(Kind.VERSION_ANNOUNCEMENT, TRAINER))
        for a in ANNOUNCEMENTS
    ],
    json_only=False,
)
RUN_ENDS = (
    RunFinished.create(TRAINER, RUN, 9, "cd" * 32),
    RunFinished.create(TRAINER, RUN, 9, "cd" * 32, seq=4),
    RunContinued.create(TRAINER, RUN, 9, seq=5),
)
VERSIONS_MESSAGE = Target(
    "versions-message",
    lambda data: decode_versions_message(data, trust=TRUST, sender="fuzz"),
    [m.encode() for m in (*RUN_ENDS, ANNOUNCEMENTS[0])],
    CBOR_TOKENS,
    trees=[(cbor2.loads(m._body()), _seal_cbor(m.KIND, TRAINER)) for m in RUN_ENDS],
    json_only=False,
)
INFOS = (
    NodeInfo(
        PEER.peer_id,
        "relay",
        RUN,
        "http://127.0.0.1:8002",
        (1, 2, 3),
        ANNOUNCEMENTS[0].encode(),
        2,
        _digest(),
    ),
    NodeInfo(PEER.peer_id, "peer", RUN, "http://127.0.0.1:1", (), None),
    NodeInfo(
        PEER.peer_id,
        "relay",
        RUN,
        "http://127.0.0.1:8002",
        (9,),
        ANNOUNCEMENTS[1].encode(),
        finished=RUN_ENDS[1].encode(),
        continued=RUN_ENDS[2].encode(),
    ),
)
NODE_INFO = Target(
    "node-info",
    lambda data: NodeInfo.decode(data, sender=""),
    [i.encode() for i in INFOS],
    CBOR_TOKENS,
    trees=[(cbor2.loads(i.encode()), _cbor) for i in INFOS],
    json_only=False,
)
ADVERTS = (
    NodeAdvert(PEER.peer_id, "relay", "http://127.0.0.1:8002", (4, 5), (6,)),
    NodeAdvert(PEER.peer_id, "peer", "http://10.0.0.1:9", (), ()),
    NodeAdvert.of(PEER.peer_id, "relay", "http://127.0.0.1:8002", [(4, "a" * 64)], [(5, "b" * 64)]),
)
NODE_ADVERT = Target(
    "node-advert",
    lambda data: NodeAdvert.decode(data, PEER.peer_id),
    [a.encode() for a in ADVERTS],
    CBOR_TOKENS,
    trees=[(cbor2.loads(a.encode()), _cbor) for a in ADVERTS],
    json_only=False,
)

CARD = RunCard(
    card_version=1,
    run_id=RUN,
    trainer=TRAINER.peer_id,
    task=TaskSpec("digits", 1, "ab" * 32),
    sampling=SamplingRules(4, 8, 16, 0.7),
    engines=(EngineSpec("transformers", "bf16"), EngineSpec("vllm", "fp16")),
    async_level=2,
    architecture_digest="cd" * 32,
    issued_at_ms=1_767_225_600_000,
)


def _resign_card(tree: Any) -> bytes:
    _resign(tree, CARD_DOMAIN, TRAINER)
    return _json(tree)


def _seal_card(tree: Any) -> bytes:
    return _json({"v": 2, "sealed": _seal_json(Kind.RUN_CARD, tree, TRAINER)})


LEGACY_CARD = canonical_json(
    {
        "body": CARD.to_obj(),
        "signer": TRAINER.peer_id,
        "signature": TRAINER.sign(CARD_DOMAIN, CARD.canonical_bytes()).hex(),
    }
)
RUN_CARD = Target(
    "run-card",
    lambda data: SignedRunCard.decode(data, trainer=TRAINER.peer_id, source="fuzz"),
    [sign_card(CARD, TRAINER).encode(), LEGACY_CARD],
    JSON_TOKENS,
    trees=[(CARD.to_obj(), _seal_card), (json.loads(LEGACY_CARD), _resign_card)],
)


# --- rollouts ------------------------------------------------------------------------------


def _batch(n_groups: int, n_samples: int) -> RolloutBatch:
    groups = []
    for g in range(n_groups):
        samples = []
        for s in range(n_samples):
            n = 1 + (g + s) % 5
            samples.append(
                Sample(
                    tuple(_rng.randrange(VOCAB) for _ in range(n)),
                    tuple(-_rng.random() for _ in range(n)),
                    float(s),
                    ("stop", "length")[s % 2],
                    _rng.randbytes(2 + 2 * TOPK),
                )
            )
        groups.append(Group(g, (1, 5, 9), tuple(samples)))
    return RolloutBatch(
        RUN, PEER.peer_id, 3, _digest(), "digits/1", n_groups, 42, 0.7, 8, tuple(groups)
    )


BATCHES = (_batch(1, 1), _batch(2, 3))
ROLLOUT_BATCH = Target(
    "rollout-batch",
    lambda data: RolloutBatch.decode(data, vocab_size=VOCAB, sender="fuzz"),
    [b.encode() for b in BATCHES],
    CBOR_TOKENS,
    max_random_bytes=4096,
    trees=[(cbor2.loads(b.encode()), _cbor) for b in BATCHES],
    json_only=False,
)


ROLLOUT_ANNOUNCEMENTS = tuple(
    RolloutAnnouncement.for_payload(PEER, RUN, 3, b.encode()) for b in BATCHES
)
ROLLOUT_ANNOUNCEMENT = Target(
    "rollout-announcement",
    lambda data: RolloutAnnouncement.decode(data, sender="fuzz"),
    [a.encode() for a in ROLLOUT_ANNOUNCEMENTS],
    CBOR_TOKENS,
    trees=[
        (cbor2.loads(a._body()), _seal_cbor(Kind.ROLLOUT_ANNOUNCEMENT, PEER))
        for a in ROLLOUT_ANNOUNCEMENTS
    ],
    json_only=False,
)


def _open_every_kind(data: bytes) -> None:
    """envelope.open under every kind and trust rule (the decoder all signed messages share)."""
    _all(
        *(
            (lambda k=k, t=t: envelope.open(k, data, t, 4096, sender="fuzz"))
            for k in Kind
            for t in (ANY_SIGNER, TRAINER.peer_id, frozenset({PEER.peer_id}))
        ),
        lambda: envelope.peek_kind(data, max_bytes=4096),
    )


ENVELOPES = (
    envelope.seal(Kind.RUN_FINISHED, b"", TRAINER.key),
    envelope.seal(Kind.VERSION_ANNOUNCEMENT, ANNOUNCEMENTS[0]._body(), TRAINER.key),
    envelope.seal(Kind.ROLLOUT_ANNOUNCEMENT, ROLLOUT_ANNOUNCEMENTS[0]._body(), PEER.key),
    envelope.seal(Kind.MANIFEST_PART, b"x" * 4096, TRAINER.key),
)
ENVELOPE = Target(
    "envelope",
    _open_every_kind,
    list(ENVELOPES),
    (*CBOR_TOKENS, *(k.value.encode() for k in Kind), TRAINER.key.public_key),
    max_random_bytes=4400,
    trees=[(cbor2.loads(e), _cbor) for e in ENVELOPES],
    json_only=False,
)

PROOFS = (bytes([0, 200]) + _rng.randbytes(2 * TOPK), bytes([0xFF, 0xD9]) + bytes(2 * TOPK))
TOPLOC_PROOF = Target(
    "toploc-proof",
    lambda data: _all(lambda: parse_proof(data, TOPK), lambda: parse_proof(data, 128)),
    list(PROOFS),
    (b"\x00\x00", b"\xff\xd9", b"\xff\xda", b"\xff\xff"),
    max_random_bytes=2 + 2 * TOPK + 4,
)
TOPLOC_BASE64 = Target(
    "toploc-base64",
    lambda text: _all(
        lambda: parse_proof(decode_proof_base64(text, TOPK), TOPK),
        lambda: decode_proof_base64(text),
    ),
    [encode_proof_base64(p).encode() for p in PROOFS],
    (b"=", b"==", b"+", b"/", b"-", b"_", b"\n", b" ", b"\xe9"),
    max_random_bytes=64,
    text=True,
)


# --- codecs --------------------------------------------------------------------------------

LENGTH = 4096
_BASE = bytes(_rng.randbytes(LENGTH))
_NEW = bytearray(_BASE)
for _i in range(0, LENGTH, 97):
    _NEW[_i] ^= 0x5A
_NEW_BYTES = bytes(_NEW)
ZSTD_TOKENS = (
    b"\x28\xb5\x2f\xfd",
    b"\x50\x2a\x4d\x18\x00\x00\x00\x00",
    b"\x00\x10",
    b"\xff\xff\xff\xff",
)
ZSTD = Target(
    "zstd",
    lambda data: _all(
        lambda: codecs.decode(codecs.ZSTD, data, LENGTH, source="fuzz"),
        lambda: codecs.decode(codecs.ZSTD, data, LENGTH, source="fuzz", scratch=bytearray(LENGTH)),
    ),
    [
        codecs.encode(codecs.ZSTD, _NEW_BYTES),
        codecs.encode(codecs.ZSTD, bytes(LENGTH), level=19),
        codecs.encode(codecs.ZSTD, _NEW_BYTES) + codecs.encode(codecs.ZSTD, b"x"),
    ],
    ZSTD_TOKENS,
)
XOR_ZSTD = Target(
    "xor-zstd",
    lambda data: _all(
        lambda: codecs.decode(codecs.XOR_ZSTD, data, LENGTH, base=_BASE, source="fuzz"),
        lambda: codecs.decode(
            codecs.XOR_ZSTD, data, LENGTH, base=_BASE, source="fuzz", out=bytearray(_BASE)
        ),
    ),
    [codecs.encode(codecs.XOR_ZSTD, _NEW_BYTES, base=_BASE)],
    ZSTD_TOKENS,
)
SPARSE = Target(
    "sparse",
    lambda data: _all(
        lambda: decode_sparse(data, LENGTH, _BASE, source="fuzz"),
        lambda: decode_sparse(data, LENGTH + 1, _BASE + b"\x07", source="fuzz"),
        lambda: decode_sparse(data, LENGTH, _BASE, source="fuzz", out=bytearray(_BASE)),
    ),
    [
        encode_sparse(_NEW_BYTES, _BASE),
        encode_sparse(_NEW_BYTES + b"\x01", _BASE + b"\x07"),
        encode_sparse(_BASE, _BASE),
    ],
    (b"SPD1", *ZSTD_TOKENS),
)


# --- HTTP ----------------------------------------------------------------------------------


def _http(data: bytes) -> None:
    request = parse_request_head(data, max_header_bytes=4096, peer="127.0.0.1:1")
    if request is not None and request.range is not None:
        for total in (0, 1, 1000):
            _all(lambda total=total: resolve_range(request.range, total))  # type: ignore[arg-type]


HTTP_TOKENS = (
    b"\r\n",
    b"\n",
    b": ",
    b"\r\n\r\n",
    b"HTTP/1.1",
    b"HTTP/1.0",
    b"//[",
    b"%",
    b"%ff",
    b"?",
    b"#",
    b"range: bytes=",
    b"transfer-encoding: chunked",
    b"content-length: ",
    b"-",
    b",",
    b"\x00",
    b"\xff",
    b"host: ",
    b" " * 100,
)
HTTP_REQUEST = Target(
    "http-request",
    _http,
    [
        b"GET /shardnet/v1/run/3/files/a.bin?x=1 HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"range: bytes=0-1023\r\n\r\n",
        b"HEAD / HTTP/1.0\r\n\r\n",
        b"GET /p%2Fq HTTP/1.1\r\nHost: a\r\nRange: bytes=-5\r\nconnection: close\r\n\r\n",
    ],
    HTTP_TOKENS,
)


def _range(text: str) -> None:
    def one() -> None:
        spec = parse_range(text)
        if isinstance(spec, ByteRange | SuffixRange):
            for total in (0, 1, 1000, 1 << 40):
                _all(lambda total=total: resolve_range(spec, total))

    _all(one, lambda: parse_content_range(text), lambda: parse_retry_after(text, now_unix_s=1.7e9))


HTTP_RANGE = Target(
    "http-range",
    _range,
    [
        b"bytes=0-1023",
        b"bytes=-5",
        b"bytes=7-",
        b"bytes 0-9/10",
        b"bytes 5-9/*",
        b"120",
        b"Wed, 21 Oct 2015 07:28:00 GMT",
        b"bytes=0-1,5-6",
    ],
    (
        b"bytes",
        b"=",
        b"-",
        b",",
        b" ",
        b"\t",
        b"/",
        b"*",
        b"9" * 40,
        b"GMT",
        b"Mon, ",
        b" 9999 ",
        b" 0000 ",
        b" 99:99:99 ",
        b"+9999",
        b"\x85",
        "\u00a0".encode(),
    ),
    max_random_bytes=128,
    text=True,
)


# --- safetensors headers of received checkpoints -------------------------------------------


@functools.cache
def _st_path() -> Path:
    """Where fuzzed headers are written (tmpfs where there is one), made on first use so that
    a run that only collects these targets leaves nothing behind, even when killed."""
    shm = Path("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="shardnet-fuzz-", dir=shm if shm.is_dir() else None))
    atexit.register(shutil.rmtree, tmp, True)
    return tmp / "model.safetensors"


def _safetensors(data: bytes) -> None:
    _st_path().write_bytes(data)
    read_tensor_shapes(_st_path())


SAFETENSORS = Target(
    "safetensors-header",
    _safetensors,
    [
        save_safetensors({"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.ones(3)}),
        save_safetensors({"e": torch.zeros(0, dtype=torch.float16)}, metadata={"k": "v"}),
    ],
    (
        b'{"',
        b'"dtype":"BF16"',
        b'"dtype":"F8_E4M3"',
        b'"shape":[',
        b'"data_offsets":[',
        b"18446744073709551615",
        b"__metadata__",
        b"\xff\xff\xff\xff\xff\xff\xff\x7f",
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    ),
)

TARGETS = (
    MANIFEST_DOC,
    MANIFEST_PART,
    VERSION_ANNOUNCEMENT,
    VERSIONS_MESSAGE,
    NODE_INFO,
    NODE_ADVERT,
    RUN_CARD,
    ROLLOUT_BATCH,
    ROLLOUT_ANNOUNCEMENT,
    ENVELOPE,
    TOPLOC_PROOF,
    TOPLOC_BASE64,
    ZSTD,
    XOR_ZSTD,
    SPARSE,
    HTTP_REQUEST,
    HTTP_RANGE,
    SAFETENSORS,
)
BY_NAME = {t.name: t for t in TARGETS}
