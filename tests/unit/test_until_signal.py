"""The role runner's signal handling (:func:`shardnet.roles.until_signal`).

A second SIGTERM while a node stops (``timeout(1)`` and a process-group ``kill`` send two) used
to kill the process before its store flush: the receiver was closed after the first signal and
trio re-raised the next under the default action, leaving the store's unclean-stop marker (the
next start re-hashed every version). Run in a child process: the failure it guards against
kills the process that receives the signal.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import logging, os, signal, trio
    from shardnet.roles import until_signal

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    async def body():
        try:
            print("ready", flush=True)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # the node's flush runs like this
                os.kill(os.getpid(), signal.SIGTERM)  # the second signal, while stopping
                for _ in range(20):
                    await trio.lowlevel.checkpoint()
                print("cleaned", flush=True)

    print("stopped", trio.run(until_signal, body), flush=True)
    """
)


def _stop(script: str) -> tuple[int, str, str]:
    """Run ``script``, send it SIGTERM once it printed ``ready``; its exit status, stdout
    (after ``ready``) and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out, err


def test_a_second_sigterm_while_stopping_does_not_cut_the_cleanup() -> None:
    code, out, err = _stop(CHILD)
    assert code == 0, err
    assert out.splitlines() == ["cleaned", "stopped True"]
    assert err.splitlines() == [
        "shutdown signal=SIGTERM",
        "shutdown_signal_repeated signal=SIGTERM state=stopping",
    ]


def test_a_third_signal_forces_the_exit() -> None:
    """A stop that hangs (a bug, a stuck disk) ends at the third signal, not never."""
    hung = CHILD.replace(
        "for _ in range(20):\n                await trio.lowlevel.checkpoint()",
        "os.kill(os.getpid(), signal.SIGINT)\n            await trio.sleep_forever()",
    )
    assert hung != CHILD
    code, out, err = _stop(hung)
    assert code == 128 + signal.SIGINT, err
    assert out == ""
    assert err.splitlines() == [
        "shutdown signal=SIGTERM",
        "shutdown_signal_repeated signal=SIGTERM state=stopping",
        "shutdown_forced signal=SIGINT store=unclean",
    ]


def test_a_body_that_returns_is_not_a_signal() -> None:
    import trio

    from shardnet.roles import until_signal

    async def body() -> None:
        await trio.lowlevel.checkpoint()

    assert trio.run(until_signal, body) is False
