"""SIGTERM and SIGINT taken by a long-running loop (the learner's daemon, the joiner's Kafka driver, the refresh's
scheduler and ``--now`` run, the monitor) for the length of its run and put back after, so that a run in a process
that goes on (a test, an embedding program) leaves the process's own dispositions as it found them."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any


def take_stop_signals(handlers: dict[int, Any], on_signal: Callable[[int, Any], None]) -> None:
    """SIGTERM and SIGINT to ``on_signal``; ``handlers`` keeps the ones replaced (the first: a second run keeps them),
    for :func:`put_back_signals` at the run's end."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        handlers.setdefault(sig, signal.signal(sig, on_signal))


def put_back_signals(handlers: dict[int, Any]) -> None:
    """The handlers :func:`take_stop_signals` replaced, put back (and forgotten). Left installed, the bound method kept
    the finished loop (a learner's model and tables, a joiner's consumer) alive, a later SIGTERM went to it, not to
    the process's own, and an ignored SIGINT (a job a shell starts in the background ignores it) was no longer
    ignored."""
    for sig, handler in handlers.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
    handlers.clear()
