"""node: a follower's record of the run's end, kept across restarts.

Theory of operation
-------------------
A relay or peer learns that the run is over from the trainer's signed
:class:`~shardcast.wire.finish.RunFinished`, and that it goes on again from
:class:`~shardcast.wire.finish.RunContinued`. Both are held in memory by the node's
:class:`~shardcast.core.tracker.VersionTracker`. Without a record on disk, a follower restarted
after the trainer has exited no longer knows the run is over: it polls the departed trainer
on the live schedule (every few seconds, an INFO line each), and ``shardnet status`` says
nothing of the end.

So the newest of the two messages a follower takes is kept, as the trainer's signed envelope
bytes, in ``<data_dir>/versions/<run>/.run-end.signed`` (:data:`END_RECORD_FILE`), written
whole with :func:`shardcast.store.replace_file` (a crash leaves the old record or the new).
At start the follower reads it back and verifies it like any message from the network
(:func:`load_end`): a record that does not verify (damaged, another trainer's, another
run's) is logged and ignored, never trusted. A run end is restored only while no committed
version is newer than its step; a newer version means the run went on after it.

Restoring a continuation matters too: it keeps refusing a replay of the run end it lifted
(ordering in :func:`~shardcast.wire.finish.end_order`).

The origin keeps no such record: its run ends come from its own counter and its trainer's
steps (:mod:`shardcast.publish.runend`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from p2p.errors import ShardnetError
from p2p.trust import TrustList
from shardcast.store import replace_file
from shardcast.wire import RunContinued, RunFinished, decode_versions_message

__all__ = ["END_RECORD_FILE", "load_end", "save_end"]

log = logging.getLogger(__name__)

END_RECORD_FILE = ".run-end.signed"
#: a record larger than this is not one (the messages are a few hundred bytes), bytes
MAX_RECORD_BYTES = 64 * 1024


def save_end(run_dir: Path, msg: RunFinished | RunContinued) -> bool:
    """Keep ``msg`` (verified and taken by the node) as the run's end record. Blocking: a
    small file, written whole (temp file, rename; not fsynced: a record lost in a crash is
    learnt again from upstreams).

    Returns:
        False if it could not be written (logged at WARNING; the node goes on without it).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        replace_file(run_dir / END_RECORD_FILE, msg.encode(), durable=False)
    except OSError as exc:
        log.warning("run_end_record_unwritable path=%s error=%s", run_dir / END_RECORD_FILE, exc)
        return False
    return True


def load_end(
    run_dir: Path, trust: TrustList, run_id: str, newest_held: int | None
) -> RunFinished | RunContinued | None:
    """The run end or continuation recorded in ``run_dir``, verified against ``trust``.
    Blocking.

    Args:
        run_id: the run this node follows; a record of another run is ignored.
        newest_held: the newest committed step in the store (None: none). A run end below it
            is stale (the run went on) and not returned.

    Returns:
        the message, or None: no record, or one that is unreadable, does not verify, is of
        another run, is a version announcement, or is a stale run end (each but the first
        logged at WARNING or INFO).
    """
    path = run_dir / END_RECORD_FILE
    try:
        with path.open("rb") as f:
            data = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("run_end_record_unreadable path=%s error=%s", path, exc)
        return None
    try:
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
        msg = decode_versions_message(data, trust=trust, sender="")
        if not isinstance(msg, RunFinished | RunContinued):
            raise ValueError(f"holds a {type(msg).__name__}, not a run end")
        if msg.run_id != run_id:
            raise ValueError(f"is of run {msg.run_id!r}, not {run_id!r}")
    except (ShardnetError, ValueError) as exc:
        log.warning("run_end_record_ignored path=%s error=%s", path, exc)
        return None
    if isinstance(msg, RunFinished) and newest_held is not None and newest_held > msg.step:
        log.info("run_end_record_stale path=%s step=%d newest_held=%d", path, msg.step, newest_held)
        return None
    return msg
