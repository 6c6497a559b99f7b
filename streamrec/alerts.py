"""Alerts and where they go: the :class:`Alert` record and its sinks (log, Kafka topic, webhook).

An alert is one JSON object, the same on every sink (the Kafka message value, the webhook body)::

    {"rule": "cold_start_share", "source": "learner", "severity": "warning", "state": "firing",
     "value": 0.83, "threshold": 0.5, "message": "...", "ts": 1718000000000,
     "labels": {"field": "user_id"}}

``state`` is ``firing`` (the condition held for the rule's ``for_s``) or ``resolved`` (it no longer
holds); each firing is followed by exactly one resolved for the same rule and labels. ``ts`` is
milliseconds since the epoch, like event time on the other topics. ``value`` is a number, or the
strings ``"NaN"``, ``"+Inf"``, ``"-Inf"`` (JSON has no such numbers; Prometheus spells them so), or
null when there is no value (a resolved alert whose series disappeared, an absence alert).
``threshold`` is null for rules without one (op ``isnan``). ``source`` names the scrape source(s)
the value came from (comma-separated), or the job that raised it. On Kafka the message key is the
rule name, so the alerts of one rule stay in order.

A sink that fails raises :class:`SinkError` (or lets a client error through); :class:`FanOut` catches,
logs and counts it per sink and carries on with the other sinks, so a dead webhook never stops alerts
reaching Kafka or the log, and never stops the monitor.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Counter as PCounter

from streamrec.settings import KafkaSettings

log = logging.getLogger("streamrec.alerts")

SINK_FAILURES = PCounter("streamrec_monitor_sink_failures_total",
                         "Alert batches a sink failed to deliver (after its retries), by sink.", ["sink"])


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AlertState(str, enum.Enum):
    FIRING = "firing"
    RESOLVED = "resolved"


def encode_value(v: float | None) -> float | str | None:
    if v is None:
        return None
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return v


def decode_value(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        return float(v.replace("Inf", "inf"))
    return float(v)


@dataclass(frozen=True)
class Alert:
    rule: str
    source: str
    severity: Severity
    state: AlertState
    value: float | None
    threshold: float | None
    message: str
    ts: int  # milliseconds since the epoch
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> bytes:
        return self.rule.encode()

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "source": self.source,
            "severity": self.severity.value,
            "state": self.state.value,
            "value": encode_value(self.value),
            "threshold": encode_value(self.threshold),
            "message": self.message,
            "ts": self.ts,
            "labels": dict(self.labels),
        }

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Alert:
        d = json.loads(data)
        return cls(rule=d["rule"], source=d["source"], severity=Severity(d["severity"]),
                   state=AlertState(d["state"]), value=decode_value(d["value"]),
                   threshold=decode_value(d["threshold"]), message=d["message"], ts=int(d["ts"]),
                   labels=dict(d.get("labels") or {}))

    def describe(self) -> str:
        """One log line: ``FIRING critical nan_losses{} value=3 > 0: message``."""
        lbl = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        return (f"{self.state.value.upper()} {self.severity.value} {self.rule}{{{lbl}}} "
                f"value={encode_value(self.value)} source={self.source or '-'}: {self.message}")


@dataclass(frozen=True)
class SinkSettings:
    """The ``[sinks]`` table of an alert rules file."""

    log: bool = True  # one log line per alert (logger streamrec.alerts)
    kafka_topic: str | None = None  # e.g. "alerts"; created with one partition if missing
    kafka_timeout_s: float = 10.0  # wait this long for the broker to acknowledge a batch
    webhook_url: str | None = None  # POST one JSON alert per request
    webhook_timeout_s: float = 5.0
    webhook_retries: int = 3  # attempts after the first one, with exponential backoff
    webhook_backoff_s: float = 0.5  # first retry waits this long, then doubles


class SinkError(Exception):
    """A sink could not deliver some alerts (after its own retries)."""


class AlertSink(Protocol):
    name: str

    def send(self, alerts: Sequence[Alert]) -> None: ...

    def close(self) -> None: ...


class LogSink:
    """One line per alert: firing at WARNING (ERROR when critical), resolved at INFO."""

    name = "log"

    def __init__(self, logger: logging.Logger = log) -> None:
        self.logger = logger

    def send(self, alerts: Sequence[Alert]) -> None:
        for a in alerts:
            if a.state is AlertState.RESOLVED:
                level = logging.INFO
            else:
                level = logging.ERROR if a.severity is Severity.CRITICAL else logging.WARNING
            self.logger.log(level, "%s", a.describe())

    def close(self) -> None:
        pass


class KafkaSink:
    """Alerts to a Kafka topic: key = rule name, value = the alert's JSON; waits for acknowledgement."""

    name = "kafka"

    def __init__(self, kafka: KafkaSettings, topic: str, timeout_s: float = 10.0) -> None:
        self.kafka, self.topic, self.timeout_s = kafka, topic, timeout_s
        self._producer: Any = None

    def send(self, alerts: Sequence[Alert]) -> None:
        if not alerts:
            return
        from stream.errors import DeliveryFailed
        from stream.kafka import AckedProducer, ensure_topics

        if self._producer is None:
            # one partition: alerts are few, and one partition keeps them in order across rules
            ensure_topics(self.kafka, [self.topic], partitions=1)
            self._producer = AckedProducer(self.kafka, **{"message.timeout.ms": int(self.timeout_s * 1000),
                                                          "linger.ms": 0})
        try:
            for a in alerts:
                self._producer.send(self.topic, a.to_json(), key=a.key)
            self._producer.flush(self.timeout_s)
        except DeliveryFailed as exc:
            # AckedProducer's report keeps the failure: start over with a fresh producer next time
            self._producer = None
            raise SinkError(f"Kafka topic {self.topic!r} at {self.kafka.bootstrap_servers}: {exc}") from None

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.flush(self.timeout_s)
            finally:
                self._producer = None


class WebhookSink:
    """``POST`` each alert as a JSON body to ``url``; retries timeouts, connection errors, 429 and 5xx
    with exponential backoff. Other 4xx answers are not retried (the request itself is wrong)."""

    name = "webhook"

    def __init__(self, url: str, timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self._sleep = sleep
        self.delivered = 0

    def _post(self, body: bytes) -> None:
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": "streamrec-monitor"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (URL from the rules file)
            resp.read()

    def _deliver(self, alert: Alert) -> str | None:
        """None when delivered, else the last error."""
        body = alert.to_json()
        delay = self.backoff_s
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(delay)
                delay *= 2
            try:
                self._post(body)
                return None
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code} {exc.reason}"
                if 400 <= exc.code < 500 and exc.code != 429:
                    break
            except (urllib.error.URLError, OSError) as exc:
                error = str(getattr(exc, "reason", exc))
        return error

    def send(self, alerts: Sequence[Alert]) -> None:
        failed = []
        for a in alerts:
            err = self._deliver(a)
            if err is None:
                self.delivered += 1
            else:
                failed.append(f"{a.rule} ({a.state.value}): {err}")
        if failed:
            raise SinkError(f"webhook {self.url}: {len(failed)} of {len(alerts)} alert(s) not delivered after "
                            f"{self.retries + 1} attempt(s): {'; '.join(failed)}")

    def close(self) -> None:
        pass


class FanOut:
    """Sends every alert batch to each sink in turn; a sink's failure is logged and counted, and the
    other sinks still get the batch."""

    name = "fanout"

    def __init__(self, sinks: Sequence[AlertSink]) -> None:
        self.sinks = list(sinks)
        self.failures: Counter[str] = Counter()

    def send(self, alerts: Sequence[Alert]) -> None:
        if not alerts:
            return
        for sink in self.sinks:
            try:
                sink.send(alerts)
            except Exception as exc:  # noqa: BLE001 - a sink must never stop the others or the monitor
                self.failures[sink.name] += 1
                SINK_FAILURES.labels(sink.name).inc()
                log.error("alert sink %s failed (%d alert(s) not delivered there): %s", sink.name, len(alerts), exc)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                log.error("closing alert sink %s: %s", sink.name, exc)


def build_sinks(settings: SinkSettings, kafka: KafkaSettings | None) -> FanOut:
    sinks: list[AlertSink] = []
    if settings.log:
        sinks.append(LogSink())
    if settings.kafka_topic:
        if kafka is None:
            raise ValueError("the kafka sink needs Kafka settings")
        sinks.append(KafkaSink(kafka, settings.kafka_topic, settings.kafka_timeout_s))
    if settings.webhook_url:
        sinks.append(WebhookSink(settings.webhook_url, settings.webhook_timeout_s, settings.webhook_retries,
                                 settings.webhook_backoff_s))
    return FanOut(sinks)
