"""node: one node per data directory, held by an advisory lock for the node's lifetime.

Two processes on one data directory (a second trainer started by mistake on the live one's,
say) would commit, retain and sign into one store: a second trainer resumed the first one's run
and signed its end into the shared store. :func:`lock_data_dir` takes an exclusive
``flock(2)`` on ``<data_dir>/node.lock`` before the node reads or writes anything else there;
the kernel releases it when the process exits, however it exits (no stale lock after a crash
or SIGKILL). Readers that are meant to run beside a node (``shardnet mirror export``,
``shardnet status``) do not take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from p2p.errors import ConfigError

LOCK_FILE = "node.lock"


@contextlib.contextmanager
def lock_data_dir(data_dir: Path) -> Iterator[None]:
    """Hold ``data_dir``'s node lock while the context runs (created with the directory if
    missing; the lock file keeps the holder's pid, for the message below).

    Raises:
        ConfigError: (field ``data_dir``) another process holds the lock (naming its pid), or
            the directory or its lock file cannot be created or opened.
    """
    path = data_dir / LOCK_FILE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError("data_dir", f"cannot use {data_dir}: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                "data_dir",
                f"{data_dir} is in use by another shardnet node (pid {holder}): "
                "one node per data directory",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
