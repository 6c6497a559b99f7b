"""``streamrec report``: an HTML report with plots of what a run recorded (``monitor/report.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from monitor.cli_text import FOLLOW_HELP
from streamrec.commands.common import EXIT_OK, add_common, default_help, emit, sources


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="an HTML report with plots of what a run recorded (monitor run log, summaries)",
                       description="Write one self-contained HTML file (PNG plots embedded) of what the running "
                       "system recorded: the monitor's run log ([run_log] path in its rules file: every scrape of "
                       "the stages' /metrics, rule states, alerts) plus the --json summaries of replay, join, train "
                       "and refresh, the publish root's last_run.json and the learner's delta files. Sections: served "
                       "quality, cold vs warm users, throughput, lag, gradient norms, feature coverage, memory, hot "
                       "set and hit rate, freshness, dead letters, alerts; one not recorded says so. --follow prints "
                       "a progress line per scrape of one source instead (make demo uses it).")
    p.add_argument("--run-dir", metavar="DIR", help="a make demo run: DIR/run-log.jsonl, DIR/*.json summaries, "
                   "DIR/serving (publish root), DIR/deltas; the report goes to DIR/report.html")
    p.add_argument("--run-log", metavar="FILE", help="the monitor's run log (its rotated FILE.1 ... are read too)")
    p.add_argument("--summary", action="extend", nargs="+", default=[], metavar="FILE",
                   help="stages' --json summaries (replay, join, train, refresh, monitor; repeatable)")
    p.add_argument("--publish-root", metavar="DIR", help="refresh's publish root, for last_run.json (DIR/serving with "
                   f"--run-dir, else {default_help(RefreshSettings, 'refresh', 'publish_root')})")
    p.add_argument("--deltas-dir", metavar="DIR", help="the learner's deltas directory (DIR/deltas with --run-dir, "
                   f"else {default_help(LearnerSettings, 'learner', 'deltas_dir')})")
    p.add_argument("--out", metavar="FILE", help="the HTML file to write (default report.html, or in --run-dir)")
    p.add_argument("--follow", metavar="SOURCE", help=FOLLOW_HELP)
    p.add_argument("--pid", type=int, help="with --follow: stop when this process has ended (default: never)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cache_refresh import run_records  # (here, as monitor: run_records reads artifacts, which import torch)
    from monitor import follow, recording, report, sections
    from streamrec.settings import SettingsError

    src = sources(args)  # the publish root and deltas directory the refresh and the learner use, unless flags say
    refresh = src.build(RefreshSettings, "refresh", publish_root=args.publish_root)
    learner = src.build(LearnerSettings, "learner", deltas_dir=args.deltas_dir)
    d = Path(args.run_dir) if args.run_dir else None
    log = args.run_log or (str(d / "run-log.jsonl") if d else None)
    if log is None:
        raise SettingsError("give --run-log FILE or --run-dir DIR")
    if args.follow:
        follow.follow_process(log, args.follow, args.pid, sys.stderr)
        return EXIT_OK
    summaries = args.summary or ([str(p) for p in sorted(d.glob("*.json"))] if d else [])
    root = args.publish_root or (d / "serving" if d else refresh.publish_root)
    try:
        inp = sections.Inputs(report.read_run_log(log), recording.read_summaries(summaries),
                            recording.usable_last_run(run_records.read_last_run(Path(root))),
                            recording.read_deltas(args.deltas_dir or (d / "deltas" if d else learner.deltas_dir)))
        out = Path(args.out or (d / "report.html" if d else "report.html"))
        made = report.write_report(inp, out)
    except (recording.ReportError, OSError) as exc:
        raise SettingsError(str(exc)) from None
    emit(args, {"report": str(out), "served": sections.served_quality(inp.summaries),
                "sections": {s.id: {"points": s.points, "missing": s.missing} for s in made}},
         lambda r: f"report: {r['report']}\n" + _served(r["served"]) + "\n".join(
             f"  {k}: {v['points']:,} points" + (f" ({'; '.join(v['missing'])})" if v["missing"] else "")
             for k, v in r["sections"].items()))
    return EXIT_OK


def _served(sv: dict[str, Any] | None) -> str:
    if not sv or not sv.get("impressions"):
        return "served quality: not in the train summary\n"
    from monitor.sections import fmt_num as f

    return (f"served quality ({sv['impressions']:,} impressions, first predictions vs final labels): "
            f"AUC {f(sv.get('auc'))}  NE {f(sv.get('ne'))}  logloss {f(sv.get('logloss'))}\n")

