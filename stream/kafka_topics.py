"""Kafka topics made and read through an admin client: creating them (:func:`ensure_topics`, a compacted one:
:func:`ensure_compacted`), their partition counts, and their ids (:func:`topic_identity`, :func:`topic_identities`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from stream.config import KafkaSettings
from stream.errors import StreamError, quoted
from stream.kafka import admin_config

log = logging.getLogger("streamrec.kafka")


def ensure_topics(kafka: KafkaSettings, topics: Iterable[str], partitions: int | None = None) -> None:
    """Create ``topics`` with ``partitions`` partitions if they do not exist (idempotent)."""
    admin = AdminClient(admin_config(kafka))
    wanted = sorted(set(topics))
    existing = admin.list_topics(timeout=10).topics
    new = [
        NewTopic(t, num_partitions=partitions or kafka.partitions, replication_factor=kafka.replication_factor)
        for t in wanted
        if t not in existing
    ]
    if not new:
        return
    for fut in admin.create_topics(new, operation_timeout=10).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Wait until metadata shows every partition (creation is asynchronous on some brokers).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=10).topics
        if all(t in md and md[t].partitions for t in wanted):
            return
        time.sleep(0.05)


def partition_counts(kafka: KafkaSettings, topics: Iterable[str]) -> dict[str, int]:
    """How many partitions each of ``topics`` has now (0: it does not exist), from one metadata request. A topic
    whose metadata carries an error (a leader not available yet, just after its creation) counts the partitions
    listed: its count is known all the same, and 0 would refuse a layout that holds."""
    admin = AdminClient(admin_config(kafka))
    md = admin.list_topics(timeout=10).topics
    return {t: len(md[t].partitions) if t in md else 0 for t in topics}


def topic_identity(kafka: KafkaSettings, topic: str, timeout_s: float = 10.0) -> dict[str, str]:
    """``{"topic_id": ..., "cluster_id": ...}`` of ``topic`` as the broker names them now (the topic id as Kafka's tools
    print it), for a checkpoint to record which topic its offsets are of: a topic deleted and created again, or another
    cluster's of the same name, has another topic id. An id the broker does not give (none, or the all-zero Uuid of a
    broker without topic ids) is left out, and so is everything when the broker cannot be asked (logged): the caller
    then cannot tell one topic from another of its name, and goes on as before topic ids were recorded."""
    return topic_identities(kafka, [topic], timeout_s)[topic]


# (bootstrap servers, topic) whose id the broker could not give: said once until it gives it again (a joiner asks
# every ``[joiner] topic_check_s`` and at each restore: a broker down for an hour said so 120 times)
_ids_unread: set[tuple[str, str]] = set()


def topic_identities(kafka: KafkaSettings, topics: Sequence[str], timeout_s: float = 10.0) -> dict[str, dict[str, str]]:
    """:func:`topic_identity` of each of ``topics`` from one admin client and one DescribeTopics (the joiner asks for
    both inputs at every restore: a client and two round trips per topic doubled its wait on a slow broker). A topic
    the broker cannot describe (absent, denied) gets the cluster id only, logged (a WARNING once until its id is read
    again, then an INFO line); the others keep theirs."""
    out: dict[str, dict[str, str]] = {t: {} for t in topics}
    try:
        admin = AdminClient(admin_config(kafka))
        cluster = admin.list_topics(timeout=timeout_s).cluster_id
        futures = admin.describe_topics(TopicCollection(list(topics)), request_timeout=timeout_s)
    except KafkaException as exc:
        _say_ids_unread(kafka, topics, "could not read the ids of topics %s (%s)", exc)
        return out
    for topic in topics:
        out[topic] = {"cluster_id": cluster} if cluster else {}
        try:
            tid = futures[topic].result().topic_id
        except KafkaException as exc:
            _say_ids_unread(kafka, [topic], "could not read the id of topic %s (%s)", exc)
            continue
        if (kafka.bootstrap_servers, topic) in _ids_unread:
            _ids_unread.discard((kafka.bootstrap_servers, topic))
            log.info("the id of topic %s is read again", topic)
        if tid is not None and (tid.get_most_significant_bits() or tid.get_least_significant_bits()):
            out[topic]["topic_id"] = str(tid)
    return out


def _say_ids_unread(kafka: KafkaSettings, topics: Sequence[str], what: str, exc: KafkaException) -> None:
    """:func:`topic_identities`' WARNING that ``topics``' ids could not be read, once until each is read again (DEBUG
    meanwhile)."""
    keys = {(kafka.bootstrap_servers, t) for t in topics}
    said = keys <= _ids_unread
    _ids_unread.update(keys)
    (log.debug if said else log.warning)(
        what + ": a topic made again under its name goes untold (said once until it is read again)",
        ", ".join(topics), quoted(str(exc)))


def ensure_compacted(kafka: KafkaSettings, topic: str, partitions: int | None = None) -> None:
    """Create ``topic`` with ``cleanup.policy=compact``; on an existing topic, check the policy and set it
    if it is not compact (a state log that is never compacted grows for ever and a restore reads its
    whole retention), ``compact,delete`` included (retention deleted live records: a chunk still holding
    impressions, an idle partition's newest one, a claim). Raises :class:`StreamError` when the broker refuses."""
    admin = AdminClient(admin_config(kafka))
    if topic not in admin.list_topics(timeout=10).topics:
        new = NewTopic(topic, num_partitions=partitions or kafka.partitions,
                       replication_factor=kafka.replication_factor, config={"cleanup.policy": "compact"})
        for fut in admin.create_topics([new], operation_timeout=10).values():
            try:
                fut.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        ensure_topics(kafka, [topic], partitions)  # waits until its partitions show in metadata
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = next(iter(admin.describe_configs([resource]).values())).result()
    entry = configs.get("cleanup.policy")
    if entry is not None and entry.value == "compact":
        return
    log.warning("topic %s has cleanup.policy=%s; setting it to compact (it holds keyed state)", topic,
                entry.value if entry is not None else "(default delete)")
    try:
        change = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
            ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)])
        next(iter(admin.incremental_alter_configs([change]).values())).result()
    except KafkaException as exc:
        raise StreamError(f"topic {topic} must be compacted (cleanup.policy=compact) and the broker refused to "
                          f"change it: {exc}. Set it with kafka-configs.sh --alter --entity-type topics "
                          f"--entity-name {topic} --add-config cleanup.policy=compact") from None
