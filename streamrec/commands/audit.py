"""``streamrec audit``: validating the event topics to their end."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from streamrec.commands.common import (
    EXIT_OK,
    add_common,
    add_kafka_flag,
    emit,
    kafka_settings,
    kv_lines,
    seconds,
    sources,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="validate the event topics to their end; malformed messages go to the DLQ",
                       description="Read the impressions and clicks topics from the group's committed offsets "
                       "to the end, validate every message, send malformed ones to <topic>.dlq with the reason "
                       "in headers, commit, and print counts per topic and partition. Running it again "
                       "continues where it stopped.")
    p.add_argument("--group", default="streamrec-audit", help="consumer group (offsets committed after the DLQ "
                   "is acknowledged; default: %(default)s)")
    p.add_argument("--idle-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="fail if nothing arrives for this long (default: 30)")
    add_kafka_flag(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import functools

    from stream.event_reader import EventReader
    from stream.events import decode_click, decode_impression
    from stream.limits import EventLimits

    src = sources(args)
    kafka = kafka_settings(args, src)
    limits = src.build(EventLimits, "limits")
    decoders: dict[str, Callable[..., Any]] = {
        kafka.impressions_topic: functools.partial(decode_impression, limits=limits),
        kafka.clicks_topic: functools.partial(decode_click, limits=limits)}
    with EventReader(kafka, args.group, decoders, stage="audit") as reader:
        reader.read_to_end(idle_timeout_s=args.idle_timeout)
        dlq = reader.dead_letters.counts
        summary = {
            "group": args.group,
            "valid": dict(reader.valid),
            "valid_by_partition": {f"{t}[{p}]": n for (t, p), n in sorted(reader.valid_by_partition.items())},
            "dead_lettered": {f"{t}:{k}": n for (t, k), n in sorted(dlq.items())},
            "dead_lettered_total": reader.dead_letters.total,
            "messages_read": reader.seen,
        }
    emit(args, summary, lambda d: "audit of group " + d["group"] + "\n" + kv_lines(
        {k: v for k, v in d.items() if k != "group"}))
    return EXIT_OK
