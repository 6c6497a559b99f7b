"""The acknowledged producer (:class:`AckedProducer`): an idempotent producer that counts acknowledgements, surfaces
delivery errors as the error each refusal is (:class:`DeliveryReport`), and renews itself after a fatal error.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from stream.config import KafkaSettings
from stream.errors import DeliveryFailed, DeliveryRefused, MessageTooLarge, PartitionMissing
from stream.kafka import Headers, producer_config
from stream.kafka_access import error_text, never_connected, principal
from stream.kafka_limits import LIBRDKAFKA_MESSAGE_BYTES

log = logging.getLogger("streamrec.kafka")


# Refusals of a write that sending it again cannot change: the principal lacks WRITE on the topic, or IDEMPOTENT_WRITE
# on the cluster (the idempotent producer's InitProducerId, a fatal error)
_DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def _denied_writes(err: KafkaError, topic: str | None, who: str) -> DeliveryRefused:
    """The :class:`DeliveryRefused` for ``err`` (one of :data:`_DENIED`) on a write to ``topic`` by ``who``
    (``principal``): names the topic, the principal and the ACL to grant."""
    where = f"topic {topic}" if topic else "its topics"
    return DeliveryRefused(
        f"the broker denied {who} writes to {where} ({err.str()}); sending again is denied again: grant the principal "
        f"WRITE and DESCRIBE on {where} (kafka-acls.sh --add --allow-principal User:NAME --operation Write "
        f"--operation Describe --topic {topic or 'TOPIC'}) and IDEMPOTENT_WRITE on the cluster (the producers are "
        "idempotent), then restart", topic=topic)


@dataclass
class DeliveryReport:
    acked: dict[str, int] = field(default_factory=dict)  # topic -> messages acknowledged
    failed: int = 0
    first_error: str | None = None


FLUSH_MARGIN_S = 5.0  # past the delivery timeout: its reports served after it expires the last messages
# ``flush_answered`` waits this long in silence (most flushes end well within it), then says what it waits for and
# how long at most, and how many messages are still unanswered every FLUSH_TELL_S while it waits
FLUSH_QUIET_S = 3.0
FLUSH_TELL_S = 15.0


class AckedProducer:
    """An idempotent producer that counts acknowledgements and surfaces delivery errors.

    librdkafka reports only failed deliveries (``delivery.report.only.error``): a Python callback per
    successful message would cost more than building the message. After :meth:`flush` returns with
    nothing outstanding, every message sent and not reported failed was acknowledged.

    ``send`` never drops a message on a full local queue: it serves callbacks and retries.
    A produce refused with a fatal error (an idempotent producer fenced, or its sequence lost by a broker that lost
    data: librdkafka's producer is unusable for good) replaces the producer with a new one and raises: what the old
    one held is unacknowledged, so its caller's batch fails and is done again on the new one. It was kept, and the
    kafka joiner driver's in-process recovery (an outage: ``stream.strikes.is_infrastructure``) failed for ever. A fatal
    error first reported in ``flush`` or ``poll`` (a delivery report, ``error_cb``) renews it there, the same way: the
    batch done again no longer fails once more on the dead producer (a second rewind).
    ``flush`` raises :class:`DeliveryFailed` if any message failed since the previous ``flush``, or
    :class:`MessageTooLarge` when one of them was refused as too large (MSG_SIZE_TOO_LARGE: over the topic's
    ``max.message.bytes`` or the broker's ``message.max.bytes``): sending it again cannot succeed, so it is no outage
    to retry (a :class:`DeliveryFailed` is, ``stream.strikes.is_infrastructure``). A write the broker denies by
    authorization (TOPIC_/CLUSTER_AUTHORIZATION_FAILED: in a delivery report, at ``produce`` once librdkafka marked the
    topic refused, or as the idempotent producer's fatal error) is :class:`DeliveryRefused`, a ConfigError, for the
    same reason: it was a DeliveryFailed, and the joiner rewound and was denied again for ever ("Is the broker up?").
    A message for a partition its topic does not have (_UNKNOWN_PARTITION, at ``produce`` or in its report) is
    :class:`PartitionMissing`, a DeliveryFailed that names the topic: the joiner checks its layout on it.
    """

    def __init__(self, kafka: KafkaSettings, **extra: Any) -> None:
        conf = producer_config(kafka, **extra)
        conf["delivery.report.only.error"] = True
        self._conf = conf
        self._fatal: KafkaError | None = None  # a fatal error the callbacks just served reported (_renew_if_fatal)
        self._producer = self._client()
        self._bootstrap = kafka.bootstrap_servers
        self._who = principal(kafka)
        # the largest message produce() takes (librdkafka refuses bigger ones at once), and the setting that says it
        self.max_message_bytes = int(conf.get("message.max.bytes", LIBRDKAFKA_MESSAGE_BYTES))
        self.max_message_setting = ("[kafka.extra] message.max.bytes" if "message.max.bytes" in kafka.extra
                                    else "the producer's message.max.bytes")
        # librdkafka answers each message within its delivery timeout (message.timeout.ms, alias delivery.timeout.ms:
        # 300 s by default; 0: never times out), retrying until then: ``flush_answered`` waits that long
        timeout_ms = int(conf.get("message.timeout.ms", conf.get("delivery.timeout.ms", 300_000)))
        self.delivery_timeout_s = math.inf if timeout_ms == 0 else timeout_ms / 1000
        # the first delivery refused as too large since the last flush: (what, its topic)
        self._too_large: tuple[str, str] | None = None
        self._denied: DeliveryRefused | None = None  # the first delivery denied by authorization since the last flush
        self._missing: str | None = None  # the topic of the first message for a partition it lacks, since the flush
        self._sent: dict[str, int] = {}
        self._failed: dict[str, int] = {}
        self._acked_before: dict[str, int] = {}  # acknowledged before the last failed flush
        self.report = DeliveryReport()
        # produced into / reported failed by the current client (:meth:`delivered`); why the broker is unreachable,
        # as error_cb last said (all brokers down: :meth:`_on_client_error`), until the caller
        # sees deliveries again and clears it; called while ``send`` waits on a full queue (a caller's broker watch)
        self._produced, self._failed_total = 0, 0
        self.timed_out = 0  # deliveries of the current client that ran out their delivery timeout
        self.unreachable: str | None = None
        self._refused: str | None = None  # error_cb's last connection refused or not resolved (the reason said)
        self.waiting: Callable[[], None] = lambda: None

    def _client(self) -> Producer:
        """A librdkafka producer whose callbacks reach this object, weakly: client -> callback -> self -> client would
        be a cycle only the cyclic GC frees, and a GC pass in a forked DataLoader worker destroys the parent's client
        there (it hangs or crashes)."""
        return Producer({**self._conf, **_weak_callbacks(weakref.ref(self))})

    def _on_fatal(self, err: KafkaError) -> None:
        if _is_fatal(err) and self._fatal is None:
            self._fatal = err

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's ``error_cb``: a fatal error (:meth:`_on_fatal`), or the broker gone (every broker down), said
        the moment it happens, where a message waiting on it fails only at its delivery timeout (300 s by default).
        The reason given is the last connection refused or not resolved, where one came: one such alone is one broker
        of several (a cluster with a broker down, a bootstrap list naming one), and the others acknowledge."""
        self._on_fatal(err)
        if never_connected([err]):
            self._refused = error_text(err)
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.unreachable = self._refused or error_text(err)

    def delivered(self) -> tuple[int, int]:
        """``(delivered, outstanding)``: messages of the current client acknowledged so far (produced, not held, not
        reported failed), and those it still holds (queued or in flight). Serves no callbacks (:meth:`poll` does)."""
        outstanding = len(self._producer)
        return self._produced - outstanding - self._failed_total, outstanding

    def _renew_if_fatal(self) -> None:
        """After a call that served callbacks (poll, flush): where they reported a fatal error, renew the producer
        there (the next send would only fail on the dead one: a second rewind for the joiner) and raise it."""
        if self._fatal is not None:
            err = self._fatal
            self._renew()
            if err.code() in _DENIED:
                raise _denied_writes(err, None, self._who)
            raise KafkaException(err)

    def _on_error(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            return
        self._on_fatal(err)
        topic = msg.topic()
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and self._too_large is None:
            self._too_large = (f"a message of {len(msg.value() or b'') + len(msg.key() or b'')} bytes for {topic} was "
                               f"refused by the broker as too large ({err.str()})", topic)
        if err.code() == KafkaError._UNKNOWN_PARTITION and self._missing is None:
            self._missing = topic
        if err.code() in _DENIED and self._denied is None:
            self._denied = _denied_writes(err, topic, self._who)
        self._failed[topic] = self._failed.get(topic, 0) + 1
        self._failed_total += 1
        self.timed_out += err.code() == KafkaError._MSG_TIMED_OUT
        self.report.failed += 1
        if self.report.first_error is None:
            self.report.first_error = f"{topic}: {err.str()}"

    def send(self, topic: str, value: bytes | None, key: bytes | str | None = None,
             headers: Headers | None = None, partition: int | None = None) -> None:
        kwargs: dict[str, Any] = {}
        if headers:
            kwargs["headers"] = list(headers)
        if partition is not None:
            kwargs["partition"] = partition
        self._produce_waiting(topic, value, key, kwargs)
        self._sent[topic] = self._sent.get(topic, 0) + 1
        self._produced += 1

    def send_run(self, topics: list[str], values: list[bytes | None], keys: list[Any], partitions: list[int]) -> None:
        """Many messages in a loop that calls ``produce`` and nothing else per message (the replay's unpaced
        chunks), each to its own partition (no headers: any costs librdkafka's produce 1-2 us CPU a message); a full
        local queue or a refused message is handled as :meth:`send` handles it, and the run's sent counts are added
        per topic at the end (up to the failing message when one raises; none when that renewed the producer: the old
        one held them)."""
        producer = self._producer
        produce = producer.produce
        done = counted = 0  # counted: of ``done``, those in ``_produced`` already (a full queue's wait needs them)
        try:
            for topic, value, key, partition in zip(topics, values, keys, partitions):  # noqa: B905 (equal lengths)
                try:
                    produce(topic, value, key, partition)  # (positional: cheaper)
                except (BufferError, KafkaException):
                    self._produced, counted = self._produced + done - counted, done
                    self._produce_waiting(topic, value, key, {"partition": partition})
                done += 1
        finally:
            if self._producer is producer:
                self._produced += done - counted
            for topic, n in Counter(topics[:done] if self._producer is producer else ()).items():
                self._sent[topic] = self._sent.get(topic, 0) + n

    def _produce_waiting(self, topic: str, value: bytes | None, key: Any, kwargs: dict[str, Any]) -> None:
        """``produce``, serving callbacks and retrying while the local queue is full; never drops the message. A
        message over the producer's ``message.max.bytes`` is :class:`MessageTooLarge`."""
        produce = self._producer.produce
        while True:
            try:
                if kwargs:
                    produce(topic, value, key, **kwargs)
                else:
                    produce(topic, value, key)
                return
            except BufferError:
                self._producer.poll(0.05)
                self._renew_if_fatal()
                self.waiting()  # a full queue waits on the broker: its caller's watch may say so, or give up
            except KafkaException as exc:
                if exc.args and exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise MessageTooLarge(
                        f"a message of {len(value or b'') + len(key or b'')} bytes for {topic} is over "
                        f"{self.max_message_setting} ({self.max_message_bytes})", topic=topic) from None
                if exc.args and exc.args[0].code() in _DENIED:
                    raise _denied_writes(exc.args[0], topic, self._who) from None
                if exc.args and exc.args[0].code() == KafkaError._UNKNOWN_PARTITION:
                    raise PartitionMissing(f"{topic} has no partition {kwargs.get('partition')} "
                                           f"({exc.args[0].str()})", topic=topic) from None
                if exc.args and _is_fatal(exc.args[0]):
                    self._renew()
                raise

    def _renew(self) -> None:
        """A new producer for one a fatal error made unusable (class docstring); nothing it held unacknowledged counts
        as sent, and what earlier flushes confirmed stays in ``acked_total``."""
        for t, n in self.report.acked.items():
            self._acked_before[t] = self._acked_before.get(t, 0) + n
        _close_dead(self._producer)  # first: its purged messages' reports land in the report dropped below
        self._producer, self._fatal = self._client(), None
        self.report, self._too_large, self._denied, self._missing = DeliveryReport(), None, None, None
        self._sent.clear()
        self._failed.clear()
        self._produced, self._failed_total, self.timed_out = 0, 0, 0

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve the delivery reports in (waiting up to ``timeout_s`` for one); raise a fatal error they brought."""
        self._producer.poll(timeout_s)
        self._renew_if_fatal()

    def flush_answered(self) -> DeliveryReport:
        """:meth:`flush` until librdkafka has answered every message (its delivery timeout and a margin): a message
        a shorter flush counts as unacknowledged may still be delivered after it (the caller's rerun, told it was not,
        then sends it twice)."""
        timeout_s = self.delivery_timeout_s + FLUSH_MARGIN_S
        return self._settled(self._wait_told(timeout_s), timeout_s)

    def _wait_told(self, timeout_s: float) -> int:
        """librdkafka's flush for up to ``timeout_s`` (inf: no limit), saying so where it takes long: with a broker
        slow or down that is minutes, and a wait in silence looked like a hang. A wait past :data:`FLUSH_QUIET_S` is
        told in one line (how many messages, how long at most), then every :data:`FLUSH_TELL_S` how many are still
        unanswered. Returns how many are unanswered at the end. A signal's exception (Ctrl-C, a handler's) leaves
        librdkafka's flush as it did when it was one call."""
        deadline = time.monotonic() + timeout_s
        left = self._producer.flush(min(FLUSH_QUIET_S, timeout_s))
        if not left or self._fatal is not None:
            return left
        most = ("no limit: message.timeout.ms is 0" if math.isinf(timeout_s)
                else f"up to {timeout_s - FLUSH_QUIET_S:.0f} s more")
        log.warning("waiting for %d message(s) to be acknowledged by %s (%s: the producer's delivery timeout and a "
                    "margin); a broker slow or down holds them this long", left, self._bootstrap, most)
        while left and self._fatal is None and (rest := deadline - time.monotonic()) > 0:
            left = self._producer.flush(min(FLUSH_TELL_S, rest))
            if left and self._fatal is None and deadline - time.monotonic() > 0:
                log.warning("still waiting for %d message(s) to be acknowledged by %s (%s)", left, self._bootstrap,
                            "no limit" if math.isinf(deadline) else f"up to {deadline - time.monotonic():.0f} s more")
        return left

    def flush(self, timeout_s: float = 60.0) -> DeliveryReport:
        return self._settled(self._producer.flush(timeout_s), timeout_s)

    def _settled(self, remaining: int, timeout_s: float) -> DeliveryReport:
        """The report of a flush of up to ``timeout_s`` that left ``remaining`` messages unanswered (:meth:`flush`)."""
        if self._fatal is not None:
            err = self._fatal
            self._renew()  # what it held since the last flush is not claimed; the next send goes to a new producer
            if err.code() in _DENIED:
                raise _denied_writes(err, None, self._who)
            raise DeliveryFailed(f"the producer for {self._bootstrap} had a fatal error ({err.str()}); the messages "
                                 "sent since the last flush were not acknowledged, and a new producer replaced it")
        self.report.acked = {t: n - self._failed.get(t, 0) for t, n in self._sent.items()}
        if remaining:
            self.report.failed += remaining
            self.report.acked = {}  # unknown which ones: claim none
            self.report.first_error = (self.report.first_error
                                       or f"{remaining} messages unacknowledged after {timeout_s}s")
        if self.report.failed:
            # Told once: a caller that recovers (and sends again) starts with a clean report. The epoch's
            # acknowledgements still count towards acked_total: exactly when every message was answered,
            # else as a lower bound (each unanswered one counted against every topic).
            for t, n in self._sent.items():
                self._acked_before[t] = self._acked_before.get(t, 0) + max(0, n - self._failed.get(t, 0) - remaining)
            error = self._failure()
            self.report = DeliveryReport()
            self._failed.clear()
            self._sent.clear()
            self._too_large, self._denied, self._missing = None, None, None
            raise error
        return self.report

    def raise_failed(self) -> None:
        """Raise now what the next :meth:`flush` would raise for the deliveries reported failed so far (served by a
        :meth:`poll`), without waiting for the rest: a caller that sends for hours (a paced replay) stops at the first
        failure instead of at its last flush. Nothing is settled here: the caller's stop flush counts what was
        acknowledged (and raises the same kind of error again, with every failure counted). One attribute read when
        nothing failed."""
        if self.report.failed:
            raise self._failure()

    def _failure(self) -> Exception:
        """The error for the deliveries this report counts failed (class docstring: which error for which refusal)."""
        failed, first = self.report.failed, self.report.first_error
        if self._denied is not None:
            return DeliveryRefused(str(self._denied), topic=self._denied.topic)  # a copy: raised once more at the flush
        if self._too_large is not None:
            too_large, topic = self._too_large
            return MessageTooLarge(f"{too_large}; {failed} message(s) failed", topic=topic)
        if self._missing is not None:
            return PartitionMissing(f"{failed} message(s) were not acknowledged by {self._bootstrap}; first error: "
                                    f"{first} (a partition {self._missing} does not have)", topic=self._missing)
        return DeliveryFailed(f"{failed} message(s) were not acknowledged by {self._bootstrap}; first error: {first}. "
                              "Is the broker up (`streamrec stack status`)?")


    @property
    def acked_total(self) -> dict[str, int]:
        """Messages acknowledged per topic over this producer's life, as of the last :meth:`flush`; a lower
        bound when a flush timed out with messages unanswered, never more than the broker confirmed."""
        out = dict(self._acked_before)
        for t, n in self.report.acked.items():
            out[t] = out.get(t, 0) + n
        return out


def _close_dead(producer: Producer) -> None:
    """Close a producer a fatal error made unusable, without waiting: it can deliver nothing more, and ``close()``
    alone waits for what it holds (up to its delivery timeout). Dropped unclosed, its librdkafka threads and queues
    lived on while anything (a traceback) referred to it."""
    steps: tuple[Callable[[], object], ...] = (
        lambda: producer.purge(in_queue=True, in_flight=True),
        lambda: producer.flush(0),  # the purged messages' reports: failed, into the report the renewal drops
        producer.close)
    for step in steps:  # each alone: a purge librdkafka refuses must not leave the producer unclosed
        try:
            step()
        except (KafkaException, RuntimeError) as exc:  # closed already, or librdkafka refusing
            log.debug("closing a producer after its fatal error: %s", exc)


def _is_fatal(err: KafkaError) -> bool:
    """librdkafka's producer is unusable for good (``error_cb`` carries the underlying error marked fatal)."""
    return err.fatal() or err.code() == KafkaError._FATAL


def _weak_callbacks(ref: weakref.ReferenceType[AckedProducer]) -> dict[str, Callable[..., None]]:
    """``on_delivery`` and ``error_cb`` calling the ``AckedProducer`` ``ref`` points to, while it lives
    (``AckedProducer._client``)."""
    def on_delivery(err: KafkaError | None, msg: Any) -> None:
        producer = ref()
        if producer is not None:
            producer._on_error(err, msg)

    def error_cb(err: KafkaError) -> None:
        producer = ref()
        if producer is not None:
            producer._on_client_error(err)

    return {"on_delivery": on_delivery, "error_cb": error_cb}
