"""``streamrec monitor``: evaluate alert rules continuously and send firing/resolved alerts."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from monitor.cli_text import ONCE_EXIT_HELP, RULES_HELP
from streamrec.commands.common import add_common, add_kafka_flag, seconds, setup_logging, tcp_port


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "monitor", help="evaluate alert rules on Prometheus metrics; send alerts to log, Kafka, webhook",
        description="Scrape the Prometheus endpoints named in an alert rules file every interval, evaluate "
        "each rule, and send a 'firing' alert when its condition has held for for_s seconds and a 'resolved' "
        "alert when it stops holding, to the log, a Kafka topic and/or a webhook. Without --rules it uses the "
        "packaged default rules (cold-start bucket share, cold-user AUC gap, NaN losses, learner lag; the same "
        "file as compose/alert-rules.toml). Runs until SIGTERM/SIGINT; --once evaluates once, prints every "
        "rule's state and sends nothing. A rules file with a mistake is an error naming the rule and field "
        f"(exit 2). --once's {ONCE_EXIT_HELP}.",
        epilog=RULES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", metavar="FILE", help="alert rules file (default: the packaged default rules)")
    p.add_argument("--once", action="store_true", help="evaluate once, print the rule states, send nothing, "
                   "exit (rate/increase/delta need two scrapes, so they show no data here); exit 0 all clear, 1 a "
                   "scrape failed, 3 a rule's condition holds")
    p.add_argument("--check", action="store_true", help="only validate the rules file and the settings the monitor "
                   "would use (--config, STREAMREC_KAFKA_*), and print its rules")
    p.add_argument("--interval", type=seconds, metavar="SECONDS", help="seconds between evaluations, "
                   "at least 0.1 (default: interval_s of the rules file)")
    p.add_argument("--state-path", metavar="FILE", help="keep the firing alerts in FILE over a restart (resolved if "
                   "they cleared meanwhile, sent again if they still hold); replaces state_path of the rules file "
                   "(default: the file's, else none)")
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
    from monitor.http_deadline import check_http_url
    from streamrec.settings import SettingsError

    sources = dict(config.sources)
    for flag in flags:  # checked as [sources] URLs are: a port out of range or no host is exit 2, not failed scrapes
        name, sep, url = flag.partition("=")
        if not sep or not name or check_http_url(url):
            raise SettingsError(f"--source {flag!r}: expected NAME=URL with an http:// or https:// URL, "
                                f"e.g. learner=http://127.0.0.1:9102/metrics ({check_http_url(url) or 'no NAME='})")
        sources[name] = url
    return dataclasses.replace(config, sources=sources)


def cmd_monitor(args: argparse.Namespace) -> int:
    from monitor.engine import Monitor, evaluate_once, once_text
    from monitor.rules import load_rules
    from streamrec.commands.common import EXIT_OK, emit, kafka_settings, sources, start_metrics

    config = _with_sources(load_rules(args.rules), args.source)
    config = dataclasses.replace(config, interval_s=args.interval or config.interval_s,  # floor: RulesConfig
                                 state_path=Path(args.state_path) if args.state_path else config.state_path)
    src = sources(args)  # in every mode: --check and --once stop on what the daemon would stop on (exit 2)
    kafka = kafka_settings(args, src) if config.sinks.kafka_topic else None
    setup_logging(args.log_level)
    if args.check:
        summary = {"rules_file": config.origin, "sources": dict(config.sources),
                   "sinks": dataclasses.asdict(config.sinks), "interval_s": config.interval_s,
                   "state_path": str(config.state_path) if config.state_path is not None else None,
                   "rules": [{"name": r.name, "condition": r.condition, "for_s": r.for_s,
                              "severity": r.severity.value} for r in config.rules]}
        emit(args, summary, lambda d: f"{d['rules_file']}: {len(d['rules'])} rule(s) OK\n" + "\n".join(
            f"  {r['severity']:<8} {r['name']}: {r['condition']} for {r['for_s']:g}s" for r in d["rules"]))
        return EXIT_OK
    if args.once:
        summary, status = evaluate_once(config)
        emit(args, summary, once_text)
        return status

    from monitor.delivery import build_sinks

    if args.metrics_port is not None:  # before the sinks start their threads: a failed bind leaves none running
        start_metrics(args.metrics_port, args.metrics_host, "--metrics-port / --metrics-host")
    sink = build_sinks(config.sinks, kafka)
    try:
        monitor = Monitor(config, sink)
    except BaseException:  # a run log that cannot be opened, say: stop the sinks' workers, then report it
        sink.close(0)
        raise
    where = ", ".join(n.name for n in sink.sinks) or "no sink"
    print(f"monitoring {len(config.rules)} rule(s) from {config.origin} every {config.interval_s:g}s, "
          f"alerts to {where}" + (f" (topic {config.sinks.kafka_topic} at {kafka.bootstrap_servers})" if kafka
                                  else ""), file=sys.stderr)
    undelivered = monitor.run_until_signalled()  # then drains the sink queues for at most close_timeout_s
    summary = monitor.summary()
    summary["sink_failures"] = dict(sink.failures)
    summary["undelivered"] = undelivered
    emit(args, summary, lambda d: (f"monitor stopped after {d['evaluations']} evaluation(s): "
                                   f"{d['alerts']['firing']} firing, {d['alerts']['resolved']} resolved alert(s) "
                                   f"sent; still firing: {len(d['firing'])}; undelivered: {d['undelivered']}"))
    return EXIT_OK
