"""The largest record each topic takes from this process (:class:`MessageLimit`, :func:`message_limits`), how much of
it a value may use (:func:`usable_bytes`), and what is said when the broker refuses a record as too large.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from stream.config import KafkaSettings
from stream.errors import MessageLimitError, MessageTooLarge, quoted
from stream.kafka import admin_config

log = logging.getLogger("streamrec.kafka")


# -- message size limits -----------------------------------------------------------------------------------------
LIBRDKAFKA_MESSAGE_BYTES = 1_000_000  # librdkafka's default producer message.max.bytes
FALLBACK_MESSAGE_BYTES = 1_000_000  # when no limit can be read at all: below Apache Kafka's default (1 MiB + 12 bytes)


class MessageLimit(NamedTuple):
    """The largest record a topic takes from this process, and where that number comes from (said in errors)."""

    bytes: int
    source: str  # "topic max.message.bytes", "[kafka.extra] message.max.bytes", ...


def usable_bytes(limit: int) -> int:
    """How much of a record of at most ``limit`` bytes its value may take: the rest is left to the key, the headers
    and the record batch's framing (61 bytes and a few per record), and to lz4, which can grow an incompressible
    value by 0.4% (the broker checks the compressed batch)."""
    return limit - 1024 - limit // 200


def message_limits(kafka: KafkaSettings, topics: Iterable[str], producer_bytes: int | None, producer_source: str,
                   timeout_s: float = 10.0) -> dict[str, MessageLimit]:
    """Per topic, the largest record it takes from a producer whose ``message.max.bytes`` is ``producer_bytes``
    (named by ``producer_source``; None: not readable): the smaller of that and the topic's ``max.message.bytes`` read
    with DescribeConfigs. Apache Kafka reports a topic's effective value, its own or the broker's
    ``message.max.bytes`` it defaults to; a broker that does not answer, or answers without it (Tansu reports only
    what was set on the topic), leaves the producer's. Neither readable: ``FALLBACK_MESSAGE_BYTES``."""
    wanted = sorted(set(topics))
    found: dict[str, int] = {}
    try:
        admin = AdminClient(admin_config(kafka))
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in wanted],
                                         request_timeout=timeout_s)
        for resource, fut in futures.items():
            entry = fut.result(timeout=timeout_s).get("max.message.bytes")
            if entry is not None and str(entry.value).isdigit():
                found[resource.name] = int(entry.value)
    except Exception as exc:  # noqa: BLE001 - a broker without DescribeConfigs (or without our right to it)
        log.warning("could not read the topics' max.message.bytes (%s); writing under the producer's limit",
                    quoted(str(exc)))
    out = {}
    for t in wanted:
        known = [(found[t], "topic max.message.bytes")] if t in found else []
        if producer_bytes is not None:
            known.append((producer_bytes, producer_source))
        out[t] = MessageLimit(*min(known)) if known else MessageLimit(FALLBACK_MESSAGE_BYTES, "a fallback (unknown)")
    return out


def raise_limit(topic: str, limit: MessageLimit) -> str:
    """What to change where ``topic`` takes records of at most ``limit``: the setting it came from."""
    if limit.source == "topic max.message.bytes":
        return (f"raise the topic's limit (kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                "--add-config max.message.bytes=1048588)")
    return f"raise {limit.source}"


def refused_as_too_large(exc: MessageTooLarge, limit: MessageLimit | None) -> MessageLimitError:
    """The :class:`MessageLimitError` for a record refused as too large (``exc``) although it was sized under
    ``limit``, the limit learned for its topic (None: not sized by that): names the topic, the setting and the fix.
    The one wording for every topic a process sizes its records for (the joiner's samples, state, late clicks and
    dead letters)."""
    topic = exc.topic or "?"
    learned = (f"sized under {limit.bytes} bytes, the limit learned for it ({limit.source})"
               if limit is not None else "not sized under a learned limit")
    return MessageLimitError(
        f"{quoted(str(exc), 300)}; the records for {topic} are {learned}, so the broker's (or the producer's) limit is "
        "lower than that: set [kafka.extra] message.max.bytes to at most the topic's max.message.bytes (records are "
        f"then written under it), or raise the topic's max.message.bytes (kafka-configs.sh --alter --entity-type "
        f"topics --entity-name {topic} --add-config max.message.bytes=1048588) and the broker's message.max.bytes")
