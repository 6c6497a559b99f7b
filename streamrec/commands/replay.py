"""``streamrec replay``: publishing a data set into the event topics."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import Any

from stream.replay.config import RESUME_HELP, DelayKind, ReplaySettings, SyntheticSettings
from streamrec.commands.common import (
    EXIT_OK,
    add_common,
    add_kafka_flag,
    count,
    default_help,
    emit,
    kafka_settings,
    kv_lines,
    sources,
)
from streamrec.settings import SettingsError, Sources

_d = functools.partial(default_help, ReplaySettings, "replay")  # _d(key): "default: [replay] key, else <built-in>"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="publish a data set's impressions and clicks in event-time order",
                       description="Publish impressions and clicks to Kafka in event-time order with an idempotent "
                       "producer; waits for every acknowledgement and prints the counts. Sources: ml-1m, ml-100k "
                       "(every rating an impression, rating >= 4 adds a click after a drawn delay), synthetic "
                       "(deterministic by seed, planted click model; tune with --syn-* flags or [synthetic]), or "
                       "a Parquet/CSV event log (map its columns with --*-col flags). Rows a file source cannot "
                       "use go to <topic>.dlq with the reason.")
    p.add_argument("--dataset", help=f"ml-1m | ml-100k | synthetic | PATH to .parquet/.csv ({_d('dataset')})")
    p.add_argument("--limit", type=count, help="replay only the first N impressions (MovieLens: earliest in event "
                   "time; event logs: first N rows of the file, rejected rows included)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, help="at most this many events per wall-clock second")
    pace.add_argument("--speed", type=float, help="replay event time this many times faster than real time")
    p.add_argument("--seed", type=int, help=f"seed of click delays and synthetic data ({_d('seed')})")
    p.add_argument("--click-delay", choices=[k.value for k in DelayKind], help="click delay distribution "
                   f"({_d('click_delay_kind')})")
    p.add_argument("--click-delay-median-s", type=float,
                   help=f"median click delay, seconds ({_d('click_delay_median_s')})")
    p.add_argument("--click-delay-sigma", type=float, help=f"lognormal sigma of log(delay) ({_d('click_delay_sigma')})")
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--broker-wait-s", type=float, help=f"fail (exit 1) once Kafka acknowledged nothing this many "
                   f"seconds ({_d('broker_wait_s')})")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics (events replayed) on this port")
    add_kafka_flag(p)
    g = p.add_argument_group("synthetic data set (--dataset synthetic)")
    for f in dataclasses.fields(SyntheticSettings):
        g.add_argument(f"--syn-{f.name.replace('_', '-')}", dest=SYN_FLAG_PREFIX + f.name,
                       type=float if f.type in ("float", float) else int,
                       help=f"({default_help(SyntheticSettings, 'synthetic', f.name)})")
    g = p.add_argument_group("Parquet/CSV event log (--dataset PATH): one row per impression")
    g.add_argument("--user-col", default="user_id", help="user id column (default: %(default)s)")
    g.add_argument("--item-col", default="item_id", help="item id column (default: %(default)s)")
    g.add_argument("--time-col", default="ts", help="event time column (default: %(default)s)")
    g.add_argument("--time-unit", default=None, choices=["s", "ms", "us", "ns", "iso"], help="unit of the time "
                   "columns (default: ms, and a file whose times are all before 1973 as ms is refused: give the unit)")
    g.add_argument("--impression-id-col", default=None, help="default: generated from the file name and row")
    g.add_argument("--clicked-col", default="clicked",
                   help="truthy -> a click follows; '' for no clicks (default: %(default)s)")
    g.add_argument("--click-time-col", default=None, help="the click's own time (else a drawn delay)")
    g.add_argument("--feature-cols", default="", help="comma-separated categorical/list context columns")
    g.add_argument("--dense-cols", default="", help="comma-separated numeric columns")
    g.add_argument("--csv-delimiter", default=None, help="default: tab for .tsv, else comma")
    add_common(p)
    p.set_defaults(func=run)


SYN_FLAG_PREFIX = "syn_"


def run(args: argparse.Namespace) -> int:
    from stream.replay.publisher import progress_bar, publish

    src = sources(args)
    kafka = kafka_settings(args, src)
    rs = src.build(ReplaySettings, "replay", dataset=args.dataset, limit=args.limit, rate=args.rate,
                   speed=args.speed, seed=args.seed, click_delay_kind=args.click_delay,
                   click_delay_median_s=args.click_delay_median_s, click_delay_sigma=args.click_delay_sigma,
                   progress=False if args.no_progress else None, metrics_port=args.metrics_port,
                   broker_wait_s=args.broker_wait_s,
                   flag_names={"click_delay_kind": "--click-delay", "progress": "--no-progress"})
    if rs.metrics_port is not None:
        from streamrec.commands.common import start_metrics

        start_metrics(rs.metrics_port, rs.metrics_host, "[replay] metrics_port / metrics_host (--metrics-port)")
    table, run = load_source(rs, args, src)
    update, close, status = progress_bar(table.n_impressions + table.n_clicks + len(table.raw), rs.progress)
    try:
        summary = publish(table, kafka, rs.dataset, rate=rs.rate, speed=rs.speed, linger_ms=rs.linger_ms,
                          broker_wait_s=rs.broker_wait_s, progress=update, status=status, run=run, resume=args.resume)
    finally:
        close()
    d = {**summary.as_dict(), "bootstrap_servers": kafka.bootstrap_servers}

    def human(d: dict[str, Any]) -> str:
        return (
            f"replayed {d['dataset']} to {d['bootstrap_servers']} in {d['elapsed_s']:.1f}s "
            f"({d['events_per_s']:,.0f} events/s)\n"
            f"  impressions: {d['impressions']:,}\n  clicks: {d['clicks']:,}\n"
            f"  malformed published: {d['malformed_published']:,}\n"
            f"  dead-lettered at source: {d['dead_lettered']:,}" + (f" ({d['dead_lettered_again']:,} of them sent by "
            "an earlier run already: the .dlq topics may hold those twice)" if d["dead_lettered_again"] else "") + "\n"
            f"  acknowledged per topic: {d['acked']}\n  skipped as delivered already (--resume): {d['skipped']}\n"
            f"  run: {d['run']}\n  source:\n{kv_lines(d['source'], '    ')}"
        )

    emit(args, d, human)
    return EXIT_OK


def load_source(rs: ReplaySettings, args: argparse.Namespace, src: Sources) -> tuple[Any, dict[str, Any]]:
    """The EventTable of ``rs.dataset`` (a packaged name, ``synthetic``, or a file path), and its run (resume.py)."""
    from stream.replay.movielens import DATASETS, load_movielens

    run = {"dataset": rs.dataset, "limit": rs.limit, "seed": rs.seed, "click_delay": rs.click_delay}  # not the pace
    if rs.dataset in DATASETS:
        return load_movielens(rs.dataset, rs.click_delay, rs.seed, rs.limit), run
    if rs.dataset == "synthetic":
        from stream.replay.synthetic import build_synthetic

        overrides = {k[len(SYN_FLAG_PREFIX):]: v for k, v in vars(args).items() if k.startswith(SYN_FLAG_PREFIX)}
        syn = src.build(SyntheticSettings, "synthetic", **overrides, flag_names={
            k: f"--{(SYN_FLAG_PREFIX + k).replace('_', '-')}" for k in overrides})
        return build_synthetic(syn, rs.click_delay, rs.seed, rs.limit), {**run, "synthetic": syn}
    path = Path(rs.dataset)
    if not path.exists():
        raise SettingsError(f"--dataset {rs.dataset!r} is neither a packaged data set ({', '.join(sorted(DATASETS))}), "
                            f"'synthetic', nor an existing Parquet/CSV file")
    from stream.limits import EventLimits
    from stream.replay.column_map import ColumnMap
    from stream.replay.eventlog import load_eventlog

    cols = ColumnMap(user=args.user_col, item=args.item_col, time=args.time_col, time_unit=args.time_unit,
                     impression_id=args.impression_id_col, clicked=args.clicked_col or None,
                     click_time=args.click_time_col, features=tuple(filter(None, (args.feature_cols or "").split(","))),
                     dense=tuple(filter(None, (args.dense_cols or "").split(","))))  # (empty names dropped)
    limits = src.build(EventLimits, "limits")  # the joiner's: it publishes what the joiner takes
    log = load_eventlog(path, cols, rs.click_delay, rs.seed, rs.limit, csv_delimiter=args.csv_delimiter, limits=limits)
    return log, {**run, "file": path, "columns": cols, "csv_delimiter": args.csv_delimiter, "limits": limits}
