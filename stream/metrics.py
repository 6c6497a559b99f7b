"""Prometheus metrics of the stream stage (names are part of the dashboards in compose/)."""

from __future__ import annotations

from prometheus_client import Counter

EVENTS = Counter(
    "streamrec_events_total",
    "Events handled by a stream stage, by stage and topic.",
    ["stage", "topic"],
)
DLQ_MESSAGES = Counter(
    "streamrec_dlq_messages_total",
    "Malformed messages sent to <topic>.dlq, by source topic and reason kind.",
    ["topic", "kind"],
)
HISTORY_MALFORMED = Counter("streamrec_history_malformed_total",
                            "Malformed entries in users' Redis click histories, skipped when read.")
INPUT_LOST = Counter("streamrec_input_lost_to_retention_total",
                     "Input records deleted (retention, DeleteRecords) before the reader resuming past them read them "
                     "(stream/retention.py), by reader and topic.", ["reader", "topic"])
