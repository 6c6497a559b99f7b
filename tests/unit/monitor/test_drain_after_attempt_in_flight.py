"""A drain (``QueuedSink.begin_close``) tries a backing-off sink again at once. An attempt already out when the drain
began used to set its own backoff as it failed (600 s here), past the drain's deadline: the drain then waited to its
deadline and dropped the alerts untried (the flaky ``test_signal_during_alert_drain``: the first attempt still out when
the scheduler's stop began the drain)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from monitor.alerts import Alert, AlertState, Severity, SinkSettings
from monitor.delivery import QueuedSink


class SlowThenUp:
    """Its first attempt waits until the drain has begun, then fails; every later one delivers."""

    name = "slow-then-up"
    timeout_s = 5.0
    batch_max = 100

    def __init__(self) -> None:
        self.attempts = 0
        self.sending, self.drain_begun = threading.Event(), threading.Event()

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        self.attempts += 1
        if self.attempts == 1:
            self.sending.set()
            self.drain_begun.wait(10)
            raise ConnectionError("broker down")

    def close(self) -> None:
        pass


def test_an_attempt_failing_after_the_drain_began_leaves_the_drains_own_try_due() -> None:
    sink = SlowThenUp()
    queue = QueuedSink(sink, SinkSettings(close_timeout_s=3.0, retry_backoff_s=600.0, retry_backoff_max_s=600.0))
    queue.send([Alert("r", "s", Severity.WARNING, AlertState.FIRING, 1.0, 0.0, "m", 1)])
    assert sink.sending.wait(10)
    queue.begin_close(time.monotonic() + 3.0)
    sink.drain_begun.set()
    left = queue.finish_close()
    assert (left, sink.attempts) == (0, 2), (left, sink.attempts)
    assert queue.stats.delivered == 1 and queue.stats.dropped["closed"] == 0
