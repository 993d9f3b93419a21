"""Hosts made of network namespaces, for tests that deploy shardnet as an operator would.

Theory of operation
-------------------
:class:`Hosts` builds on :class:`simulations.netns.Lab`: a bridge in its own namespace and, per
host, a namespace whose ``eth0`` has a private address ``10.211.K.(i+2)/24`` on that bridge.
Nothing is created in the caller's namespace, and the only addresses in use are those of the
namespaces created here, so no traffic can leave them. The links are shaped at 1 Gb/s (the
lab always shapes; at that rate it never limits these tests).

:meth:`Hosts.add_router` adds a home router (source NAT, unsolicited inbound dropped) with a LAN
of its own, and :meth:`Hosts.add_behind` a host on that LAN: it can open connections to the
hosts on the bridge, and none of them can open one to it.

Every host also gets its own working directory (its "disk"), the cwd of its commands, so the
README's relative paths (``--key trainer.key``, ``--data-dir trainer-data``) mean the same as on
a machine of its own.

:meth:`Hosts.start` runs a long-lived command inside a host (``ip netns exec``, which execs the
command: the child's pid is the node's pid) in a session of its own; a reader thread copies its
stdout into ``<name>.out`` and picks out the ``shardnet-ready {json}`` line; another copies its
stderr (the node's ``event key=value`` log) into ``<name>.err`` and keeps its lines, so a test
waits for a log line as an event (:meth:`Node.wait_line`). :meth:`Node.stop` sends SIGTERM
to the process group and SIGKILL after a grace period; :meth:`Node.kill` sends SIGKILL.
:meth:`Hosts.close` (also on failure, via the fixture) stops every node it started and tears
the lab down, which kills whatever is left in the namespaces and deletes them. A lab whose
owner died is removed by :func:`simulations.netns.cleanup_stale` at the next start.

Waiting is unavoidable here (real processes, real time), but nothing polls: every wait blocks
until the awaited line is read (or the process exits), bounded by a deadline, and fails with the
tails of the node logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from simulations import netns

T = TypeVar("T")
READY_PREFIX = "shardnet-ready "
REPO = Path(__file__).parents[2]
LINK_BYTES_PER_S = 125e6  # 1 Gb/s: the lab shapes every link; this never limits a test


def available() -> tuple[bool, str]:
    """(True, "") if hosts can be made here (root, iproute2, ``ip netns``), else (False, why)."""
    return netns.available()


@dataclass(frozen=True)
class Host:
    """One emulated machine: a namespace, its address and its working directory."""

    name: str
    ip: str
    netns: str
    workdir: Path

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]


class _Lines:
    """The lines of one output stream as they are read, kept; each line wakes the waiters."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._cond = threading.Condition()

    def add(self, line: str) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait(self, match: Callable[[str], T | None], timeout_s: float) -> T | None:
        """The first non-None ``match(line)`` over the lines read so far and to come; None if
        the stream ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if (found := match(line)) is not None:
                        return found
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    return None
                self._cond.wait(left)


class Node:
    """A long-lived process on a host (see the module docstring)."""

    def __init__(self, name: str, host: Host, argv: list[str], logdir: Path) -> None:
        self.name = name
        self.host = host
        self.argv = argv
        self.out_path = logdir / f"{name}.out"
        self.err_path = logdir / f"{name}.err"
        self.ready: dict[str, Any] | None = None
        self._ready_event = threading.Event()
        self.log = _Lines()  # stderr
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # cwd is the host's directory: find this checkout's packages from there too
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
            ),
        }
        self.proc = subprocess.Popen(
            [*host.exec_prefix(), *argv],
            cwd=host.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            # background shells start jobs with SIGINT ignored; give the node the default
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self._reader = threading.Thread(target=self._read, name=f"stdout-{name}", daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(
            target=self._read_err, name=f"stderr-{name}", daemon=True
        )
        self._err_reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.out_path, "ab") as out:
            for line in iter(self.proc.stdout.readline, b""):
                out.write(line)
                out.flush()
                text = line.decode(errors="replace")
                if self.ready is None and text.startswith(READY_PREFIX):
                    self.ready = json.loads(text[len(READY_PREFIX) :])
                    self._ready_event.set()
        self._ready_event.set()  # stdout closed: the process is gone (or closing)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        try:
            with open(self.err_path, "ab") as err:
                for line in iter(self.proc.stderr.readline, b""):
                    err.write(line)
                    err.flush()
                    self.log.add(line.decode(errors="replace"))
        finally:
            self.log.end()  # stderr closed: the process is gone (or closing)

    def wait_line(self, match: Callable[[str], T | None], timeout_s: float) -> T | None:
        """The first non-None ``match(line)`` over the node's log lines (stderr), those read
        already and those to come; None if the node exits or ``timeout_s`` passes first."""
        return self.log.wait(match, timeout_s)

    @property
    def info(self) -> dict[str, Any]:
        """The ready line (the node must be ready)."""
        assert self.ready is not None, f"{self.name} is not ready"
        return self.ready

    @property
    def pid(self) -> int:
        """The node's pid (``ip netns exec`` execs the command)."""
        return self.proc.pid

    def running(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The node's ready line, as a dict.

        Raises:
            AssertionError: it exited first or was not ready within ``timeout_s``.
        """
        self._ready_event.wait(timeout_s)
        if self.ready is None:
            state = "exited" if not self.running() else f"not ready after {timeout_s} s"
            raise AssertionError(f"{self.name} {state}\n{self.tail()}")
        return self.ready

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM the node's process group, SIGKILL after ``grace_s``; the exit code."""
        if self.running():
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        return self.wait()

    def kill(self) -> int:
        """SIGKILL the node's process group; the exit code (-9)."""
        self._signal(signal.SIGKILL)
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the exit; the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout_s``.
        """
        code = self.proc.wait(timeout_s)
        for reader, stream in (
            (self._reader, self.proc.stdout),
            (self._err_reader, self.proc.stderr),
        ):
            reader.join(5)
            if stream is not None and not reader.is_alive():
                stream.close()
        return code

    def tail(self, n_chars: int = 3000) -> str:
        """The end of the node's stderr and stdout, for failure messages."""
        parts = []
        for p in (self.err_path, self.out_path):
            try:
                parts.append(f"--- {p.name} ---\n{p.read_text(errors='replace')[-n_chars:]}")
            except OSError:
                pass
        return "\n".join(parts)


class Hosts:
    """A set of hosts on one bridge; use as a context manager (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lab = netns.Lab()
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, netns.NatRouter] = {}
        self.behind: dict[int, list[str]] = {}  # LAN -> names of the hosts behind its router
        self.nodes: list[Node] = []
        self.logdir = root / "logs"

    def __enter__(self) -> Hosts:
        netns.cleanup_stale()
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.lab.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str) -> Host:
        """A new host called ``name`` with its own address and working directory."""
        index = len(self.hosts)
        port = self.lab.add_node(index, LINK_BYTES_PER_S, LINK_BYTES_PER_S, 0.0, 0.0)
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        host = Host(name, port.ip, port.netns, workdir)
        self.hosts[name] = host
        return host

    def add_router(self, name: str, *, symmetric: bool = False) -> netns.NatRouter:
        """A home router called ``name`` on the bridge with a LAN of its own behind source NAT
        (see :meth:`simulations.netns.Lab.add_nat_router`; ``symmetric``: a random public port
        per connection); add hosts behind it with :meth:`add_behind`.

        Raises:
            simulations.netns.NetnsError: ``nft`` is not installed.
        """
        index = len(self.hosts)
        lan = len(self.routers)
        shape = (LINK_BYTES_PER_S, LINK_BYTES_PER_S, 0.0, 0.0)
        router = self.lab.add_nat_router(index, lan, shape, symmetric=symmetric)
        self.routers[name] = router
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        self.hosts[name] = Host(name, router.port.ip, router.port.netns, workdir)
        return router

    def add_behind(self, router: netns.NatRouter, name: str) -> Host:
        """A new host called ``name`` on ``router``'s LAN (reaches the bridge through the
        router's NAT; nothing on the bridge can open a connection to it)."""
        port = self.lab.add_lan_node(router, len(self.behind.get(router.lan, [])))
        self.behind.setdefault(router.lan, []).append(name)
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        host = Host(name, port.ip, port.netns, workdir)
        self.hosts[name] = host
        return host

    def run(self, host: Host, argv: list[str], timeout_s: float = 120.0) -> str:
        """Run a short command on ``host``; its stdout.

        Raises:
            AssertionError: non-zero exit (with its stderr).
        """
        res = subprocess.run(
            [*host.exec_prefix(), *argv],
            cwd=host.workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if res.returncode != 0:
            raise AssertionError(f"{argv} on {host.name} exited {res.returncode}: {res.stderr}")
        return res.stdout

    def start(self, host: Host, name: str, argv: list[str]) -> Node:
        """Start a long-lived command on ``host``; ``name`` names its log files."""
        node = Node(name, host, argv, self.logdir)
        self.nodes.append(node)
        return node

    def http_get(self, host: Host, url: str, timeout_s: float = 5.0) -> str | None:
        """GET ``url`` from inside ``host``; the body, or None if it could not be fetched."""
        code = (
            "import sys, urllib.request\n"
            "try:\n"
            f"    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout={timeout_s})"
            ".read().decode())\n"
            "except OSError:\n"
            "    sys.exit(3)\n"
        )
        res = subprocess.run(
            [*host.exec_prefix(), sys.executable, "-c", code, url],
            capture_output=True,
            text=True,
            timeout=timeout_s + 10,
            check=False,
        )
        return res.stdout if res.returncode == 0 else None

    def close(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove the hosts."""
        try:
            for node in reversed(self.nodes):
                node.stop(grace_s=10)  # signals a running node only; waits and closes pipes
        finally:
            self.lab.teardown()

    def logs(self) -> str:
        """The tails of every node's logs (for a failure message)."""
        return "\n".join(f"===== {n.name} =====\n{n.tail(1500)}" for n in self.nodes)


def metric(text: str | None, name: str) -> float | None:
    """The value of an unlabelled Prometheus metric in exposition ``text``, or None."""
    for line in (text or "").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
