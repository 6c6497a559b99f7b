"""When the refresh runs: an APScheduler (3.x) cron schedule in a time zone, plus a catch-up on start.

APScheduler's own ``misfire_grace_time`` covers a run that is late while the process is up (a busy
executor, a suspended VM); with ``coalesce`` several late runs collapse into one. It cannot know
about a run that was due while the process was *down*, because this scheduler keeps its jobs in
memory. So the last successful run is persisted (``<publish_root>/last_run.json``) and compared on
start with the latest scheduled fire time: if that fire time lies within the grace period and no
run succeeded since, nor ran since without publishing (failed, or held by a rollback pin: ``last_ran``,
``run_records.restore_last_success``), the refresh runs at once (:func:`missed_run`, a pure function).

A stop (SIGTERM/SIGINT) ends the schedule and waits for the run in progress, for at most :data:`STOP_GRACE_S`, so
that its alert is queued before the alerts are closed; a run still going then is abandoned with an error line, a
``refresh_failed`` alert (stage ``shutdown``) and exit :data:`EXIT_ABANDONED` (:func:`run_forever`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.events import EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers import SchedulerNotRunningError
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger

from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from stream.errors import ConfigError
from stream.secrets import redact
from stream.stop_signals import put_back_signals, take_stop_signals

log = logging.getLogger("streamrec.refresh")

# How long a stop (SIGTERM/SIGINT) waits for the refresh run in progress before abandoning it (run_forever). With the
# alert drain after it (close_timeout_s 10 s, + 0.5 s join grace) a stop takes at most ~25 s: within Kubernetes'
# default terminationGracePeriodSeconds and compose's stop_grace_period (30 s) with a margin (20 s + 10 s was the whole
# 30 s: a SIGKILL could cut the drain). A run builds for longer than this at scale: a stop during it is then abandoned,
# alerted and exits EXIT_ABANDONED.
STOP_GRACE_S = 14.0
EXIT_FAILED = 1  # streamrec.commands.common.EXIT_FAILED: the process edge's code for a failed run
EXIT_ABANDONED = EXIT_FAILED  # a run abandoned at a stop
# The longest the scheduler sleeps between looks at the wall clock (_WallClockScheduler)
WALL_CLOCK_LOOK_S = 60.0


_CRON_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # crontab's 0..6 (and 7: Sunday again)
_NUMERIC_DAYS = re.compile(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?")
# What APScheduler 3 reads of an item holding letters: a name or a range of names (month, weekday) and the day field's
# ``last``. Its patterns for them are not anchored at the end: it read ``mon-fri/2`` as ``mon-fri`` (every weekday,
# crontab: Mon, Wed, Fri), ``jan-jun/2`` as ``jan-jun``, ``mon#2`` as ``mon``, ``lastx`` as ``last``, in silence.
_NAME_RANGE = re.compile(r"[a-z]+(?:-[a-z]+)?", re.IGNORECASE)
_NAMED_ITEMS = {2: ("day of the month", re.compile(r"last", re.IGNORECASE), "write 'last' alone or numbers"),
                3: ("month", _NAME_RANGE, "write a step over numbers ('1-6/2' for jan,mar,may) or list the names"),
                4: ("weekday", _NAME_RANGE, "write a step over numbers ('1-5/2' for mon,wed,fri) or list the names")}


def _check_named_items(fields: list[str]) -> None:
    """ValueError for an item with letters that APScheduler 3 would read only the start of (:data:`_NAMED_ITEMS`)."""
    for i, (what, whole, fix) in _NAMED_ITEMS.items():
        for item in fields[i].split(",") if i < len(fields) else ():
            if whole.match(item) is not None and whole.fullmatch(item) is None:  # read as its start alone
                raise ValueError(f"{what} {item!r} has more after its name (a step, '#', other text), which this "
                                 f"scheduler would not read, running on other days than it says: {fix}")


def crontab_weekdays(field: str) -> str:
    """A crontab weekday field as APScheduler 3 reads it the same way: each numeric item (``0``, ``1-5``, ``*/2``,
    ``1-5/2``; 0 and 7 are Sunday) written as day names, which both count alike. APScheduler 3's numbers start at
    Monday (its issue 286): ``1-5`` ran Tuesday to Saturday, ``0`` on Mondays, ``7`` was refused. Items with names are
    left to APScheduler. ValueError for a number outside 0-7, a range running backwards, a step of 0."""
    if field == "*":
        return field
    out = []
    for item in field.split(","):
        m = _NUMERIC_DAYS.fullmatch(item)
        if m is None:
            out.append(item)
            continue
        star, first, last, step = m.groups()
        lo = 0 if star == "*" else int(first)
        hi = 6 if star == "*" or (last is None and step is not None) else int(last if last is not None else first)
        n = 1 if step is None else int(step)
        if not 0 <= lo <= hi <= 7 or n < 1:
            raise ValueError(f"weekday {item!r} is not one of crontab's 0-7 (0 and 7: Sunday), a range of them "
                             "running forwards, or such a range with a step of at least 1")
        out.append(",".join(_CRON_DAYS[d] for d in sorted({d % 7 for d in range(lo, hi + 1, n)})))
    return ",".join(out)


class CrontabTrigger(CronTrigger):
    """A ``CronTrigger`` that, as crontab (cronie, Vixie cron), fires a fixed-time job once on the night the clocks go
    back: when the minute and the hour fields both name fixed values (``30 2``, not ``*/15 2`` or ``30 *``), the second
    instant of a repeated wall time is no fire time. APScheduler fired ``30 2 * * *`` at 02:30 CEST and again at 02:30
    CET: two nightly refreshes. On the night the clocks go forward, such a job whose wall time is skipped fires once at
    the change (03:00 for ``30 2`` in Europe/Berlin), as crontab runs it "immediately" (APScheduler: 03:30). A wildcard
    job fires at every instant, as crontab's does."""

    __slots__ = ("fixed",)

    def get_next_fire_time(self, previous_fire_time: dt.datetime | None, now: dt.datetime) -> dt.datetime | None:
        t = super().get_next_fire_time(previous_fire_time, now)
        if t is not None and not getattr(self, "fixed", False) and _skipped(t):  # from _increment_field_value: the
            return t.astimezone(dt.timezone.utc).astimezone(self.timezone)  # same instant, as a wall time that exists
        while t is not None and getattr(self, "fixed", False):
            if _skipped(t):  # in the hour the clocks skip: crontab runs it once, at the change (APScheduler: 03:30)
                change = _gap_end(t)
                if change.astimezone(dt.timezone.utc) >= now.astimezone(dt.timezone.utc):
                    return change
            elif not _second_instant(t):
                return t
            t = super().get_next_fire_time(None, (t.astimezone(dt.timezone.utc) + dt.timedelta(microseconds=1))
                                           .astimezone(self.timezone))
        return t

    def _increment_field_value(self, dateval: dt.datetime, fieldnum: int) -> tuple[dt.datetime, int]:
        """APScheduler's step to the next value of a field, never past the wall time it steps to.

        APScheduler adds the wall-time difference to the UTC instant: across the clocks going forward that lands late
        in wall time (midnight "next day" from 00:00 CET on 2026-03-29 in Europe/Berlin was 01:00 CEST on the 30th), so
        a ``0 0 * * *`` job skipped the day after the change. The wall time it meant is taken instead (one the clocks
        skip, a change at midnight, is then handled as any skipped time); a landing earlier in wall time (the clocks
        went back: the repeated hour comes again) is kept, and the fields are checked again from it."""
        # the same step in UTC, which has no clock changes: the wall time meant (its fields are read as wall times)
        meant = super()._increment_field_value(dateval.replace(tzinfo=dt.timezone.utc), fieldnum)[0]
        stepped, fieldnum = super()._increment_field_value(dateval, fieldnum)
        if stepped.replace(tzinfo=None) > meant.replace(tzinfo=None):
            return meant.replace(tzinfo=self.timezone), fieldnum
        return stepped, fieldnum


def _skipped(t: dt.datetime) -> bool:
    """Whether ``t``'s wall time does not exist (the clocks went forward over it): read as an instant and back, it
    is another wall time."""
    return t.astimezone(dt.timezone.utc).astimezone(t.tzinfo).replace(tzinfo=None) != t.replace(tzinfo=None)


def _gap_end(t: dt.datetime) -> dt.datetime:
    """The instant the clocks went forward over ``t``'s (skipped) wall time: the first second with the offset after
    the change, found between ``t`` read with the offset after it (``fold=1``, the earlier instant) and before it."""
    utc = dt.timezone.utc
    lo, hi = int(t.replace(fold=1).astimezone(utc).timestamp()), int(t.replace(fold=0).astimezone(utc).timestamp())
    after = dt.datetime.fromtimestamp(hi, t.tzinfo).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if dt.datetime.fromtimestamp(mid, t.tzinfo).utcoffset() == after else (mid, hi)
    return dt.datetime.fromtimestamp(hi, t.tzinfo)


def _second_instant(t: dt.datetime) -> bool:
    """Whether ``t`` is the later of the two instants of a wall time that happens twice (the clocks went back)."""
    first, second = t.replace(fold=0), t.replace(fold=1)
    return first.astimezone(dt.timezone.utc) < second.astimezone(dt.timezone.utc) == t.astimezone(dt.timezone.utc)


def make_trigger(schedule: str, timezone: str) -> CronTrigger:
    """A cron trigger; ValueError with the offending value on a bad expression or time zone.

    The expression means what it means to crontab: the weekday field counts from Sunday (:func:`crontab_weekdays`),
    and one that restricts both the day of the month and the weekday is refused: crontab fires when either matches,
    APScheduler 3 only when both do (a day of the 1st that is a Monday, for ``0 3 1 * 1``); a fixed-time one fires once
    on the night the clocks go back (:class:`CrontabTrigger`)."""
    try:
        tz = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"time zone {timezone!r} is unknown; use an IANA name such as 'UTC' or "
                         "'Europe/Berlin'") from None
    fields = schedule.split()  # APScheduler refuses any other count than 5 below
    day, weekday = (fields[2], fields[4]) if len(fields) == 5 else ("*", "*")
    try:
        _check_named_items(fields)
        crontab = " ".join([*fields[:4], crontab_weekdays(weekday)]) if len(fields) == 5 else schedule
        trigger = CrontabTrigger.from_crontab(crontab, timezone=tz)
    except ValueError as exc:
        raise ValueError(f"schedule {schedule!r} is not a 5-field crontab expression "
                         f"('minute hour day month weekday', e.g. '0 3 * * *'): {exc}") from None
    trigger.fixed = len(fields) == 5 and not fields[0].startswith("*") and not fields[1].startswith("*")
    if not day.startswith("*") and not weekday.startswith("*"):
        raise ValueError(f"schedule {schedule!r} restricts both the day of the month ({day!r}) and the weekday "
                         f"({weekday!r}): crontab runs on the days either matches, this scheduler only on days both "
                         "match; restrict one of them (the weekday alone, e.g. '0 3 * * 1', or the days of the month "
                         "alone)")
    if trigger.get_next_fire_time(None, dt.datetime.now(tz)) is None:  # e.g. '0 3 30 2 *' (February 30th)
        raise ValueError(f"schedule {schedule!r} never fires (no such date); the scheduler would idle for ever")
    return trigger


def check_schedule(schedule: str, timezone: str) -> None:
    """ConfigError (a usage error, exit 2) naming the bad schedule or time zone; checked when the scheduler is
    started, never for ``--now``, ``--rollback`` or ``--status``, which do not use them."""
    try:
        make_trigger(schedule, timezone)
    except ValueError as exc:
        raise ConfigError(f"[refresh] {exc}") from None


def fire_times_between(trigger: CronTrigger, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """Scheduled fire times t with start <= t <= end (compared as instants).

    The walk steps in UTC: on the night the clocks go back, a local wall time plus 1 µs can be an hour
    *earlier* (the second 02:30 is ``fold=1``; 02:30:00.000001 is ``fold=0``), and the trigger would return
    the same fire time for ever. Every step is also checked to be strictly later than the one before.
    """
    utc = dt.timezone.utc
    start_utc, end_utc = start.astimezone(utc), end.astimezone(utc)
    out: list[dt.datetime] = []
    t = trigger.get_next_fire_time(None, start_utc.astimezone(trigger.timezone))
    while t is not None and t.astimezone(utc) <= end_utc:
        out.append(t)
        step = t.astimezone(utc) + dt.timedelta(microseconds=1)
        nxt = trigger.get_next_fire_time(t, step.astimezone(trigger.timezone))
        if nxt is not None and nxt.astimezone(utc) <= t.astimezone(utc):
            raise RuntimeError(f"the schedule's trigger went back from {t.isoformat()} to {nxt.isoformat()}")
        t = nxt
    return out


def missed_run(trigger: CronTrigger, now: dt.datetime, last_success: dt.datetime | None,
               grace_s: float) -> dt.datetime | None:
    """The fire time to catch up on at start, or None.

    That is the latest scheduled fire time within ``[now - grace_s, now]``, if no run succeeded at or
    after it. Fire times older than the grace period are not caught up (the next scheduled run will
    come); ``streamrec refresh --now`` runs one on demand.
    """
    now = now.astimezone(dt.timezone.utc)  # elapsed-time arithmetic: local wall times jump at DST changes
    # never before 1970 (a grace of 10**11 s was an OverflowError at start)
    start = now - dt.timedelta(seconds=min(grace_s, max(0.0, now.timestamp())))
    # The latest fire time only: windows back from now, doubling, until one holds a fire time. Listing every fire time
    # of the grace held the start for seconds (a per-minute schedule, a grace of a year); the window that finds one
    # holds few (the half after it held none).
    window = dt.timedelta(minutes=1)
    while True:
        due = fire_times_between(trigger, max(start, now - window), now)
        if due or now - window <= start:
            break
        window *= 2
    if not due:
        return None
    latest = due[-1]
    if last_success is not None and last_success >= latest:
        return None
    return latest


class _WallClockScheduler(BlockingScheduler):
    """APScheduler 3's BlockingScheduler, looking at the wall clock at least every :data:`WALL_CLOCK_LOOK_S`.

    APScheduler sleeps (a monotonic wait) until the next fire time as the wall clock gave it when it went to sleep: a
    clock stepped forward meanwhile (NTP correcting a drifted VM, a host resumed with its clock set) woke it that much
    after the fire time by the new clock, and the night's run was dropped as missed when that was more than
    ``misfire_grace_s``, although the step had passed the fire time by less (01:00 stepped to 03:30: woken at 05:30,
    2.5 h late). Now the run is due within a look of the step, late by what the step passed it by."""

    def _process_jobs(self) -> float | None:
        wait = super()._process_jobs()
        return WALL_CLOCK_LOOK_S if wait is None else min(wait, WALL_CLOCK_LOOK_S)


def build_scheduler(job: Callable[[], Any], schedule: str, timezone: str, grace_s: int,
                    last_success: dt.datetime | None, now: dt.datetime | None = None,
                    on_skip: Callable[[str, str], Any] | None = None, guard: threading.Lock | None = None,
                    stopping: threading.Event | None = None) -> BlockingScheduler:
    """The scheduler (not started): ``job`` on the cron schedule, plus a one-off run now if one was missed.

    Runs never overlap: a run due while the previous one is still going is skipped, in one place (the guard below;
    APScheduler's ``max_instances`` is 2 so that it never skips a run itself, silently but for a log line), and
    ``on_skip(why, "scheduler")`` reports it (``streamrec refresh``: ``job.skipped``, counted and a warning alert).
    Late runs within ``grace_s`` still run and several late runs coalesce into one; a run later than that (the machine
    asleep past it) does not run, and is reported through ``on_skip(why, "missed")``, never only in APScheduler's log:
    a stage of its own (it was ``scheduler``, so the metric and the alert told a machine asleep from a run lasting
    longer than the schedule's period by the message alone).

    ``guard``: the lock a run holds while it runs (:func:`run_forever` waits on it at shutdown); ``stopping``: once
    set, a run due then does not start (logged, not reported as a skip: the process is stopping).
    """
    trigger = make_trigger(schedule, timezone)
    tz = ZoneInfo(timezone)
    sched = _WallClockScheduler(timezone=tz)
    lock = guard or threading.Lock()
    stop = stopping or threading.Event()

    def guarded() -> None:
        if stop.is_set():  # checked again under the lock: run_forever sets it before it waits on the lock
            log.info("the scheduler is stopping; the run due now does not start")
            return
        if not lock.acquire(blocking=False):
            if stop.is_set():  # run_forever holds the lock: it has waited for the last run
                log.info("the scheduler is stopping; the run due now does not start")
                return
            why = "this scheduler's previous refresh is still running; the run due now is skipped"
            if on_skip is None:
                log.warning("%s", why)
            else:
                on_skip(why, "scheduler")
            return
        try:
            if stop.is_set():
                log.info("the scheduler is stopping; the run due now does not start")
                return
            job()
        finally:
            lock.release()

    sched.add_job(guarded, trigger, id="refresh", name="cache refresh", misfire_grace_time=grace_s, coalesce=True,
                  max_instances=2)  # the second instance meets the guard: skipped and reported, not just logged

    def report_missed(event: JobExecutionEvent) -> None:
        # APScheduler drops a run whose fire time passed more than grace_s ago while this process was up (the machine
        # asleep, a suspended VM, the clock moved forward) with a log line of its own, and nothing else: reported here
        # like the guard's skip, with how to refresh now (several missed fire times coalesce into one report)
        when = event.scheduled_run_time
        upcoming = trigger.get_next_fire_time(None, dt.datetime.now(tz))
        why = (f"the run due at {when.isoformat() if when else 'an earlier time'} was missed by more than "
               f"misfire_grace_s ({grace_s} s): this process was held up then (the machine asleep, a suspended VM, "
               f"the clock moved forward); the next run is at {upcoming.isoformat() if upcoming else 'never'}, run "
               "`streamrec refresh --now` to refresh before it")
        if on_skip is None:
            log.warning("%s", why)
        else:
            on_skip(why, "missed")

    sched.add_listener(report_missed, EVENT_JOB_MISSED)
    now = now or dt.datetime.now(tz)
    missed = missed_run(trigger, now, last_success, grace_s)
    if missed is not None:
        log.warning("the run due at %s was missed (no run since); running it now", missed.isoformat())
        sched.add_job(guarded, "date", run_date=now, id="refresh-missed", name="missed cache refresh",
                      misfire_grace_time=grace_s)
    log.info("refresh scheduled '%s' (%s); next run %s", schedule, timezone, trigger.get_next_fire_time(None, now))
    return sched


def run_forever(job: Callable[[], Any], schedule: str, timezone: str, grace_s: int,
                last_success: dt.datetime | None, on_skip: Callable[[str, str], Any] | None = None,
                alerts: RefreshAlerts | None = None, stop_grace_s: float = STOP_GRACE_S,
                hard_exit: Callable[[int], Any] = os._exit,
                where: Callable[[], tuple[str | None, str | None]] | None = None) -> int:
    """Run the scheduler of :func:`build_scheduler` (on a thread of its own) until SIGTERM/SIGINT to this (main)
    thread.

    ``job`` handles its own failures (logs and alerts); an exception escaping it is logged by
    APScheduler and the schedule continues. The scheduler's own thread dying (an exception in APScheduler's loop)
    ends it as a failure: an error line, a ``refresh_failed`` alert at stage ``scheduler``, returns :data:`EXIT_FAILED`
    (it returned as after a stop, and the process exited 0, never to refresh again), also when a signal came in the
    same look (the death wins). A run in progress then is waited for as at a stop (a signal more ends the wait); one
    abandoned is that alert, saying the thread died (its exception) and the run's stage, not a signal, and exits
    :data:`EXIT_ABANDONED`. Returns 0 after a stop, also when the thread raises once the stop has begun the
    scheduler's shutdown (APScheduler failing in it): that is a warning, not a death.

    Stopping: the signal stops the schedule (no run starts after it), and this returns once a run in progress has
    finished, so that its own alert (failed, pinned, degraded) is queued on ``alerts`` before the caller closes them.
    Before, it returned at once and ``streamrec refresh`` closed the alert queue under the run: the run's alert was
    dropped as "closed", only logged. The wait is bounded by ``stop_grace_s`` (:data:`STOP_GRACE_S`); a second
    signal ends it at once. A run still going then is abandoned: an error line, a ``refresh_failed`` alert at stage
    ``shutdown`` saying so, ``alerts`` closed (drained for its ``close_timeout_s``), and the process exits with
    :data:`EXIT_ABANDONED` through ``hard_exit`` (``os._exit``: the run's worker thread is no daemon, an ordinary exit
    would wait for it, unbounded). Before it returns ``alerts`` are closed, drained for their ``close_timeout_s``
    under this function's handlers: a further signal ends the drain with a log line (it was a KeyboardInterrupt
    traceback once the default handlers were back). Abandoning is safe for the publish root: a publish is atomic and
    the next run removes what this one left (``publish.clean_leftovers``). ``where`` (``job.RunProgress.where``): the
    stage the run is in and the last error it saw (a Redis retry's), named in that alert (and its ``run_stage`` label).
    """
    guard, stopping = threading.Lock(), threading.Event()
    sched = build_scheduler(job, schedule, timezone, grace_s, last_success, on_skip=on_skip, guard=guard,
                            stopping=stopping)
    signals: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        # only noted here: the handler runs in this thread wherever it was, and a lock taken here (the executor's in
        # sched.shutdown, an Event's) may be the one this thread held when the signal came: a deadlock
        signals.append(signum)

    previous: dict[int, Any] = {}
    take_stop_signals(previous, stop)
    died: list[str] = []
    try:
        def scheduling() -> None:
            try:
                sched.start()
            except JobLookupError as exc:  # APScheduler 3 races its shutdown from another thread: a pass over the due
                if not stopping.is_set():  # jobs in progress then finds its one-off job (the catch-up run) gone
                    died.append(f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - reported by run_forever: an alert and a failed exit
                if stopping.is_set():  # raised by the shutdown of a stop: the stop is the outcome (exit 0)
                    log.warning("the refresh scheduler failed in its shutdown after the stop (%s: %s)",
                                type(exc).__name__, exc, exc_info=True)
                    return
                log.error("the refresh scheduler's thread died", exc_info=True)
                died.append(f"{type(exc).__name__}: {exc}")

        loop = threading.Thread(target=scheduling, name="refresh-scheduler", daemon=True)
        loop.start()
        while not signals and loop.is_alive():
            time.sleep(0.2)  # a signal interrupts it (the handler runs); the loop sees it within 0.2 s
        stopping.set()  # no run starts from here on
        while loop.is_alive():  # (a signal can come before start() has set the scheduler running)
            if sched.running:
                with contextlib.suppress(SchedulerNotRunningError):
                    sched.shutdown(wait=False)
            loop.join(0.2)
        with contextlib.suppress(SchedulerNotRunningError):  # its thread died: the executor's workers outlived it
            sched.shutdown(wait=False)
        if not signals and not died:  # start() returned by itself
            died.append("the scheduler stopped without a stop signal")
        # The thread's death wins over a signal seen in the same look (both within the 0.2 s above): it was a stop,
        # exit 0 and no alert, the death only in APScheduler's log line
        _wait_for_run(guard, signals, stop_grace_s, alerts, hard_exit, where, died=died[0] if died else None)
        if not died:
            return 0
        message = (f"the refresh scheduler's thread died ({redact(died[0])[:500]}): no refresh runs from this process "
                   "any more; it exits so that its supervisor restarts it (a run missed meanwhile runs on start within "
                   "misfire_grace_s). Run `streamrec refresh --now` to refresh before")
        log.error("%s (exit %d)", message, EXIT_FAILED)
        if alerts is not None:
            alerts.fire("scheduler", message, FAILED_RULE)
        return EXIT_FAILED
    finally:
        if alerts is not None:  # drained under this handler: a signal more ends the drain (a traceback, before)
            _drain(alerts, signals)
        put_back_signals(previous)


def _drain(alerts: RefreshAlerts, signals: list[int]) -> int:
    """``alerts.close()`` at shutdown, ended early by a stop signal beyond those that came before it."""
    seen = len(signals)
    return alerts.close(abort=lambda: signal.Signals(signals[seen]).name if len(signals) > seen else None)


def _wait_for_run(guard: threading.Lock, signals: list[int], stop_grace_s: float,
                  alerts: RefreshAlerts | None, hard_exit: Callable[[int], Any],
                  where: Callable[[], tuple[str | None, str | None]] | None = None, died: str | None = None) -> None:
    """At shutdown: wait up to ``stop_grace_s`` for the run in progress (the holder of ``guard``); abandon it after
    (:func:`run_forever`). Returns holding ``guard``: no run starts after this. A second signal ends the wait.
    ``died``: the shutdown is the scheduler's thread dying of that exception, whether or not a signal came with it
    (the first signal ends the wait, or the second when one came with the death; the abandonment says the thread died
    and is alerted at stage ``scheduler``)."""
    before = 1 if signals else 0  # the stop (or the signal that came with the death); one more ends the wait

    def again() -> bool:
        return len(signals) > before

    if guard.acquire(blocking=False):
        log.info("refresh scheduler stopped (no run in progress)")
        return
    log.warning("%s: waiting up to %g s (the stop grace) for the refresh run in progress to finish; a%s SIGTERM/SIGINT "
                "stops at once", "the scheduler's thread died" if died else "stopping", stop_grace_s,
                " second" if before else "")
    deadline = time.monotonic() + stop_grace_s
    while not again():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if guard.acquire(timeout=min(left, 0.2)):  # in slices: a second signal is seen within 0.2 s
            log.info("refresh scheduler stopped after the run in progress finished")
            return
    why = (("a second stop signal came" if before else "a stop signal came") if again() else
           f"it did not finish within the stop grace of {stop_grace_s:g} s")
    stage, error = where() if where is not None else (None, None)
    at = (f" at stage {stage} (last error it saw: {redact(error)[:500] if error else 'none'})" if stage else "")
    cause = (f"the refresh scheduler's thread died ({redact(died)[:500]})" if died else
             "the refresh scheduler was stopped (SIGTERM/SIGINT)")
    message = (f"{cause} during a refresh run{at} and {why}: the run is abandoned and the process exits without it"
               f"{' (for its supervisor to restart it)' if died else ''}. A publish is atomic: CURRENT names the "
               "previous version or the new one (`streamrec refresh --status`); the run's own outcome alert is not "
               "sent unless it had failed already (a refresh_failed alert of its stage, before this one). Run "
               "`streamrec refresh --now` to refresh before the next scheduled run")
    log.error("%s (exit %d)", message, EXIT_ABANDONED)
    if alerts is not None:
        alerts.fire("scheduler" if died else "shutdown", message, FAILED_RULE,
                    labels={"run_stage": stage} if stage else None)
        _drain(alerts, signals)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        sys.stdout.flush()
    hard_exit(EXIT_ABANDONED)
