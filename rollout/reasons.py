"""What the trainer answers to a rollout batch and why: one enum each for the validator, the
inbox, acks and metrics.

Theory of operation
-------------------
A rejection reason is decided in two places: :class:`rollout.verify.Validator` (the checks,
cheapest first; see the table in :mod:`rollout.verify`) and :class:`rollout.inbox.RolloutInbox`
(before any check: a payload that does not match its announcement, or does not decode). Both
name it with a :class:`RejectReason`; the member's value is the string that goes on the wire
(the ``reason`` of a ``rejected`` :class:`rollout.exchange.Ack`), into the
``shardnet_rollout_samples_rejected_total{reason}`` metric and into reports, so those keep
their names. It is a ``StrEnum``: a member compares equal to, hashes like and formats as its
value, so a reason decoded from the wire (a plain ``str``) finds its counter and its penalty.
An :class:`rollout.exchange.Ack`'s ``status`` is an :class:`AckStatus`; its ``reason`` is a
:class:`RejectReason` when the status is ``rejected`` and an :class:`AckReason` otherwise
(``accepted``/``ok``, ``ignored``/``refused``, ``retry`` with why the peer should try again).
This module imports nothing, so light modules (:mod:`rollout.reputation`, the simulator) can
use it without the validator's numpy.
"""

from __future__ import annotations

import enum

__all__ = ["AckReason", "AckStatus", "RejectReason"]


class RejectReason(enum.StrEnum):
    """Why a rollout batch was rejected (the value is the wire/metric string)."""

    UNTRUSTED = "untrusted"  # submitter not allowed, or signer and payload disagree
    WRONG_RUN = "wrong_run"  # run id, task, sampling parameters or engine differ
    STALE_STEP = "stale_step"  # policy step outside the accepted window
    UNKNOWN_WEIGHTS = "unknown_weights"  # manifest digest is not the claimed step's
    DUPLICATE = "duplicate"  # the same (submitter, step) was already accepted
    PROMPT = "prompt"  # not the seeded prompts, or a wrong group layout
    TERMINATION = "termination"  # a sample ends (or fails to end) against the rules
    REWARD = "reward"  # reported reward differs from the recomputed one
    TOPLOC = "toploc"  # a TOPLOC proof does not match the validator's prefill
    REPLAY = "replay"  # a token is not the seeded Gumbel-max choice
    SAMPLING = "sampling"  # reported logprobs differ from the validator's
    CHECK_ERROR = "check_error"  # a check raised (fail closed)
    INTEGRITY = "integrity"  # inbox: the fetched payload does not match its announcement
    SCHEMA = "schema"  # inbox: the payload does not decode, or names another step


class AckStatus(enum.StrEnum):
    """What the trainer decided about an announced batch (the value is the wire string)."""

    ACCEPTED = "accepted"  # final: the batch joined the training buffer
    REJECTED = "rejected"  # final: the reason is a RejectReason
    IGNORED = "ignored"  # final: the submitter is refused (reputation below the threshold)
    RETRY = "retry"  # not final: the peer announces it again after a backoff


class AckReason(enum.StrEnum):
    """Why an ack is not a rejection (the value is the wire string, as ``status:reason`` keys
    the inbox's answer counts: ``retry:busy``)."""

    OK = "ok"  # accepted
    REFUSED = "refused"  # ignored: the submitter's reputation is below the threshold
    RATE_LIMITED = "rate_limited"  # retry: the submitter's announcement bucket is empty
    AHEAD = "ahead"  # retry: the batch names a policy step the trainer has not reached
    BUSY = "busy"  # retry: the training buffer is full
    FETCH_FAILED = "fetch_failed"  # retry: the trainer could not fetch the payload
