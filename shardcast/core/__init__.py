"""core: what a node decides, sans-IO (no trio, no I/O; ``now`` and a seeded
``random.Random`` come in as arguments).

One download's decisions (:mod:`.session`, events in, actions out), source selection
(:mod:`.select`), when to abandon a download (:mod:`.liveness`), which versions to fetch to
catch up (:mod:`.catchup`), retention (:mod:`.retention`), upstream poll pacing
(:mod:`.pollpolicy`) and what a mirror listed (:mod:`.mirrorpoll`). The trio drivers
(:mod:`shardcast.download`) and the simulator (``simulations/``) run the same objects.
Imports only :mod:`shardcast.wire` (and ``p2p.errors``).
"""

from __future__ import annotations

from shardcast.core import catchup
from shardcast.core.catchup import plan
from shardcast.core.liveness import Abandon, Answer
from shardcast.core.mirrorpoll import MirrorPoll
from shardcast.core.pollpolicy import PollPolicy, poll_delay
from shardcast.core.reachability import (
    DIALBACK_PROTOCOL,
    MAX_DIALBACK_BYTES,
    DialbackAnswer,
    DialbackLimiter,
    DialbackLimits,
    DialbackRequest,
    DialbackResult,
    LaneCheck,
    Reachability,
    judge_request,
)
from shardcast.core.retention import should_materialize, versions_to_prune
from shardcast.core.select import SchedulerConfig, SourceBans, blame
from shardcast.core.session import (
    Action,
    Ban,
    Blame,
    Cancel,
    Check,
    Commit,
    Compare,
    DownloadStats,
    Drop,
    End,
    Fail,
    Fetch,
    Keep,
    KeepSuspect,
    Offer,
    Outcome,
    PollHave,
    Probe,
    Session,
    SessionConfig,
    Verdict,
)
from shardcast.core.tracker import (
    LEARNED_KEPT,
    MANIFEST_RETRY_FIRST_S,
    MANIFEST_RETRY_MAX_S,
    FinishedTake,
    Held,
    PollNext,
    PollOutcome,
    Take,
    Version,
    VersionTracker,
    Via,
    Want,
    abandons,
    confirmed_elsewhere,
    judge,
    judge_finished,
    manifest_retry_s,
    superseded,
    want,
)

__all__ = [
    "DIALBACK_PROTOCOL",
    "LEARNED_KEPT",
    "MANIFEST_RETRY_FIRST_S",
    "MANIFEST_RETRY_MAX_S",
    "MAX_DIALBACK_BYTES",
    "Abandon",
    "Action",
    "Answer",
    "Ban",
    "Blame",
    "Cancel",
    "Check",
    "Commit",
    "Compare",
    "DialbackAnswer",
    "DialbackLimiter",
    "DialbackLimits",
    "DialbackRequest",
    "DialbackResult",
    "DownloadStats",
    "Drop",
    "End",
    "Fail",
    "Fetch",
    "FinishedTake",
    "Held",
    "Keep",
    "KeepSuspect",
    "LaneCheck",
    "MirrorPoll",
    "Offer",
    "Outcome",
    "PollHave",
    "PollNext",
    "PollOutcome",
    "PollPolicy",
    "Probe",
    "Reachability",
    "SchedulerConfig",
    "Session",
    "SessionConfig",
    "SourceBans",
    "Take",
    "Verdict",
    "Version",
    "VersionTracker",
    "Via",
    "Want",
    "abandons",
    "blame",
    "catchup",
    "confirmed_elsewhere",
    "judge",
    "judge_finished",
    "judge_request",
    "manifest_retry_s",
    "plan",
    "poll_delay",
    "should_materialize",
    "superseded",
    "versions_to_prune",
    "want",
]
