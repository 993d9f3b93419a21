"""Real processes for integration tests: ``shardnet`` nodes, a free port, nginx on 127.0.0.1.

* :class:`Node` runs one ``python -m shardnet.cli ...`` process; its stderr is read line by
  line in a thread, so a test waits for a log line as an event, with a deadline.
* :func:`nodes` (a fixture: import it into a test module) stops every node a test started.
* :func:`nginx` serves a directory with Debian's nginx (foreground, one process) on a free
  127.0.0.1 port; :data:`NGINX` is its binary (None when missing: tests skip on
  :data:`NEEDS_NGINX`). Its error log is read through a pipe too: nginx logs its version
  (``[notice] ... nginx/1.22.1``) once its configuration is loaded and its sockets listen,
  and that line is the readiness event.

Nothing here polls: every wait is for a line (or an exit), bounded by a deadline.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = [
    "LOOPBACK_ANY",
    "NEEDS_NGINX",
    "NGINX",
    "Node",
    "free_port",
    "nginx",
    "nodes",
]

# every node on 127.0.0.1: the roles' defaults (all interfaces, fixed ports) are for operators
LOOPBACK_ANY = ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """One ``shardnet`` process; its stderr lines are kept and can be waited for."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardnet.cli", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with open(self.log_path, "a") as fh:
            for line in self.proc.stderr:
                fh.write(line)
                self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 120.0, count: int = 1) -> str:
        """The ``count``-th line (old or new) matching ``pattern``; fails after ``timeout_s``
        (the lines are events: this blocks on the reader's queue, it never polls)."""
        rx = re.compile(pattern)
        seen = 0
        for line in self.lines:
            if rx.search(line):
                seen += 1
                if seen == count:
                    return line
        deadline = time.monotonic() + timeout_s
        what = f"/{pattern}/" + (f" {count} times" if count > 1 else "")
        try:
            while True:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:
                    pytest.fail(f"{self.name} exited before {what}; see {self.log_path}")
                self.lines.append(line)
                if rx.search(line):
                    seen += 1
                    if seen == count:
                        return line
        except queue.Empty:
            pytest.fail(f"{self.name}: no {what} within {timeout_s}s; see {self.log_path}")

    def drain(self) -> list[str]:
        """Every line read so far (after the process ended: all of them)."""
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                return self.lines
            if line is not None:
                self.lines.append(line)

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(1 for ln in self.drain() if rx.search(ln))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    started: list[Node] = []
    (tmp_path / "logs").mkdir()
    yield started
    for n in started:
        n.stop(signal.SIGKILL)


NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)
NEEDS_NGINX = pytest.mark.skipif(
    NGINX is None, reason="the nginx binary is missing (apt-get install nginx)"
)


@contextmanager
def nginx(root: Path, work: Path) -> Iterator[str]:
    """Serve ``root`` with nginx on 127.0.0.1 (foreground, one process); yields its URL.

    ``work/access.log`` has one line per request: ``<request> status=<code>
    bytes=<body bytes> auth="<X-Shardnet-Auth or ->"``.
    """
    assert NGINX is not None
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = work / "nginx.conf"
    temps = " ".join(
        f"{k}_temp_path {work / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf.write_text(
        f"daemon off; master_process off; pid {work}/nginx.pid;\n"
        "error_log stderr notice;\n"  # read through a pipe: its first lines say it is ready
        "events {}\n"
        # the log shows whether a request was signed (requests to a mirror are anonymous)
        "http { log_format lane '$request status=$status bytes=$body_bytes_sent "
        'auth="$http_x_shardnet_auth"\';\n'
        f"  access_log {work}/access.log lane; {temps}\n"
        "  default_type application/octet-stream;\n"
        f"  server {{ listen 127.0.0.1:{port}; root {root};\n"
        "    location ~ /(manifest|versions)$ { default_type application/json; } } }\n"
    )
    proc = subprocess.Popen(
        [NGINX, "-c", str(conf), "-p", str(work), "-e", "stderr"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    errors = _NginxLog(proc, work / "error.log")
    try:
        if not errors.listening.wait(10):
            pytest.fail(f"nginx did not listen within 10 s: {errors.path.read_text()[-2000:]}")
        if not errors.ready:
            proc.wait(5)
            pytest.fail(f"nginx exited {proc.returncode}: {errors.path.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        errors.thread.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


# logged by nginx after its configuration is loaded, i.e. after its sockets listen
_NGINX_STARTED = re.compile(r"\[notice\] \d+#\d+: nginx/\d")


class _NginxLog:
    """Copies nginx's error log (its stderr) to ``path`` in a thread; ``listening`` is set at
    the readiness line (``ready`` True) or when the log ends (nginx exited; ``ready`` False)."""

    def __init__(self, proc: subprocess.Popen[str], path: Path) -> None:
        self.proc = proc
        self.path = path
        self.ready = False
        self.listening = threading.Event()
        self.thread = threading.Thread(target=self._read, name="nginx-log", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.path.open("a") as fh:
            for line in self.proc.stderr:
                fh.write(line)
                fh.flush()
                if not self.ready and _NGINX_STARTED.search(line):
                    self.ready = True
                    self.listening.set()
        self.listening.set()
