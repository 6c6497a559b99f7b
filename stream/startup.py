"""Waiting for a service a process has just started (the local stack's broker and Redis, a test's redis-server):
ready, exited, or too slow, told apart as soon as it happens.

A service that dies at start (a bad flag, its port taken between the starter's check and its bind, a binary that
exits at once) cost the whole start wait (20 s by default) before an error that did not say it had died:
:func:`wait_ready` polls the process between probes, and :func:`not_started` says which service, how it ended,
the last lines it logged and what to do."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from stream.files import read_tail

POLL_S = 0.05  # between probes: a service on loopback answers within milliseconds once it listens
LOG_TAIL_BYTES = 2000  # of a service's log, read when it did not start ...
LOG_TAIL_LINES = 10  # ... and the last lines of that shown


def wait_ready(probe: Callable[[], bool], timeout_s: float, running: Callable[[], bool] = lambda: True) -> bool:
    """Whether ``probe`` says ready within ``timeout_s`` (tried at least once) while ``running`` says the process
    lives: False at the deadline, or as soon as the process is gone. ``probe`` should return within seconds: the
    process is looked at between probes. A probe answered after the process died (whoever took its port) is no
    answer from it."""
    deadline = time.monotonic() + timeout_s
    while running():
        if probe() and running():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return False


def exit_status(code: int) -> str:
    """``exit status 2``, or ``killed by signal 9 (SIGKILL)`` for a negative ``Popen.returncode``."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:  # a number this platform has no name for
        return f"killed by signal {-code}"


def log_tail(log: Path, since: int = 0) -> str:
    """The last lines of ``log`` after its first ``since`` bytes (its size when this start began: it grows over every
    start) that say something, indented under the error that shows them; a log that cannot be read says why."""
    try:
        lines = [line for line in read_tail(log, LOG_TAIL_BYTES, since).splitlines() if line.strip()][-LOG_TAIL_LINES:]
    except OSError as exc:
        return f"  (cannot read it: {exc})"
    return "\n".join(f"  {line}" for line in lines) or "  (nothing: this start wrote no line)"


def not_started(name: str, address: str, code: int | None, timeout_s: float, log: Path, since: int, again: str) -> str:
    """Why the service ``name`` started for ``address`` is not there: exited with ``code`` (a Popen return code), or
    still running but not ready within ``timeout_s`` (``code`` None; the caller stops it). One line saying so and
    what to do (``again``: the command that starts it again), then the last lines this start wrote to its ``log``
    (past ``since``, its size before)."""
    if code is None:
        head = (f"{name} did not become ready on {address} within {timeout_s}s (still running: stopped): see its log, "
                f"then {again}")
    else:
        head = (f"{name} exited at start ({exit_status(code)}) before answering on {address}: fix what its log says "
                f"(a bad flag? its port taken by another process since the check?), then {again}")
    return f"{head}; the last lines of {log}:\n{log_tail(log, since)}"


def dies_with_parent(when: bool = True) -> Callable[[], None] | None:
    """A ``preexec_fn`` binding a service to the thread that starts it (None: not ``when``): SIGKILLed when that thread
    ends, however it ends (Linux prctl PR_SET_PDEATHSIG, kept over the exec; a test session killed before its teardown,
    by SIGTERM, the hang watchdog or an OOM kill, left its broker and Redis running), and exits at once if it ended
    before the child asked."""
    import ctypes

    if not when:
        return None
    if not sys.platform.startswith("linux"):
        raise RuntimeError("a service bound to the process that starts it needs Linux (prctl PR_SET_PDEATHSIG)")
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # looked up before the fork, not in the child

    def bind() -> None:
        if prctl(1, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:  # 1: PR_SET_PDEATHSIG
            os._exit(1)
    return bind


def environment_without(names: Iterable[str], service: str, log: logging.Logger) -> dict[str, str]:
    """``os.environ`` for the process of ``service``, less ``names``: the variables it reads where a flag it is not
    given would be, generic names that other tools set for themselves; each one set is said in a WARNING, not read."""
    unread = sorted(set(names) & set(os.environ))
    if unread:
        log.warning("%s: %s in the environment are not read (its starter gives its settings; another tool's values "
                    "changed or failed its start): unset them to silence this", service, ", ".join(unread))
    return {k: v for k, v in os.environ.items() if k not in unread}
