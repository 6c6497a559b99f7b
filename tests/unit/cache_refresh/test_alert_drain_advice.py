"""The refresh's alert queue closing with alerts undelivered (a broker too slow to answer within the drain) logged
"raise close_timeout_s in [sinks] to wait longer": [sinks] is the monitor's section; the refresh reads none and its
drain time is fixed. Its queue must say what is true for the refresh; the monitor's keeps its advice."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest

from cache_refresh import alerts as refresh_alerts
from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from monitor.alerts import Alert
from monitor.delivery import QueuedSink
from stream.config import KafkaSettings


class HangingSink:
    """A broker that neither answers nor fails until released (no failure is counted)."""

    name = "hanging"
    timeout_s = 60.0
    batch_max = 100

    def __init__(self) -> None:
        self.release = threading.Event()

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        self.release.wait()

    def close(self) -> None:
        pass


def _closed_with_one_left(queue_owner: RefreshAlerts | QueuedSink, sink: HangingSink,
                          caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.ERROR):
        try:
            assert queue_owner.close(timeout_s=0.0) == 1
        finally:
            sink.release.set()
    [said] = [r.getMessage() for r in caplog.records if "undelivered (" in r.getMessage()]
    return said


def test_the_refresh_alert_queue_closing_with_alerts_left_names_no_sinks_setting(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    sink = HangingSink()
    monkeypatch.setattr(refresh_alerts, "KafkaSink", lambda *a, **kw: sink)
    alerts = RefreshAlerts(KafkaSettings(bootstrap_servers="127.0.0.1:9"), "alerts")
    alerts.fire("hot_set", "refresh failed at hot_set: Redis unreachable", FAILED_RULE)
    said = _closed_with_one_left(alerts, sink, caplog)
    assert "[sinks]" not in said and "close_timeout_s" not in said
    assert "the refresh's alert drain at exit is 10 s (not a setting)" in said and "logged when raised" in said


def test_the_monitor_alert_queue_closing_with_alerts_left_still_names_its_sinks_setting(
        caplog: pytest.LogCaptureFixture) -> None:
    sink = HangingSink()
    queue = QueuedSink(sink)
    queue.send([Alert(rule="r", source="monitor", severity=refresh_alerts.Severity("critical"),
                      state=refresh_alerts.AlertState.FIRING, value=None, threshold=None, message="m", ts=0)])
    assert "raise close_timeout_s in [sinks] to wait longer" in _closed_with_one_left(queue, sink, caplog)
