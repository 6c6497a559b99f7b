"""Where the refresh's alerts go: the log at once, and the Kafka alerts topic through a retrying queue.

The refresh alerts on what an operator must see (``refresh_failed``, ``refresh_pinned``, ``refresh_skipped``,
``refresh_degraded``, ``refresh_lineage_switched``: ``cache_refresh/job.py``). An alert is a ``monitor.alerts.Alert``
in the monitor's record shape, written to the log (``LogSink``) when it is raised and handed to a
``monitor.alerts.QueuedSink`` in front of a ``KafkaSink``: the monitor's own delivery, so a broker that is down when
the alert is raised does not lose it. Undelivered alerts stay queued and are retried with backoff (``retry_backoff_s``
doubling to ``retry_backoff_max_s``), in order, until the broker takes them; each failed attempt is logged and counted
(``streamrec_monitor_sink_failures_total{sink="kafka"}``, ``..._delivered_total``, ``..._dropped_total``, served on
the scheduler's ``[refresh] metrics_port``).

Before, the refresh made one Kafka attempt per alert and, when it failed, wrote one error line: a refresh that failed
while the broker was down (the holdout read fails with it) raised a critical alert nobody but the log saw.

Lifetimes: the scheduler (``streamrec refresh``) keeps one :class:`RefreshAlerts` for the whole process, so an alert
raised while the broker is down arrives when it is back, however long after; :meth:`close` at shutdown drains for
``close_timeout_s`` (10 s, ``SinkSettings``' default: the refresh reads no ``[sinks]`` section), after the run in
progress has finished (``scheduler.run_forever`` waits for it, within a stop grace; a run abandoned after that is itself
a ``refresh_failed`` alert at stage ``shutdown``, its ``run_stage`` label and message naming the stage it was in
and its last error), so that run's alert is delivered too, not dropped as "closed". A
one-shot run (``--now``, or ``run_once`` without one) opens its own and closes it before it returns, draining for up to
``close_timeout_s`` (the 10 s one attempt had); what is still undelivered then is counted
(``..._dropped_total{reason="closed"}``) and logged with the alerts' rules, and the run's exit code says the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from monitor.alerts import Alert, AlertState, KafkaSink, LogSink, QueuedSink, Severity, SinkSettings, drain
from stream.config import KafkaSettings

log = logging.getLogger("streamrec.refresh")

FAILED_RULE = "refresh_failed"  # a run that failed, or was abandoned at shutdown (job.ALERT_RULE, scheduler.py)


class RefreshAlerts:
    """The refresh's alert sinks (module docstring). ``topic`` empty: the log only. Never raises."""

    def __init__(self, kafka: KafkaSettings, topic: str, settings: SinkSettings | None = None) -> None:
        self.settings = settings or SinkSettings(kafka_topic=topic or None)
        self._log = LogSink(log)
        advice = (f"the refresh's alert drain at exit is {self.settings.close_timeout_s:g} s (not a setting); each "
                  "alert was logged when raised")  # ([sinks] is the monitor's section)
        self._kafka = (QueuedSink(KafkaSink(kafka, topic, timeout_s=self.settings.kafka_timeout_s), self.settings,
                                  advice) if topic else None)

    def fire(self, stage: str, message: str, rule: str, severity: str = "critical",
             labels: dict[str, str] | None = None) -> Alert:
        """Log a firing alert now and queue it for the Kafka topic (returns at once); returns the alert. A
        ``severity`` that is not a :class:`~monitor.alerts.Severity` value is logged and the alert goes as critical
        (this method's default: an alert is never lost nor made quieter by a caller's typo)."""
        try:
            level = Severity(severity)
        except ValueError:
            log.error("alert %s: unknown severity %r (known: %s); sent as critical", rule, severity,
                      ", ".join(s.value for s in Severity))
            level = Severity.CRITICAL
        alert = Alert(rule=rule, source="refresh", severity=level, state=AlertState.FIRING, value=None,
                      threshold=None, message=message, ts=int(time.time() * 1000),
                      labels={"stage": stage, **(labels or {})})
        try:
            self._log.send([alert])
        except Exception as exc:  # noqa: BLE001 - a logging handler failing must not mask the refresh's error
            log.error("could not log the %s alert: %s", rule, exc)
        if self._kafka is not None:
            self._kafka.send([alert])
        return alert

    @property
    def pending(self) -> int:
        """Alerts not yet acknowledged by Kafka (queued or being sent)."""
        return self._kafka.depth if self._kafka is not None else 0

    def wait_delivered(self, timeout_s: float) -> bool:
        """Wait until every alert queued so far is delivered (or dropped); False if that takes longer."""
        return self._kafka.wait_idle(timeout_s) if self._kafka is not None else True

    def close(self, timeout_s: float | None = None, abort: Callable[[], str | None] | None = None) -> int:
        """Deliver what is queued for at most ``timeout_s`` (default ``close_timeout_s``), then stop; returns how many
        alerts were left undelivered (counted and logged by the queue). ``abort`` (polled every 0.2 s) naming a reason
        (a second stop signal: ``scheduler.run_forever``) ends the drain at once, with a log line saying so."""
        if self._kafka is None:
            return 0
        queue = self._kafka
        return drain([queue], time.monotonic() + (queue.close_timeout_s if timeout_s is None else timeout_s), abort)
