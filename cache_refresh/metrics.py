"""Prometheus metrics of the refresh job: each run's outcome, duration and hot set, and the last success.

Set by :func:`cache_refresh.job.run_once` (every run: the schedule's and ``--now``'s); served while the scheduler
runs with ``[refresh] metrics_port`` (``cache_refresh.scheduler.run_forever``). A one-shot ``--now`` exits with its
summary and exit code instead.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge

log = logging.getLogger("streamrec.refresh")

RUNS = Counter("streamrec_refresh_runs_total", "Refresh runs by outcome: published, held (validated, not published "
               "over a rollback pin), skipped (did nothing because another run was going: stage lock, another "
               "process's run held the publish root; stage scheduler, this scheduler's previous run had not ended; "
               "stage missed, its fire time passed more than misfire_grace_s ago, the machine asleep) or failed (by "
               "stage; published nothing, the live artifact kept serving).",
               ["outcome", "stage"])
DEGRADED = Counter("streamrec_refresh_degraded_total", "Warnings of runs that published (each also a "
                   "refresh_degraded alert), by stage: the quality gate skipped, newer checkpoints skipped, an empty "
                   "hot set, or a step after the switch that failed (record, embedding_store, notify, ...).",
                   ["stage"])
LINEAGE_SWITCHED = Counter("streamrec_refresh_lineage_switched_total", "Publishes that replaced the live version with "
                           "a model of another training run (the checkpoint's lineage differs from the live "
                           "version's; each also a refresh_lineage_switched alert): a learner started afresh, e.g. "
                           "pointed at an empty checkpoint_dir.")
LAST_SUCCESS = Gauge("streamrec_refresh_last_success_timestamp_seconds", "Unix time the last refresh published an "
                     "artifact, by this process or as recorded in the publish root's last_run.json, else (no usable "
                     "last_run.json) when the live version was published (0: nothing live). Its age is how stale the "
                     "serving model is.")
LAST_RUN = Gauge("streamrec_refresh_last_run_timestamp_seconds", "Unix time the last refresh run ended, whatever its "
                 "outcome.")
DURATION = Gauge("streamrec_refresh_duration_seconds", "How long the last refresh run took (s).")
HOT_ROWS = Gauge("streamrec_refresh_hot_rows", "Rows of the last published artifact's hot set (in the scorer's "
                 "memory; the rest is read from the cold rows).")
HOT_SHARE = Gauge("streamrec_refresh_hot_share_of_table", "Share of the embedding table's rows that the last "
                  "published artifact holds hot.")


_last_success = 0.0  # what LAST_SUCCESS holds: it only moves forward, unless it is in the future
# (cache_refresh.run_records.MAX_CLOCK_SKEW_S is this: a recorded time further ahead than it is not trusted)
MAX_CLOCK_SKEW_S = 300.0


def _set_last_success(when: float) -> None:
    """Move the gauge forward to ``when``; or back to it, with a warning, when what it holds is more than
    :data:`MAX_CLOCK_SKEW_S` ahead of this host's clock (a publish while the clock was ahead, corrected since) and
    ``when`` is not. Before, it only moved forward: it stayed at the time from the future, and the staleness alert on
    it silent, until the clock caught up, through every publish and failed run in between."""
    global _last_success
    now = time.time()
    ahead = _last_success > now + MAX_CLOCK_SKEW_S
    if when > _last_success or (ahead and when <= now + MAX_CLOCK_SKEW_S):
        if ahead and when < _last_success:
            log.warning("the last refresh success held, %s, is in the future (more than %g s ahead of this host's "
                        "clock: it was set while the clock was ahead); not trusted, replaced by %s",
                        _utc(_last_success), MAX_CLOCK_SKEW_S, _utc(when))
        _last_success = when
        LAST_SUCCESS.set(when)


def _utc(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return f"{t!r} (epoch seconds)"


def restore_last_success(when: float) -> None:
    """The last success on record (``last_run.json``, else the live version's publish time:
    ``cache_refresh.run_records.restore_last_success``), read when the scheduler or a run starts: a restarted scheduler
    otherwise said 0 until its next publish (the dashboard's "time since last success" read ~56 years), and a run
    published by another process (``--now``) is seen. Moves the gauge back only from a time in the future
    (:func:`_set_last_success`)."""
    _set_last_success(when)


def skipped(stage: str) -> None:
    """A run that did nothing because another was going (``stage``: ``lock`` or ``scheduler``). Not a run that ended:
    the last-run time and duration stay the other run's."""
    RUNS.labels("skipped", stage).inc()


def observe(summary: dict[str, Any] | None, seconds: float, failed_stage: str | None = None) -> None:
    """Record one run: its summary (None when it failed at ``failed_stage``) and how long it took."""
    now = time.time()
    LAST_RUN.set(now)
    DURATION.set(seconds)
    if summary is None:
        RUNS.labels("failed", failed_stage or "unknown").inc()
        return
    if not summary.get("published"):
        RUNS.labels("held", "publish").inc()
        return
    RUNS.labels("published", "").inc()
    _set_last_success(now)
    hot = summary.get("hot_set") or {}
    if isinstance(hot.get("rows"), (int, float)):
        HOT_ROWS.set(hot["rows"])
    if isinstance(hot.get("share_of_table"), (int, float)):
        HOT_SHARE.set(hot["share_of_table"])
