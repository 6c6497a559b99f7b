"""The text ``streamrec monitor --help`` (and ``streamrec report --follow``) shows, the exit statuses of
``--once`` and the way alerts and the report write a time: kept apart from ``rules.py`` and ``engine.py`` so that
building the command line's parser imports none of the monitor (0.1 s per command)."""

from __future__ import annotations

import datetime as dt

# ``streamrec monitor --once``: its exit status, for a health check that cannot read the printed states.
ONCE_OK = 0  # every source scraped and no rule's condition holds
ONCE_SCRAPE_FAILED = 1  # a source could not be scraped: its rules show no data, so nothing can be told
ONCE_CONDITION_HOLDS = 3  # every source scraped and some rule's condition holds (pending or firing)
ONCE_EXIT_HELP = (f"exit status: {ONCE_OK} every source scraped and no rule's condition holds; {ONCE_SCRAPE_FAILED} a "
                  f"scrape failed (a dead source gives its rules no data); 2 a usage or settings error; "
                  f"{ONCE_CONDITION_HOLDS} a rule's condition holds now (pending or firing: one evaluation cannot "
                  "wait for_s); every rule's state is printed in each case")

# ``streamrec report --follow``: how much of the end of the run log its first pass reads (a run log holds up to
# [run_log] max_bytes, 64 MiB by default, of days of records: read whole, it was all parsed before the first line)
FOLLOW_TAIL_BYTES = 1 << 20
FOLLOW_HELP = (f"print progress of SOURCE from the run log while --pid lives: like tail -f, it starts from the last "
               f"{FOLLOW_TAIL_BYTES >> 20} MiB of the run log, then follows what is appended (exit 1 if --pid is not "
               "running at the start, or the run log never appeared while it ran)")

RULES_HELP = """\
rules file (TOML):
  interval_s = 15                       # seconds between evaluations (default 15)
  scrape_timeout_s = 5                  # per source, in total (default 5)
  scrape_error_hold_s = 60              # a series whose source fails to scrape keeps its state this long
  sample_max_age_s = 300                # a sample with a timestamp older than this is no data (default 300)
  state_path = "monitor-state.json"     # optional: what is firing, kept over a restart
  history_max_series = 2000             # label sets per metric kept for rate() & co (more: counted, logged)
  [sources]                             # Prometheus /metrics endpoints, by name
  learner = "http://127.0.0.1:9102/metrics"
  [sinks]
  log = true                            # one log line per alert on stderr
  kafka_topic = "alerts"                # optional; key = rule name, value = alert JSON
  webhook_url = "http://host/hook"      # optional; POST each alert as JSON
  webhook_timeout_s = 5                 # one POST, connect to answer, in total (kafka_timeout_s = 10)
  queue_size = 1000                     # alerts waiting per sink; beyond it superseded, then oldest dropped
  queue_max_bytes = 67108864            # the bytes they may hold (default 64 MiB), the same
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
  keep_firing_for_s = 300               # optional: resolve only after not holding this long (flapping)

expressions: metric names, label selectors {l="v", l!="v", l=~"re", l!~"re"}, numbers, + - * /,
  parentheses, sum/max/min/avg/count [by (l, ...)] (expr), rate/increase/delta(metric[60s]), abs(expr).
  e.g. streamrec_learner_warm_auc - streamrec_learner_cold_auc
       max by (field) (streamrec_learner_bucket_share)
       rate(streamrec_learner_nan_losses_total[60s])
  A regex with a repeat inside a repeat, (a+)+b, is refused (exponential time in Python's re): write a+b.
  Vectors combine series with equal labels. A metric no source exports is "no data" (never fires).
  NaN compares false with every op; use op = "isnan" to alert on NaN.

alerts (JSON, same on every sink): {"rule", "source", "severity", "state": "firing"|"resolved",
  "value", "threshold", "message", "ts" (ms), "labels", "kind": "series"|"absent", "fingerprint"}.
  One "firing" when a condition has held for for_s, one "resolved" when it stops holding, with the
  same "fingerprint" (the alert's identity: group by it, not by rule and labels). Each sink has its
  own queue and thread: a dead or slow sink never delays evaluation or the other sinks; failed
  deliveries are retried with backoff.

examples:
  streamrec monitor --once                      # default rules, evaluate once, print rule states
  streamrec monitor --rules my-rules.toml --check
  streamrec monitor --source learner=http://learner:9102/metrics --metrics-port 9104
"""


def utc_text(t: float) -> str:
    """Unix seconds as the page and the alerts' text show a time: ``2026-12-06 13:23:16 UTC``."""
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
