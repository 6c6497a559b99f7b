"""``streamrec join``: the impression-click joiner."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import Any

from stream.config import RedisSettings
from stream.errors import close_after_error
from stream.joiner.config import Driver, EmissionPolicy, JoinerSettings
from stream.stop_signals import StopsTaken
from streamrec.commands.common import (
    add_common,
    add_kafka_flag,
    default_help,
    emit,
    kafka_settings,
    kv_lines,
    setup_logging,
    sources,
    start_metrics,
)

_d = functools.partial(default_help, JoinerSettings, "joiner")  # _d(key): "default: [joiner] key, else <built-in>"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("join", help="join impressions and clicks into labelled samples (faust worker)",
                       description="Run the impression-click joiner: a faust-streaming worker reading the impressions "
                       "and clicks topics (co-partitioned by impression id), labelling each impression 1 if a click "
                       "arrives within the attribution window (event time) and 0 when the window expires, attaching "
                       "the user's click history as of the impression, counting items and users per day in Redis, "
                       "and writing Arrow sample batches to the samples topic. Late and orphan clicks go to "
                       "late_clicks, malformed events to <topic>.dlq. Runs until SIGTERM, or until idle with "
                       "--exit-when-idle. Several workers with the same --app-id split the partitions.")
    p.add_argument("--app-id", help="faust app id = consumer group "
                   f"({_d('app_id')})")
    p.add_argument("--window-s", type=float, help="attribution window, event-time seconds "
                   f"({_d('attribution_window_s')})")
    p.add_argument("--lateness-s", type=float, help="allowed lateness of the watermark, seconds "
                   f"({_d('allowed_lateness_s')})")
    p.add_argument("--emission", choices=[e.value for e in EmissionPolicy],
                   help="when samples go out: wait (a positive at its click, a negative when the window closes), "
                   "window (all at window close), fake_negative (a negative at once and the positive again at its "
                   "click), es_dfm (the label seen after --elapsed-s, the positive again at a later click); "
                   f"{_d('emission')}. The learner corrects for each (README, delayed feedback)")
    p.add_argument("--elapsed-s", type=float, help="es_dfm: event time an impression waits for its click "
                   f"({_d('elapsed_s')})")
    p.add_argument("--exit-when-idle", type=float, metavar="SECONDS", help="exit after this long without input "
                   "(bounded runs: tests, demo, replays)")
    p.add_argument("--drain", action="store_true", help="with --exit-when-idle: treat the input as complete and "
                   "expire every pending impression before exiting")
    p.add_argument("--redis-url", help="Redis for counts and history "
                   f"({default_help(RedisSettings, 'redis', 'url')})")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", help="address the metrics listener binds "
                   f"({_d('metrics_host')}: loopback only; 0.0.0.0 for every "
                   "interface)")
    p.add_argument("--driver", choices=["faust", "kafka"], help="faust-streaming worker or a plain "
                   "confluent-kafka consumer loop with the same semantics and several times the throughput "
                   f"({_d('driver')})")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="how much the process logs to stderr (default: %(default)s)")
    add_kafka_flag(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stream.joiner.pipeline import JoinPipeline
    from stream.limits import EventLimits

    src = sources(args)
    kafka = kafka_settings(args, src)
    redis_settings = src.build(RedisSettings, "redis", url=args.redis_url)
    js = src.build(JoinerSettings, "joiner", app_id=args.app_id, attribution_window_s=args.window_s,
                   allowed_lateness_s=args.lateness_s, exit_when_idle_s=args.exit_when_idle,
                   drain_at_exit=True if args.drain else None, metrics_port=args.metrics_port, driver=args.driver,
                   metrics_host=args.metrics_host, emission=args.emission, elapsed_s=args.elapsed_s,
                   flag_names={"attribution_window_s": "--window-s", "allowed_lateness_s": "--lateness-s",
                               "exit_when_idle_s": "--exit-when-idle", "drain_at_exit": "--drain"})
    setup_logging(args.log_level)
    if js.metrics_port is not None:
        start_metrics(js.metrics_port, js.metrics_host,
                      "[joiner] metrics_port / metrics_host (--metrics-port / --metrics-host)")
    pipeline = JoinPipeline(kafka, redis_settings, js, src.build(EventLimits, "limits"))
    if js.driver is Driver.KAFKA:
        from stream.joiner.kafka_driver import KafkaJoinWorker

        worker: Any = KafkaJoinWorker(pipeline, kafka, js)
    else:
        from stream.joiner.worker import FaustJoinWorker

        worker = FaustJoinWorker(pipeline, kafka, js)
    print(f"joining {kafka.impressions_topic} + {kafka.clicks_topic} -> {kafka.samples_topic} on "
          f"{kafka.bootstrap_servers} (group {js.app_id}, driver {js.driver}, window {js.attribution_window_s:g}s)",
          file=sys.stderr)
    with StopsTaken(worker.stop if js.driver is Driver.KAFKA else None,  # a stop after the run: the summary, a
                    lambda: worker.stop_reason == "signal") as stops:  # stop after the run's own stop: the process's
        try:
            code = stops.run(worker.run)
        except BaseException:  # a close that fails too (Redis away while flushing the counts) is logged, not raised
            close_after_error(pipeline.close, "closing the joiner", logging.getLogger("streamrec.join"))
            raise
        pipeline.close()
        summary = pipeline.totals.summary()
        summary.update(group=js.app_id, driver=js.driver, records_acked=pipeline.producer.acked_total,
                       input_pauses=dict(worker.gate.pauses), reason=worker.stop_reason)
        emit(args, summary, lambda d: "join summary\n" + kv_lines(d))
    return code
