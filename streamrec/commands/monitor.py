"""``streamrec monitor``: evaluate alert rules continuously and send firing/resolved alerts."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from typing import Any

from streamrec.commands.common import add_common, add_kafka_flag, seconds, setup_logging, tcp_port

RULES_HELP = """\
rules file (TOML):
  interval_s = 15                       # seconds between evaluations (default 15)
  [sources]                             # Prometheus /metrics endpoints, by name
  learner = "http://127.0.0.1:9102/metrics"
  [sinks]
  log = true                            # one log line per alert on stderr
  kafka_topic = "alerts"                # optional; key = rule name, value = alert JSON
  webhook_url = "http://host/hook"      # optional; POST each alert as JSON
  webhook_timeout_s = 5                 # one POST, connect to answer, in total (kafka_timeout_s = 10)
  queue_size = 1000                     # alerts waiting per sink; beyond it the oldest are dropped
  retry_backoff_s = 0.5                 # after a failed attempt; doubles per failure in a row ...
  retry_backoff_max_s = 30              # ... up to this; undelivered alerts stay queued until delivered
  close_timeout_s = 10                  # at shutdown, keep delivering this long, then report the rest

  [[rule]]
  name = "cold_start_share"             # unique
  expr = 'streamrec_learner_bucket_share{field="user_id"}'
  op = ">"                              # > >= < <= == != isnan
  threshold = 0.5                       # (not with isnan)
  for_s = 300                           # must hold this long before firing
  severity = "warning"                  # info | warning | critical
  description = "New users mostly served by hash buckets"
  labels = { team = "ranking" }         # optional
  absent_for_s = 600                    # optional: fire when expr has no data this long

expressions: metric names, label selectors {l="v", l!="v", l=~"re", l!~"re"}, numbers, + - * /,
  parentheses, sum/max/min/avg/count [by (l, ...)] (expr), rate/increase/delta(metric[60s]), abs(expr).
  e.g. streamrec_learner_warm_auc - streamrec_learner_cold_auc
       max by (field) (streamrec_learner_bucket_share)
       rate(streamrec_learner_nan_losses_total[60s])
  Vectors combine series with equal labels. A metric no source exports is "no data" (never fires).
  NaN compares false with every op; use op = "isnan" to alert on NaN.

alerts (JSON, same on every sink): {"rule", "source", "severity", "state": "firing"|"resolved",
  "value", "threshold", "message", "ts" (ms), "labels"}. One "firing" when a condition has held for
  for_s, one "resolved" when it stops holding. Each sink has its own queue and thread: a dead or slow
  sink never delays evaluation or the other sinks; failed deliveries are retried with backoff.

examples:
  streamrec monitor --once                      # default rules, evaluate once, print rule states
  streamrec monitor --rules my-rules.toml --check
  streamrec monitor --source learner=http://learner:9102/metrics --metrics-port 9104
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "monitor", help="evaluate alert rules on Prometheus metrics; send alerts to log, Kafka, webhook",
        description="Scrape the Prometheus endpoints named in an alert rules file every interval, evaluate "
        "each rule, and send a 'firing' alert when its condition has held for for_s seconds and a 'resolved' "
        "alert when it stops holding, to the log, a Kafka topic and/or a webhook. Without --rules it uses the "
        "packaged default rules (cold-start bucket share, cold-user AUC gap, NaN losses, learner lag; the same "
        "file as compose/alert-rules.toml). Runs until SIGTERM/SIGINT; --once evaluates once, prints every "
        "rule's state and sends nothing. A rules file with a mistake is an error naming the rule and field "
        "(exit 2).",
        epilog=RULES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", metavar="FILE", help="alert rules file (default: the packaged default rules)")
    p.add_argument("--once", action="store_true", help="evaluate once, print the rule states, send nothing, "
                   "exit (rate/increase/delta need two scrapes, so they show no data here)")
    p.add_argument("--check", action="store_true", help="only validate the rules file and print its rules")
    p.add_argument("--interval", type=seconds, metavar="SECONDS", help="seconds between evaluations "
                   "(default: interval_s of the rules file)")
    p.add_argument("--source", action="append", default=[], metavar="NAME=URL",
                   help="scrape URL as source NAME, replacing the file's source of that name (repeatable)")
    p.add_argument("--metrics-port", type=tcp_port, help="serve the monitor's own Prometheus /metrics on this port "
                   "(streamrec_monitor_alerts_total, _rule_evaluations_total, _scrape_errors_total, "
                   "and per sink _sink_delivered_total, _sink_failures_total, _sink_retries_total, "
                   "_sink_dropped_total{reason}, _sink_queue_depth)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the --metrics-port listener binds "
                   "(default %(default)s: loopback only; 0.0.0.0 for every interface)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s; the log sink writes firing alerts at warning/error, "
                   "resolved at info)")
    add_kafka_flag(p)
    add_common(p)
    p.set_defaults(func=cmd_monitor)


def _with_sources(config: Any, flags: list[str]) -> Any:
    from streamrec.settings import SettingsError

    sources = dict(config.sources)
    for flag in flags:
        name, sep, url = flag.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SettingsError(f"--source {flag!r}: expected NAME=URL with an http:// or https:// URL, "
                                "e.g. learner=http://127.0.0.1:9102/metrics")
        sources[name] = url
    return dataclasses.replace(config, sources=sources)


def _rows_human(d: dict[str, Any]) -> str:
    lines = [f"rules: {d['rules_file']}", "sources: " + (", ".join(f"{k}={v}" for k, v in d["sources"].items())
                                                         or "none")]
    for name, err in d.get("scrape_errors", {}).items():
        lines.append(f"  scrape of {name} failed: {err}")
    for r in d["rules"]:
        lbl = ",".join(f'{k}="{v}"' for k, v in sorted(r["labels"].items()))
        value = "no data" if r["value"] is None else r["value"]
        lines.append(f"  {r['state']:<9} {r['severity']:<8} {r['rule']}{{{lbl}}} value={value}  "
                     f"[{r['condition']} for {r['for_s']:g}s]")
    return "\n".join(lines)


def cmd_monitor(args: argparse.Namespace) -> int:
    from monitor.engine import Monitor, RuleEngine, Scraper
    from monitor.rules import load_rules
    from streamrec.commands.common import EXIT_OK, emit, kafka_settings, sources

    config = _with_sources(load_rules(args.rules), args.source)
    if args.interval is not None:  # checked by seconds()
        config = dataclasses.replace(config, interval_s=args.interval)
    setup_logging(args.log_level)
    if args.check:
        summary = {"rules_file": config.origin, "sources": dict(config.sources),
                   "sinks": dataclasses.asdict(config.sinks), "interval_s": config.interval_s,
                   "rules": [{"name": r.name, "condition": r.condition, "for_s": r.for_s,
                              "severity": r.severity.value} for r in config.rules]}
        emit(args, summary, lambda d: f"{d['rules_file']}: {len(d['rules'])} rule(s) OK\n" + "\n".join(
            f"  {r['severity']:<8} {r['name']}: {r['condition']} for {r['for_s']:g}s" for r in d["rules"]))
        return EXIT_OK
    if args.once:
        import time

        engine = RuleEngine(config.rules, config.history_s)
        snap = Scraper(config.sources, config.scrape_timeout_s).scrape()
        engine.evaluate(snap, time.time())
        summary = {"rules_file": config.origin, "sources": dict(config.sources), "scrape_errors": snap.errors,
                   "rules": [s.as_dict() for s in engine.status()]}
        emit(args, summary, _rows_human)
        return EXIT_OK

    from monitor.alerts import build_sinks

    kafka = kafka_settings(args, sources(args)) if config.sinks.kafka_topic else None
    if args.metrics_port is not None:  # before the sinks start their threads: a failed bind leaves none running
        from streamrec.commands.common import start_metrics

        start_metrics(args.metrics_port, args.metrics_host, "--metrics-port / --metrics-host")
    sink = build_sinks(config.sinks, kafka)
    monitor = Monitor(config, sink)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    where = ", ".join(n.name for n in sink.sinks) or "no sink"
    print(f"monitoring {len(config.rules)} rule(s) from {config.origin} every {config.interval_s:g}s, "
          f"alerts to {where}" + (f" (topic {config.sinks.kafka_topic} at {kafka.bootstrap_servers})" if kafka
                                  else ""), file=sys.stderr)
    try:
        monitor.run(stop)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        undelivered = monitor.close()  # drains the sink queues for at most close_timeout_s
    summary = monitor.summary()
    summary["sink_failures"] = dict(sink.failures)
    summary["undelivered"] = undelivered
    emit(args, summary, lambda d: (f"monitor stopped after {d['evaluations']} evaluation(s): "
                                   f"{d['alerts']['firing']} firing, {d['alerts']['resolved']} resolved alert(s) "
                                   f"sent; still firing: {len(d['firing'])}; undelivered: {d['undelivered']}"))
    return EXIT_OK
