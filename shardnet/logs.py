"""Logging configuration for entry points (libraries only emit; see STYLE.md §13).

Messages are ``event key=value`` strings. ``--log-json`` turns each record into one JSON
object per line with ``ts``, ``level``, ``logger``, ``event`` and the ``key=value`` pairs split
out, so log shippers can index them.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``key=value`` pairs of the message become fields."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        event, _, rest = msg.partition(" ")
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "event": event,
        }
        for part in rest.split(" "):
            key, sep, val = part.partition("=")
            if sep and key.isidentifier():
                out[key] = val
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(level: str = "INFO", as_json: bool = False, name: str = "") -> None:
    """Configure the root logger to stderr (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{name} " if name else ""
        fmt = f"%(asctime)s.%(msecs)03d %(levelname)s {prefix}%(name)s %(message)s"
        formatter = logging.Formatter(fmt, "%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("libp2p", "multiaddr"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
