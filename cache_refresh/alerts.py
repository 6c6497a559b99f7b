"""Where the refresh's alerts go: the log at once, and the Kafka alerts topic through a retrying queue.

The refresh alerts on what an operator must see (``refresh_failed``, ``refresh_pinned``, ``refresh_skipped``,
``refresh_degraded``, ``refresh_lineage_switched``: ``cache_refresh/job.py``). An alert is a ``monitor.alerts.Alert``
in the monitor's record shape, written to the log (``LogSink``) when it is raised and handed to a
``monitor.delivery.QueuedSink`` in front of a ``KafkaSink``: the monitor's own delivery, so a broker that is down when
the alert is raised does not lose it. Undelivered alerts stay queued and are retried with backoff (``retry_backoff_s``
doubling to ``retry_backoff_max_s``), in order, until the broker takes them; each failed attempt is logged and counted
(``streamrec_monitor_sink_failures_total{sink="kafka"}``, ``..._delivered_total``, ``..._dropped_total``, served on
the scheduler's ``[refresh] metrics_port``).

Resolution: a publish resolves what earlier runs fired. With :meth:`RefreshAlerts.record_in` (every run calls it with
its publish root; the scheduler's and a one-shot run's are built with it, ``publish_root``, so an alert fired before
any run is recorded too) each alert fired is also appended to ``<publish_root>/``:data:`FIRING` (one JSON line: rule,
severity, labels, so the same fingerprint), whichever process fired it (a scheduled run, an operator's ``--now``, a
scheduler abandoning a run at shutdown, its thread dying; the root is created if no run has yet); the next run that
publishes sends one ``resolved`` record per fingerprint in it (:meth:`RefreshAlerts.resolve_firing`; those of a
publish killed while resolving, too) and starts the file afresh. That is the monitor's contract on the alerts topic
(every firing is followed by one resolved, ``monitor/alerts.py``); before, a refresh sent firing records only, and a
consumer grouping by fingerprint showed a failure of months ago as firing, through every good run since.

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

import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from monitor.alerts import Alert, AlertState, KafkaSink, LogSink, Severity, SinkSettings
from monitor.delivery import QueuedSink, drain
from stream.config import KafkaSettings
from stream.files import describe_os_error, leftover_writer_alive, open_regular

log = logging.getLogger("streamrec.refresh")

FAILED_RULE = "refresh_failed"  # a run that failed, or was abandoned at shutdown (job.ALERT_RULE, scheduler.py)
FIRING = "refresh_firing.jsonl"  # in the publish root: the alerts fired since the last publish (module docstring)
TAKEN = f".{FIRING}.taken-"  # + <pid>-<ns>: FIRING renamed aside by a publish resolving it (resolve_firing)
_LINE_MAX = 64 << 10  # a line of FIRING longer than this is no record the refresh wrote (skipped in pieces)


class RefreshAlerts:
    """The refresh's alert sinks (module docstring). ``topic`` empty: the log only. ``publish_root``: recorded in from
    the start (:meth:`record_in`), so that an alert fired before any run (the scheduler's thread dying before its first
    run, a ``shutdown`` abandonment) is resolved by a later publish too. Never raises."""

    def __init__(self, kafka: KafkaSettings, topic: str, settings: SinkSettings | None = None, *,
                 publish_root: Path | None = None) -> None:
        self.settings = settings or SinkSettings(kafka_topic=topic or None)
        self._log = LogSink(log)
        advice = (f"the refresh's alert drain at exit is {self.settings.close_timeout_s:g} s (not a setting); each "
                  "alert was logged when raised")  # ([sinks] is the monitor's section)
        self._kafka = (QueuedSink(KafkaSink(kafka, topic, timeout_s=self.settings.kafka_timeout_s), self.settings,
                                  advice) if topic else None)
        self._firing: Path | None = None  # record_in
        if publish_root is not None:
            self.record_in(publish_root)

    def record_in(self, root: Path) -> None:
        """From here on each alert fired is also recorded in ``root``'s :data:`FIRING`, for a publish to resolve."""
        self._firing = Path(root) / FIRING

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
        self._send(alert)
        if self._firing is not None:
            self._remember(self._firing, alert)
        return alert

    def _send(self, alert: Alert) -> None:
        """To the log now, and queued for Kafka (never raises)."""
        try:
            self._log.send([alert])
        except Exception as exc:  # noqa: BLE001 - a logging handler failing must not mask the refresh's error
            log.error("could not log the %s alert: %s", alert.rule, exc)
        if self._kafka is not None:
            self._kafka.send([alert])

    @staticmethod
    def _remember(path: Path, alert: Alert) -> None:
        """Append ``alert``'s identity to :data:`FIRING` (one ``O_APPEND`` write: lines of processes firing at once do
        not mix); an error is logged (the alert is sent all the same, only never resolved)."""
        line = json.dumps({"rule": alert.rule, "severity": alert.severity.value, "labels": dict(alert.labels)}) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # no run has made the publish root yet
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("could not record the %s alert in %s (%s): a publish will not resolve it", alert.rule, path,
                        describe_os_error(exc))

    def resolve_firing(self, version: str) -> int:
        """Send one ``resolved`` record for each alert (fingerprint) recorded in :data:`FIRING` (:meth:`record_in`)
        since the last publish, ``version`` being the publish that resolves them, and start that record afresh; returns
        how many. Call it holding the publish root's ``refresh_lock`` (the publish does).

        The record is first renamed aside (:data:`TAKEN`): an alert fired meanwhile by another process goes to a new
        file, for the next publish. The aside is removed only once its resolved records are queued, and the asides of
        processes killed before that (their pid gone) are resolved with this one: every alert fired is resolved at
        least once, twice only after such a kill. Before, the aside had a temp name, and ``publish.clean_leftovers``
        removed a killed process's, with the alerts it held never resolved. Never raises: what cannot be read is logged
        and left unresolved."""
        if self._firing is None:
            return 0
        taken = self._dead_asides()  # before this one's: each there is of a process killed in this method
        mine = self._firing.with_name(f"{TAKEN}{os.getpid()}-{time.time_ns()}")  # unique: a same-pid dead one's stays
        try:
            os.rename(self._firing, mine)
            taken.append(mine)
        except FileNotFoundError:
            pass  # nothing fired since the last publish
        except OSError as exc:
            log.warning("cannot take %s to resolve its alerts (%s); they stay firing", self._firing,
                        describe_os_error(exc))
        resolved: dict[str, Alert] = {}
        taken = [path for path in taken if self._read_aside(path, version, resolved)]  # one unread stays, for the next
        for alert in resolved.values():
            self._send(alert)
        for path in taken:  # after the sends: a process killed before this leaves them for the next publish
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove %s (%s): the next publish resolves its alerts again", path,
                            describe_os_error(exc))
        return len(resolved)

    def _dead_asides(self) -> list[Path]:
        """The :data:`TAKEN` asides of processes gone (this process's pid included: an earlier process's, as
        ``stream.files.leftover_writer_alive`` says), killed in :meth:`resolve_firing` before removing them."""
        assert self._firing is not None
        try:
            found = sorted(p for p in self._firing.parent.iterdir() if p.name.startswith(TAKEN))
        except OSError as exc:
            log.warning("cannot list %s for the alerts of a killed publish (%s); they stay firing",
                        self._firing.parent, describe_os_error(exc))
            return []
        owners = ((p, p.name[len(TAKEN):].split("-")[0]) for p in found)  # (path, its pid as written)
        return [p for p, pid in owners if pid.isdigit() and not leftover_writer_alive(int(pid))]

    def _read_aside(self, path: Path, version: str, resolved: dict[str, Alert]) -> bool:
        """Add to ``resolved`` (by fingerprint) the resolved record of each alert in ``path``, a :data:`FIRING` taken
        aside; whether it was read to its end. What cannot be read is logged and kept (an aside of this process's pid
        is a dead one's to the next publish, :meth:`_dead_asides`): removed unread, its alerts were never resolved."""
        try:
            with open_regular(path) as (fh, _):
                # line by line, each bounded: a schedule failing every minute for months appends far more than a state
                # file holds, but few fingerprints
                reader, seen = io.BufferedReader(fh), set()
                for line in iter(lambda: reader.readline(_LINE_MAX), b""):
                    if line in seen:  # the same alert again (each line is one record: a few kinds)
                        continue
                    seen.add(line)
                    alert = self._resolved(line, version)
                    if alert is not None:
                        resolved.setdefault(alert.fingerprint, alert)
        except OSError as exc:
            log.warning("cannot read %s to resolve its alerts (%s); they stay firing until a publish can", path,
                        describe_os_error(exc))
            return False
        return True

    def _resolved(self, line: bytes, version: str) -> Alert | None:
        """The resolved record of one line of :data:`FIRING`; None (logged) for a line that is no alert record."""
        try:
            rec = json.loads(line)
            return Alert(rule=str(rec["rule"]), source="refresh", severity=Severity(rec["severity"]),
                         state=AlertState.RESOLVED, value=None, threshold=None,
                         message=f"resolved: the refresh published {version}", ts=int(time.time() * 1000),
                         labels={str(k): str(v) for k, v in dict(rec["labels"]).items()})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            log.warning("%s: a line that is no alert record is skipped (%s)", self._firing, str(exc)[:200])
            return None

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
