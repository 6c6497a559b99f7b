"""Replay throughput: ``streamrec replay``'s publish path against a raw confluent-kafka producer.

Both send the same messages (same keys, same JSON bytes, same topics layout) to the same broker with
the same producer settings (idempotent, acks=all, lz4, linger 20 ms); the raw producer gets the bytes
pre-encoded, so the ratio is the cost of building events from the columnar table, ordering and
acknowledgement tracking. Runs: ours, raw, ours again (the machine is noisy; compare within one run).

    python bench/replay.py                       # ml-1m, starts its own local stack on free ports
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
from stream.kafka import ensure_topics, producer_config  # noqa: E402
from stream.replay.config import ClickDelay
from stream.replay.movielens import load_movielens  # noqa: E402
from stream.replay.publisher import publish  # noqa: E402
from streamrec.stack import (  # noqa: E402
    LocalStack,
    StackSettings,  # noqa: E402
    free_port,
)
from tests.kafka_io import read_topic  # noqa: E402


def fresh_topics(base: KafkaSettings) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    return dataclasses.replace(base, impressions_topic=f"bench-imp-{tag}", clicks_topic=f"bench-clk-{tag}")


def run_ours(table, kafka: KafkaSettings) -> float:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    summary = publish(table, kafka, "bench")
    return (summary.impressions + summary.clicks) / summary.elapsed_s


def run_raw(messages: list[tuple[str, bytes, bytes]], kafka: KafkaSettings) -> float:
    ensure_topics(kafka, {t for t, _, _ in messages})
    p = Producer(producer_config(kafka))
    acked = 0

    def on_delivery(err, _msg) -> None:
        nonlocal acked
        if err is None:
            acked += 1

    t0 = time.monotonic()
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
    elapsed = time.monotonic() - t0
    assert acked == len(messages), f"raw producer: {len(messages) - acked} unacknowledged"
    return len(messages) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-1m", choices=["ml-1m", "ml-100k"])
    ap.add_argument("--bootstrap-servers", help="use a running broker instead of starting one")
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
        ours_1 = run_ours(table, k1)
        # The exact bytes ours produced, in the order produced (per partition order is what matters).
        messages = [(k1.impressions_topic.replace("imp", "rawimp"), r.key, r.value)
                    for r in read_topic(k1, k1.impressions_topic)]
        messages += [(k1.clicks_topic.replace("clk", "rawclk"), r.key, r.value)
                     for r in read_topic(k1, k1.clicks_topic)]
        raw = run_raw(messages, base)
        ours_2 = run_ours(table, fresh_topics(base))
    finally:
        if stack is not None:
            stack.down()
    ours = max(ours_1, ours_2)
    result = {"dataset": args.dataset, "events": events, "ours_events_per_s": [round(ours_1), round(ours_2)],
              "raw_events_per_s": round(raw), "ratio_ours_to_raw": round(ours / raw, 3)}
    print(f"{'variant':<28}{'events/s':>12}")
    print(f"{'streamrec replay (run 1)':<28}{ours_1:>12,.0f}")
    print(f"{'raw confluent-kafka':<28}{raw:>12,.0f}")
    print(f"{'streamrec replay (run 2)':<28}{ours_2:>12,.0f}")
    print(f"ratio streamrec/raw (best run): {ours / raw:.2f}  ({events:,} events of {args.dataset})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
