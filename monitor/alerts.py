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
:class:`SinkError` naming the alerts it did not deliver.
The monitor puts each sink behind a queue of its own (:mod:`monitor.delivery`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import hashlib
import http.client
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from monitor.http_deadline import check_http_url, post_json, time_left
from stream.config import KafkaSettings
from stream.errors import StreamrecError, quoted, shown
from stream.kafka import admin_config
from stream.kafka_access import ACCESS_CHECK_S, KafkaAccessError, check_access
from stream.secrets import hide_url_path, redact, redacted_repr

log = logging.getLogger("streamrec.alerts")


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
                said = shown(v, 80) if v is None or type(v) in (str, int, float, bool) else type(v).__name__
                raise ValueError(f"alert record's {key!r} is not {what}: {said}")
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

    def weight(self) -> int:
        """About the bytes this alert holds: its message's and labels' bytes as UTF-8 (what every sink sends; a label
        of emoji is four times its characters), and a little for the rest: what a sink's queue counts against
        ``queue_max_bytes``. Counted once per alert (a queue's bound sums its alerts at every send)."""
        return self._weight

    @functools.cached_property
    def _weight(self) -> int:
        return 256 + sum(len(text.encode("utf-8", "surrogatepass"))
                         for text in (self.message, *itertools.chain.from_iterable(self.labels.items())))

    def shortened(self, limit: int = 1024) -> Alert:
        """This alert with its message and each label name and value cut to ``limit`` characters (saying how long
        they were), and its labels, in name order, to ``16 * limit`` characters in all (the rest one label ``...``
        saying how many were left out), its fingerprint kept: for a sink that cannot carry it whole (a scraped label
        value of megabytes is over Kafka's message size; so are a hundred thousand short labels of one series)."""
        def cut(text: str) -> str:
            return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

        labels: dict[str, str] = {}
        room = 16 * limit
        for i, (k, v) in enumerate(sorted(self.labels.items())):
            k, v = cut(k), cut(v)
            room -= len(k) + len(v)
            if room < 0:  # ("..." is no label name a series can have)
                labels["..."] = f"{len(self.labels) - i} more labels left out"
                break
            labels[k] = v
        return dataclasses.replace(self, message=cut(self.message), labels=labels)

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
    # the bytes those alerts may hold (Alert.weight), beyond it the same; one over WebhookSink.MAX_BODY goes shortened
    queue_max_bytes: int = 64 << 20
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
    seconds; None: ``timeout_s`` from now). :class:`~monitor.delivery.QueuedSink` calls it with at most ``batch_max``
    alerts, from one thread at a time."""

    name: str
    timeout_s: float
    batch_max: int

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None: ...

    def close(self) -> None: ...


class LogSink:
    """One line per alert: firing at WARNING (ERROR when critical), resolved at INFO; :meth:`Alert.shortened`, as the
    other sinks send an alert too large for them, its fingerprint kept."""

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
            self.logger.log(level, "%s", a.shortened().describe())  # a scraped value of megabytes: one line of them

    def close(self) -> None:
        pass


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
            if self.topic not in admin.list_topics(timeout=time_left(deadline, "listing topics")).topics:
                left = time_left(deadline, "creating the topic")
                # one partition: alerts are few, and one partition keeps them in order across rules
                new = NewTopic(self.topic, num_partitions=1, replication_factor=self.kafka.replication_factor)
                fut = admin.create_topics([new], operation_timeout=left, request_timeout=left)[self.topic]
                try:
                    fut.result(timeout=time_left(deadline, "creating the topic"))
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise
            while True:  # creation is asynchronous on some brokers: wait until its metadata shows a partition
                md = admin.list_topics(timeout=time_left(deadline, "waiting for the topic's metadata")).topics
                if self.topic in md and md[self.topic].partitions:
                    break
                time.sleep(min(0.05, time_left(deadline, "waiting for the topic's metadata")))
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


class WebhookSink:
    """``POST`` each alert as a JSON body to ``url``, one request per alert, every request ended by the
    attempt's deadline (:func:`post_json`), shortened where too large (:meth:`_post`). 2xx: delivered.
    Timeouts, connection errors, 408, 429 and 5xx: undelivered (retried by the queue, not before the answer's
    ``Retry-After``: :class:`~monitor.delivery.QueuedSink`). Any other answer (4xx, 3xx): the request itself is refused,
    so the alert is *rejected* (retrying the same request cannot help)."""

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
                error = f"{type(exc).__name__}: {quoted(str(exc), 200)}".rstrip(": ")
            else:
                if 200 <= status < 300:
                    self.delivered += 1
                    continue
                error = f"HTTP {status} {reason}" + (f": {_one_line(detail[:200].decode('utf-8', 'replace'))}" if detail
                                                     else "")  # (the receiver's text: a line break forged a log line)
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
