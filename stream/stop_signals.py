"""SIGTERM and SIGINT taken by a long-running loop (the learner's daemon, the joiner's Kafka driver, the refresh's
scheduler and ``--now`` run, the monitor) for the length of its run and put back after, so that a run in a process
that goes on (a test, an embedding program) leaves the process's own dispositions as it found them."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


class StopFlag:
    """A stop that a signal handler sets, waited for by the main thread (``streamrec serve``'s wait, the monitor's
    rounds). Not a ``threading.Event``: its ``set`` takes the Event's lock, and a handler runs in the main thread
    between two bytecodes wherever it is, inside ``Event.wait``'s own ``with self._cond`` too, where that lock is held
    by the very thread the handler interrupted: the handler waited on it for ever, the process hung and took no second
    SIGTERM (reproduced by holding the lock as the signal came). Here :meth:`set` is one attribute write, and
    :meth:`wait` sleeps in slices of ``slice_s`` (a signal's handler runs within one) looking at it."""

    def __init__(self, slice_s: float = 0.1) -> None:
        self.slice_s = slice_s
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set, or ``timeout`` seconds (None: no bound); whether it is set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = self.slice_s if deadline is None else min(self.slice_s, deadline - time.monotonic())
            if left <= 0:
                break
            time.sleep(left)
        return self._set


class StopsTaken:
    """SIGTERM and SIGINT taken for a command's work around a run that takes them for its own length (``streamrec
    join``, ``train`` (under torchrun too: :meth:`take`), ``serve``, ``refresh --now``): the run put back the process's
    own as it returned, and a stop after (in the close's last flush, before the summary) killed the process, no summary,
    where a stop in the run ends with it. Taken once: the first calls ``on_stop`` (none: nothing to stop) and puts the
    process's own back, so a second is the process's own again (SIGTERM's default ends it, SIGINT's raises
    KeyboardInterrupt). With ``on_stop``, taken from the start (the run's take nests in it, its put-back puts this back:
    a stop before the run took them over stops it at once), without, from the run's end; taken again there in any case
    (faust's event loop, closed, leaves them at their defaults), unless ``stopped()``: the run was ended by a stop, the
    operator's first, and one after it is their second, the process's own (a close that puts this back again hands such
    a stop on to the process's own)."""

    def __init__(self, on_stop: Callable[[], None] | None, stopped: Callable[[], bool] = lambda: False) -> None:
        self.on_stop, self.stopped = on_stop, stopped
        self._own: dict[int, Any] = {}  # the process's own, put back by the first stop taken and at the end
        self._absorbed = False

    def __enter__(self) -> StopsTaken:
        if self.on_stop is not None:
            self._take()
        return self

    def take(self, on_stop: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """Taken from here with these, as ``with StopsTaken(on_stop, stopped)`` takes them from its start: for a run
        whose owner is built inside the command's work (the sharded learner, in ``run_ranks`` after the group's
        join), while the summary is printed by the command after that work (``streamrec train`` under torchrun)."""
        self.on_stop, self.stopped = on_stop, stopped
        self._take()

    def run(self, run: Callable[[], T]) -> T:
        try:
            return run()
        finally:
            stopped, self.on_stop = self.stopped(), None  # known at the run's end: no stop reaches the run after
            self.stopped = lambda: stopped  # nothing of the run's owner kept (a sharded learner holds the group)
            if stopped:
                self._put_back()
            else:
                self._take()

    def __exit__(self, *exc: object) -> None:
        self._put_back()

    def _take(self) -> None:
        take_stop_signals(self._own, self._taken)

    def _put_back(self) -> None:
        put_back_signals(dict(self._own))  # kept: a run's close may put this back again

    def _taken(self, signum: int, frame: Any) -> None:
        self._put_back()
        if self._absorbed or self.stopped():  # the operator's second stop: the process's own
            signal.raise_signal(signum)
            return
        self._absorbed = True
        if self.on_stop is not None:
            self.on_stop()
