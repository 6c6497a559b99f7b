"""Replay throughput: ``streamrec replay``'s publish path against a raw confluent-kafka producer.

Both send the same messages (same keys, same JSON bytes, same topics layout) to the same broker with
the same producer settings (idempotent, acks=all, lz4, linger 20 ms); the raw producer gets the bytes
pre-encoded, so the ratio is the cost of building events from the columnar table, ordering and
acknowledgement tracking. Runs: ours, raw, ours again (the machine is noisy; compare within one run);
the raw producer sends the messages in the order they are read back from the broker, a partition at a time,
which the broker takes in far fewer, larger batches than any event-time order; ``raw (replay order)`` sends
the same messages in the order streamrec sends them (event time, impressions and clicks interleaved).
``--rounds N`` repeats raw, raw (replay order) and ours N times, in turn, and rates the best of each. Beside events/s,
each run's CPU time of this process (all its threads: Python and librdkafka's) per event, which other
processes on the machine disturb far less than the wall clock.

    python bench/replay.py                       # ml-1m, starts its own local stack on free ports
    python bench/replay.py --rounds 3            # ours, then 3 x (raw, raw in replay order, ours)
    python bench/replay.py --dataset ml-100k --bootstrap-servers 127.0.0.1:19092
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer  # noqa: E402

from stream.config import KafkaSettings
from stream.kafka import producer_config  # noqa: E402
from stream.kafka_topics import ensure_topics  # noqa: E402
from stream.replay.config import ClickDelay
from stream.replay.movielens import load_movielens  # noqa: E402
from stream.replay.publisher import publish, replay_order  # noqa: E402
from stream.replay.table import CLICK, IMPRESSION  # noqa: E402
from streamrec.stack import (  # noqa: E402
    LocalStack,
    StackSettings,  # noqa: E402
    free_port,
)
from tests.kafka_io import read_topic  # noqa: E402

# Reading ours back (every message kept as a Python record) can take longer than read_topic's default 30 s for
# ML-1M's million impressions on a busy machine
READ_BACK_S = 300.0


def fresh_topics(base: KafkaSettings) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    return dataclasses.replace(base, impressions_topic=f"bench-imp-{tag}", clicks_topic=f"bench-clk-{tag}")


@dataclasses.dataclass
class Run:
    events_per_s: float  # over the publisher's own span (ours: ``ReplaySummary.elapsed_s``)
    cpu_us_per_event: float  # this process's CPU time (all threads) over that span, per event
    call_events_per_s: float | None = None  # ours: over the whole ``publish`` call (topic checks, producer start)


def run_ours(table, kafka: KafkaSettings) -> Run:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    t0, c0 = time.monotonic(), time.process_time()
    summary = publish(table, kafka, "bench")
    call_s, cpu_s = time.monotonic() - t0, time.process_time() - c0
    events = summary.impressions + summary.clicks
    return Run(events / summary.elapsed_s, cpu_s / events * 1e6, events / call_s)


def run_raw(messages: list[tuple[str, bytes, bytes]], kafka: KafkaSettings) -> Run:
    ensure_topics(kafka, {t for t, _, _ in messages})
    p = Producer(producer_config(kafka))
    acked = 0

    def on_delivery(err, _msg) -> None:
        nonlocal acked
        if err is None:
            acked += 1

    t0, c0 = time.monotonic(), time.process_time()
    for i, (topic, key, value) in enumerate(messages):
        while True:
            try:
                p.produce(topic, value, key, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        if i % 5000 == 0:
            p.poll(0)
    p.flush(120)
    elapsed, cpu_s = time.monotonic() - t0, time.process_time() - c0
    assert acked == len(messages), f"raw producer: {len(messages) - acked} unacknowledged"
    return Run(len(messages) / elapsed, cpu_s / len(messages) * 1e6)


def in_replay_order(table, messages: list[tuple[str, bytes, bytes]], n_impressions: int
                    ) -> list[tuple[str, bytes, bytes]]:
    """``messages`` (the impressions first, then the clicks, as read back) in the order ``publish`` sent them.
    MovieLens keys are unique per kind (one impression per rating, at most one click per impression)."""
    kinds, indexes = replay_order(table)
    ids = {IMPRESSION: table.impression_id.tolist(), CLICK: table.click_impression_id.tolist()}
    position = {(kind, ids[kind][i]): n for n, (kind, i) in enumerate(zip(kinds.tolist(), indexes.tolist(),
                                                                           strict=True))}
    kind_of = [IMPRESSION] * n_impressions + [CLICK] * (len(messages) - n_impressions)
    order = sorted(range(len(messages)), key=lambda j: position[(kind_of[j], messages[j][1].decode())])
    return [messages[j] for j in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-1m", choices=["ml-1m", "ml-100k"])
    ap.add_argument("--bootstrap-servers", help="use a running broker instead of starting one")
    ap.add_argument("--rounds", type=int, default=1, help="raw, raw in replay order and ours this many "
                    "times each, in turn (after a first ours); default 1")
    args = ap.parse_args()

    stack = None
    if args.bootstrap_servers:
        base = KafkaSettings(bootstrap_servers=args.bootstrap_servers)
    else:
        stack = LocalStack(StackSettings(state_dir=Path(tempfile.mkdtemp()), kafka_port=free_port(),
                                         redis_port=free_port()))
        stack.up()
        base = KafkaSettings(bootstrap_servers=stack.bootstrap_servers)
    try:
        table = load_movielens(args.dataset, ClickDelay(), seed=7)
        events = table.n_impressions + table.n_clicks
        k1 = fresh_topics(base)
        ours = [run_ours(table, k1)]
        # The exact bytes ours produced, in the order produced (per partition order is what matters).
        messages = [(k1.impressions_topic.replace("imp", "rawimp"), r.key, r.value)
                    for r in read_topic(k1, k1.impressions_topic, timeout_s=READ_BACK_S)]
        messages += [(k1.clicks_topic.replace("clk", "rawclk"), r.key, r.value)
                     for r in read_topic(k1, k1.clicks_topic, timeout_s=READ_BACK_S)]
        ordered = in_replay_order(table, messages, table.n_impressions)
        raws: list[Run] = []
        raws_ordered: list[Run] = []
        for _ in range(args.rounds):
            for msgs, runs in ((messages, raws), (ordered, raws_ordered)):
                tag = fresh_topics(base)  # fresh topics every run: a run appends to no earlier one's partitions
                runs.append(run_raw([(tag.impressions_topic if "rawimp" in t else tag.clicks_topic, k, v)
                                     for t, k, v in msgs], base))
            ours.append(run_ours(table, fresh_topics(base)))
    finally:
        if stack is not None:
            stack.down()
    best_ours = max(ours, key=lambda r: r.events_per_s)
    best_raw = max(raws, key=lambda r: r.events_per_s)
    best_ordered = max(raws_ordered, key=lambda r: r.events_per_s)
    ratio = best_ours.events_per_s / best_raw.events_per_s
    ratio_ordered = best_ours.events_per_s / best_ordered.events_per_s
    cpu_ours, cpu_raw = min(r.cpu_us_per_event for r in ours), min(r.cpu_us_per_event for r in raws)
    result = {"dataset": args.dataset, "events": events,
              "ours_events_per_s": [round(r.events_per_s) for r in ours],
              "ours_call_events_per_s": [round(r.call_events_per_s or 0) for r in ours],
              "raw_events_per_s": [round(r.events_per_s) for r in raws],
              "raw_replay_order_events_per_s": [round(r.events_per_s) for r in raws_ordered],
              "ours_cpu_us_per_event": [round(r.cpu_us_per_event, 3) for r in ours],
              "raw_cpu_us_per_event": [round(r.cpu_us_per_event, 3) for r in raws],
              "raw_replay_order_cpu_us_per_event": [round(r.cpu_us_per_event, 3) for r in raws_ordered],
              "ratio_ours_to_raw": round(ratio, 3), "ratio_ours_to_raw_replay_order": round(ratio_ordered, 3),
              "cpu_ratio_raw_to_ours": round(cpu_raw / cpu_ours, 3)}
    print(f"{'variant':<28}{'events/s':>12}{'cpu us/event':>14}")
    runs = [("streamrec replay", ours[0])]
    for raw_run, ordered_run, ours_run in zip(raws, raws_ordered, ours[1:], strict=True):
        runs += [("raw confluent-kafka", raw_run), ("raw (replay order)", ordered_run), ("streamrec replay", ours_run)]
    for name, r in runs:
        print(f"{name:<28}{r.events_per_s:>12,.0f}{r.cpu_us_per_event:>14.3f}")
    print(f"ratio streamrec/raw (best runs): {ratio:.2f}; streamrec/raw in replay order: {ratio_ordered:.2f}  "
          f"({events:,} events of {args.dataset}); CPU per event raw/streamrec (least of each): "
          f"{cpu_raw / cpu_ours:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
