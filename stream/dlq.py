"""Dead-letter queue: malformed messages go to ``<topic>.dlq`` with the reason in headers.

The DLQ record keeps the original key and value bytes untouched where they fit, so an operator can fix and replay
it. Headers:

============================  ==============================================================
``dlq.reason``                human-readable reason (``field 'ts': got -5, expected ...``), at
                              most ``REASON_BYTES`` bytes of UTF-8 (a longer one is cut, ``...``)
``dlq.kind``                  machine-readable class (``bad_json``, ``invalid_field``, ...)
``dlq.source.topic``          topic the message came from (or was meant for)
``dlq.source.partition``      its partition, ``-1`` when it never reached the broker
``dlq.source.offset``         its offset, ``-1`` when it never reached the broker (then no
                              coordinates to de-duplicate on: :attr:`DeadLetter.source_coordinates`)
``dlq.value_truncated_from``  only where the value was too large to send whole: its size
                              (the record then holds its first ``TRUNCATED_BYTES``, or as many as
                              the dead-letter topic's limit leaves room for)
``dlq.key_truncated_from``    only where the key alone left no room under that limit: its size
                              (the record then holds as many of its first bytes as fit beside
                              the value, which is kept whole wherever it fits alone)
``dlq.headers_dropped``       only where the source message's own headers did not fit: how many
``dlq.original_headers``      always the last header: how many of the record's first headers
                              are the source message's own (0 when it had none, or they were dropped)
============================  ==============================================================

The source message's own headers (a samples message's ``streamrec-watermark``, an application's tracing or schema
ids) come first, unchanged and in their order, and ours follow them, as Kafka Connect's dead-letter queue adds its
``__connect.errors.*`` headers after the original ones: replaying ``headers[:n]`` (``n`` the last header's value;
:attr:`DeadLetter.original_headers`) with the key and value to the source topic sends the message that was sent. A
source header may bear one of our names (a producer's ``dlq.reason``): :meth:`DeadLetter.from_headers` reads ours only
after the first ``n``, never a source one. The source headers are kept whole or dropped whole: kept where the record
fits with them, our headers and as much of the key and value as without them under the topic's limit (each header
sized with its name, value and 10 bytes of length framing: beside a value cut to ``TRUNCATED_BYTES`` either way they
stay); otherwise dropped, counted in ``dlq.headers_dropped``, and the key and value
sized as if there had been none (the event's bytes matter more to whoever fixes it than the headers).

Size: a dead-letter topic's limit is learned like the joiner's other topics' (``stream.kafka_limits.message_limits``:
the topic's ``max.message.bytes`` by DescribeConfigs, the producer's ``message.max.bytes``, the smaller), given by the
process that learned it at start (the joiner) or learned here at the first dead letter to that topic (the learner,
the event reader, the replay), and every record is sized under it before it is sent: a value over the room the key
and headers leave is cut, with ``dlq.value_truncated_from``. A limit that leaves no room for the headers
(``MIN_DLQ_BYTES``) is a :class:`~stream.errors.ConfigError` naming the topic and the setting, when it is learned. A
dead letter the broker refuses as too large all the same (its limit lower than it reported, or lowered since) is a
:class:`~stream.errors.MessageLimitError` at the flush (a ConfigError, exit 2): sending it again cannot succeed, and
it is no fault of the message (no strikes) nor an outage (no retry, which would refuse it for ever).
"""

from __future__ import annotations

import re
from collections import Counter as Tally
from collections.abc import Mapping
from dataclasses import dataclass

from stream.config import KafkaSettings
from stream.errors import BadMessage, ConfigError, MessageTooLarge, shown
from stream.kafka import Headers
from stream.kafka_limits import MessageLimit, message_limits, raise_limit, refused_as_too_large, usable_bytes
from stream.kafka_producer import AckedProducer
from stream.metrics import DLQ_MESSAGES

TRUNCATED_BYTES = 65_536
REASON_BYTES = 2048  # the most a dlq.reason header takes (a reason may quote its input)
_KIND_BYTES = 64
_TOPIC_BYTES = 249  # Kafka's longest topic name
# The most our headers take: reason, kind, source topic, the eight names, partition, offset, the two truncations and
# the two header counts (20 digits each); what is left of a record under its limit is the key's, the value's and the
# source headers' (these only where they fit beside the rest: module docstring).
HEADER_BYTES = REASON_BYTES + _KIND_BYTES + _TOPIC_BYTES + 8 * 32 + 6 * 20
_HEADER_FRAMING = 10  # a record header's two length varints at their largest
OriginalHeaders = Headers
MIN_DLQ_BYTES = HEADER_BYTES + 1024  # usable bytes (stream.kafka_limits.usable_bytes) a dead-letter topic must leave


def _bounded(text: str, n: int) -> bytes:
    """``text`` as UTF-8, cut to at most ``n`` bytes (at a character boundary, ``...`` marking the cut)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= n:
        return raw
    return raw[:n - 3].decode("utf-8", "ignore").encode() + b"..."


def _cut(key: bytes | None, value: bytes | None,
         room: int) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """``key`` and ``value`` cut to ``room`` bytes, with the headers that say so (module docstring): the key alone
    where the value (the event itself) then fits whole; else the value, to at most ``TRUNCATED_BYTES``, and the key
    too where it alone is over (``MIN_DLQ_BYTES`` leaves room > 0 after every header)."""
    key_cut = ("dlq.key_truncated_from", str(len(key or b"")).encode())
    if len(key or b"") + len(value or b"") <= room:
        return key, value, []
    if len(value or b"") <= room - sum(map(len, key_cut)):
        return (key or b"")[:room - sum(map(len, key_cut)) - len(value or b"")], value, [key_cut]
    # Keep what fits and say how much there was: the reason and the source offset still point to it.
    value_cut = ("dlq.value_truncated_from", str(len(value or b"")).encode())
    cuts = [value_cut]
    room -= sum(map(len, value_cut))
    if key is not None and len(key) > room:
        cuts.append(key_cut)
        room -= sum(map(len, key_cut))
        key = key[:max(0, room)]
    return key, (value or b"")[:max(0, min(TRUNCATED_BYTES, room - len(key or b"")))], cuts


def check_room(topic: str, limit: MessageLimit) -> None:
    """A :class:`ConfigError` where a dead-letter topic's limit leaves no room for a dead letter's headers."""
    if usable_bytes(limit.bytes) < MIN_DLQ_BYTES:
        raise ConfigError(f"dead-letter topic {topic} takes records of at most {limit.bytes} bytes ({limit.source}); a "
                          f"dead letter's headers alone may take {HEADER_BYTES} (its reason, kind and source), and "
                          f"the least limit that leaves room for them is about {MIN_DLQ_BYTES + 1024 + 64}: "
                          f"{raise_limit(topic, limit)}")


@dataclass(frozen=True)
class DeadLetter:
    reason: str
    kind: str
    source_topic: str
    source_partition: int
    source_offset: int
    original_headers: tuple[tuple[str, bytes | None], ...] = ()  # the source message's, to replay with it
    headers_dropped: int = 0  # how many source headers did not fit (then original_headers is empty)
    value_truncated_from: int | None = None
    key_truncated_from: int | None = None

    @property
    def source_coordinates(self) -> tuple[str, int, int] | None:
        """What a DLQ reader de-duplicates on (dead letters are at least once: module docstring): the source record's
        topic, partition and offset, the same in every dead letter of one consumed record. None where the offset is
        -1: the message never reached a topic (a replay's row; a sample or late click the joiner could not write, its
        partition known), so it has no coordinates, and two such dead letters of one topic are two messages, never
        one (the topic/partition/offset rule dropped all but one of them as repeats)."""
        if self.source_offset < 0:
            return None
        return self.source_topic, self.source_partition, self.source_offset

    @classmethod
    def from_headers(cls, headers: OriginalHeaders | None) -> DeadLetter:
        """A dead letter's own headers read after its source message's (module docstring); one written before the
        source headers were kept (no ``dlq.original_headers``) holds ours only. A dead-letter topic takes records from
        any producer: headers :class:`DeadLetters` did not write (one of ours missing, a number that is not a plain
        decimal, a source-header count past the headers there) are a ValueError saying which."""
        hs = list(headers or [])

        def number(name: str, raw: bytes | str | None, lo: int = -1, hi: int = 2**63 - 1) -> int:
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            if text is None or not re.fullmatch(r"-?[0-9]{1,19}", text) or not lo <= int(text) <= hi:
                raise ValueError(f"not a dead letter's headers: {name} is {shown(text, 40)}, expected an integer "
                                 f"from {lo} to {hi}")
            return int(text)

        counted = bool(hs) and hs[-1][0] == "dlq.original_headers"
        n = number("dlq.original_headers", hs[-1][1], 0, len(hs) - 1) if counted else 0
        h = {k: (v or b"").decode("utf-8", "replace") for k, v in hs[n:]}
        missing = [k for k in ("dlq.reason", "dlq.kind", "dlq.source.topic", "dlq.source.partition",
                               "dlq.source.offset") if k not in h]
        if missing:
            raise ValueError(f"not a dead letter's headers: no {', '.join(missing)} after the {n} source headers")
        return cls(
            reason=h["dlq.reason"],
            kind=h["dlq.kind"],
            source_topic=h["dlq.source.topic"],
            source_partition=number("dlq.source.partition", h["dlq.source.partition"]),
            source_offset=number("dlq.source.offset", h["dlq.source.offset"]),
            original_headers=tuple(hs[:n]),
            headers_dropped=number("dlq.headers_dropped", h.get("dlq.headers_dropped", "0"), 0),
            value_truncated_from=(number("dlq.value_truncated_from", h["dlq.value_truncated_from"], 0)
                                  if "dlq.value_truncated_from" in h else None),
            key_truncated_from=(number("dlq.key_truncated_from", h["dlq.key_truncated_from"], 0)
                                if "dlq.key_truncated_from" in h else None),
        )


class DeadLetters:
    """Sends bad messages to ``<topic><dlq_suffix>``, each sized under that topic's limit (module docstring), and
    counts them (per topic and kind). ``limits``: dead-letter topic -> its limit, learned by the caller; a topic not
    in it is learned at its first dead letter."""

    def __init__(self, kafka: KafkaSettings, producer: AckedProducer | None = None,
                 limits: Mapping[str, MessageLimit] | None = None) -> None:
        self._kafka = kafka
        self._producer = producer or AckedProducer(kafka)
        self._limits: dict[str, MessageLimit] = {}
        for topic, limit in (limits or {}).items():
            self._limits[topic] = self._within_producer(limit)
            check_room(topic, self._limits[topic])
        self.counts: Tally[tuple[str, str]] = Tally()

    def _within_producer(self, limit: MessageLimit) -> MessageLimit:
        """``limit``, or the producer's ``message.max.bytes`` where that is smaller (it refuses bigger records)."""
        return min(limit, MessageLimit(self._producer.max_message_bytes, self._producer.max_message_setting))

    def limit(self, dlq_topic: str) -> MessageLimit:
        """What ``dlq_topic`` takes from this producer: given, or learned now (once)."""
        got = self._limits.get(dlq_topic)
        if got is None:
            learned = message_limits(self._kafka, [dlq_topic], self._producer.max_message_bytes,
                                     self._producer.max_message_setting)[dlq_topic]
            got = self._within_producer(learned)
            check_room(dlq_topic, got)
            self._limits[dlq_topic] = got
        return got

    def send(self, topic: str, key: bytes | str | None, value: bytes | None, error: BadMessage,
             partition: int = -1, offset: int = -1, headers: OriginalHeaders | None = None) -> None:
        """``headers``: the source message's own, kept in front of ours where they fit (module docstring)."""
        dlq_topic = self._kafka.dlq_topic(topic)
        original = list(headers or ())
        ours = [
            ("dlq.reason", _bounded(error.reason, REASON_BYTES)),
            ("dlq.kind", _bounded(error.kind, _KIND_BYTES)),
            ("dlq.source.topic", _bounded(topic, _TOPIC_BYTES)),
            ("dlq.source.partition", str(partition).encode()),
            ("dlq.source.offset", str(offset).encode()),
        ]
        raw_key = key.encode("utf-8", "replace") if isinstance(key, str) else key
        room = usable_bytes(self.limit(dlq_topic).bytes) - sum(len(k) + len(v) for k, v in ours)
        count = ("dlq.original_headers", str(len(original)).encode())
        original_bytes = sum(len(k.encode("utf-8", "surrogatepass")) + len(v or b"") + _HEADER_FRAMING
                             for k, v in original)
        if not original:
            sent = _cut(raw_key, value, room - len(count[0]) - len(count[1]))
        else:
            dropped = ("dlq.headers_dropped", count[1])
            sent = _cut(raw_key, value, room - sum(map(len, dropped)) - len(count[0]) - 1)  # (then a count of "0")
            kept_room = room - original_bytes - len(count[0]) - len(count[1])
            # Dropped only where they cost key or value bytes: beside a value cut to TRUNCATED_BYTES either way,
            # a source message's tracing id went for no byte of the event.
            if kept_room >= 0 and (kept := _cut(raw_key, value, kept_room))[:2] == sent[:2]:
                sent = kept
            else:
                ours.append(dropped)
                count, original = ("dlq.original_headers", b"0"), []
        raw_key, value, cuts = sent
        self._producer.send(dlq_topic, value, raw_key, headers=[*original, *ours, *cuts, count])
        self.counts[(topic, error.kind)] += 1
        DLQ_MESSAGES.labels(topic, error.kind).inc()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def flush(self) -> None:
        """Wait until every dead letter is acknowledged (raises ``DeliveryFailed`` otherwise, and a
        :class:`~stream.errors.MessageLimitError` where the broker refused one as too large: module docstring)."""
        try:
            self._producer.flush()
        except MessageTooLarge as exc:
            raise refused_as_too_large(exc, self._limits.get(exc.topic or "")) from None
