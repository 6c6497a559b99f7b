"""RefreshAlerts.fire promises never to raise: an unknown severity string is logged and sent as critical."""

from __future__ import annotations

import logging

import pytest

from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from monitor.alerts import Severity
from stream.config import KafkaSettings


def test_fire_with_an_unknown_severity_logs_it_and_sends_the_alert_as_critical(
        caplog: pytest.LogCaptureFixture) -> None:
    alerts = RefreshAlerts(KafkaSettings(), "")  # the log only
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        alert = alerts.fire("publish", "publish failed", FAILED_RULE, severity="urgent")
    assert alert.severity is Severity.CRITICAL
    assert any("'urgent'" in r.getMessage() and "critical" in r.getMessage() for r in caplog.records
               if r.levelno == logging.ERROR)
    assert any("publish failed" in r.getMessage() for r in caplog.records)  # the alert itself was logged
    assert alerts.fire("publish", "skipped", FAILED_RULE, severity="warning").severity is Severity.WARNING
