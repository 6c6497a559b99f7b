"""The kill and reap of a child process a test started, every wait bounded, for ``finally:`` blocks and teardowns.

pytest-timeout fires once per test: a wait with no bound in a ``finally:`` or a fixture's teardown, reached after
that timeout or any other failure, blocks the xdist worker for good (CI hung 70 min so). ``proc.kill()`` then
``proc.communicate()`` was such a wait: communicate reads the pipes to EOF, and a grandchild that inherited them (a
forked worker) keeps them open after the child is dead. And a child left running when a test fails slows every later
test on a 2-core runner.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

REAP_TIMEOUT_S = 30.0


def kill_and_reap(proc: subprocess.Popen[Any], *, group: bool = False, timeout_s: float = REAP_TIMEOUT_S) -> None:
    """Kill ``proc`` if it still runs and reap it within ``timeout_s``. ``group``: ``proc`` was started with
    ``start_new_session=True`` and may have forked (torchrun, a learner's DataLoader workers): its whole process
    group is killed, even when ``proc`` itself has ended, so no grandchild is left behind.

    It waits for the process, never for its pipes (a grandchild may hold them), and does not close them (a reader
    thread of the test's may be blocked on them: garbage collection closes them). A process still there after
    ``timeout_s`` is reported as a warning, not waited for."""
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        warnings.warn(f"process {proc.pid} ({proc.args!r:.200}) still running {timeout_s:g} s after SIGKILL",
                      RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[Any], *, group: bool = False) -> Iterator[subprocess.Popen[Any]]:
    """``with reaped(Popen(...)) as proc:``: whatever happens in the block, ``proc`` is not left running after it
    (:func:`kill_and_reap`)."""
    try:
        yield proc
    finally:
        kill_and_reap(proc, group=group)


def close_all(closes: Iterable[Callable[[], object]]) -> None:
    """Call each of ``closes`` in order, every one even when an earlier one raised (a teardown closing several
    pipelines or servers in a plain loop left the rest open after the first error); then raise the last
    error, the earlier ones chained as its context."""
    with contextlib.ExitStack() as stack:
        for close in reversed(list(closes)):  # (an ExitStack calls them last in, first out)
            stack.callback(close)


class Reaper:
    """The child processes a test started (``proc = reaper.add(Popen(...))``): :meth:`close` (the ``reaper``
    fixture's teardown, tests/conftest.py) kills and reaps every one still running, whatever ended the test, so a
    failed test leaves no joiner or learner running into the next ones."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen[Any], bool]] = []

    def add(self, proc: subprocess.Popen[Any], *, group: bool = False) -> subprocess.Popen[Any]:
        """Track ``proc`` (``group``: kill its process group, :func:`kill_and_reap`); returns it."""
        self.procs.append((proc, group))
        return proc

    def close(self) -> None:
        procs, self.procs = self.procs, []
        for proc, group in reversed(procs):
            kill_and_reap(proc, group=group)
