"""A wall clock stepped forward while the scheduler sleeps (NTP correcting a drifted VM) past the fire time by less
than ``misfire_grace_s``: the night's run still runs (``scheduler._WallClockScheduler``). APScheduler slept a monotonic
wait computed from the clock before the step, woke that much after the fire time by the new clock and dropped the run
as missed: 01:00 stepped to 03:30 woke it at 05:30, 2.5 h past a 03:00 fire time with a grace of 1 h."""

from __future__ import annotations

import datetime as dt
import logging
import threading

import pytest
from apscheduler.schedulers import base

from cache_refresh import scheduler
from cache_refresh.scheduler import build_scheduler

UTC = dt.timezone.utc


def test_a_clock_stepped_forward_past_the_fire_time_within_the_grace_still_runs_the_night(
        monkeypatch: pytest.MonkeyPatch) -> None:
    step = [dt.timedelta(0)]  # added to APScheduler's wall clock (its executor's misfire check keeps the real one)

    class SteppedClock(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> SteppedClock:  # type: ignore[override]
            return dt.datetime.now(tz) + step[0]  # type: ignore[return-value]

    monkeypatch.setattr(base, "datetime", SteppedClock)
    monkeypatch.setattr(scheduler, "WALL_CLOCK_LOOK_S", 0.05)
    now = dt.datetime.now(UTC)
    fire = (now + dt.timedelta(hours=3)).replace(minute=0, second=0, microsecond=0)  # 2 to 3 hours ahead
    ran, reported, asleep = threading.Event(), [], threading.Event()

    class Asleep(logging.Handler):  # the scheduler has computed its wait by the clock before the step
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Next wakeup is due"):
                asleep.set()

    logger = logging.getLogger("apscheduler.scheduler")
    handler = Asleep(logging.DEBUG)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    sched = build_scheduler(ran.set, f"{fire.minute} {fire.hour} * * *", "UTC", 3600, now,
                            on_skip=lambda why, stage: reported.append(stage))
    thread = threading.Thread(target=sched.start, daemon=True)
    thread.start()
    try:
        assert asleep.wait(30), "the scheduler did not compute its first wait"
        step[0] = fire - now + dt.timedelta(minutes=30)  # the clock steps to 30 minutes past the fire time
        assert ran.wait(30), f"the night's run did not run after the clock stepped forward (reported: {reported})"
        assert reported == []
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        sched.shutdown(wait=False)
        thread.join(5)
