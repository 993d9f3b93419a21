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
from shardcast.core.catchup import plan, worth_finishing
from shardcast.core.liveness import Abandon, Answer
from shardcast.core.mirrorpoll import MirrorPoll
from shardcast.core.pollpolicy import PollPolicy, poll_delay
from shardcast.core.retention import versions_to_prune
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

__all__ = [
    "Abandon",
    "Action",
    "Answer",
    "Ban",
    "Blame",
    "Cancel",
    "Check",
    "Commit",
    "Compare",
    "DownloadStats",
    "Drop",
    "End",
    "Fail",
    "Fetch",
    "Keep",
    "KeepSuspect",
    "MirrorPoll",
    "Offer",
    "Outcome",
    "PollHave",
    "PollPolicy",
    "Probe",
    "SchedulerConfig",
    "Session",
    "SessionConfig",
    "SourceBans",
    "Verdict",
    "blame",
    "catchup",
    "plan",
    "poll_delay",
    "versions_to_prune",
    "worth_finishing",
]
