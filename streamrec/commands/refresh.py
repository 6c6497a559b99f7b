"""``streamrec refresh``: the nightly hot-embedding cache refresh (scheduler, --now, --rollback, --status).

Who may end a rollback: ``--rollback`` pins the older version (``<publish_root>/PINNED``). The scheduled
runs (no mode flag) respect the pin: while it holds the live version they build and validate, publish
nothing, log an error and write a ``refresh_pinned`` alert; ``--status`` shows the pin and the last run
it held back. ``--now`` is the operator's explicit action: it publishes over the pin and removes it
(the rollback ends; serving applies learner deltas again).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from cache_refresh.settings import LogLevel, RefreshSettings
from learner.config import ArtifactFormat
from stream.config import KafkaSettings, RedisSettings
from stream.secrets import redact
from stream.stop_signals import StopsTaken
from streamrec.commands.common import (
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_OK,
    add_common,
    add_kafka_flag,
    default_help,
    emit,
    kv_lines,
    setup_logging,
    start_metrics,
)
from streamrec.settings import SettingsError, Sources, read_config_file


def _settings(args: argparse.Namespace) -> tuple[RefreshSettings, KafkaSettings, RedisSettings]:
    src = Sources(file_data=read_config_file(args.config))
    kafka = src.build(KafkaSettings, "kafka", bootstrap_servers=args.bootstrap_servers)
    rds = src.build(RedisSettings, "redis", url=args.redis_url)
    rs = src.build(RefreshSettings, "refresh", checkpoint_dir=args.checkpoint_dir, publish_root=args.publish_root,
                   format=args.format, schedule=args.schedule, timezone=args.timezone)
    if args.allow_older and not args.now:
        raise SettingsError("--allow-older goes with --now (an operator's run)")
    if not (args.now or args.rollback or args.status):  # the scheduler's settings: checked only where used
        from cache_refresh.scheduler import check_schedule
        check_schedule(rs.schedule, rs.timezone)
    return rs, kafka, rds


def cmd_refresh(args: argparse.Namespace) -> int:
    rs, kafka, rds = _settings(args)
    setup_logging(args.log_level or rs.log_level)
    from cache_refresh import job, run_records, status
    from cache_refresh.publish import rollback
    from learner import artifact_versions
    from learner.tensorpack import load_signing_key
    if args.status:
        st = status.status(Path(rs.publish_root))
        emit(args, st, lambda d: "refresh status\n" + kv_lines(d))
        return EXIT_OK if st["current"] else EXIT_FAILED
    if args.rollback:
        version = rollback(Path(rs.publish_root), signing_key=load_signing_key(rs.signing_key_file))  # error: exit 1
        path = Path(rs.publish_root) / artifact_versions.VERSIONS / version
        receivers = job.notify(rs, rds, version, path)
        emit(args, {"current": version, "path": str(path), "notified": bool(receivers),
                    "notify_receivers": receivers, "pinned": True},
             lambda d: f"rolled back: {d['current']} is current ({d['path']}) and pinned: serving applies no "
             "learner deltas to it and scheduled refreshes do not publish over it until an operator runs "
             "`streamrec refresh --now`")
        return EXIT_OK
    if args.now:  # SIGTERM in the run: failed, exit 1; after it (the summary): absorbed, unless the run had one
        with StopsTaken(None, (stop := job.StopSignals()).stopped) as stops:  # ends a pin
            summary = stops.run(lambda: job.run_now(rs, kafka, rds, allow_older=args.allow_older, stop=stop))
            emit(args, summary, lambda d: "refresh summary\n" + kv_lines(d))
            if summary.get("skipped"):
                print(f"streamrec refresh: {redact(summary['skipped']['message'])}; it publishes (or fails and "
                      "alerts) by itself: check `streamrec refresh --status` when it has ended, and run --now again "
                      f"if you still need to (exit {EXIT_BUSY})", file=sys.stderr)
                return EXIT_BUSY
        return EXIT_OK

    from cache_refresh.alerts import RefreshAlerts
    from cache_refresh.scheduler import run_forever

    # one for the process: an alert is retried until the broker takes it, and recorded for a publish to resolve from
    # the start, so one fired before any run is too (cache_refresh/alerts.py); progress: for an abandoning stop
    alerts, progress = RefreshAlerts(kafka, rs.alerts_topic, publish_root=Path(rs.publish_root)), job.RunProgress()

    def scheduled() -> None:
        job.scheduled_run(rs, kafka, rds, alerts, progress)  # respects a rollback pin; failures are logged and alerted

    def skip(why: str, stage: str) -> None:  # stage: scheduler (its previous run still going) or missed
        job.skipped(alerts, Path(rs.publish_root), why, stage)

    last_success = run_records.restore_last_success(Path(rs.publish_root))  # the gauge too, before the first scrape
    if rs.metrics_port is not None:
        start_metrics(rs.metrics_port, rs.metrics_host, "[refresh] metrics_port / metrics_host")
    print(f"refresh scheduled '{rs.schedule}' ({rs.timezone}); publishing to {rs.publish_root}", file=sys.stderr)
    try:  # 0 after a stop, EXIT_FAILED when the scheduler's thread died (logged and alerted)
        return run_forever(scheduled, rs.schedule, rs.timezone, rs.misfire_grace_s, last_success, on_skip=skip,
                           alerts=alerts, where=progress.where)
    finally:
        alerts.close()  # run_forever drained them (close_timeout_s; a second signal ends it): a no-op then


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "refresh", help="the nightly hot-embedding cache refresh: build, validate and publish a serving artifact",
        description="Refresh the serving artifact from the learner's newest checkpoint. Steps: read the Redis "
        "per-day counts of the last [refresh] days -> hot set (top hot_items items and hot_users users, plus "
        "every row of small context fields) -> build the artifact (a TorchScript scorer holding the MLP, FM, "
        "bias and the hot rows; the cold rows in a memory-mapped cold_rows.npy; manifest.json with the "
        "version, source checkpoint and offsets, config, hot-set stats and the sha256 of every file) -> "
        "validate (probe scores equal the learner's eager fp32 scores within validate_tolerance; AUC on the "
        "last holdout_messages samples not more than max_auc_drop below the live artifact's) -> publish "
        "atomically under <publish_root>/versions/ and point CURRENT at it, keeping keep_versions -> "
        "PUBLISH the version on <redis prefix>:model-updates. A failure publishes nothing, writes a firing "
        "alert to the Kafka alerts topic and exits 1; the live artifact keeps serving. Without --now/"
        "--rollback/--status it runs forever on the cron schedule (default '0 3 * * *' UTC); a run missed "
        "while it was down runs on start if within misfire_grace_s. Rollback pins: while a --rollback pin "
        "holds, scheduled runs build and validate but do not publish (they log an error and write a "
        "refresh_pinned alert); only --now, an operator's run, publishes over the pin and ends the rollback. "
        "One refresh per publish root runs at a time (a lock); each run first removes what killed runs "
        "left (staged directories, temp files). A run while another holds the publish root (a --now during the "
        "scheduled run, or the reverse) does nothing: it logs a warning, writes a refresh_skipped alert (warning) "
        "and counts streamrec_refresh_runs_total{outcome=\"skipped\"}; so does a scheduled run due while the "
        "scheduler's previous one is still going. A publish whose checkpoint is of another training run than the "
        "live version's (another lineage: a learner started afresh) publishes and writes a refresh_lineage_switched "
        "alert (warning); the summary says lineage_switched.",
        epilog="Settings: [refresh] in --config and STREAMREC_REFRESH_<KEY> (checkpoint_dir, publish_root, days, "
        "hot_items, hot_users, schedule, timezone, misfire_grace_s, keep_versions, format, validate_tolerance, "
        "holdout_messages, max_auc_drop, redis_attempts, redis_backoff_s, notify_channel, alerts_topic, metrics_port, "
        "embedding_store = in_process | layered: also write the non-hot rows to Redis for a layered serving, "
        "embedding_store_dtype = float32 | float16, embedding_store_cluster). Exit codes: 0 ok, 1 failed, 2 usage, "
        "3 skipped (--now: another refresh holds the publish root; nothing done). A --now run that SIGTERM or SIGINT "
        "stops ends as a failed run: staged files removed, nothing published, a refresh_failed alert, exit 1. "
        "Examples: streamrec refresh --now --json; streamrec refresh --rollback; streamrec refresh --status --json")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--now", action="store_true", help="run one refresh now and exit (0 published, 1 failed, "
                      "3 skipped: another refresh is running on the publish root); an operator's run: it publishes "
                      "over a rollback pin and removes it")
    mode.add_argument("--rollback", action="store_true", help="make the version before the current one current "
                      "again (after verifying it) and pin it: serving applies no learner deltas to it and scheduled "
                      "runs do not publish over it until the next --now; notify serving")
    mode.add_argument("--status", action="store_true", help="print the current version and its manifest summary, "
                      "the rollback pin and the last scheduled run it held back or that failed since the last publish")
    p.add_argument("--allow-older", action="store_true", help="with --now: publish even an older checkpoint")
    d = functools.partial(default_help, RefreshSettings, "refresh")  # d(key): "default: [refresh] key, else <built-in>"
    p.add_argument("--checkpoint-dir", help=f"the learner's checkpoints ({d('checkpoint_dir')})")
    p.add_argument("--publish-root", help=f"where versions and CURRENT live ({d('publish_root')})")
    p.add_argument("--format", choices=[f.value for f in ArtifactFormat], help=f"scorer format ({d('format')})")
    p.add_argument("--schedule", help=f"crontab expression ({d('schedule', repr(RefreshSettings.schedule))})")
    p.add_argument("--timezone", help=f"IANA time zone of the schedule ({d('timezone')})")
    p.add_argument("--redis-url", help=f"Redis with the counts ({default_help(RedisSettings, 'redis', 'url')})")
    p.add_argument("--log-level", choices=[v.value for v in LogLevel], help=d("log_level"))
    add_kafka_flag(p)
    add_common(p)
    p.set_defaults(func=cmd_refresh)
