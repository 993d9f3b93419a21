"""publish: the origin's run-end counter, which orders its run ends and continuations.

The trainer signs :class:`~shardcast.wire.finish.RunFinished` when its last step is out and
:class:`~shardcast.wire.finish.RunContinued` when it is restarted on a finished run with more
steps to go. Followers keep whichever is newer by
:func:`~shardcast.wire.finish.end_order` (step, then ``seq``), so each message the origin signs
gets a ``seq`` one higher than any before it: :func:`next_end_seq` keeps the counter in
``<data_dir>/versions/<run>/.run-end.json``, written (fsynced, then renamed) before the message
is signed, so a crash never reuses a value a follower may have seen.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from shardcast.store import replace_file

__all__ = ["END_SEQ_FILE", "next_end_seq"]

log = logging.getLogger(__name__)

END_SEQ_FILE = ".run-end.json"


def next_end_seq(path: Path) -> int:
    """Increment the counter kept at ``path`` and return the new value (>= 1). Blocking.

    A missing file counts as 0. An unreadable one (damaged, edited) cannot be trusted to be
    the highest value ever used, so the counter jumps to the wall clock in microseconds
    (far above any count of restarts; logged at WARNING) and goes on from there.

    Raises:
        OSError: the counter cannot be written.
    """
    try:
        current = json.loads(path.read_bytes())["seq"]
        if not isinstance(current, int) or isinstance(current, bool) or current < 0:
            raise ValueError(f"seq {current!r} is not a non-negative integer")
    except FileNotFoundError:
        current = 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        current = time.time_ns() // 1000
        log.warning("run_end_seq_unreadable path=%s error=%s seq_from=%d", path, exc, current)
    seq = current + 1
    replace_file(path, json.dumps({"seq": seq}).encode(), durable=True)
    return seq
