"""When the refresh runs: an APScheduler (3.x) cron schedule in a time zone, plus a catch-up on start.

APScheduler's own ``misfire_grace_time`` covers a run that is late while the process is up (a busy
executor, a suspended VM); with ``coalesce`` several late runs collapse into one. It cannot know
about a run that was due while the process was *down*, because this scheduler keeps its jobs in
memory. So the last successful run is persisted (``<publish_root>/last_run.json``) and compared on
start with the latest scheduled fire time: if that fire time lies within the grace period and no
run succeeded since, the refresh runs at once (:func:`missed_run`, a pure function).
"""

from __future__ import annotations

import datetime as dt
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger

log = logging.getLogger("streamrec.refresh")


def make_trigger(schedule: str, timezone: str) -> CronTrigger:
    """A cron trigger; ValueError with the offending value on a bad expression or time zone."""
    try:
        tz = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"time zone {timezone!r} is unknown; use an IANA name such as 'UTC' or "
                         "'Europe/Berlin'") from None
    try:
        return CronTrigger.from_crontab(schedule, timezone=tz)
    except ValueError as exc:
        raise ValueError(f"schedule {schedule!r} is not a 5-field crontab expression "
                         f"('minute hour day month weekday', e.g. '0 3 * * *'): {exc}") from None


def fire_times_between(trigger: CronTrigger, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """Scheduled fire times t with start <= t <= end."""
    out = []
    t = trigger.get_next_fire_time(None, start)
    while t is not None and t <= end:
        out.append(t)
        t = trigger.get_next_fire_time(t, t + dt.timedelta(microseconds=1))
    return out


def missed_run(trigger: CronTrigger, now: dt.datetime, last_success: dt.datetime | None,
               grace_s: float) -> dt.datetime | None:
    """The fire time to catch up on at start, or None.

    That is the latest scheduled fire time within ``[now - grace_s, now]``, if no run succeeded at or
    after it. Fire times older than the grace period are not caught up (the next scheduled run will
    come); ``streamrec refresh --now`` runs one on demand.
    """
    due = fire_times_between(trigger, now - dt.timedelta(seconds=grace_s), now)
    if not due:
        return None
    latest = due[-1]
    if last_success is not None and last_success >= latest:
        return None
    return latest


def build_scheduler(job: Callable[[], Any], schedule: str, timezone: str, grace_s: int,
                    last_success: dt.datetime | None, now: dt.datetime | None = None) -> BlockingScheduler:
    """The scheduler (not started): ``job`` on the cron schedule, plus a one-off run now if one was missed.

    Runs never overlap (a run still going makes the next one skip, with a warning); late runs within
    ``grace_s`` still run and several late runs coalesce into one.
    """
    trigger = make_trigger(schedule, timezone)
    tz = ZoneInfo(timezone)
    sched = BlockingScheduler(timezone=tz)
    lock = threading.Lock()

    def guarded() -> None:
        if not lock.acquire(blocking=False):
            log.warning("a refresh is still running; skipping this one")
            return
        try:
            job()
        finally:
            lock.release()

    sched.add_job(guarded, trigger, id="refresh", name="cache refresh", misfire_grace_time=grace_s, coalesce=True,
                  max_instances=1)
    now = now or dt.datetime.now(tz)
    missed = missed_run(trigger, now, last_success, grace_s)
    if missed is not None:
        log.warning("the run due at %s was missed (no success since); running it now", missed.isoformat())
        sched.add_job(guarded, "date", run_date=now, id="refresh-missed", name="missed cache refresh",
                      misfire_grace_time=grace_s)
    log.info("refresh scheduled '%s' (%s); next run %s", schedule, timezone, trigger.get_next_fire_time(None, now))
    return sched


def run_forever(job: Callable[[], Any], schedule: str, timezone: str, grace_s: int,
                last_success: dt.datetime | None) -> None:
    """Run the scheduler of :func:`build_scheduler` in this (main) thread until SIGTERM/SIGINT.

    ``job`` handles its own failures (logs and alerts); an exception escaping it is logged by
    APScheduler and the schedule continues.
    """
    sched = build_scheduler(job, schedule, timezone, grace_s, last_success)

    def stop(signum: int, frame: Any) -> None:
        sched.shutdown(wait=False)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sched.start()
