"""``stream.startup``: the wait on a service just started stops as soon as its process is gone, and the error says
how it ended and what it last logged."""

from __future__ import annotations

import os
from pathlib import Path

from stream.startup import exit_status, log_tail, not_started, wait_ready


def test_the_wait_stops_at_the_first_look_that_finds_the_process_gone_whatever_the_timeout() -> None:
    looks = iter([True, True])
    probes: list[int] = []
    assert wait_ready(lambda: bool(probes.append(1)), 1e9, lambda: next(looks, False)) is False
    assert len(probes) == 2  # one per look while it ran; none after (the old wait probed until the timeout)


def test_an_answer_after_the_process_died_is_not_taken_as_ready() -> None:
    """Whoever took the port while ours died answers the probe: the process is looked at again after it."""
    looks = iter([True])
    assert wait_ready(lambda: True, 1e9, lambda: next(looks, False)) is False


def test_a_ready_service_is_ready_with_no_time_at_all() -> None:
    assert wait_ready(lambda: True, 0.0) is True


def test_exit_status_names_the_signal_that_killed_it() -> None:
    assert exit_status(3) == "exit status 3"
    assert exit_status(-9) == "killed by signal 9 (SIGKILL)"
    assert exit_status(-1000) == "killed by signal 1000"


def test_the_log_tail_is_its_last_lines_that_say_something_indented(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n\n" for i in range(30)))
    assert log_tail(log).splitlines() == [f"  line {i}" for i in range(20, 30)]
    log.write_text("")
    assert log_tail(log) == "  (nothing: this start wrote no line)"
    os.mkfifo(tmp_path / "fifo.log")
    assert log_tail(tmp_path / "fifo.log").startswith("  (cannot read it: ") and "not a regular file" in log_tail(
        tmp_path / "fifo.log")


def test_not_started_tells_an_exit_from_a_slow_start(tmp_path: Path) -> None:
    log = tmp_path / "redis.log"
    log.write_text("Bad directive\n")
    died = not_started("redis", "127.0.0.1:1", 1, 20.0, log, 0, "run it again").splitlines()
    assert died[0].startswith("redis exited at start (exit status 1) before answering on 127.0.0.1:1: ")
    assert died[0].endswith(f"then run it again; the last lines of {log}:") and died[1:] == ["  Bad directive"]
    slow = not_started("redis", "127.0.0.1:1", None, 20.0, log, 0, "run it again").splitlines()[0]
    assert slow.startswith("redis did not become ready on 127.0.0.1:1 within 20.0s (still running: stopped)")


def test_the_log_tail_leaves_out_what_earlier_starts_wrote_and_keeps_this_starts_first_line(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("earlier start\n")
    since = log.stat().st_size
    with log.open("a") as fh:
        fh.write("this start's first line\nits last\n")
    assert log_tail(log, since).splitlines() == ["  this start's first line", "  its last"]
    with log.open("a") as fh:
        fh.write("x" * 3000 + "\nthe end\n")  # more than the tail reads: cut inside a line, that line left out
    assert log_tail(log, since).splitlines() == ["  the end"]
    assert log_tail(log, log.stat().st_size) == "  (nothing: this start wrote no line)"
