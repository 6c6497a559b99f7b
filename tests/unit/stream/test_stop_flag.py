"""A stop set by a SIGTERM/SIGINT handler must take no lock: the handler runs in the main thread between two bytecodes
wherever it is, and a ``threading.Event``'s ``set`` takes the Event's lock, held by that very thread inside
``Event.wait`` (the monitor waits between its rounds, ``streamrec serve`` for its stop): the handler waited for it for
ever, the process hung and took no second SIGTERM (``stream.stop_signals.StopFlag``)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from stream.stop_signals import StopFlag
from tests.python_child import run_python

# The monitor's run replaced by one that takes the SIGTERM while holding the stop's own lock, where it has one (an
# Event's, as inside Event.wait); its close by a no-op. A handler that takes that lock never returns.
_MONITOR_SIGNALLED_HOLDING_ITS_STOPS_LOCK = """
import signal
from types import SimpleNamespace
from monitor.engine import Monitor

def run(stop, interval_s=None):
    held = getattr(stop, "_cond", None)
    if held is not None:
        with held:
            signal.raise_signal(signal.SIGTERM)
    else:
        signal.raise_signal(signal.SIGTERM)
    assert stop.wait(5), "the stop was not seen"

print("undelivered", Monitor.run_until_signalled(SimpleNamespace(run=run, close=lambda abort: 0)), flush=True)
"""


def test_the_monitors_stop_signal_ends_its_run_even_while_its_wait_holds_a_lock() -> None:
    out = run_python(_MONITOR_SIGNALLED_HOLDING_ITS_STOPS_LOCK, timeout_s=30)
    assert out.returncode == 0 and "undelivered 0" in out.stdout, out.stderr[-2000:]


def test_a_stop_flag_set_by_a_signal_handler_ends_the_wait_within_a_slice() -> None:
    flag = StopFlag(slice_s=0.05)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: flag.set())
    try:
        threading.Timer(0.1, signal.raise_signal, (signal.SIGUSR1,)).start()  # (handled in this, the main, thread)
        assert flag.wait(30) is True and flag.is_set()
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("timeout_s", [0.0, 0.12])
def test_a_stop_flag_not_set_waits_out_its_timeout_and_says_so(timeout_s: float) -> None:
    flag = StopFlag(slice_s=0.05)
    began = time.monotonic()
    assert flag.wait(timeout_s) is False and not flag.is_set()
    assert time.monotonic() - began >= timeout_s
    flag.set()
    assert flag.wait() is True and flag.wait(0) is True
