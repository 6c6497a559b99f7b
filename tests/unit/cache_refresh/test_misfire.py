"""A scheduled run that APScheduler drops as missed (its fire time passed more than ``misfire_grace_s`` ago while
the process was up: the machine was asleep, the VM suspended, the clock jumped forward) is reported like the
scheduler's other skips (``on_skip``: a ``refresh_skipped`` warning and ``outcome="skipped"``), naming the missed
fire time and how to refresh now. Before, the only trace was APScheduler's own log line: no alert, no metric, and
serving kept a model a day older than anyone knew until the staleness alert."""

from __future__ import annotations

import datetime as dt
import threading

from cache_refresh.scheduler import build_scheduler


def test_a_run_missed_by_more_than_the_grace_is_reported_as_a_skip_not_only_logged() -> None:
    ran: list[bool] = []
    reported: list[str] = []
    stages: list[str] = []
    got = threading.Event()

    def on_skip(why: str, stage: str) -> None:
        reported.append(why)
        stages.append(stage)
        got.set()

    # the daily fire time 12 hours from now: none falls between the missed run set below (5 hours ago) and now, which
    # the report would name instead (several missed fire times coalesce into the last; "0 3 * * *" failed whenever
    # the test ran between 03:00 and 08:00 UTC)
    hour = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=12)).hour
    sched = build_scheduler(lambda: ran.append(True), f"0 {hour} * * *", "UTC", 60, dt.datetime.now(dt.timezone.utc),
                            on_skip=on_skip)
    thread = threading.Thread(target=sched.start, daemon=True)
    thread.start()
    try:
        started = threading.Event()
        while not sched.running and not started.wait(0.01):
            pass
        due = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(hours=5)
        sched.modify_job("refresh", next_run_time=due)  # as when the machine wakes 5 hours after the fire time
        assert got.wait(30), "the missed run was not reported"
    finally:
        sched.shutdown(wait=False)
        thread.join(30)
    assert ran == []
    assert len(reported) == 1
    assert f"the run due at {due.isoformat()}" in reported[0]
    assert "misfire_grace_s (60 s)" in reported[0] and "streamrec refresh --now" in reported[0]
    # its own stage, not the overlap's ("scheduler": the previous run still going), which the metric and alert named
    assert stages == ["missed"]
