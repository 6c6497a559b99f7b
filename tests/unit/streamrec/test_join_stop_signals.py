"""``streamrec join`` takes SIGTERM/SIGINT from its worker's run to its summary. The run took them for its own length
and put the process's own back as it returned, so a stop that came after (a process manager's SIGTERM while the close
flushed the day counts to Redis, or while the summary was printed) killed the process: no last flush, no summary, status
-15 where a stop during the run ends with the summary and status 0. Each run here is a child process (the old behaviour
kills it) with a stand-in pipeline and worker: the worker's run takes the signals as the driver's does (kafka: taken and
put back; faust: its closed event loop leaves them at their defaults); the stops arrive in the close."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.python_child import last_json, run_python

CHILD = """
import os, signal, sys
from types import SimpleNamespace
import stream.joiner.kafka_driver, stream.joiner.pipeline, stream.joiner.worker
from stream.stop_signals import put_back_signals, take_stop_signals
from streamrec.cli import main

STOPS_AT_CLOSE, EARLY, SIGNALLED = int(sys.argv[1]), sys.argv[2] == "early", sys.argv[2] == "signalled"

class Pipeline:
    def __init__(self, *args):
        self.totals = SimpleNamespace(summary=lambda: {"samples": 7})
        self.producer = SimpleNamespace(acked_total=7)
    def close(self):
        for _ in range(STOPS_AT_CLOSE):
            os.kill(os.getpid(), signal.SIGTERM)
        print("day counts flushed", file=sys.stderr, flush=True)

class KafkaWorker:
    def __init__(self, *args):
        self.gate, self._stop = SimpleNamespace(pauses={}), False
    def stop(self):
        self._stop = True
    def _on_signal(self, signum, frame):
        self._stop = True
    def run(self):
        if EARLY:  # a stop before the run took the signals over
            os.kill(os.getpid(), signal.SIGTERM)
        handlers = {}
        take_stop_signals(handlers, self._on_signal)
        try:
            if SIGNALLED:  # the operator's stop ends the run
                os.kill(os.getpid(), signal.SIGTERM)
            return 0
        finally:
            put_back_signals(handlers)
    @property
    def stop_reason(self):
        return "signal" if self._stop else "input idle"

class FaustWorker:
    stop_reason = "signal" if SIGNALLED else "input idle"
    def __init__(self, *args):
        self.gate = SimpleNamespace(pauses={})
    def run(self):  # asyncio's loop.close() removes its signal handlers: SIG_DFL, SIGINT's default_int_handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return 0

stream.joiner.pipeline.JoinPipeline = Pipeline
stream.joiner.kafka_driver.KafkaJoinWorker = KafkaWorker
stream.joiner.worker.FaustJoinWorker = FaustWorker
sys.exit(main(["join", "--driver", sys.argv[3], "--json"]))
"""


def _join(driver: str, stops_at_close: int, how: str = "-") -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, str(stops_at_close), how, driver, timeout_s=120)


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_sigterm_after_the_run_still_flushes_and_prints_the_summary_with_status_0(driver: str) -> None:
    done = _join(driver, stops_at_close=1)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "day counts flushed" in done.stderr
    summary = last_json(done)
    assert (summary["samples"], summary["driver"], summary["reason"]) == (7, driver, "input idle")


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_second_sigterm_after_the_run_is_the_process_own_again(driver: str) -> None:
    done = _join(driver, stops_at_close=2)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "day counts flushed" not in done.stderr


def test_a_sigterm_before_the_kafka_run_takes_the_signals_stops_the_run_with_its_summary() -> None:
    done = _join("kafka", stops_at_close=0, how="early")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert last_json(done)["reason"] == "signal"


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_sigterm_after_a_run_a_sigterm_ended_is_the_operators_second_and_the_process_own(driver: str) -> None:
    """The run's stop was the operator's first: one in the close is their second, which cuts the exit short (it was
    absorbed: a second SIGTERM to a joiner stuck in its last flush did nothing)."""
    stopped = _join(driver, stops_at_close=0, how="signalled")
    assert stopped.returncode == 0, (stopped.returncode, stopped.stderr[-2000:])
    assert last_json(stopped)["reason"] == "signal"
    done = _join(driver, stops_at_close=1, how="signalled")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "day counts flushed" not in done.stderr
