"""Alerts and where they go: the :class:`Alert` record, its sinks (log, Kafka topic, webhook) and the
queues that deliver to them.

An alert is one JSON object, the same on every sink (the Kafka message value, the webhook body)::

    {"rule": "cold_start_share", "source": "learner", "severity": "warning", "state": "firing",
     "value": 0.83, "threshold": 0.5, "message": "...", "ts": 1718000000000,
     "labels": {"field": "user_id"}, "kind": "series", "fingerprint": "5c5c29b57a589d8a"}

``kind`` and ``fingerprint`` say *which* alert this is; group, deduplicate and match firing with resolved
by ``fingerprint``, not by rule name and labels. ``kind`` is ``series`` (one series of the rule's
expression) or ``absent`` (the rule's ``absent_for_s`` alert: the expression has had no data that long;
its labels are ``{"absent": "true"}`` for readers, which a series of the rule may carry too).
``fingerprint`` is 16 hex digits (:func:`alert_fingerprint`) of the rule, the kind and the series' own
labels: the same for every alert of one series (across restarts), different for any two series, and
never equal between a series and its rule's absence alert. (Rule name + ``labels`` is not an identity:
a series may have the labels of the absence alert, and ``labels`` also carry the rule's own labels.)
``labels`` are the rule's own labels (from the rules file) and the series' labels; a series label named
like a rule label keeps its value under ``exported_<name>`` (as Prometheus renames a scraped label that
collides with a target label), so the series ``{}`` and ``{team="x"}`` of a rule labelled
``team = "x"`` show ``{team="x"}`` and ``{team="x", exported_team="x"}``.
Both fields were added later: a record without them (an older writer) reads with the identity the new
code gives the same alert (:func:`legacy_identity`), given its rule's labels; without them, as ``kind``
``series`` with the fingerprint of its rule and labels. ``state`` is ``firing`` (the condition held for the rule's
``for_s``) or ``resolved`` (it no longer holds); each firing is followed by exactly one resolved with the
same fingerprint. ``ts`` is
milliseconds since the epoch, like event time on the other topics. ``value`` is a number, or the
strings ``"NaN"``, ``"+Inf"``, ``"-Inf"`` (JSON has no such numbers; Prometheus spells them so), or
null when there is no value (a resolved alert whose series disappeared, an absence alert).
``threshold`` is null for rules without one (op ``isnan``). ``source`` names the scrape source(s)
the value came from (comma-separated), or the job that raised it. On Kafka the message key is the
rule name, so the alerts of one rule stay in order.

Delivery. A sink (:class:`LogSink`, :class:`KafkaSink`, :class:`WebhookSink`) makes one delivery
*attempt* per :meth:`~AlertSink.send` call, and every attempt ends by a total deadline (the sink's
``timeout_s``, not a per-read timeout: a receiver that trickles its answer is cut off too). It raises
:class:`SinkError` naming the alerts it did not deliver. The monitor never calls a sink itself:
:class:`QueuedSink` puts each sink behind a bounded queue drained by a worker thread of its own, so a
slow or dead sink never delays rule evaluation nor the other sinks; alerts an attempt did not deliver
stay queued (in order) and are retried with exponential backoff. An alert leaves a queue only when
delivered, or dropped for one of three reasons, each counted (``streamrec_monitor_sink_dropped_total``)
and logged: ``overflow`` (more than ``queue_size`` waiting: first the alerts a later one of the same fingerprint
supersedes, then the oldest; :meth:`QueuedSink._trim`), ``rejected`` (the sink
refused the alert itself, e.g. HTTP 400, or Kafka's MSG_SIZE_TOO_LARGE or TOPIC_AUTHORIZATION_FAILED, at
produce() or at delivery: :data:`REFUSED_FOR_GOOD`; retrying cannot help) and ``closed`` (still queued when
:meth:`QueuedSink.close` ran out of time). Delivery is at least once: an attempt cut off at its
deadline may have reached the receiver, and the alert is sent again. :class:`FanOut` hands every
batch to several queued sinks.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import email.utils
import enum
import hashlib
import http.client
import io
import json
import logging
import math
import re
import socket
import threading
import time
import unicodedata
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge

from stream.config import KafkaSettings
from stream.errors import StreamrecError, clip
from stream.kafka import ACCESS_CHECK_S, KafkaAccessError, admin_config, check_access
from stream.secrets import hide_url_path, redact, redacted_repr

log = logging.getLogger("streamrec.alerts")

SINK_DELIVERED = PCounter("streamrec_monitor_sink_delivered_total", "Alerts a sink delivered, by sink.", ["sink"])
SINK_FAILURES = PCounter("streamrec_monitor_sink_failures_total",
                         "Delivery attempts that failed, by sink (undelivered alerts stay queued and are retried).",
                         ["sink"])
SINK_RETRIES = PCounter("streamrec_monitor_sink_retries_total",
                        "Delivery attempts that retried alerts an earlier attempt failed to deliver, by sink.",
                        ["sink"])
SINK_DROPPED = PCounter("streamrec_monitor_sink_dropped_total",
                        "Alerts given up on, by sink and reason: overflow (queue full: superseded, then the oldest "
                        "dropped), rejected (the sink refused the alert itself), closed (undelivered at shutdown).",
                        ["sink", "reason"])
SINK_QUEUE = Gauge("streamrec_monitor_sink_queue_depth",
                   "Alerts waiting for delivery (queued or being sent), by sink.", ["sink"])


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


class AlertKind(str, enum.Enum):
    SERIES = "series"  # one series of the rule's expression
    ABSENT = "absent"  # the rule's absent_for_s alert: the expression has had no data that long


def alert_fingerprint(rule: str, kind: AlertKind, labels: Mapping[str, str]) -> str:
    """An alert's identity (module docstring): 16 hex digits of a SHA-256 over the rule, the kind and the series'
    own labels, written as one JSON array (strings quoted and escaped, so no two inputs write the same text). A lone
    surrogate (JSON's ``"\\udc80"``, which another writer's record may hold) is encoded as it is (``surrogatepass``):
    plain UTF-8 raised UnicodeEncodeError for it, out of :meth:`Alert.from_json` and every Alert made with it."""
    canon = json.dumps([rule, kind.value, sorted(labels.items())], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()[:16]


LEGACY_ABSENT_LABELS = {"absent": "true"}  # an absence alert's own labels, as an older writer showed them


def legacy_identity(rule: str, labels: Mapping[str, str], rule_labels: Mapping[str, str] | None,
                    kind: AlertKind | None = None) -> tuple[AlertKind, str]:
    """The kind and fingerprint the monitor now gives an alert an older writer sent without them (rule, and
    ``labels`` as it wrote them). That writer showed ``{**rule_labels, **series}``, while the fingerprint is of the
    series' own labels: one fingerprint of all of ``labels`` split an alert fired before an upgrade and resolved
    after it (the restarted monitor restores it from its state file) into two identities wherever the rule has
    labels. So the rule's labels (``rule_labels``: from the rules file, or the run log's ``start`` record) are taken
    out again: a label with the rule's value is the rule's (a series label of the same name replaced it, so one
    with another value is the series'; a series that had the rule's very value is the ambiguity the merge made and
    reads as not having it). Own labels ``{"absent": "true"}`` are the rule's absence alert (a series with that
    label alone is the one case read wrongly) unless ``kind`` says. Without ``rule_labels`` (``None``), ``labels`` are
    taken whole."""
    rl = rule_labels or {}
    own = {k: v for k, v in labels.items() if rl.get(k) != v}
    if kind is None:
        kind = AlertKind.ABSENT if own == LEGACY_ABSENT_LABELS else AlertKind.SERIES
    return kind, alert_fingerprint(rule, kind, own)


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
    kind: AlertKind = AlertKind.SERIES
    # "" computes it from rule, kind and labels; the engine passes the one of the series' own labels (its labels
    # here also carry the rule's labels)
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", alert_fingerprint(self.rule, self.kind, self.labels))
        # scrubbed where every alert is made, for every sink (the log's filter covered the log copy only: a refresh
        # failure's message quoting an exception went to Kafka and webhooks as it was)
        object.__setattr__(self, "message", redact(self.message))

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
            "kind": self.kind.value,
            "fingerprint": self.fingerprint,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes | str, rule_labels: Mapping[str, str] | None = None) -> Alert:
        """An alert as a sink sent it; one an older writer sent without ``kind`` and ``fingerprint`` gets those the
        monitor now gives it (:func:`legacy_identity`; ``rule_labels`` are its rule's labels, when known).

        Any other record is a ValueError saying what is wrong: not JSON (or not UTF-8), nested past the parser, not an
        object, a missing key, or a field of another type or value than the module docstring's (``ts`` an integer,
        ``value`` and ``threshold`` a number, null or one of its three strings, ``labels`` strings to strings).
        ``kind`` and ``fingerprint`` may be missing, null or empty (an older writer)."""
        try:
            d = json.loads(data)
        except RecursionError:
            raise ValueError("alert record nested too deep for the JSON parser") from None
        except ValueError as exc:  # UnicodeDecodeError is one
            raise ValueError(f"alert record is not JSON ({exc})") from None
        if not isinstance(d, dict):
            raise ValueError(f"alert record is not a JSON object but {type(d).__name__}")

        def get(key: str, ok: Callable[[Any], bool], what: str, optional: bool = False) -> Any:
            if key not in d and not optional:
                raise ValueError(f"alert record is missing {key!r}")
            v = d.get(key)
            if not (ok(v) or optional and v in (None, "")):
                shown = clip(repr(v), 80) if v is None or type(v) in (str, int, float, bool) else type(v).__name__
                raise ValueError(f"alert record's {key!r} is not {what}: {shown}")
            return v

        def member(e: type[enum.Enum]) -> Callable[[Any], bool]:
            return lambda v: isinstance(v, str) and v in {m.value for m in e}

        def number(v: Any) -> bool:
            if type(v) is int:
                try:
                    float(v)
                except OverflowError:  # a JSON integer past a float's range
                    return False
            return v is None or isinstance(v, str) and v in ("NaN", "+Inf", "-Inf") or type(v) in (int, float)

        labels = get("labels", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                     "an object of strings", optional=True) or {}
        kind_ = get("kind", member(AlertKind), "series or absent", optional=True)
        kind = AlertKind(kind_) if kind_ else None
        rule = get("rule", lambda v: isinstance(v, str), "a string")
        if fp := get("fingerprint", lambda v: isinstance(v, str), "a string", optional=True):
            kind, fingerprint = kind or AlertKind.SERIES, fp
        else:
            kind, fingerprint = legacy_identity(rule, labels, rule_labels, kind)
        return cls(rule=rule, source=get("source", lambda v: isinstance(v, str), "a string"),
                   severity=Severity(get("severity", member(Severity), "a severity")),
                   state=AlertState(get("state", member(AlertState), "firing or resolved")),
                   value=decode_value(get("value", number, "a number, null, NaN, +Inf or -Inf")),
                   threshold=decode_value(get("threshold", number, "a number, null, NaN, +Inf or -Inf")),
                   message=get("message", lambda v: isinstance(v, str), "a string"),
                   ts=get("ts", lambda v: type(v) is int, "an integer (milliseconds)"), labels=labels, kind=kind,
                   fingerprint=fingerprint)

    def shortened(self, limit: int = 1024) -> Alert:
        """This alert with its message and each label name and value cut to ``limit`` characters (saying how long
        they were), its fingerprint kept: for a sink that cannot carry it whole (a scraped label value of megabytes
        is over Kafka's message size)."""
        def cut(text: str) -> str:
            return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

        return dataclasses.replace(self, message=cut(self.message),
                                   labels={cut(k): cut(v) for k, v in self.labels.items()})

    def describe(self) -> str:
        """One log line: ``FIRING critical nan_losses{} value=3 source=learner id=<fingerprint>: message``; an
        absence alert says ``absent`` after its labels (a series may have the same labels). Label values are quoted
        as JSON strings and every control character is escaped (:func:`_one_line`): a scraped label value is the
        target's text (the exposition's ``\\n`` is a line break), and written raw it began a forged log line, or
        sent a terminal escape sequence."""
        lbl = ",".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in sorted(self.labels.items()))
        kind = " absent" if self.kind is AlertKind.ABSENT else ""
        return _one_line(f"{self.state.value.upper()} {self.severity.value} {self.rule}{{{lbl}}}{kind} "
                         f"value={encode_value(self.value)} source={self.source or '-'} id={self.fingerprint}: "
                         f"{self.message}")


# C0, DEL and C1 (0x9b is a terminal's CSI), and lone surrogates (a log stream cannot encode them)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _one_line(text: str) -> str:
    """``text`` with each control character (and lone surrogate) written as a ``\\uXXXX`` escape: one line, no
    terminal sequences, encodable."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


@dataclass(frozen=True)
class SinkSettings:
    """The ``[sinks]`` table of an alert rules file: where alerts go, and how they are delivered.

    Each enabled sink has its own queue and worker thread (see the module docstring). Timeouts are
    *total* deadlines of one delivery attempt; a failed attempt is retried after ``retry_backoff_s``,
    doubling with every failure in a row up to ``retry_backoff_max_s``, for as long as the alerts stay
    queued. The defaults suit one monitor sending a few alerts an hour.
    """

    log: bool = True  # one log line per alert (logger streamrec.alerts)
    kafka_topic: str | None = None  # e.g. "alerts"; created with one partition if missing
    kafka_timeout_s: float = 10.0  # one attempt (topic check, produce, acknowledgement) ends within this, in total
    webhook_url: str | None = None  # POST one JSON alert per request
    webhook_timeout_s: float = 5.0  # one POST (connect, send, the answer's status and headers), in total
    queue_size: int = 1000  # alerts waiting per sink; beyond it superseded, then oldest dropped (counted, logged)
    retry_backoff_s: float = 0.5  # wait after a failed attempt; doubles with each failure in a row ...
    retry_backoff_max_s: float = 30.0  # ... up to this
    close_timeout_s: float = 10.0  # at shutdown, keep delivering queued alerts this long, then report the rest

    def __repr__(self) -> str:
        """The webhook as its scheme and host only (its user-info, path and query may be its token: Slack's are in the
        path; ``stream.secrets.hide_url_path``), the rest through ``redacted_repr``."""
        shown = copy.copy(self)
        if self.webhook_url:
            object.__setattr__(shown, "webhook_url", hide_url_path(self.webhook_url))
        return redacted_repr(shown)


class SinkError(StreamrecError):
    """One delivery attempt did not deliver every alert of its batch.

    ``undelivered``: the alerts to try again (None: every alert of the batch not in ``rejected``);
    ``rejected``: alerts the sink refused for good (retrying cannot help; they are dropped and logged);
    ``retry_after_s``: how long the receiver asked to be left alone (HTTP ``Retry-After``), or None.
    """

    def __init__(self, message: str, undelivered: Sequence[Alert] | None = None,
                 rejected: Sequence[Alert] = (), retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.undelivered = None if undelivered is None else list(undelivered)
        self.rejected = list(rejected)
        self.retry_after_s = retry_after_s


class AlertSink(Protocol):
    """A destination for alerts. :meth:`send` makes one delivery attempt and returns (every alert
    delivered) or raises (:class:`SinkError` says which were not) by ``deadline`` (``time.monotonic()``
    seconds; None: ``timeout_s`` from now). :class:`QueuedSink` calls it with at most ``batch_max``
    alerts, from one thread at a time."""

    name: str
    timeout_s: float
    batch_max: int

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None: ...

    def close(self) -> None: ...


class LogSink:
    """One line per alert: firing at WARNING (ERROR when critical), resolved at INFO."""

    name = "log"
    timeout_s = 5.0  # not enforced: a log record is written by the logging handlers
    batch_max = 100

    def __init__(self, logger: logging.Logger = log) -> None:
        self.logger = logger

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        for a in alerts:
            if a.state is AlertState.RESOLVED:
                level = logging.INFO
            else:
                level = logging.ERROR if a.severity is Severity.CRITICAL else logging.WARNING
            self.logger.log(level, "%s", a.describe())

    def close(self) -> None:
        pass


def _left(deadline: float, what: str) -> float:
    """Seconds until ``deadline``; :class:`TimeoutError` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"deadline passed {what}")
    return left


# librdkafka error codes (KafkaError.code(), from produce() or a delivery report) that refuse one alert for good:
# too large for the broker or topic (MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE), a record the broker will not
# take (INVALID_RECORD), or a producer not allowed to write the topic (TOPIC_/CLUSTER_AUTHORIZATION_FAILED, an
# operator's ACL, like the webhook's HTTP 403). Retrying cannot help, and the alert would block every one behind
# it: it is dropped ("rejected": counted and logged). Every other error is retried, the non-retriable ones
# included: a timed-out message (_MSG_TIMED_OUT, a broker that is down) is not retriable() yet transient, and a
# fatal() error is cured by the fresh producer every failed attempt gets. An unknown topic (UNKNOWN_TOPIC_OR_PART,
# retriable in Kafka's table; _UNKNOWN_TOPIC) is retried too: topic metadata that has not propagated yet.
REFUSED_FOR_GOOD = frozenset({10, 18, 87, 29, 31})  # MSG_SIZE_TOO_LARGE, RECORD_LIST_TOO_LARGE, INVALID_RECORD,
# TOPIC_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED (checked against confluent_kafka.KafkaError in the tests)


class KafkaSink:
    """Alerts to a Kafka topic: key = rule name, value = the alert's JSON; an attempt succeeds when the
    broker acknowledged every alert of the batch.

    Everything an attempt does is bounded by its deadline: the topic check (and creation, with one
    partition, if missing), producing and waiting for acknowledgements. The topic is checked before every attempt,
    not once: alerts are few, and after the topic was deleted while the monitor ran the next alerts were acknowledged
    by the local broker and never readable (a broker without auto-creation fails every attempt instead). Alerts not
    acknowledged by the deadline are purged from the producer and reported undelivered, and the next attempt starts
    with a fresh producer (an alert purged while in flight may still land: at least once).
    """

    name = "kafka"
    batch_max = 100

    def __init__(self, kafka: KafkaSettings, topic: str, timeout_s: float = 10.0) -> None:
        self.kafka, self.topic, self.timeout_s = kafka, topic, timeout_s
        self._producer: Any = None

    def _ensure_topic(self, deadline: float) -> None:
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(admin_config(self.kafka))
        try:
            if self.topic not in admin.list_topics(timeout=_left(deadline, "listing topics")).topics:
                left = _left(deadline, "creating the topic")
                # one partition: alerts are few, and one partition keeps them in order across rules
                new = NewTopic(self.topic, num_partitions=1, replication_factor=self.kafka.replication_factor)
                fut = admin.create_topics([new], operation_timeout=left, request_timeout=left)[self.topic]
                try:
                    fut.result(timeout=_left(deadline, "creating the topic"))
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise
            while True:  # creation is asynchronous on some brokers: wait until its metadata shows a partition
                md = admin.list_topics(timeout=_left(deadline, "waiting for the topic's metadata")).topics
                if self.topic in md and md[self.topic].partitions:
                    break
                time.sleep(min(0.05, _left(deadline, "waiting for the topic's metadata")))
        except (KafkaException, TimeoutError) as exc:
            raise SinkError(f"Kafka topic {self.topic!r} at {self.kafka.bootstrap_servers}: not ready within "
                            f"kafka_timeout_s={self.timeout_s:g}s: {exc}. Is the broker up (`streamrec stack "
                            "status`)?") from None

    def _new_producer(self) -> Any:
        from confluent_kafka import Producer

        from stream.kafka import producer_config

        return Producer(producer_config(self.kafka, **{"message.timeout.ms": max(1, int(self.timeout_s * 1000)),
                                                       "linger.ms": 0}))

    def _discard_producer(self) -> None:
        if self._producer is not None:
            self._producer.purge(in_queue=True, in_flight=True, blocking=False)
            self._producer.poll(0)
            self._producer = None

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        if not alerts:
            return
        end = time.monotonic() + self.timeout_s if deadline is None else deadline
        # the builders' one-time access check, bounded by this attempt's deadline (a refusal raises here)
        try:
            check_access(self.kafka, timeout_s=max(0.1, min(ACCESS_CHECK_S, end - time.monotonic())))
        except KafkaAccessError as exc:
            raise SinkError(str(exc), undelivered=list(alerts)) from None
        self._ensure_topic(end)  # (every attempt: the class docstring)
        if self._producer is None:
            self._producer = self._new_producer()
        errors: dict[int, str | None] = {}  # index -> None (acknowledged) or the error
        refused: dict[int, str] = {}  # index -> why Kafka refuses that alert for good

        def report(i: int, err: Any, _msg: Any) -> None:
            if err is not None and err.code() in REFUSED_FOR_GOOD:
                refused[i] = err.str()
            errors[i] = None if err is None or i in refused else err.str()

        try:
            for i, a in enumerate(alerts):
                why = self._produce(a, partial(report, i))
                if why is not None:
                    refused[i] = why
                    errors[i] = None  # not undelivered: refused (counted and logged by the queue)
            self._producer.flush(max(0.0, end - time.monotonic()))
        except BufferError:
            pass  # the producer's local queue is full: whatever was not acknowledged is retried below
        except Exception:  # e.g. _FATAL from produce(): this producer is done; the next attempt makes a new one
            self._discard_producer()
            raise
        rejected = [alerts[i] for i in sorted(refused)]
        undelivered = [a for i, a in enumerate(alerts) if errors.get(i, "not acknowledged") is not None]
        if rejected and not undelivered:
            raise SinkError(f"Kafka topic {self.topic!r}: {len(rejected)} alert(s) refused for good: "
                            f"{refused[min(refused)]}", undelivered=[], rejected=rejected)
        if undelivered:
            self._discard_producer()
            errs = [e for _, e in sorted(errors.items()) if e is not None]
            first = errs[0] if errs else f"no acknowledgement by the attempt's deadline ({self.timeout_s:g}s)"
            raise SinkError(f"Kafka topic {self.topic!r} at {self.kafka.bootstrap_servers}: {len(undelivered)} of "
                            f"{len(alerts)} alert(s) not acknowledged ({first}). Is the broker up (`streamrec "
                            "stack status`)?", undelivered=undelivered, rejected=rejected)

    def _produce(self, a: Alert, on_delivery: Any) -> str | None:
        """Produce ``a``; one over the message size goes :meth:`Alert.shortened` (produce() refused it at once
        with MSG_SIZE_TOO_LARGE, the attempt failed, and the alert and every one behind it stayed queued for good).
        Returns why Kafka refuses the alert for good (:data:`REFUSED_FOR_GOOD`; too large even shortened), or None."""
        from confluent_kafka import KafkaError, KafkaException

        for candidate in (a, a.shortened()):
            try:
                self._producer.produce(self.topic, candidate.to_json(), a.key, on_delivery=on_delivery)
                return None
            except KafkaException as exc:
                code = exc.args[0].code()
                if code != KafkaError.MSG_SIZE_TOO_LARGE and code in REFUSED_FOR_GOOD:
                    return str(exc.args[0].str())
                if code != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
        return "too large for a message even with its labels and message cut short"

    def close(self) -> None:
        self._discard_producer()  # every attempt waited for its acknowledgements: nothing is outstanding


# -- HTTP with a total deadline ---------------------------------------------------------------------
class _DeadlineReader(io.RawIOBase):
    """Reads a socket, each read given only the time left until ``deadline``: a peer that trickles
    bytes is cut off at the deadline, not once per read. Reads through the socket's own file object
    (``makefile``), which keeps the socket open while the answer is read, as http.client expects: it
    closes its connection right after the headers of an answer that ends when the peer hangs up."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int | None:
        self._sock.settimeout(_left(self._deadline, "reading the answer"))
        return self._raw.readinto(buf)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """What :class:`http.client.HTTPResponse` needs of a socket (``makefile``), reading by a deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _deadline_response(sock: socket.socket, *args: Any, deadline: float, **kw: Any) -> http.client.HTTPResponse:
    return http.client.HTTPResponse(_DeadlineSocket(sock, deadline), *args, **kw)  # type: ignore[arg-type]


def _connect(address: tuple[str, int], deadline: float) -> socket.socket:
    """Like :func:`socket.create_connection`, but every address tried gets only the time left."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_left(deadline, "connecting"))
            sock.connect(addr)
            sock.settimeout(_left(deadline, "connecting"))  # the TLS handshake, if any, gets what is left
            return sock
        except OSError as exc:
            sock.close()
            error = exc
            if isinstance(exc, TimeoutError):
                break
    raise error or OSError(f"{host} resolves to no address")


def _deadline_connection(url: str, deadline: float) -> tuple[http.client.HTTPConnection, str]:
    """A connected HTTP(S) connection to ``url`` whose connect, send and every read of the answer get only the time
    left until ``deadline``, and the request path; closed again if connecting fails."""
    parts = urllib.parse.urlsplit(url)
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn = conn_class(parts.hostname or "", port, timeout=_left(deadline, "connecting"))
    conn._create_connection = lambda address, *_: _connect(address, deadline)  # type: ignore[attr-defined]
    conn.response_class = partial(_deadline_response, deadline=deadline)  # type: ignore[assignment]
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(_left(deadline, "sending"))  # sendall: a total limit since Python 3.5
    except BaseException:
        conn.close()
        raise
    return conn, _request_target(parts)


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _request_target(parts: urllib.parse.SplitResult) -> str:
    """The path and query of ``parts`` as an HTTP request sends them: each non-ASCII character percent-encoded as
    UTF-8 (as browsers and ``requests`` send it), the rest as written. http.client raised UnicodeEncodeError for a
    raw one at every request: a rules file with ``webhook_url = ".../köln"`` loaded, and each alert stayed queued."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _NON_ASCII.sub(lambda m: urllib.parse.quote(m.group(), safe=""), target)


def _auth_headers(url: str) -> dict[str, str]:
    """``Authorization: Basic`` for the user and password ``url`` names (``https://user:password@host/...``,
    percent-escapes decoded, UTF-8), as curl sends them; none when it names no user. http.client itself drops
    them: a receiver that wants them answered 401 to every request."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(user.encode()).decode("ascii")}


def retry_after_s(value: str | None) -> float | None:
    """Seconds an HTTP ``Retry-After`` header asks for: delay-seconds or an HTTP-date (RFC 9110 10.2.3), never
    negative; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # ("²".isdigit(), and a Latin-1 header may carry it)
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo is not None else None


def post_json(url: str, body: bytes, deadline: float) -> tuple[int, str, bytes, float | None]:
    """``POST`` ``body`` to ``url``; returns (status, reason, the first bytes of an error answer's body, the seconds
    its ``Retry-After`` asks for or None).

    Promise: returns or raises by ``deadline`` (``time.monotonic()`` seconds), whatever the peer does:
    connecting, sending and every read of the answer get only the time left, so a server that accepts
    and never answers, or trickles its answer, raises :class:`TimeoutError` at the deadline. (Name
    resolution is the one step the operating system's resolver bounds instead.) A 2xx answer's body
    is not read: the status says the alert arrived. Redirects are not followed. A user and password in ``url``
    are sent as HTTP Basic authentication.
    """
    conn, path = _deadline_connection(url, deadline)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       "User-Agent": "streamrec-monitor", **_auth_headers(url)})
        resp = conn.getresponse()
        detail = b""
        if not 200 <= resp.status < 300:
            try:
                detail = resp.read(300)
            except (OSError, http.client.HTTPException):
                pass
        return resp.status, resp.reason, detail, retry_after_s(resp.getheader("Retry-After"))
    finally:
        conn.close()


def get_text(url: str, deadline: float, max_bytes: int) -> str:
    """``GET`` ``url`` and return its body as text: UTF-8, each undecodable byte kept as a lone surrogate
    (``surrogateescape``, U+DC80..U+DCFF), so :func:`monitor.exposition.parse` refuses it where Prometheus does (a
    label value, HELP text) and reads past it where Prometheus does (a comment); ``errors="replace"`` read a
    Latin-1 ``K\\xf6ln`` as ``K\\ufffdln``.

    Promise, as :func:`post_json`: returns or raises by ``deadline`` (``time.monotonic()`` seconds),
    whatever the peer does (a server that accepts and never answers, or trickles its answer, raises
    :class:`TimeoutError` at the deadline), and never holds more than ``max_bytes`` of the answer: a
    longer one raises :class:`ValueError` saying so. A status other than 2xx raises
    :class:`OSError` naming it; redirects are not followed (give the final URL). A user and password in ``url``
    are sent as HTTP Basic authentication.
    """
    conn, path = _deadline_connection(url, deadline)
    try:
        conn.request("GET", path, headers={"Accept": "text/plain", "User-Agent": "streamrec-monitor",
                                           **_auth_headers(url)})
        resp = conn.getresponse()
        if not 200 <= resp.status < 300:
            raise OSError(f"HTTP {resp.status} {resp.reason}" + (" (redirects are not followed: give the final "
                                                                  "URL)" if 300 <= resp.status < 400 else ""))
        body = resp.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise ValueError(f"the answer is larger than {max_bytes} bytes; not read further")
        return body.decode("utf-8", "surrogateescape")
    finally:
        conn.close()


def check_http_url(url: str) -> str | None:
    """None when ``url`` is a usable http(s) URL (a webhook, a scrape source), else what is wrong with it."""
    odd = dict.fromkeys(c for c in url if c.isspace() or unicodedata.category(c) == "Cc")  # urlsplit drops some
    if odd:  # (each escaped: the message must not carry a NUL or a line break to the terminal or the log)
        return (f"holds a control character or space ({', '.join(json.dumps(c) for c in odd)}; a space is %20 in a "
                "URL)")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:  # its detail quotes the netloc's parts: not where a user-info (a password) is among them
        return (str(exc) if "@" not in url else "its host or port cannot be read (in a user:password@, a '/', '?', "
                "'#' or '@' must be percent-encoded)")
    if parts.scheme not in ("http", "https"):
        return "expected an http:// or https:// URL"
    if not parts.hostname:
        return "the URL names no host"
    return None


class WebhookSink:
    """``POST`` each alert as a JSON body to ``url``, one request per alert, every request ended by the
    attempt's deadline (:func:`post_json`), shortened where too large (:meth:`_post`). 2xx: delivered.
    Timeouts, connection errors, 408, 429 and 5xx: undelivered (retried by the queue, not before the answer's
    ``Retry-After``: :class:`QueuedSink`). Any other answer (4xx, 3xx): the request itself is refused, so the alert is
    *rejected* (retrying the same request cannot help)."""

    name = "webhook"
    batch_max = 1
    MAX_BODY = 1 << 20  # bytes; a longer alert goes shortened (Kafka's default message size, a receiver's likely limit)

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        problem = check_http_url(url)
        if problem:
            raise ValueError(f"webhook URL {hide_url_path(url)!r}: {problem}; e.g. http://alertmanager:9093/hook")
        self.url, self.timeout_s = url, timeout_s
        self.shown = hide_url_path(url)  # in messages: a Slack-style URL's path is its token
        self.delivered = 0

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        end = time.monotonic() + self.timeout_s if deadline is None else deadline
        rejected: list[Alert] = []
        why: list[str] = []
        for i, a in enumerate(alerts):
            wait = None
            try:
                status, reason, detail, wait = self._post(a, end)
            except TimeoutError:
                error = (f"no answer within the attempt's deadline (webhook_timeout_s={self.timeout_s:g}s, "
                         "connect + send + answer)")
            except (OSError, http.client.HTTPException) as exc:
                error = f"{type(exc).__name__}: {exc}".rstrip(": ")
            else:
                if 200 <= status < 300:
                    self.delivered += 1
                    continue
                error = f"HTTP {status} {reason}" + (f": {detail[:200].decode('utf-8', 'replace')}" if detail else "")
                if not (status in (408, 429) or status >= 500):
                    rejected.append(a)
                    why.append(f"{a.rule} ({a.state.value}): {error}")
                    continue
            # the receiver is down or overloaded: stop here, the rest stay queued in order
            raise SinkError(f"webhook {self.shown}: {len(alerts) - i} of {len(alerts)} alert(s) not delivered: "
                            f"{error}", undelivered=alerts[i:], rejected=rejected, retry_after_s=wait)
        if rejected:
            raise SinkError(f"webhook {self.shown} refused {len(rejected)} alert(s), which are dropped (the "
                            f"receiver rejects the request itself; check webhook_url): {'; '.join(why)}",
                            undelivered=[], rejected=rejected)

    def _post(self, a: Alert, end: float) -> tuple[int, str, bytes, float | None]:
        """POST ``a``; one longer than :attr:`MAX_BODY`, or refused with 413 (too large), goes
        :meth:`Alert.shortened`, its fingerprint kept, as the Kafka sink sends one over the message size. Sent whole,
        a scraped label value of megabytes made the alert rejected (413), or failed every attempt for ever where the
        receiver hung up mid-body (a broken pipe, retried) and held every alert behind it."""
        body = a.to_json()
        if len(body) > self.MAX_BODY:
            body = a.shortened().to_json()
        answer = post_json(self.url, body, end)
        if answer[0] == 413 and (short := a.shortened().to_json()) != body:
            answer = post_json(self.url, short, end)
        return answer

    def close(self) -> None:
        pass


# -- queues -------------------------------------------------------------------------------------------
class Backoff:
    """The wait before the next attempt after ``failures`` failed attempts in a row: ``first_s``,
    doubled per further failure, never more than ``max_s``."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max(max_s, first_s)

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 60))


@dataclass
class DeliveryStats:
    """What one sink's queue has done (also in the streamrec_monitor_sink_* metrics)."""

    delivered: int = 0  # alerts
    failed: int = 0  # attempts that failed
    retried: int = 0  # attempts that retried alerts an earlier attempt failed to deliver
    dropped: Counter[str] = field(default_factory=Counter)  # alerts, by reason: overflow, rejected, closed
    queued: int = 0  # alerts waiting now (queued or being sent)

    def as_dict(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "failed": self.failed, "retried": self.retried,
                "dropped": dict(self.dropped), "queued": self.queued}


def _which(alerts: Sequence[Alert], limit: int = 5) -> str:
    shown = ", ".join(f"{a.rule}({a.state.value}, ts={a.ts})" for a in alerts[:limit])
    return shown + (f" and {len(alerts) - limit} more" if len(alerts) > limit else "")


class QueuedSink:
    """Delivers alerts to ``sink`` from a bounded queue, on a worker thread of its own.

    Promises:

    * :meth:`send` only queues and returns at once: however slow or dead the sink, the caller (rule
      evaluation) is never delayed, and neither are other sinks (each has its own queue and thread).
    * Every attempt (``sink.send`` of up to ``sink.batch_max`` alerts) has a total deadline of
      ``sink.timeout_s``; one that starts while :meth:`close` drains ends by close's deadline.
    * Alerts an attempt did not deliver go back to the head of the queue, in order, and are retried
      after :class:`Backoff` (``retry_backoff_s`` doubling to ``retry_backoff_max_s``), until delivered; a
      receiver's ``Retry-After`` (429, 503) lengthens the wait to what it asks, up to ``retry_backoff_max_s`` (a
      receiver asking for a day does not park the alerts that long). It was ignored: a throttled receiver got
      the next request 0.5 s later, and more 429s.
      Alerts are delivered in the order they were queued, at least once.
    * At most ``queue_size`` alerts wait (plus the batch being sent); beyond that the superseded, then the oldest
      are dropped (:meth:`_trim`).
      Every alert dropped (overflow, rejected by the sink, closed) is counted and logged.
    * :meth:`close` keeps delivering until the queue is empty or its deadline (trying at once, whatever
      the backoff, then backing off as before), then reports (log and return value) how many alerts
      were left undelivered.
    """

    JOIN_GRACE_S = 0.5  # close() waits this much beyond its deadline for an attempt cut off at it to return

    def __init__(self, sink: AlertSink, settings: SinkSettings = SinkSettings(),
                 close_advice: str = "raise close_timeout_s in [sinks] to wait longer") -> None:
        """``close_advice``: what the close's log line tells the operator when alerts were left undelivered by a
        sink that never failed (the owner's setting, or why there is none)."""
        self.sink, self.name, self.close_advice = sink, sink.name, close_advice
        self.queue_size = max(1, settings.queue_size)
        self.close_timeout_s = settings.close_timeout_s
        self.backoff = Backoff(settings.retry_backoff_s, settings.retry_backoff_max_s)
        self.stats = DeliveryStats()
        self._queue: deque[Alert] = deque()
        self._in_flight: list[Alert] = []
        self._cond = threading.Condition()
        self._failures_in_row = 0
        self._retry_at = 0.0
        self._close_deadline: float | None = None
        self._closed = False  # close() is done: the worker stops after its current attempt
        self._left_at_close: list[Alert] = []
        SINK_QUEUE.labels(self.name).set(0)
        self._thread = threading.Thread(target=self._run, name=f"alert-sink-{self.name}", daemon=True)
        self._thread.start()

    # -- the caller's side
    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        """Queue ``alerts`` for delivery; returns at once (``deadline`` is not needed: nothing waits)."""
        if not alerts:
            return
        with self._cond:
            if self._closed:
                late, overflow = list(alerts), []
            else:
                late = []
                self._queue.extend(alerts)
                overflow = self._trim()
                self._cond.notify_all()
        if late:
            self._drop(late, "closed", "the sink is closed")
        if overflow:
            self._drop(overflow, "overflow", f"more than queue_size={self.queue_size} alerts wait for delivery")

    @property
    def depth(self) -> int:
        """Alerts waiting: queued or being sent."""
        with self._cond:
            return len(self._queue) + len(self._in_flight)

    def waiting(self) -> list[Alert]:
        """The alerts not delivered yet (being sent, then queued, in order); after :meth:`close`, the ones it
        left undelivered."""
        with self._cond:
            return list(self._left_at_close) if self._closed else [*self._in_flight, *self._queue]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing waits for delivery; False if that takes longer than ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self, timeout_s: float | None = None) -> int:
        """Deliver what is queued for at most ``timeout_s`` (default ``close_timeout_s``), stop the
        worker and close the sink; returns (and logs) how many alerts were left undelivered. An attempt
        still running at the deadline (it began before close, with a longer deadline of its own) is not
        waited for beyond :attr:`JOIN_GRACE_S`: its alerts count as undelivered and it finishes in the
        background. A second call returns 0."""
        self.begin_close(time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s))
        return self.finish_close()

    def begin_close(self, deadline: float) -> None:
        """Start draining: the worker delivers what is queued until ``deadline`` (``time.monotonic()``).
        A sink backing off after failures is tried again at once: its next retry may be due only after
        the deadline (up to ``retry_backoff_max_s`` away), and the sink may well answer again by now.
        A later call with an earlier deadline brings the drain's end forward (a stop signal cutting it short)."""
        with self._cond:
            if self._close_deadline is None or deadline < self._close_deadline:
                self._close_deadline = deadline
                self._retry_at = min(self._retry_at, time.monotonic())
            self._cond.notify_all()

    def finish_close(self) -> int:
        """Wait for the drain that :meth:`begin_close` started; the count of alerts left undelivered."""
        with self._cond:
            if self._closed:
                return 0
            assert self._close_deadline is not None, "begin_close() first"
            deadline = self._close_deadline
        self._thread.join(max(0.0, deadline - time.monotonic()) + self.JOIN_GRACE_S)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            if self._thread.is_alive():  # an attempt overran its deadline: count its alerts undelivered too
                left = self._in_flight + left
            self._left_at_close = left
            self._queue.clear()
            self._set_depth()
            self._cond.notify_all()
        if left:
            self._drop(left, "closed", "the close deadline passed before they were delivered")
            log.error("alert sink %s closed with %d alert(s) undelivered (%s)", self.name, len(left),
                      self.close_advice if self.stats.failed == 0 else
                      "the sink kept failing; see the errors above")
        return len(left)

    # -- the worker's side
    def _run(self) -> None:
        try:
            while (batch := self._take()) is not None:
                self._attempt(batch)
        finally:
            try:
                self.sink.close()
            except Exception as exc:  # noqa: BLE001 - closing one sink must not stop the others
                log.error("closing alert sink %s: %s", self.name, exc)

    def _take(self) -> list[Alert] | None:
        """The next batch to send, once the backoff allows; None when the worker should stop."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                closing = self._close_deadline
                if closing is not None and (not self._queue or now >= closing):
                    return None
                if not self._queue:
                    self._cond.wait()
                    continue
                wake = self._retry_at if closing is None else min(self._retry_at, closing)
                if now < wake:
                    self._cond.wait(wake - now)
                    continue
                n = min(max(1, self.sink.batch_max), len(self._queue))
                self._in_flight = [self._queue.popleft() for _ in range(n)]
                return list(self._in_flight)

    def _attempt(self, batch: list[Alert]) -> None:
        retry = self._failures_in_row > 0
        deadline = time.monotonic() + self.sink.timeout_s
        if self._close_deadline is not None:
            deadline = min(deadline, self._close_deadline)
        if retry:
            SINK_RETRIES.labels(self.name).inc()
        try:
            self.sink.send(batch, deadline)
        except Exception as exc:  # noqa: BLE001 - a sink's failure must never end its worker
            self._settle(batch, exc, retry)
        else:
            self._settle(batch, None, retry)

    def _settle(self, batch: list[Alert], exc: Exception | None, retry: bool) -> None:
        if exc is None:
            undelivered: list[Alert] = []
            rejected: list[Alert] = []
        elif isinstance(exc, SinkError):
            rejected = exc.rejected
            gone = {id(a) for a in rejected}
            undelivered = [a for a in batch if id(a) not in gone] if exc.undelivered is None else exc.undelivered
        else:  # a client error let through: nothing of the batch is known delivered
            undelivered, rejected = list(batch), []
        kept = {id(a) for a in undelivered} | {id(a) for a in rejected}
        delivered = [a for a in batch if id(a) not in kept]
        with self._cond:
            self._in_flight = []
            overflow: list[Alert] = []
            if not self._closed:
                self._queue.extendleft(reversed(undelivered))
                overflow = self._trim()
            recovered, wait = 0, 0.0
            if undelivered:
                self._failures_in_row += 1
                wait = self.backoff.delay(self._failures_in_row)
                if isinstance(exc, SinkError) and exc.retry_after_s is not None:  # the receiver's word, within ours
                    wait = max(wait, min(exc.retry_after_s, self.backoff.max_s))
                self._retry_at = time.monotonic() + wait
            else:  # everything delivered (or refused for good): the sink answers again
                recovered, self._failures_in_row = self._failures_in_row, 0
            self.stats.delivered += len(delivered)
            self.stats.retried += int(retry)
            self.stats.failed += int(exc is not None)
            self._set_depth()
            self._cond.notify_all()
        if delivered:
            SINK_DELIVERED.labels(self.name).inc(len(delivered))
        if exc is not None:
            SINK_FAILURES.labels(self.name).inc()
            if undelivered:
                log.warning("alert sink %s: attempt failed, %d alert(s) stay queued, retry #%d in %.3gs: %s",
                            self.name, len(undelivered), self._failures_in_row, wait, exc)
        if rejected:
            self._drop(rejected, "rejected", str(exc))
        if overflow:
            self._drop(overflow, "overflow", f"more than queue_size={self.queue_size} alerts wait for delivery")
        if recovered:
            log.info("alert sink %s delivers again after %d failed attempt(s)", self.name, recovered)
        if delivered and self._closed:  # an attempt close() stopped waiting for, counted "closed" there
            log.warning("alert sink %s: an attempt cut off at close delivered %d alert(s) after all (counted "
                        "dropped at close): %s", self.name, len(delivered), _which(delivered))

    # -- both
    def _trim(self) -> list[Alert]:
        """Drop queued alerts beyond ``queue_size`` (hold the lock); returns them. Superseded ones go first, oldest
        first: an alert with a later one of the same fingerprint queued behind it (a receiver's last word on that
        alert is the later one either way); then the oldest. Dropping the oldest alone dropped, under a sink down for
        hours and one flapping rule, a resolved whose firing was delivered before the outage: that alert stayed firing
        at the receiver for ever (and out of the state file, which keeps only the resolves still queued)."""
        excess = len(self._queue) - self.queue_size
        if excess <= 0:
            self._set_depth()
            return []
        seen: set[str] = set()
        superseded: set[int] = set()  # queue positions
        for i in range(len(self._queue) - 1, -1, -1):
            fp = self._queue[i].fingerprint
            if fp in seen:
                superseded.add(i)
            seen.add(fp)
        victims = sorted(superseded)[:excess]
        victims += [i for i in range(len(self._queue)) if i not in superseded][:excess - len(victims)]
        gone = set(victims)
        dropped = [a for i, a in enumerate(self._queue) if i in gone]
        self._queue = deque(a for i, a in enumerate(self._queue) if i not in gone)
        self._set_depth()
        return dropped

    def _set_depth(self) -> None:
        self.stats.queued = len(self._queue) + len(self._in_flight)
        SINK_QUEUE.labels(self.name).set(self.stats.queued)

    def _drop(self, alerts: list[Alert], reason: str, why: str) -> None:
        with self._cond:
            self.stats.dropped[reason] += len(alerts)
        SINK_DROPPED.labels(self.name, reason).inc(len(alerts))
        log.error("alert sink %s dropped %d alert(s) (%s: %s): %s", self.name, len(alerts), reason, why,
                  _which(alerts))


class FanOut:
    """Hands every alert batch to each sink's own :class:`QueuedSink` (sinks given unqueued are queued
    with ``settings``) and returns at once; one sink failing or hanging never affects the others."""

    name = "fanout"

    def __init__(self, sinks: Sequence[AlertSink | QueuedSink], settings: SinkSettings = SinkSettings()) -> None:
        self.settings = settings
        self.sinks = [s if isinstance(s, QueuedSink) else QueuedSink(s, settings) for s in sinks]

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        for sink in self.sinks:
            sink.send(alerts)

    @property
    def failures(self) -> Counter[str]:
        """Failed delivery attempts, by sink name."""
        out: Counter[str] = Counter()
        for s in self.sinks:
            out[s.name] += s.stats.failed
        return +out

    def stats(self) -> dict[str, dict[str, Any]]:
        """:class:`DeliveryStats` by sink name (a second sink of the same name as ``name#2``)."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.sinks:
            key, n = s.name, 1
            while key in out:
                n += 1
                key = f"{s.name}#{n}"
            out[key] = s.stats.as_dict()
        return out

    def waiting(self) -> list[Alert]:
        """The alerts some sink has not delivered yet (:meth:`QueuedSink.waiting`), sink after sink."""
        return [a for s in self.sinks for a in s.waiting()]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no sink has alerts waiting; False if that takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(s.wait_idle(max(0.0, deadline - time.monotonic())) for s in self.sinks)

    def close(self, timeout_s: float | None = None, abort: Callable[[], str | None] | None = None) -> int:
        """Drain every sink in parallel for at most ``timeout_s`` (default ``close_timeout_s``); the
        count of alerts left undelivered, over all sinks (each sink logs its own). ``abort``: as for
        :func:`drain` (a stop signal beyond the one that began the shutdown ends the drain)."""
        return drain(self.sinks, time.monotonic() + (self.settings.close_timeout_s if timeout_s is None else timeout_s),
                     abort)


def drain(queues: Sequence[QueuedSink], deadline: float, abort: Callable[[], str | None] | None = None) -> int:
    """Close ``queues`` together: each delivers what it holds until ``deadline`` (``time.monotonic()``); the count of
    alerts left undelivered. ``abort`` (polled every 0.2 s) naming a reason (a further stop signal) ends the drain at
    once, with a log line saying so; the alerts still queued are dropped and counted as at the deadline. Without it a
    second SIGTERM during ``streamrec monitor``'s drain killed the process: no summary, no last state-file save."""
    for queue in queues:
        queue.begin_close(deadline)
    while abort is not None and (left := deadline - time.monotonic()) > 0:
        if (why := abort()) is not None:
            log.warning("%s during the alert drain at shutdown: the drain ends now; the alerts still undelivered are "
                        "dropped", why)
            for queue in queues:
                queue.begin_close(time.monotonic())
            break
        idle_by = time.monotonic() + min(left, 0.2)
        if all(q.wait_idle(max(0.0, idle_by - time.monotonic())) for q in queues):
            break
    return sum(queue.finish_close() for queue in queues)


def build_sinks(settings: SinkSettings, kafka: KafkaSettings | None) -> FanOut:
    sinks: list[AlertSink] = []
    if settings.log:
        sinks.append(LogSink())
    if settings.kafka_topic:
        if kafka is None:
            raise ValueError("the kafka sink needs Kafka settings")
        sinks.append(KafkaSink(kafka, settings.kafka_topic, settings.kafka_timeout_s))
    if settings.webhook_url:
        sinks.append(WebhookSink(settings.webhook_url, settings.webhook_timeout_s))
    return FanOut(sinks, settings)
