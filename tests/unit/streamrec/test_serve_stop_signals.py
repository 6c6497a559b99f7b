"""``streamrec serve``: the operator's first SIGTERM/SIGINT ends the wait, and the drain (requests in flight, the
updater, the clients) and the summary follow; a second is the operator's second stop, the process's own, which cuts the
drain short. It was absorbed: serve kept its handler through the drain, so a second SIGTERM to a service stuck there did
nothing. Each run is a child process with a stand-in service: its start sends the first stop, its stop (the drain) the
others."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.python_child import last_json, run_python

CHILD = """
import os, signal, sys
from types import SimpleNamespace
import serving.service
from streamrec.cli import main

STOPS_IN_DRAIN = int(sys.argv[1])
NO_COUNTS = SimpleNamespace(collect=lambda: [])

class Service:
    url, device = "http://127.0.0.1:0", "cpu"
    def __init__(self, *args, **kwargs):
        self.holder = SimpleNamespace(model=lambda: None)
        self.updater = SimpleNamespace(status=lambda: {"model_version": None})
        self.metrics = SimpleNamespace(swaps=NO_COUNTS, requests=NO_COUNTS)
    def start(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the operator's stop
        return self
    def stop(self):
        for _ in range(STOPS_IN_DRAIN):
            os.kill(os.getpid(), signal.SIGTERM)
        print("drained", file=sys.stderr, flush=True)

serving.service.ScoringService = Service
sys.exit(main(["serve", "--no-redis", "--port", "0", "--device", "cpu", "--threads", "1", "--publish-root",
               sys.argv[2], "--json"]))
"""


def _serve(tmp_path: Path, stops_in_drain: int) -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, str(stops_in_drain), str(tmp_path), timeout_s=300)


def test_a_sigterm_drains_and_prints_the_summary_with_status_0(tmp_path: Path) -> None:
    done = _serve(tmp_path, stops_in_drain=0)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "drained" in done.stderr
    assert last_json(done)["url"] == "http://127.0.0.1:0"


def test_a_second_sigterm_in_the_drain_is_the_process_own(tmp_path: Path) -> None:
    done = _serve(tmp_path, stops_in_drain=1)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "drained" not in done.stderr
