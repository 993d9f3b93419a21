"""Rollout rejection reasons are one enum (:class:`rollout.reasons.RejectReason`), whose values
are the wire/metric strings: every place that decides a reason uses a member, every member has
a penalty and a line in the validator's table, and a member goes on the wire as its string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import rollout.verify
from rollout.exchange import Ack
from rollout.reasons import AckStatus, RejectReason
from rollout.reputation import Reputation, ReputationConfig
from rollout.toploc_judge import ToplocReason, judge

ROOT = Path(__file__).parents[2]
DECIDED_BY_INBOX = {RejectReason.INTEGRITY, RejectReason.SCHEMA}


def test_values_are_the_wire_and_metric_strings() -> None:
    """Reports, metrics and acks keep their names: the value is the lower-case member name."""
    assert {r.value for r in RejectReason} == {r.name.lower() for r in RejectReason}
    assert len({r.value for r in RejectReason}) == len(RejectReason)


def test_every_reason_has_a_penalty() -> None:
    """Adding a reason means deciding what it costs its submitter."""
    assert set(ReputationConfig().penalties) == set(RejectReason)


@pytest.mark.parametrize("reason", list(RejectReason))
def test_a_reason_round_trips_the_wire_as_its_string(reason: RejectReason) -> None:
    sent = Ack("b" * 32, AckStatus.REJECTED, reason)
    assert sent.encode() == Ack("b" * 32, AckStatus.REJECTED, reason.value).encode()
    got = Ack.decode(sent.encode())
    assert type(got.reason) is str
    assert got.reason == reason
    # a reason read off the wire (a plain str) finds the member's penalty
    rep = Reputation(ReputationConfig())
    assert rep.record("peer", False, got.reason) == pytest.approx(
        1.0 - ReputationConfig().penalties[reason]
    )


def test_the_validator_table_lists_what_the_validator_decides() -> None:
    """The module table of :mod:`rollout.verify` names every reason the validator decides."""
    doc = rollout.verify.__doc__ or ""
    table = doc.split("===============  ====", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^([a-z_]+)\s{2,}", table, re.MULTILINE))
    assert listed - {"reason"} == {r.value for r in RejectReason} - DECIDED_BY_INBOX


@pytest.mark.parametrize("module", ["rollout/verify.py", "rollout/inbox.py"])
def test_reasons_are_decided_with_members_not_strings(module: str) -> None:
    """No ``Reject("...")``, ``_refuse(ann, "...")`` or ``reject_unchecked("...")``: a string
    literal could name a reason that does not exist."""
    tree = ast.parse((ROOT / module).read_text())
    deciders = {"Reject": 0, "_refuse": 1, "reject_unchecked": 0, "_reject": 0}
    found = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in deciders and len(node.args) > deciders[name]:
            found += 1
            arg = node.args[deciders[name]]
            assert not isinstance(arg, ast.Constant), (
                f"{module}:{node.lineno} names a reason {arg.value!r}"
            )
    assert found > 0


def test_toploc_judge_reasons() -> None:
    assert judge([]).reason is ToplocReason.NO_CHUNKS
    assert str(ToplocReason.MANT_ERR_MEAN) == "mant_err_mean"
