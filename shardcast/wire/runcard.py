"""wire: the run card: the run's rules, signed by the trainer, that every node fetches and follows.

Theory of operation
-------------------
A run has one set of rules that the trainer's validator enforces and every inference peer must
follow: which run, which task (and the digest of its data), the sampling rules, the inference
engine(s) whose rollouts are accepted, the async window and the model architecture. Instead of
configuring them on every node, the trainer (or ``shardnet origin``) writes them into a
:class:`RunCard`, signs it with its PeerID key, and every node serves it; a peer started with
only the trainer's PeerID and one bootstrap address fetches it, checks the signature against
the pinned PeerID, and adopts it. Changing a rule means issuing a new card with a higher
``card_version`` (:func:`next_card`); announcements of new versions carry the card version
and digest, so followers notice it and fetch it before they use that version.

Wire format (schema ``v`` = 1): the signed body is canonical JSON (UTF-8, sorted keys, no
whitespace, integers and strings only; :func:`shardcast.wire.canonical.canonical_json`)::

    {"v": 1, "card_version": 3, "run_id": "my-run", "trainer": "12D3KooW…",
     "task": {"name": "digits", "version": 1, "digest": "<64 hex>"},
     "sampling": {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 16,
                  "temperature": "1.0"},
     "engines": [{"family": "transformers", "dtype": "bf16"}],
     "async_level": 2,
     "model": {"architecture_digest": "<64 hex>"},
     "issued_at_ms": 1767225600000,
     "mirrors": ["http://mirror.example.org/run"]}

``temperature`` is the shortest decimal that round-trips the float (Python ``repr``), as a
string, so the signed bytes hold no float. ``engines`` is a list so that a run can later accept
several engine families, each with its own validator path; today's validator judges one.
``mirrors`` is optional (absent when empty, so cards issued before it existed keep their bytes
and digest): static mirrors (:mod:`shardcast.serve.mirror`) the trainer names, 1 to
:data:`MAX_CARD_MIRRORS` distinct ``http://HOST[:PORT][/PATH]`` URLs of at most
:data:`MAX_MIRROR_URL` characters, in the form ``--mirror`` normalizes them to (no trailing
``/``). Followers that adopt the card add them to their own mirrors; a mirror stays untrusted
(every byte is checked against the signed manifest), the card only says where to look. A node
that predates the field refuses a card that has it (an unknown field).
``validator_profile`` is optional in the same way (absent unless the trainer was given
``--validator-profile``): ``{"digest": "<64 hex>", "engines": {"transformers-bf16":
{"prefill_max_mant_err_mean": "0.25", ...}}}``, the BLAKE3 of the calibrated profile file
(:mod:`rollout.calibrate`) and, for each of the card's engines it covers, the thresholds the
validator judges that engine's rollouts with (every name of :data:`PROFILE_THRESHOLD_KEYS`, as
canonical decimal strings), so peers and auditors see which thresholds the run uses.
The body is sealed by the trainer in a :mod:`p2p.envelope` of kind ``run-card``; the signer
must be the pinned trainer and equal ``body.trainer``. The document stored as
``<data_dir>/runcard.json``, served at ``GET /shardnet/v1/runcard`` and on
``/shardnet/runcard/1.0.0`` is canonical JSON ``{"v": 2, "sealed": "<base64 envelope>"}``.
The card's digest is the BLAKE3 of the canonical body. A document is at most
:data:`MAX_CARD_BYTES`.

Older format, still read (cards stored before, nodes serving one): ``{"body": {...},
"signer": "<PeerID>", "signature": "<128 hex>"}``, the signature over
``b"shardnet/runcard/v1\\0" + body`` (:func:`p2p.keys.domain_message`). A card read in that
format is stored and served in it.

Every decoder treats its input as hostile; each failure is a typed error naming the field:
:class:`MalformedRunCard`, :class:`BadRunCardSignature`, :class:`WrongRunCardKey`. This module
imports no libp2p (signatures: :mod:`p2p.keys`, PyNaCl).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from p2p import envelope, fields
from p2p.envelope import Kind
from p2p.errors import (
    BadSignature,
    ConfigError,
    FieldError,
    IntegrityError,
    LocalProtocolError,
    RemoteProtocolError,
    UntrustedSigner,
)
from p2p.keys import KeyHolder, public_key_of, verify
from shardcast.wire.canonical import (
    DIGEST_RE,
    RUN_ID_RE,
    blake3_hex,
    canonical_json,
    loads_untrusted,
)
from shardcast.wire.lane_urls import check_mirror_url  # the one URL rule of --mirror

__all__ = [
    "CARD_DOMAIN",
    "CARD_FILE",
    "CARD_SCHEMA",
    "DEFAULT_ASYNC_LEVEL",
    "DEFAULT_ENGINE",
    "DEFAULT_SAMPLING",
    "MAX_CARD_BYTES",
    "MAX_CARD_MIRRORS",
    "MAX_ENGINES",
    "MAX_MIRROR_URL",
    "PROFILE_THRESHOLD_KEYS",
    "BadRunCardSignature",
    "CardProfile",
    "EngineSpec",
    "MalformedRunCard",
    "RunCard",
    "SamplingRules",
    "SignedRunCard",
    "TaskSpec",
    "UnsupportedEngine",
    "WrongRunCardKey",
    "architecture_digest",
    "choose_engine",
    "next_card",
    "sign_card",
]

CARD_SCHEMA = 1
CARD_DOCUMENT_VERSION = 2
CARD_KIND = Kind.RUN_CARD
CARD_DOMAIN = "runcard/v1"
"""Signature domain of cards in the old format (read only)."""
MAX_CARD_BYTES = 16 * 1024
MAX_CARD_BODY_BYTES = 8 * 1024
CARD_FILE = "runcard.json"
MAX_ENGINES = 8
MAX_CARD_MIRRORS = 8
MAX_MIRROR_URL = 256
_TOKEN_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
# task names: a built-in (``digits``), a dataset (``<stem>@<digest prefix>``) or an entry point
_TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,95}$")
_DTYPES = ("bf16", "fp16", "fp32")
_BODY_KEYS = frozenset(
    {
        "v",
        "card_version",
        "run_id",
        "trainer",
        "task",
        "sampling",
        "engines",
        "async_level",
        "model",
        "issued_at_ms",
    }
)
_OPTIONAL_KEYS = frozenset({"mirrors", "validator_profile"})
PROFILE_THRESHOLD_KEYS = frozenset(
    {
        *(
            f"{part}_{k}"
            for part in ("prefill", "decode")
            for k in ("max_exp_mismatches", "max_mant_err_mean", "max_mant_err_median")
        ),
        "logprob_tolerance",
        "logprob_max_tolerance",
        "replay_margin",
        "eos_min_prob",
    }
)
"""The threshold names of a card's ``validator_profile`` (``rollout.calibrate.THRESHOLD_NAMES``)."""
IGNORED_CONFIG_KEYS = frozenset(
    {"dtype", "torch_dtype", "transformers_version", "architectures", "_name_or_path"}
)
"""``config.json`` keys that do not describe the architecture (left out of its digest)."""


class MalformedRunCard(FieldError):
    """A run card that is not valid: too large, not JSON, or a field with a bad value.

    Attributes:
        field: the offending field (``sampling.temperature``), or ``""`` for the document.
    """

    def __init__(self, source: str, field: str, message: str) -> None:
        super().__init__(source, f"run card {field or 'document'}: {message}", field)

    @classmethod
    def for_field(cls, peer: str, field: str, message: str) -> MalformedRunCard:
        """The error :mod:`p2p.fields` raises for ``field``."""
        return cls(peer, field, message)


class BadRunCardSignature(IntegrityError):
    """A run card whose signature does not verify against its signer."""


class WrongRunCardKey(UntrustedSigner):
    """A validly signed run card from a key other than the pinned trainer's."""


class UnsupportedEngine(ConfigError):
    """This node cannot run any engine the card accepts (field ``engine``)."""

    def __init__(self, message: str) -> None:
        super().__init__("engine", message)


@dataclass(frozen=True)
class TaskSpec:
    """The task: ``name`` (``digits``), ``version`` (>= 1) and the digest of its data."""

    name: str
    version: int
    digest: str

    @property
    def id(self) -> str:
        """``name/version``: the task string rollout batches carry (``digits/1``)."""
        return f"{self.name}/{self.version}"


@dataclass(frozen=True)
class SamplingRules:
    """How peers sample.

    Attributes:
        prompts_per_step: prompts per peer per policy step.
        group_size: samples per prompt (the GRPO group).
        max_new_tokens: completion cap, tokens.
        temperature: sampling temperature (> 0, finite).
    """

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float


@dataclass(frozen=True, order=True)
class EngineSpec:
    """An inference engine family and dtype (``transformers``/``bf16``)."""

    family: str
    dtype: str

    @property
    def id(self) -> str:
        """``family-dtype`` (``transformers-bf16``), the form used in settings."""
        return f"{self.family}-{self.dtype}"

    @classmethod
    def parse(cls, text: str, field: str = "engines") -> EngineSpec:
        """Parse ``family-dtype``.

        Raises:
            ConfigError: not ``family-dtype`` with a known dtype.
        """
        family, _, dtype = text.rpartition("-")
        if not _TOKEN_RE.match(family) or dtype not in _DTYPES:
            raise ConfigError(
                field, f"{text!r} is not FAMILY-DTYPE (e.g. transformers-bf16; dtypes {_DTYPES})"
            )
        return cls(family, dtype)


DEFAULT_ENGINE = EngineSpec("transformers", "bf16")
"""The engine a run accepts unless told otherwise."""

DEFAULT_SAMPLING = SamplingRules(
    prompts_per_step=4, group_size=8, max_new_tokens=16, temperature=1.0
)
"""The run's sampling rules unless told otherwise: the one declaration of these defaults
(the CLI settings, :class:`rollout.batch.SamplingConfig` and the trainer's config take them
from here)."""

DEFAULT_ASYNC_LEVEL = 2
"""Policy steps a rollout may lag unless told otherwise (INTELLECT-2 used 2, arXiv
2505.07291 section 3)."""


@dataclass(frozen=True)
class CardProfile:
    """The validator profile a run judges rollouts with (``--validator-profile``): the
    profile file's digest (:meth:`rollout.calibrate.ValidatorProfile.digest`) and, per engine
    id, its thresholds as canonical decimal strings (the card holds no floats).

    Attributes:
        digest: BLAKE3 hex of the profile file.
        engines: ``((engine_id, ((threshold name, decimal text), ...)), ...)``, sorted.
    """

    digest: str
    engines: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]

    @classmethod
    def of(cls, digest: str, thresholds: Mapping[str, Mapping[str, float]]) -> CardProfile:
        """From a digest and ``{engine_id: {name: value}}`` (values written as
        :func:`repr` of the float)."""
        return cls(
            digest,
            tuple(
                (e, tuple((k, _float_text(v)) for k, v in sorted(t.items())))
                for e, t in sorted(thresholds.items())
            ),
        )

    def thresholds(self) -> dict[str, dict[str, float]]:
        """``{engine_id: {name: value}}``."""
        return {e: {k: float(v) for k, v in t} for e, t in self.engines}

    def to_obj(self) -> dict[str, Any]:
        """The card's ``validator_profile`` object."""
        return {"digest": self.digest, "engines": {e: dict(t) for e, t in self.engines}}


@dataclass(frozen=True)
class RunCard:
    """The run's rules (see module docstring for the wire format).

    Attributes:
        card_version: increases with every change of rules, >= 1.
        run_id: the run.
        trainer: the trainer's PeerID (the only valid signer).
        task: the task and the digest of its data.
        sampling: the sampling rules.
        engines: the engine families/dtypes whose rollouts the validator accepts (1..8,
            distinct, in order of preference).
        async_level: how many versions a rollout may lag.
        architecture_digest: :func:`architecture_digest` of the model's ``config.json``.
        issued_at_ms: wall-clock time of issue, milliseconds since the Unix epoch.
        mirrors: static mirror base URLs followers add to their own (0..8; see the module
            docstring).
        validator_profile: the calibrated thresholds the run's validator uses, when the
            trainer was given a profile file (``--validator-profile``); None: the built-in
            defaults of the code (``rollout.verify``).
    """

    card_version: int
    run_id: str
    trainer: str
    task: TaskSpec
    sampling: SamplingRules
    engines: tuple[EngineSpec, ...]
    async_level: int
    architecture_digest: str
    issued_at_ms: int
    mirrors: tuple[str, ...] = ()
    validator_profile: CardProfile | None = None

    def __post_init__(self) -> None:
        _check_body(self.to_obj(), "")

    def to_obj(self) -> dict[str, Any]:
        """The JSON body (``mirrors`` only when there are some)."""
        body: dict[str, Any] = {
            "v": CARD_SCHEMA,
            "card_version": self.card_version,
            "run_id": self.run_id,
            "trainer": self.trainer,
            "task": {
                "name": self.task.name,
                "version": self.task.version,
                "digest": self.task.digest,
            },
            "sampling": {
                "prompts_per_step": self.sampling.prompts_per_step,
                "group_size": self.sampling.group_size,
                "max_new_tokens": self.sampling.max_new_tokens,
                "temperature": _float_text(self.sampling.temperature),
            },
            "engines": [{"family": e.family, "dtype": e.dtype} for e in self.engines],
            "async_level": self.async_level,
            "model": {"architecture_digest": self.architecture_digest},
            "issued_at_ms": self.issued_at_ms,
        }
        if self.mirrors:
            body["mirrors"] = list(self.mirrors)
        if self.validator_profile is not None:
            body["validator_profile"] = self.validator_profile.to_obj()
        return body

    def canonical_bytes(self) -> bytes:
        """The signed bytes."""
        return canonical_json(self.to_obj())

    def digest(self) -> str:
        """BLAKE3 hex digest of the canonical bytes: the card's identity."""
        return blake3_hex(self.canonical_bytes())

    def same_rules(self, other: RunCard) -> bool:
        """True if ``other`` has the same rules (version and issue time aside)."""
        return (
            replace(other, card_version=self.card_version, issued_at_ms=self.issued_at_ms) == self
        )

    @classmethod
    def from_obj(cls, obj: Any, source: str = "") -> RunCard:
        """Parse and validate a body.

        Raises:
            MalformedRunCard: naming the first bad field.
        """
        _check_body(obj, source)
        t, s, m = obj["task"], obj["sampling"], obj["model"]
        return cls(
            obj["card_version"],
            obj["run_id"],
            obj["trainer"],
            TaskSpec(t["name"], t["version"], t["digest"]),
            SamplingRules(
                s["prompts_per_step"], s["group_size"], s["max_new_tokens"], float(s["temperature"])
            ),
            tuple(EngineSpec(e["family"], e["dtype"]) for e in obj["engines"]),
            obj["async_level"],
            m["architecture_digest"],
            obj["issued_at_ms"],
            tuple(obj.get("mirrors", ())),
            _card_profile(obj.get("validator_profile")),
        )


def _float_text(x: float) -> str:
    return repr(float(x))


def _fail(source: str, field: str, message: str) -> MalformedRunCard:
    return MalformedRunCard(source, field, message)


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, source: str, prefix: str = "") -> None:
    fields.need_int(obj, key, lo, hi, source, error=MalformedRunCard, prefix=prefix)


def _obj(obj: Mapping[str, Any], key: str, keys: set[str], source: str) -> Mapping[str, Any]:
    return fields.need_map(obj, key, keys, source, error=MalformedRunCard)


def _check_body(obj: Any, source: str) -> None:
    """Validate a card body (types and ranges), raising :class:`MalformedRunCard`."""
    if not isinstance(obj, dict):
        raise _fail(source, "", "body is not an object")
    if obj.get("v") != CARD_SCHEMA:
        raise _fail(source, "v", f"schema {obj.get('v')!r}, this node reads {CARD_SCHEMA}")
    if not _BODY_KEYS <= set(obj) <= _BODY_KEYS | _OPTIONAL_KEYS:
        missing = sorted(_BODY_KEYS - set(obj))
        extra = sorted(set(obj) - _BODY_KEYS - _OPTIONAL_KEYS)
        raise _fail(source, "", f"missing fields {missing}, unknown fields {extra}")
    _int(obj, "card_version", 1, 1 << 62, source)
    run_id = obj["run_id"]
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise _fail(source, "run_id", f"{run_id!r} is not a valid run id")
    trainer = obj["trainer"]
    if not isinstance(trainer, str) or not 8 <= len(trainer) <= 128 or not trainer.isalnum():
        raise _fail(source, "trainer", f"{trainer!r} is not a PeerID")
    _check_task(obj, source)
    _check_sampling(obj, source)
    seen = _check_engines(obj["engines"], source)
    _int(obj, "async_level", 0, 1 << 16, source)
    model = _obj(obj, "model", {"architecture_digest"}, source)
    if not isinstance(model["architecture_digest"], str) or not DIGEST_RE.match(
        model["architecture_digest"]
    ):
        raise _fail(source, "model.architecture_digest", "is not 64 lowercase hex characters")
    _int(obj, "issued_at_ms", 0, 1 << 52, source)
    if "mirrors" in obj:
        _check_mirrors(obj["mirrors"], source)
    if "validator_profile" in obj:
        _check_profile(obj["validator_profile"], seen, source)


def _check_task(obj: Mapping[str, Any], source: str) -> None:
    """``task``: a task name, a version in 1 .. 2**31 and a 64-hex digest."""
    task = _obj(obj, "task", {"name", "version", "digest"}, source)
    if not isinstance(task["name"], str) or not _TASK_RE.match(task["name"]):
        raise _fail(source, "task.name", f"{task['name']!r} is not a task name")
    _int(task, "version", 1, 1 << 31, source, "task.")
    if not isinstance(task["digest"], str) or not DIGEST_RE.match(task["digest"]):
        raise _fail(source, "task.digest", "is not 64 lowercase hex characters")


def _check_sampling(obj: Mapping[str, Any], source: str) -> None:
    """``sampling``: prompts per step and group size in 1 .. 2**16, max new tokens in
    1 .. 2**20, and the temperature as a canonical decimal in (0, 100]."""
    s = _obj(
        obj, "sampling", {"prompts_per_step", "group_size", "max_new_tokens", "temperature"}, source
    )
    _int(s, "prompts_per_step", 1, 1 << 16, source, "sampling.")
    _int(s, "group_size", 1, 1 << 16, source, "sampling.")
    _int(s, "max_new_tokens", 1, 1 << 20, source, "sampling.")
    temp = s["temperature"]
    try:
        value = float(temp) if isinstance(temp, str) and len(temp) <= 32 else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 100) or _float_text(value) != temp:
        raise _fail(
            source, "sampling.temperature", f"{temp!r} is not a canonical decimal in (0, 100]"
        )


def _check_engines(engines: Any, source: str) -> set[tuple[str, str]]:
    """``engines``: 1 to MAX_ENGINES distinct ``{family, dtype}``; returns the
    (family, dtype) pairs."""
    if not isinstance(engines, list) or not 1 <= len(engines) <= MAX_ENGINES:
        raise _fail(source, "engines", f"must be a list of 1 to {MAX_ENGINES} engines")
    seen: set[tuple[str, str]] = set()
    for e in engines:
        if (
            not isinstance(e, dict)
            or set(e) != {"family", "dtype"}
            or not isinstance(e["family"], str)
            or not _TOKEN_RE.match(e["family"])
            or e["dtype"] not in _DTYPES
        ):
            raise _fail(source, "engines", f"{e!r} is not {{family, dtype in {_DTYPES}}}")
        if (e["family"], e["dtype"]) in seen:
            raise _fail(source, "engines", f"{e['family']}-{e['dtype']} is listed twice")
        seen.add((e["family"], e["dtype"]))
    return seen


def _card_profile(obj: Any) -> CardProfile | None:
    if obj is None:
        return None
    return CardProfile(
        obj["digest"],
        tuple((e, tuple(sorted(t.items()))) for e, t in sorted(obj["engines"].items())),
    )


def _check_profile(obj: Any, engines: set[tuple[str, str]], source: str) -> None:
    """``validator_profile``: a digest and, for 1..MAX_ENGINES of the card's engines, every
    threshold of :data:`PROFILE_THRESHOLD_KEYS` as a canonical decimal >= 0."""
    field = "validator_profile"
    prof = _obj({field: obj}, field, {"digest", "engines"}, source)
    if not isinstance(prof["digest"], str) or not DIGEST_RE.match(prof["digest"]):
        raise _fail(source, f"{field}.digest", "is not 64 lowercase hex characters")
    by_engine = prof["engines"]
    if not isinstance(by_engine, dict) or not 1 <= len(by_engine) <= MAX_ENGINES:
        raise _fail(source, f"{field}.engines", f"must map 1 to {MAX_ENGINES} engines")
    ids = {f"{f}-{d}" for f, d in engines}
    for eid, th in by_engine.items():
        if eid not in ids:
            raise _fail(source, f"{field}.engines", f"{eid!r} is not one of the card's engines")
        if not isinstance(th, dict) or set(th) != PROFILE_THRESHOLD_KEYS:
            raise _fail(
                source,
                f"{field}.engines.{eid}",
                f"must have exactly {sorted(PROFILE_THRESHOLD_KEYS)}",
            )
        for k, text in th.items():
            try:
                value = float(text) if isinstance(text, str) and len(text) <= 32 else math.nan
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value >= 0) or _float_text(value) != text:
                raise _fail(
                    source,
                    f"{field}.engines.{eid}.{k}",
                    f"{text!r} is not a canonical decimal >= 0",
                )


def _check_mirrors(mirrors: Any, source: str) -> None:
    """``mirrors``: 1..MAX_CARD_MIRRORS distinct, normalized mirror URLs (an empty list is
    written as no field at all, so it is refused: one card, one encoding)."""
    if not isinstance(mirrors, list) or not 1 <= len(mirrors) <= MAX_CARD_MIRRORS:
        raise _fail(source, "mirrors", f"must be a list of 1 to {MAX_CARD_MIRRORS} URLs")
    for url in mirrors:
        if not isinstance(url, str) or not 0 < len(url) <= MAX_MIRROR_URL:
            raise _fail(source, "mirrors", f"{url!r} is not a URL (<= {MAX_MIRROR_URL} chars)")
        try:
            normal = check_mirror_url(url, "mirrors")
        except ConfigError as exc:
            raise _fail(source, "mirrors", str(exc).removeprefix("mirrors: ")) from None
        if normal != url:
            raise _fail(source, "mirrors", f"{url!r} is not in normal form ({normal!r})")
    if len(set(mirrors)) != len(mirrors):
        raise _fail(source, "mirrors", "a mirror is listed twice")


@dataclass(frozen=True)
class SignedRunCard:
    """A card with the trainer's signature (``legacy``: read in the old format, kept in it)."""

    card: RunCard
    signer: str
    signature: bytes
    legacy: bool = False

    @property
    def digest(self) -> str:
        """The card's digest."""
        return self.card.digest()

    @property
    def version(self) -> int:
        """The card version."""
        return self.card.card_version

    def envelope(self) -> dict[str, Any]:
        """The old-format JSON envelope ``{"body", "signer", "signature"}``."""
        return {
            "body": self.card.to_obj(),
            "signer": self.signer,
            "signature": self.signature.hex(),
        }

    def sealed(self) -> bytes:
        """The :mod:`p2p.envelope` bytes (new format only).

        Raises:
            LocalProtocolError: the card was signed in the old format.
        """
        if self.legacy:
            raise LocalProtocolError("an old-format run card has no envelope bytes")
        return envelope.encode_sealed(
            CARD_KIND, self.card.canonical_bytes(), public_key_of(self.signer), self.signature
        )

    def encode(self) -> bytes:
        """Canonical JSON bytes of the document (what is stored and served)."""
        if self.legacy:
            return canonical_json(self.envelope())
        sealed = base64.b64encode(self.sealed()).decode("ascii")
        return canonical_json({"v": CARD_DOCUMENT_VERSION, "sealed": sealed})

    @classmethod
    def decode(cls, data: bytes, *, trainer: str, source: str = "") -> SignedRunCard:
        """Parse and verify a document (either format) against the pinned trainer PeerID.

        Args:
            data: the document bytes (untrusted).
            trainer: the pinned trainer PeerID.
            source: who sent it (PeerID, URL or path), for errors.

        Raises:
            MalformedRunCard: too large, not JSON, malformed envelope or body.
            BadRunCardSignature: the signature does not verify.
            WrongRunCardKey: a valid signature by a key other than ``trainer``.
        """
        if len(data) > MAX_CARD_BYTES:
            raise _fail(source, "", f"{len(data)} bytes exceed {MAX_CARD_BYTES}")
        try:
            env = loads_untrusted(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _fail(source, "", f"not JSON: {exc}") from exc
        if isinstance(env, dict) and set(env) == {"body", "signer", "signature"}:
            return cls._decode_legacy(env, trainer, source)
        if not isinstance(env, dict) or set(env) != {"v", "sealed"}:
            raise _fail(source, "", "document must have exactly v, sealed")
        fields.need_version(env, CARD_DOCUMENT_VERSION, "run card", source, error=MalformedRunCard)
        text = fields.need_str(env, "sealed", MAX_CARD_BYTES, source, error=MalformedRunCard)
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _fail(source, "sealed", "is not base64") from exc
        if base64.b64encode(raw).decode("ascii") != text:
            raise _fail(source, "sealed", "is not canonical base64")
        try:
            opened = envelope.open(CARD_KIND, raw, trainer, MAX_CARD_BODY_BYTES, sender=source)
        except BadSignature as exc:
            raise BadRunCardSignature(f"run card signature ({exc})", source) from exc
        except UntrustedSigner as exc:
            raise WrongRunCardKey(
                f"run card signed by {exc.source}, the pinned trainer is {trainer}", source
            ) from exc
        except RemoteProtocolError as exc:  # MalformedEnvelope, MessageTooLarge
            raise _fail(source, "sealed", str(exc)) from exc
        try:
            body = loads_untrusted(opened.body)
            canonical = canonical_json(body) == opened.body
        except (ValueError, UnicodeDecodeError, TypeError) as exc:
            raise _fail(source, "", f"body is not JSON: {exc}") from exc
        if not canonical:
            raise _fail(source, "", "body is not canonical JSON")
        return cls._checked(body, opened.signer, opened.signature, False, source)

    @classmethod
    def _decode_legacy(cls, env: dict[str, Any], trainer: str, source: str) -> SignedRunCard:
        signer, sig_hex = env["signer"], env["signature"]
        if not isinstance(signer, str) or not isinstance(sig_hex, str) or len(sig_hex) != 128:
            raise _fail(source, "signature", "signer and a 128-hex-digit signature are required")
        try:
            signature = bytes.fromhex(sig_hex)
        except ValueError as exc:
            raise _fail(source, "signature", "is not hex") from exc
        try:
            body = canonical_json(env["body"])
        except TypeError as exc:
            raise _fail(source, "", f"body is not canonical JSON: {exc}") from exc
        try:
            verify(signer, CARD_DOMAIN, body, signature)
        except IntegrityError as exc:
            raise BadRunCardSignature(f"run card signature ({exc})", source) from exc
        if signer != trainer:
            raise WrongRunCardKey(
                f"run card signed by {signer}, the pinned trainer is {trainer}", source
            )
        return cls._checked(env["body"], signer, signature, True, source)

    @classmethod
    def _checked(
        cls, body: Any, signer: str, signature: bytes, legacy: bool, source: str
    ) -> SignedRunCard:
        card = RunCard.from_obj(body, source)
        if card.trainer != signer:
            raise _fail(source, "trainer", f"names {card.trainer} but is signed by {signer}")
        return cls(card, signer, signature, legacy)

    @classmethod
    def load(cls, path: Path, *, trainer: str) -> SignedRunCard | None:
        """The card stored at ``path``, verified, or None if there is no file.

        Raises:
            MalformedRunCard, BadRunCardSignature, WrongRunCardKey: see :meth:`decode`.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        return cls.decode(data, trainer=trainer, source=str(path))


def sign_card(card: RunCard, signer: KeyHolder) -> SignedRunCard:
    """Sign ``card`` with the trainer's key (an Identity or its signing key).

    Raises:
        ConfigError: ``card.trainer`` is not the signer's PeerID (field ``trainer``).
    """
    key = signer.key
    if card.trainer != key.peer_id:
        raise ConfigError("trainer", f"card names {card.trainer}, the key is {key.peer_id}")
    return SignedRunCard(card, key.peer_id, envelope.sign(CARD_KIND, card.canonical_bytes(), key))


def next_card(rules: RunCard, previous: SignedRunCard | None, signer: KeyHolder) -> SignedRunCard:
    """The card to publish for ``rules``, given the card published before (if any).

    ``rules``' ``card_version`` and ``issued_at_ms`` are the proposal: if ``previous`` has the
    same rules it is kept as is (same version and digest, e.g. after a restart); otherwise
    the new card gets ``previous.card_version + 1`` (or ``rules.card_version`` for the first).

    Raises:
        ConfigError: ``previous`` belongs to another run (field ``run_id``) or another
            trainer (field ``trainer``), or the signer is not ``rules.trainer``.
    """
    if previous is not None:
        old = previous.card
        if old.run_id != rules.run_id:
            raise ConfigError(
                "run_id",
                f"the data directory holds run {old.run_id!r} (card v{old.card_version}), "
                f"not {rules.run_id!r}: use another --data-dir or --run-id {old.run_id}",
            )
        if old.trainer != rules.trainer:
            raise ConfigError("trainer", f"the stored card belongs to trainer {old.trainer}")
        if old.same_rules(rules):
            # an old-format card is resealed as it is (same body, version and digest)
            return sign_card(old, signer) if previous.legacy else previous
        rules = replace(rules, card_version=old.card_version + 1)
    return sign_card(rules, signer)


def architecture_digest(config: Mapping[str, Any]) -> str:
    """BLAKE3 hex digest of a model's ``config.json`` (a dict), keys that do not describe the
    architecture (:data:`IGNORED_CONFIG_KEYS`: dtype, versions, names) left out.

    Floats are written with Python's shortest round-trip ``repr``; keys sorted, no spaces.
    """
    kept = {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return blake3_hex(text.encode())


def choose_engine(
    card: RunCard, local: Mapping[str, frozenset[str]], preferred: str | None = None
) -> EngineSpec:
    """Pick the engine a peer runs for ``card`` (pure).

    Args:
        card: the run's card.
        local: engine family -> dtypes this machine can run (e.g. ``{"transformers":
            {"bf16"}}``; ``vllm`` only when installed).
        preferred: the family the operator asked for, or None (the card's first runnable).

    Raises:
        UnsupportedEngine: nothing the card accepts runs here (or not the preferred family);
            the message names what the card asks for and what this machine has.
    """
    have = sorted(f"{f}-{d}" for f, ds in local.items() for d in ds)
    asked = ", ".join(e.id for e in card.engines)
    for e in card.engines:
        if e.dtype in local.get(e.family, frozenset()) and preferred in (None, e.family):
            return e
    if preferred is not None:
        why = (
            f"--engine {preferred} is not among the engines of run card "
            f"v{card.card_version} ({asked})"
            if all(e.family != preferred for e in card.engines)
            else f"--engine {preferred} cannot run {asked} here (this machine has: "
            f"{', '.join(have) or 'none'})"
        )
        raise UnsupportedEngine(why)
    raise UnsupportedEngine(
        f"run card v{card.card_version} accepts rollouts from {asked}; this machine can run "
        f"{', '.join(have) or 'none'} (vllm needs the shardnet[vllm] extra)"
    )
