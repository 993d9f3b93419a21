"""Logging configuration for entry points (libraries only emit; see STYLE.md §13).

Messages are ``event key=value`` strings. py-libp2p's own records (and multiaddr's) are
captured at WARNING and above and pass through the same handler as ours, rewritten as
``libp2p_message text="…"`` so that nothing raw reaches stderr (py-libp2p detaches its
``libp2p`` logger at import, which left its warnings to Python's last-resort handler).

``--log-json`` turns each record into one JSON object per line with ``ts``, ``level``,
``logger``, ``event`` and the ``key=value`` pairs split out, so log shippers can index them.
Times, in both formats, are wall-clock UTC in ISO 8601 with milliseconds
(``2026-05-01T12:00:00.123Z``; :func:`shardcast.node.nodestatus.iso`).
"""

from __future__ import annotations

import json
import logging
import sys

from shardcast.node import iso


class TextFormatter(logging.Formatter):
    """``<ISO time> <LEVEL> [<name>] <logger> <message>``."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``key=value`` pairs of the message become fields."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        event, _, rest = msg.partition(" ")
        out: dict[str, object] = {
            "ts": iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "event": event,
        }
        text = getattr(record, "library_text", None)
        for part in rest.split(" ") if text is None else ():
            key, sep, val = part.partition("=")
            if sep and key.isidentifier():
                out[key] = val
        if text is not None:
            out["text"] = text
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


LIBRARY_LOGGERS = ("libp2p", "multiaddr")
# Library warnings that shardnet causes by design or already reports as its own event; shown
# only at DEBUG:
# - gossipsub refusing a GRAFT from a direct peer (shardnet peers its connections directly,
#   so every heartbeat logs it), and the "GRAFT flood" that follows on the other side when
#   the refused peer GRAFTs again within the backoff (at every start; its score penalty gates
#   nothing: shardnet's router keeps py-libp2p's thresholds at -inf, p2p/gossip.py);
# - py-libp2p's per-address dial failure (the follower logs ``upstream_unreachable`` with
#   the error and its retry delay), and its failure to open a stream to a peer (shardnet's
#   request translates it into a typed error that its caller handles and logs: a ping to a
#   peer that is shutting down logged it at ERROR on every clean stop).
EXPECTED_LIBRARY_NOISE = (
    ("libp2p.pubsub.gossipsub", "GRAFT: ignoring request from direct peer"),
    ("libp2p.pubsub.gossipsub", "GRAFT flood detected from peer"),
    ("libp2p.transport.tcp", "Failed to open TCP stream"),
    ("libp2p.host.basic_host", "Failed to open stream to peer"),
)


class LibraryFilter(logging.Filter):
    """Rewrites a library's record as ``<library>_message text="…"`` (an event like ours).

    Records listed in :data:`EXPECTED_LIBRARY_NOISE` are dropped unless the root logger is at
    DEBUG.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        top = record.name.split(".", 1)[0]
        if top in LIBRARY_LOGGERS and not getattr(record, "_shardnet_rewritten", False):
            text = record.getMessage()
            if logging.getLogger().level > logging.DEBUG and any(
                record.name.startswith(name) and text.startswith(prefix)
                for name, prefix in EXPECTED_LIBRARY_NOISE
            ):
                return False
            record.msg = f"{top}_message text={json.dumps(text)}"
            record.args = None
            record._shardnet_rewritten = True
            record.library_text = text
        return True


def capture_library_logs(level: int) -> None:
    """Route py-libp2p's and multiaddr's loggers to the root handler at ``level`` or above.

    Imports libp2p first (through :mod:`p2p.host`) so that its import-time logging setup has
    run and is undone here, not after.
    """
    import p2p.host  # noqa: F401  (libp2p's import configures its logger; undo it below)

    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
        lg.setLevel(max(logging.WARNING, level))


def configure(level: str = "INFO", as_json: bool = False, name: str = "") -> None:
    """Configure the root logger to stderr (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{name} " if name else ""
        handler.setFormatter(
            TextFormatter(f"%(asctime)s %(levelname)s {prefix}%(name)s %(message)s")
        )
    handler.addFilter(LibraryFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    capture_library_logs(root.level)
