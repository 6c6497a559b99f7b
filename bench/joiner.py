"""Joiner throughput: one ``streamrec join`` worker against raw confluent-kafka consumption of the same topics.

One run, same broker, same data: a synthetic stream (Zipf users/items, clicks, duplicates, orphans)
is replayed into fresh topics, then read by

  raw     a confluent-kafka consumer: consume(5000), orjson.loads, a dict join of clicks to
          impressions (the ceiling: no validation, no state durability, no output);
  kafka   ``streamrec join --driver kafka`` (validated events, per-partition join, Redis counts and
          history, Arrow samples and state chunks written and acknowledged before offsets commit);
  faust   ``streamrec join`` (the same pipeline on faust's consumer: stream/joiner/faust_delivery.py).

events/s for a worker spans its first to its last batch (group join and idle exit excluded); raw is read again in
each round (the median is the ceiling every ratio divides by; its range is shown). The
worker's own breakdown (stage_s) says what limits it. ``cpu s`` is the worker process's user + system CPU time
(start-up and idle exit included): on a machine shared with other work, where the wall clock of a run moves by
2x, it moves far less, so an A/B on a busy machine compares it (with ``--rounds`` for the spread).

    python bench/joiner.py [--impressions 200000] [--drivers kafka,faust] [--rounds 1] [--profile DIR]
    python bench/joiner.py --dataset ml-1m --drivers kafka     # MovieLens-1M replayed (the demo's join step)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition  # noqa: E402

from stream.config import KafkaSettings  # noqa: E402
from stream.replay.config import ClickDelay, SyntheticSettings  # noqa: E402
from stream.replay.movielens import load_movielens  # noqa: E402
from stream.replay.publisher import publish  # noqa: E402
from stream.replay.synthetic import build_synthetic  # noqa: E402
from streamrec.stack import (  # noqa: E402
    LocalStack,
    StackSettings,  # noqa: E402
    free_port,
)


def raw_join(kafka: KafkaSettings, total: int) -> float:
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"raw-{uuid.uuid4().hex}",
                  "enable.partition.eof": True, "enable.auto.commit": False})
    parts = [TopicPartition(t, p, OFFSET_BEGINNING) for t in (kafka.impressions_topic, kafka.clicks_topic)
             for p in range(kafka.partitions)]
    c.assign(parts)
    pending: dict[str, dict] = {}
    joined = seen = 0
    eof: set[tuple[str, int]] = set()
    t0 = None
    while len(eof) < len(parts):
        for m in c.consume(5000, 0.5):
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    eof.add((m.topic(), m.partition()))
                continue
            t0 = t0 or time.monotonic()
            seen += 1
            try:
                ev = orjson.loads(m.value())
            except orjson.JSONDecodeError:
                continue
            if m.topic() == kafka.impressions_topic:
                pending[ev.get("impression_id")] = ev
            elif ev.get("impression_id") in pending:
                joined += 1
    elapsed = time.monotonic() - (t0 or time.monotonic())
    c.close()
    return seen / elapsed


def run_worker(kafka: KafkaSettings, redis_url: str, driver: str, profile: Path | None = None,
               root: Path | None = None) -> dict:
    """One worker's summary; ``root``: run the worker of another checkout (its ``streamrec``), for an A/B."""
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_IMPRESSIONS_TOPIC=kafka.impressions_topic,
               STREAMREC_KAFKA_CLICKS_TOPIC=kafka.clicks_topic,
               STREAMREC_KAFKA_SAMPLES_TOPIC=f"bench-samples-{driver}-{uuid.uuid4().hex[:6]}",
               STREAMREC_REDIS_URL=redis_url, STREAMREC_REDIS_PREFIX=f"bench-{uuid.uuid4().hex[:6]}")
    prof = []
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        prof = ["-m", "cProfile", "-o", str(profile / f"join-{driver}.prof")]
    cmd = [sys.executable, *prof, "-m", "streamrec.cli", "join", "--driver", driver, "--app-id",
           f"bench-{driver}-{uuid.uuid4().hex[:6]}", "--exit-when-idle", "3", "--drain", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # counts waited-for children only: the worker, not the stack
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=root)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{driver} worker failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    summary["cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impressions", type=int, default=200_000)
    ap.add_argument("--drivers", default="kafka,faust")
    ap.add_argument("--rounds", type=int, default=1, help="run each worker this many times, interleaved (with "
                    "--compare-with: this checkout and the other alternate); the table shows the median and range")
    ap.add_argument("--compare-with", type=Path, metavar="DIR", help="also run each driver from the checkout in DIR "
                    "(e.g. `git worktree add DIR <commit>`), alternating with this one, for a side-by-side A/B")
    ap.add_argument("--dataset", default="synthetic", help="synthetic (default), or a packaged MovieLens set "
                    "(ml-1m, ml-100k: stream/replay/movielens.py; installed as environment.md says) replayed whole")
    ap.add_argument("--profile", type=Path, help="write each worker's cProfile stats to DIR/join-<driver>.prof "
                    "(slows the worker; for where the time goes, not for its figures)")
    args = ap.parse_args()
    stack = LocalStack(StackSettings(state_dir=Path(tempfile.mkdtemp()), kafka_port=free_port(),
                                     redis_port=free_port()))
    stack.up()
    try:
        tag = uuid.uuid4().hex[:6]
        kafka = dataclasses.replace(KafkaSettings(bootstrap_servers=stack.bootstrap_servers),
                                    impressions_topic=f"bench-imp-{tag}", clicks_topic=f"bench-clk-{tag}")
        if args.dataset == "synthetic":
            table = build_synthetic(SyntheticSettings(impressions=args.impressions, users=1_000_000, items=100_000,
                                                      impressions_per_s=2000.0), ClickDelay(), seed=1)
        else:
            table = load_movielens(args.dataset, ClickDelay(), 1, None)
        s = publish(table, kafka, args.dataset)
        total = s.impressions + s.clicks
        raws: list[float] = []
        runs: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            # the ceiling measured again in each round, beside the workers: on this shared machine it moves as much
            # as they do (104-123 k events/s on the synthetic stream in one session), so one reading skews every ratio
            raws.append(raw_join(kafka, total))
            for driver in args.drivers.split(","):
                for root in ([None] if args.compare_with is None else [args.compare_with.resolve(), None]):
                    r = run_worker(kafka, stack.redis_url, driver, args.profile, root)
                    assert r["samples"] == s.impressions + r["delayed_positives"], r  # fake_negative: a 0, then clicks
                    name = f"streamrec join --driver {driver}" + ("" if root is None else f" @{root.name}")
                    runs.setdefault(name, []).append(r)
    finally:
        stack.down()
    print(f"{args.dataset}: {total:,} events ({s.impressions:,} impressions, {s.clicks:,} clicks), 4 partitions, "
          f"one worker process, {args.rounds} round(s); load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<40}{'events/s':>10}{'vs raw':>8}{'cpu s':>8}{'process s':>11}  range (events/s; cpu s)")
    raw = statistics.median(raws)
    print(f"{'raw confluent-kafka (ceiling)':<40}{raw:>10,.0f}{1:>8.2f}{'':>8}{'':>11}  "
          f"{min(raws):,.0f}-{max(raws):,.0f}")
    for name, rs in runs.items():
        eps, cpu = [r["events_per_s"] for r in rs], [r["cpu_s"] for r in rs]
        print(f"{name:<40}{statistics.median(eps):>10,.0f}{statistics.median(eps) / raw:>8.2f}"
              f"{statistics.median(cpu):>8.2f}{statistics.median([r['process_s'] for r in rs]):>11.2f}"
              f"  {min(eps):,}-{max(eps):,}; {min(cpu):.2f}-{max(cpu):.2f}")
    for name, rs in runs.items():
        for r in rs:
            print(f"{name}: stage seconds {r['stage_s']} (process {r['process_s']}s, cpu {r['cpu_s']}s, worker "
                  f"{r['elapsed_s']}s from start to idle exit); held back {r['held_back']}, input pauses "
                  f"{r.get('input_pauses')}, peak RSS {r.get('max_rss_mb')} MB")
    print(json.dumps({"raw confluent-kafka (ceiling)": {"events_per_s": raw, "ratio": 1.0,
                                                        "range": [min(raws), max(raws)]}}
                     | {name: {"events_per_s": statistics.median(r["events_per_s"] for r in rs),
                               "ratio": round(statistics.median(r["events_per_s"] for r in rs) / raw, 3),
                               "cpu_s": statistics.median(r["cpu_s"] for r in rs)} for name, rs in runs.items()}))


if __name__ == "__main__":
    main()
