"""A stop (SIGTERM) of ``streamrec refresh`` while a scheduled run is going (cache_refresh/scheduler.py run_forever):
the run's own alert reaches the alert sink before the sink is closed; a run that outlasts the stop grace is abandoned
with an alert saying so and exit 1. Before, the stop returned at once and the process edge closed the alert queue
under the run: the run's alert was dropped as "closed", only logged.

The composition is the process edge's (``streamrec/commands/refresh.py``): ``run_forever(..., alerts=alerts)``, then
``alerts.close()``; the sink behind the real retrying queue is a list (the Kafka path: tests/integration/
test_refresh_alerts.py)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from cache_refresh.scheduler import EXIT_ABANDONED, run_forever
from monitor.alerts import Alert, SinkSettings
from monitor.delivery import QueuedSink
from stream.config import KafkaSettings


class ListSink:
    """An alert sink keeping what it was sent; ``closed`` is set when its queue closes it."""

    name = "stop-test"
    timeout_s = 5.0
    batch_max = 100

    def __init__(self, closed: threading.Event | None = None) -> None:
        self.sent: list[Alert] = []
        self.closed = closed or threading.Event()

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        self.sent.extend(alerts)

    def close(self) -> None:
        self.closed.set()


class ListedAlerts(RefreshAlerts):
    """The refresh's alerts (log, then a real QueuedSink) with a ListSink where the KafkaSink would be."""

    def __init__(self, sink: ListSink) -> None:
        super().__init__(KafkaSettings(), "")
        self._kafka = QueuedSink(sink, SinkSettings(close_timeout_s=5.0))


class Seen(logging.Handler):
    """Sets ``event`` when a record of the refresh logger contains ``text``."""

    def __init__(self, text: str, event: threading.Event) -> None:
        super().__init__()
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


class Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def hard_exit(code: int) -> None:
    raise Exited(code)


@pytest.fixture()
def waiting() -> Iterator[threading.Event]:
    """Set once the stopping scheduler logs that it waits for the run in progress."""
    event = threading.Event()
    handler = Seen("waiting up to", event)
    logger = logging.getLogger("streamrec.refresh")
    logger.addHandler(handler)
    try:
        yield event
    finally:
        logger.removeHandler(handler)


def serve(job: Callable[[], None], alerts: RefreshAlerts, stop_grace_s: float) -> None:
    """``streamrec refresh``'s scheduler: a run is due at once (every minute, none recorded), then the alerts close."""
    try:
        run_forever(job, "* * * * *", "UTC", 3600, None, alerts=alerts, stop_grace_s=stop_grace_s,
                    hard_exit=hard_exit)
    finally:
        alerts.close()


def test_the_alert_of_a_run_in_flight_at_sigterm_reaches_the_sink() -> None:
    waiting = threading.Event()  # the scheduler waits for the run, or (the defect) the alerts were closed under it
    sink = ListSink(closed=waiting)
    alerts = ListedAlerts(sink)

    def run() -> None:  # the SIGTERM comes mid-run; the run ends once one of those happened
        os.kill(os.getpid(), signal.SIGTERM)
        waiting.wait(30)
        alerts.fire("validate", "refresh failed at validate: holdout AUC dropped", FAILED_RULE)

    handler = Seen("waiting up to", waiting)
    logging.getLogger("streamrec.refresh").addHandler(handler)
    try:
        serve(run, alerts, stop_grace_s=60)
    finally:
        logging.getLogger("streamrec.refresh").removeHandler(handler)
    assert [(a.rule, a.labels["stage"]) for a in sink.sent] == [(FAILED_RULE, "validate")]


def test_a_run_outlasting_the_stop_grace_is_abandoned_with_an_alert_and_exit_1() -> None:
    sink = ListSink()
    alerts = ListedAlerts(sink)
    release, ended = threading.Event(), threading.Event()

    def run() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        release.wait(30)
        ended.set()

    try:
        with pytest.raises(Exited) as exited:
            serve(run, alerts, stop_grace_s=0.3)
    finally:
        release.set()
    assert exited.value.code == EXIT_ABANDONED == 1
    assert [(a.rule, a.labels["stage"]) for a in sink.sent] == [(FAILED_RULE, "shutdown")]
    assert "did not finish within the stop grace of 0.3 s" in sink.sent[0].message
    assert ended.wait(30)  # the abandoned run's thread ends (in production the process exits under it)


def test_a_second_signal_abandons_the_run_at_once(waiting: threading.Event) -> None:
    sink = ListSink()
    alerts = ListedAlerts(sink)
    release, ended = threading.Event(), threading.Event()

    def run() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        waiting.wait(30)
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(30)
        ended.set()

    try:
        with pytest.raises(Exited) as exited:
            serve(run, alerts, stop_grace_s=600)
    finally:
        release.set()
    assert exited.value.code == EXIT_ABANDONED
    assert [a.labels["stage"] for a in sink.sent] == ["shutdown"]
    assert "a second stop signal came" in sink.sent[0].message
    assert ended.wait(30)


def test_the_signal_handlers_are_restored_after_the_scheduler_stops() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    serve(lambda: os.kill(os.getpid(), signal.SIGTERM), ListedAlerts(ListSink()), stop_grace_s=60)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_handler_not_set_from_python_is_put_back_as_the_default_after_the_scheduler_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``signal.signal`` returns None for a handler a C library or an embedding program installed: putting that back
    was ``signal.signal(sig, None)``, a TypeError from run_forever's ``finally`` that replaced its exit code and left
    the scheduler's handler installed (``stream/stop_signals.py`` puts back the default for it)."""
    real, saved = signal.signal, {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def installed_outside_python(sig: int, handler: object) -> object:
        previous = real(sig, handler)  # type: ignore[arg-type]
        return None if handler not in (signal.SIG_DFL, signal.SIG_IGN) else previous

    monkeypatch.setattr(signal, "signal", installed_outside_python)
    try:
        serve(lambda: os.kill(os.getpid(), signal.SIGTERM), ListedAlerts(ListSink()), stop_grace_s=60)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        for sig, handler in saved.items():
            real(sig, handler)
