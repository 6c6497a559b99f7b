"""``streamrec refresh --now`` takes SIGTERM/SIGINT from its run's end to its summary. The run (``job.run_now``) took
them for its own length and put the process's own back as it returned, so a stop while the summary was printed killed
the process: the run had published, but no summary and status -15 (a stop that comes once the publish has begun lets
the run finish with its summary). A first stop there is absorbed, a second is the process's own; after a run that got a
stop (held: it came in the publish), one there is the operator's second. Each run is a child process with a stand-in
for the run's stages (``run_once``) under the real ``run_now``; the stops arrive while the summary is written."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.python_child import last_json, run_python

CHILD = """
import os, signal, sys
import cache_refresh.job
from streamrec.cli import main

STOPS_IN_SUMMARY, HELD = int(sys.argv[1]), sys.argv[2] == "held"

class Stops:
    def __str__(self):  # written by the summary's print
        for _ in range(STOPS_IN_SUMMARY):
            os.kill(os.getpid(), signal.SIGTERM)
        return "written"

def run_once(rs, kafka, rds, respect_pin=False, allow_older=False, stop=None, **kwargs):
    if HELD:  # the operator's stop in the publish: the run finishes
        stop.hold("during the publish")
        os.kill(os.getpid(), signal.SIGTERM)
    return {"current": "v1", "stops": Stops()}

cache_refresh.job.run_once = run_once
sys.exit(main(["refresh", "--now", "--json", "--checkpoint-dir", sys.argv[3], "--publish-root", sys.argv[3]]))
"""


def _refresh(tmp_path: Path, stops_in_summary: int, how: str = "-") -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, str(stops_in_summary), how, str(tmp_path), timeout_s=300)


def test_a_sigterm_while_the_summary_is_printed_is_absorbed_with_status_0(tmp_path: Path) -> None:
    done = _refresh(tmp_path, stops_in_summary=1)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert last_json(done) == {"current": "v1", "stops": "written"}


def test_a_second_sigterm_while_the_summary_is_printed_is_the_process_own(tmp_path: Path) -> None:
    done = _refresh(tmp_path, stops_in_summary=2)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert done.stdout == ""


def test_a_sigterm_after_a_run_that_got_one_is_the_operators_second_and_the_process_own(tmp_path: Path) -> None:
    held = _refresh(tmp_path, stops_in_summary=0, how="held")
    assert held.returncode == 0, (held.returncode, held.stderr[-2000:])
    assert "SIGTERM during the publish" in held.stderr
    done = _refresh(tmp_path, stops_in_summary=1, how="held")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert done.stdout == ""
