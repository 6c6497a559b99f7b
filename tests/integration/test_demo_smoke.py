"""``make demo`` end to end, CI-sized: the script the Makefile runs (streamrec/demo.sh) on ML-100k against the
session's own stack, with its own ports and a run directory of its own. Checks what a user gets at the end:
the report exists, every section has a PNG drawn from recorded data, and the printed served quality is a
number. On the earliest LIMIT ratings of ML-100k (DEMO_LIMIT): training dominates the run, and LIMIT impressions
still show learning (served AUC 0.67, NE 0.95 at 50,000; 0.64 and 0.98 at 30,000). About a minute on 2 cores."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrec.stack import LocalStack, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LIMIT = 50_000  # impressions replayed (of 100,000): ~78,000 samples to train instead of ~155,000


# A model sized for ML-100k's 943 users and 1,682 items instead of the defaults' millions of rows (a 100 MB table that
# every checkpoint, the refresh and serving's load copied): for the tests of demo.sh's own control flow, whose proof
# does not depend on the model. The end-to-end test keeps the defaults a user gets.
SMALL_MODEL = {"STREAMREC_LEARNER_BUCKETS": "5000", "STREAMREC_LEARNER_CTX_BUCKETS": "1000",
               "STREAMREC_LEARNER_ID_CAPACITY": "5000", "STREAMREC_LEARNER_COLD_TRACKER_CAPACITY": "10000",
               "STREAMREC_LEARNER_MLP": "64,64"}


def demo_env(stack: LocalStack, run: Path, limit: int, small_model: bool = False) -> dict[str, str]:
    """demo.sh's settings for a run on the session's stack, on ports and in a directory of its own. The join and the
    training end 2 s after their input (not 5): the stage before each wrote all of it before it started."""
    return {**os.environ, **(SMALL_MODEL if small_model else {}), "DEMO_IDLE": "2", "DEMO_DATASET": "ml-100k",
            "DEMO_STACK": "0", "DEMO_DIR": str(run), "DEMO_LIMIT": str(limit),
            "DEMO_JOIN_PORT": str(free_port()), "DEMO_LEARNER_PORT": str(free_port()),
            "DEMO_SERVE_PORT": str(free_port()), "SR": str(BIN / "streamrec"), "PY": sys.executable,
            "STREAMREC_KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap_servers, "STREAMREC_REDIS_URL": stack.redis_url}


@pytest.mark.timeout(480)  # above the run's own 420 s, so that a slow demo fails with its output, not a stack dump
def test_the_demo_runs_end_to_end_and_writes_a_report_with_every_plot(stack: LocalStack, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    env = demo_env(stack, run, LIMIT)
    try:
        proc = subprocess.run(["bash", str(ROOT / "streamrec" / "demo.sh")], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=420)
    except subprocess.TimeoutExpired as exc:
        said = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                       for o in (exc.stdout, exc.stderr))
        pytest.fail(f"the demo ran past 420 s; what it said:\n{said[-6000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    served = re.search(r"served quality \(([\d,]+) impressions[^)]*\): AUC (\S+)\s+NE (\S+)", out)
    assert served, out[-3000:]
    impressions, auc, ne = int(served[1].replace(",", "")), float(served[2]), float(served[3])
    assert LIMIT // 2 < impressions <= LIMIT and 0.55 < auc < 1.0 and 0.0 < ne < 1.0, served[0]
    assert f"{run}/report.html" in out and "stack down" in out  # where the report is, how to stop everything

    page = (run / "report.html").read_text()
    sections = re.findall(r"<section id='([^']+)' data-points='(\d+)' data-png='(\d)'>(.*?)</section>", page, re.S)
    assert [s[0] for s in sections] == ["served-quality", "cold-warm", "throughput", "lag", "gradient-norms",
                                        "coverage", "memory", "hot-set", "freshness", "dead-letters", "alerts"]
    for sid, points, png, body in sections:
        assert png == "1" and int(points) > 0, f"section {sid}: no recorded data drawn"
        img = re.search(r"data:image/png;base64,([^']+)'", body)
        assert img and base64.b64decode(img[1]).startswith(b"\x89PNG"), sid
    for stage in ("replay", "join", "train", "refresh", "monitor"):
        assert json.loads((run / f"{stage}.json").read_text()), stage
    sources = {json.loads(line).get("source") for line in (run / "run-log.jsonl").read_text().splitlines()}
    assert {"joiner", "learner", "serving"} <= sources


def test_a_monitor_that_ended_early_is_reported_and_the_demo_still_writes_its_report(stack: LocalStack,
                                                                                     tmp_path: Path) -> None:
    """The monitor runs in the background; killed (or crashed) mid-run, the demo's bare `kill` of it failed under
    set -e at the very end: exit 1, "kill: (pid) - No such process", no report of the run that had finished."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "streamrec" / "demo.sh")], cwd=ROOT,
                            env=demo_env(stack, run, 5_000, small_model=True),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:  # the monitor is up from before the replay: kill it once training has begun
        out.append(line)
        if line.startswith("== train"):
            break
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    # the `streamrec monitor` subcommand as one argument: the run directory's path names this test (a "monitor"), and
    # a stage started by then (the learner, its report --follow) has it in its arguments too
    monitor, = [int(c) for c in children if b"monitor" in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")]
    os.kill(monitor, signal.SIGKILL)
    out.append(proc.stdout.read())
    text = "".join(out)
    assert proc.wait() == 0, text[-6000:]
    assert "demo: the monitor ended before the run did (exit 137" in text, text[-3000:]
    assert (run / "report.html").is_file() and not (run / "monitor.json").exists()


def _catches_sigint(pid: int) -> bool:
    """Whether ``pid`` has a handler on SIGINT now (/proc: the SigCgt mask, bit n-1 for signal n)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGINT - 1) & 1)


def _child_running(parent: int, word: bytes) -> int:
    """The child of ``parent`` whose command line has ``word`` as an argument, once it is there."""
    while True:
        for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            try:
                if word in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0"):
                    return int(c)
            except FileNotFoundError:  # a short-lived child (the stage's `report --follow`, a digest) gone already
                pass
        time.sleep(0.02)


def test_a_sigint_that_stops_the_learner_stops_the_backgrounded_demo_before_it_refreshes_or_serves(
        stack: LocalStack, tmp_path: Path) -> None:
    """Backgrounded by a non-interactive shell, the demo ignores SIGINT (inherited SIG_IGN, which bash cannot trap);
    the learner takes it, saves what it trained and exits 0 ("reason": "signal"). A Ctrl-C to the group stopped the
    learner, and the demo went on to refresh and serve the partly trained model, exit 0."""
    run = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "streamrec" / "demo.sh")], cwd=ROOT,
                            env=demo_env(stack, run, 5_000, small_model=True),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("== train"):
            break
    learner = _child_running(proc.pid, b"train")
    while not _catches_sigint(learner):  # its run() has taken SIGINT: before that it ignores it, as the demo does
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C sends: the whole group
    out.append(proc.stdout.read())
    text = "".join(out)
    assert proc.wait() == 1, text[-6000:]
    assert "demo: the learner was stopped by a signal" in text, text[-3000:]
    assert "== refresh" not in text and "== serve" not in text and not (run / "serving").exists()
    assert json.loads((run / "train.json").read_text())["reason"] == "signal"
