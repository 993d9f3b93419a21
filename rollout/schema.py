"""Rollout batches (wire schema version 2) and their signed announcements (version 1).

Theory of operation
-------------------
An inference peer answers the prompts assigned to it at a policy step (see
:mod:`rollout.task`) with ``group_size`` samples each, and packs them into one
:class:`RolloutBatch`: canonical CBOR, at most ``MAX_BATCH_BYTES``. The batch is never signed
by itself; instead the peer seals a small :class:`RolloutAnnouncement` (a :mod:`p2p.envelope`
of kind ``rollout-announcement``) carrying the batch's BLAKE3 digest and size, the policy step
and the submitter's PeerID, which must be the envelope's signer. The announcement travels
over gossip and over a direct stream to the trainer; the payload is fetched once, checked
against the announced digest and size, and only then decoded. So a payload is bound to its
submitter's key without signing megabytes, and a trainer can refuse a batch (stale step, bad
reputation, rate limit) before spending bandwidth on it.

Batch schema 2 adds ``engine``, the id of the inference engine that sampled the batch
(``transformers-bf16``, ``vllm-bf16``: :attr:`shardcast.wire.runcard.EngineSpec.id`), which must be
one of the run card's engines. Schema-1 batches (from peers before it) still decode, with
``engine == ""``, so that the validator rejects them as ``wrong_run`` with a clear reason
rather than as malformed.

Field bounds are enforced while decoding (lengths, token-id and float ranges); semantic checks
(prompt correctness, rewards, TOPLOC proofs) belong to :mod:`rollout.verify`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3

from p2p import envelope, wire
from p2p.envelope import ANY_SIGNER, Kind
from p2p.errors import RemoteProtocolError, UntrustedSigner
from p2p.keys import KeyHolder, public_key_of

ANNOUNCE_KIND = Kind.ROLLOUT_ANNOUNCEMENT
MAX_BATCH_BYTES = 32 * 1024 * 1024
MAX_ANNOUNCEMENT_BYTES = 4096
MAX_GROUPS = 1024
MAX_SAMPLES = 256
MAX_TOKENS = 32768
MAX_PROOF_BYTES = 1 << 20
MAX_ENGINE_ID = 40
FINISH_REASONS = ("stop", "length")
BATCH_SCHEMA = 2
DEFAULT_ENGINE_ID = "transformers-bf16"
"""The engine id a batch names when none is given (``shardcast.wire.runcard.DEFAULT_ENGINE``)."""


BATCH_ID_DOMAIN = b"rollout-batch-id/v1\x00"


def batch_id_for(submitter: str, digest: str) -> str:
    """The id of a batch: 32 hex characters of BLAKE3 over the submitter's PeerID and the
    payload digest, so that two submitters announcing the same bytes name two batches (a
    decision about one submitter's announcement can never land on another's batch)."""
    h = blake3.blake3(BATCH_ID_DOMAIN)
    h.update(submitter.encode())
    h.update(b"\x00")
    h.update(digest.encode())
    return h.hexdigest()[:32]


def check_announcement_gossip(run_id: str) -> Callable[[str, bytes], None]:
    """Gossip check of the rollouts topic: a well-formed announcement of ``run_id`` signed by
    its submitter (run before the message is delivered or forwarded).

    The returned function raises RemoteProtocolError or IntegrityError.
    """

    def check(origin: str, data: bytes) -> None:
        ann = RolloutAnnouncement.decode(data, sender=origin)
        if ann.run_id != run_id:
            raise RemoteProtocolError(origin, f"rollout announcement of run {ann.run_id!r}")

    return check


def rollouts_topic(run_id: str) -> str:
    """Gossipsub topic of rollout announcements for ``run_id``."""
    return f"shardnet/{run_id}/rollouts/1"


@dataclass(frozen=True)
class Sample:
    """One completion of a prompt.

    Attributes:
        completion_ids: sampled token ids, ``[N]``.
        logprobs: log-probability of each sampled token under the sampling distribution,
            ``[N]``, natural log, each in ``[-1e4, 0]``.
        reward: the reward the peer computed (the trainer recomputes it; never trusted).
        finish_reason: ``"stop"`` (ended with EOS) or ``"length"`` (hit the cap).
        proof: TOPLOC proofs of this sample, concatenated (258 bytes each by default).
    """

    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    finish_reason: str
    proof: bytes


@dataclass(frozen=True)
class Group:
    """The samples of one prompt (a GRPO group).

    Attributes:
        prompt_index: position of the prompt in ``task.prompts_for(submitter, step, n)``.
        prompt_ids: the prompt's token ids, ``[L]``.
        samples: ``group_size`` samples.
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class RolloutBatch:
    """All groups a peer produced for one policy step.

    Attributes:
        run_id: the run.
        submitter: the producing peer's PeerID.
        policy_step: the version whose weights generated the samples.
        manifest_digest: digest of that version's manifest (binds the exact weights).
        task: task name, e.g. ``"digits/1"``.
        n_prompts: how many prompts the peer was assigned (``prompts_for(..., n)``).
        seed: the sampling seed the peer used.
        temperature: sampling temperature (> 0).
        max_new_tokens: the length cap.
        groups: the groups, one per prompt.
        engine: id of the engine family and dtype that sampled it (``transformers-bf16``);
            ``""`` for a decoded schema-1 batch.
    """

    run_id: str
    submitter: str
    policy_step: int
    manifest_digest: str
    task: str
    n_prompts: int
    seed: int
    temperature: float
    max_new_tokens: int
    groups: tuple[Group, ...]
    engine: str = DEFAULT_ENGINE_ID

    def encode(self) -> bytes:
        """Canonical CBOR bytes (schema 2)."""
        return wire.encode(
            {
                "v": BATCH_SCHEMA,
                "engine": self.engine,
                "run_id": self.run_id,
                "submitter": self.submitter,
                "policy_step": self.policy_step,
                "manifest_digest": self.manifest_digest,
                "task": self.task,
                "n_prompts": self.n_prompts,
                "seed": self.seed,
                "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens,
                "groups": [
                    {
                        "i": g.prompt_index,
                        "prompt": list(g.prompt_ids),
                        "samples": [
                            {
                                "ids": list(s.completion_ids),
                                "lp": list(s.logprobs),
                                "r": s.reward,
                                "fin": s.finish_reason,
                                "proof": s.proof,
                            }
                            for s in g.samples
                        ],
                    }
                    for g in self.groups
                ],
            }
        )

    @property
    def n_samples(self) -> int:
        """Total samples over all groups."""
        return sum(len(g.samples) for g in self.groups)

    @classmethod
    def decode(cls, data: bytes, *, vocab_size: int, sender: str = "") -> RolloutBatch:
        """Parse a batch with bounds checks (token ids in ``[0, vocab_size)``, lengths, floats).

        Raises:
            MessageTooLarge / RemoteProtocolError: malformed or out of bounds.
        """
        obj = wire.decode(data, max_bytes=MAX_BATCH_BYTES, sender=sender)
        version = wire.need(obj, "v", int, sender)
        if version not in (1, BATCH_SCHEMA):
            wire.need_version(obj, BATCH_SCHEMA, "rollout batch", sender)  # raises
        engine = "" if version == 1 else wire.need_str(obj, "engine", MAX_ENGINE_ID, sender)
        max_new = wire.need_int(obj, "max_new_tokens", 1, MAX_TOKENS, sender)
        groups = []
        for raw in wire.need_list(obj, "groups", MAX_GROUPS, sender):
            if not isinstance(raw, dict):
                raise RemoteProtocolError(sender, "group is not a map")
            prompt = _ids(wire.need_list(raw, "prompt", MAX_TOKENS, sender), vocab_size, sender)
            if not prompt:
                raise RemoteProtocolError(sender, "empty prompt")
            samples = []
            for rs in wire.need_list(raw, "samples", MAX_SAMPLES, sender):
                if not isinstance(rs, dict):
                    raise RemoteProtocolError(sender, "sample is not a map")
                ids = _ids(wire.need_list(rs, "ids", max_new, sender), vocab_size, sender)
                lps = wire.need_list(rs, "lp", max_new, sender)
                if len(lps) != len(ids) or not ids:
                    raise RemoteProtocolError(
                        sender, "logprobs and completion lengths differ or the completion is empty"
                    )
                if not all(
                    isinstance(x, float | int)
                    and not isinstance(x, bool)
                    and math.isfinite(x)
                    and -1e4 <= x <= 0
                    for x in lps
                ):
                    raise RemoteProtocolError(sender, "logprob outside [-1e4, 0]")
                fin = wire.need_str(rs, "fin", 8, sender)
                if fin not in FINISH_REASONS:
                    raise RemoteProtocolError(sender, f"finish reason {fin!r}")
                samples.append(
                    Sample(
                        tuple(ids),
                        tuple(float(x) for x in lps),
                        wire.need_float(rs, "r", -1e6, 1e6, sender),
                        fin,
                        wire.need_bytes(rs, "proof", MAX_PROOF_BYTES, sender),
                    )
                )
            if not samples:
                raise RemoteProtocolError(sender, "group without samples")
            groups.append(
                Group(wire.need_int(raw, "i", 0, MAX_GROUPS, sender), tuple(prompt), tuple(samples))
            )
        return cls(
            wire.need_str(obj, "run_id", 128, sender),
            wire.need_str(obj, "submitter", 128, sender),
            wire.need_int(obj, "policy_step", 0, 1 << 62, sender),
            wire.need_str(obj, "manifest_digest", 64, sender),
            wire.need_str(obj, "task", 64, sender),
            wire.need_int(obj, "n_prompts", 1, MAX_GROUPS, sender),
            wire.need_int(obj, "seed", 0, (1 << 63) - 1, sender),
            wire.need_float(obj, "temperature", 1e-3, 100.0, sender),
            max_new,
            tuple(groups),
            engine,
        )


def _ids(raw: list[Any], vocab_size: int, sender: str) -> list[int]:
    for t in raw:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RemoteProtocolError(sender, f"token id {t!r} outside [0, {vocab_size})")
    return raw


@dataclass(frozen=True)
class RolloutAnnouncement:
    """The signed, small announcement of a batch.

    Attributes:
        run_id: the run.
        batch_id: 32 hex chars, unique per (submitter, payload): :func:`batch_id_for`.
        digest: BLAKE3 hex digest of the payload bytes.
        size: payload size in bytes.
        step: the batch's policy step.
        submitter: PeerID of the peer that produced and signed it.
        signature: Ed25519 signature by ``submitter`` (envelope kind ``rollout-announcement``).
    """

    run_id: str
    batch_id: str
    digest: str
    size: int
    step: int
    submitter: str
    signature: bytes

    def _body(self) -> bytes:
        return wire.encode(
            {
                "v": 1,
                "run_id": self.run_id,
                "batch_id": self.batch_id,
                "digest": self.digest,
                "size": self.size,
                "step": self.step,
                "submitter": self.submitter,
            }
        )

    @classmethod
    def for_payload(
        cls, identity: KeyHolder, run_id: str, step: int, payload: bytes
    ) -> RolloutAnnouncement:
        """Announce ``payload`` (an encoded batch) signed by ``identity`` (an Identity or a
        signing key)."""
        key = identity.key
        digest = blake3.blake3(payload).hexdigest()
        batch_id = batch_id_for(key.peer_id, digest)
        unsigned = cls(run_id, batch_id, digest, len(payload), step, key.peer_id, b"")
        sig = envelope.sign(ANNOUNCE_KIND, unsigned._body(), key)
        return cls(run_id, batch_id, digest, len(payload), step, key.peer_id, sig)

    def encode(self) -> bytes:
        """The sealed envelope bytes (:mod:`p2p.envelope`), signed by the submitter."""
        return envelope.encode_sealed(
            ANNOUNCE_KIND, self._body(), public_key_of(self.submitter), self.signature
        )

    @classmethod
    def decode(cls, data: bytes, sender: str = "") -> RolloutAnnouncement:
        """Parse and verify the submitter's signature (trust decisions are the caller's).

        Raises:
            MessageTooLarge, MalformedEnvelope, FieldError (RemoteProtocolError): malformed.
            BadSignature (IntegrityError): the signature does not verify.
            UntrustedSigner (IntegrityError): signed by a key other than the submitter's.
        """
        opened = envelope.open(
            ANNOUNCE_KIND, data, ANY_SIGNER, MAX_ANNOUNCEMENT_BYTES, sender=sender
        )
        body_bytes, sig = opened.body, opened.signature
        body = wire.decode(body_bytes, max_bytes=MAX_ANNOUNCEMENT_BYTES, sender=sender)
        wire.need_version(body, 1, "rollout announcement", sender)
        ann = cls(
            wire.need_str(body, "run_id", 128, sender),
            wire.need_str(body, "batch_id", 32, sender),
            wire.need_str(body, "digest", 64, sender),
            wire.need_int(body, "size", 1, MAX_BATCH_BYTES, sender),
            wire.need_int(body, "step", 0, 1 << 62, sender),
            wire.need_str(body, "submitter", 128, sender),
            sig,
        )
        if ann._body() != body_bytes:
            raise RemoteProtocolError(sender, "announcement body is not canonical")
        if ann.submitter != opened.signer:
            raise UntrustedSigner(
                f"rollout announcement of {ann.submitter} signed by {opened.signer}",
                opened.signer,
            )
        if ann.batch_id != batch_id_for(ann.submitter, ann.digest):
            raise RemoteProtocolError(sender, "batch_id does not bind the submitter and digest")
        return ann

    def check_payload(self, payload: bytes, source: str = "") -> None:
        """Check ``payload`` against the announced size and digest.

        Raises:
            IntegrityError: size or digest mismatch.
        """
        from p2p.errors import IntegrityError

        if len(payload) != self.size:
            raise IntegrityError(
                f"batch {self.batch_id} has {len(payload)} bytes, announced {self.size}", source
            )
        if blake3.blake3(payload).hexdigest() != self.digest:
            raise IntegrityError(f"batch {self.batch_id} digest mismatch", source)
