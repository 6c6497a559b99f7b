"""Fault injection for the refresh and the scoring service (issue 11, items 8 and 9; ``pytest -m faults``).

* ``streamrec refresh --now`` SIGKILLed ``3 x --fault-rounds`` times: at random instants and at every step
  of building and publishing (``tests/fault_hooks_publish.py`` kills the real process there). After each
  kill ``CURRENT`` names a complete version that verifies (or nothing, before the first publish), never a
  staged or temporary one (a watcher reads it every few milliseconds throughout), and the next run
  removes what the killed one left and publishes.
* ``streamrec serve`` SIGKILLed while a client sends requests, at random instants during swaps and
  deltas, inside a swap (the new version loaded, not swapped in) and inside a delta apply; restarted, it
  serves the current artifact and deltas again with the learner's scores.
* Redis stopped during a refresh (retries with backoff, then a failure with its reason that publishes
  nothing; the next run succeeds) and during serving (200 with scores all along, the degraded history
  counted, history used again once Redis is back). Each test starts its own redis-server.
* A full (ENOSPC) or read-only (EROFS) publish root: the refresh fails saying so, nothing half-written is
  made current, ``CURRENT`` still verifies, serving keeps serving; with space back the next run publishes.
* A scheduled refresh while an operator's rollback pin holds publishes nothing; ``--now`` ends the pin.

CI runs one round (``make test``); ``make faults`` runs ``--fault-rounds 10``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from cache_refresh import job, run_records
from cache_refresh.publish import refresh_lock, rollback
from cache_refresh.settings import RefreshSettings
from learner import artifact, artifact_manifest, artifact_versions
from learner import checkpoint as ckpt_io
from learner.batch import to_tensors
from learner.delta_writer import DeltaWriter
from serving.model import ScoringModel
from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from stream.features import hash_value
from stream.history import UserHistory
from streamrec.stack import free_port, redis_binary
from tests.child_lines import Lines
from tests.integration.test_faults import Service, wait_port
from tests.integration.test_serving import CFG, TOL, TinyLearner, publish_version, request_as_joiner_batch

pytestmark = pytest.mark.faults

HOOK = [sys.executable, "-m", "tests.fault_hooks_publish"]
REQ = {"user_id": "bob", "items": [1, 2, 3, "x"], "context": {"device": 1, "genres": [4, 5], "year": 1995}}
DAY_MS = 1_750_000_000_000
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
log = logging.getLogger(__name__)


# -- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Service]:
    """A redis-server of this test's own (AOF in the test's directory: data survives a restart)."""
    port, d = free_port(), tmp_path / "redis"
    d.mkdir()
    svc = Service([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                   "yes", "--appendfsync", "always", "--dir", str(d)], port)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def stop_redis(svc: Service, hard: bool) -> None:
    """SIGTERM (a clean shutdown) or SIGKILL (a crash) of the test's redis-server."""
    assert svc.proc is not None
    if hard:
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(timeout=20)
    else:
        svc.stop()


def eager(learner: TinyLearner, body: dict = REQ, history: list[int] | None = None) -> np.ndarray:
    return learner.eager_scores(to_tensors(request_as_joiner_batch(body, history or []), CFG))


def save_checkpoint(learner: TinyLearner, directory: Path) -> None:
    """The tiny learner's model as a learner checkpoint (what `streamrec refresh` reads)."""
    meta = {"samples_trained": learner.trainer.samples, "offsets": {"0": learner.trainer.steps},
            "partition_rows": {}, "duplicates": 0, "feature_config": CFG.to_dict(),
            "model": {"mlp": "8", "dropout": 0.0}, "metrics": {}, "topic": "samples"}
    ckpt_io.save(directory, {"model": learner.model.state_dict()}, meta)
    time.sleep(0.002)  # checkpoint names carry ms


@dataclass
class Refresh:
    """One refresh set-up: a checkpoint of a tiny learner, day counts in the test's Redis, a publish root."""

    learner: TinyLearner
    ckpt: Path
    root: Path
    redis_url: str
    prefix: str
    keep: int = 1

    def flags(self) -> list[str]:
        return ["--checkpoint-dir", str(self.ckpt), "--publish-root", str(self.root), "--redis-url", self.redis_url]

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, STREAMREC_REDIS_PREFIX=self.prefix, STREAMREC_REFRESH_HOLDOUT_MESSAGES="0",
                   STREAMREC_REFRESH_ALERTS_TOPIC="", STREAMREC_REFRESH_HOT_ITEMS="10",
                   STREAMREC_REFRESH_HOT_USERS="5", STREAMREC_REFRESH_SMALL_FIELD_ROWS="0",
                   STREAMREC_REFRESH_KEEP_VERSIONS=str(self.keep), STREAMREC_REFRESH_REDIS_ATTEMPTS="2",
                   STREAMREC_REFRESH_REDIS_BACKOFF_S="0.05")
        env.pop("STREAMREC_TEST_KILL_AT", None)
        env.pop("STREAMREC_TEST_PUBLISH_FAULT", None)
        env.update(extra)
        return env

    def settings(self, **changes: Any) -> tuple[RefreshSettings, KafkaSettings, RedisSettings]:
        rs = RefreshSettings(checkpoint_dir=self.ckpt, publish_root=self.root, hot_items=10, hot_users=5,
                             small_field_rows=0, holdout_messages=0, alerts_topic="", keep_versions=self.keep,
                             redis_attempts=2, redis_backoff_s=0.05)
        rs = RefreshSettings(**{**rs.__dict__, **changes})
        return rs, KafkaSettings(), RedisSettings(url=self.redis_url, prefix=self.prefix)

    def cmd(self, *extra: str) -> list[str]:
        return [*HOOK, "refresh", "--now", "--json", *self.flags(), *extra]


def make_refresh(tmp_path: Path, server: Service, seed: int = 0, keep: int = 1) -> Refresh:
    learner = TinyLearner(seed=seed)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(learner, ckpt)
    url, prefix = f"redis://127.0.0.1:{server.port}/0", f"t{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    counts = DailyCounts(client, prefix=prefix)
    items = [hash_value(k) for k in range(30) for _ in range(30 - k)]
    users = [hash_value(f"u{k}") for k in range(20) for _ in range(20 - k)]
    counts.record("item", "impression", items, np.full(len(items), DAY_MS))
    counts.record("user", "impression", users, np.full(len(users), DAY_MS))
    client.close()
    return Refresh(learner, ckpt, tmp_path / "serving", url, prefix, keep)


def leftovers(root: Path) -> list[str]:
    """What a killed run can leave: staged directories, half-pruned versions, temp files."""
    out = []
    staging = root / artifact_versions.STAGING
    if staging.is_dir():
        out += [f"{artifact_versions.STAGING}/{p.name}" for p in staging.iterdir()]
    versions = root / artifact_versions.VERSIONS
    if versions.is_dir():
        out += [f"versions/{p.name}" for p in versions.iterdir() if p.name.startswith(".")]
    if root.is_dir():
        out += [p.name for p in root.iterdir() if ".tmp-" in p.name]
    return sorted(out)


def assert_current_sound(root: Path) -> str | None:
    """CURRENT is absent or names a version under versions/ whose every file verifies and which loads."""
    name = artifact_versions.current_version(root)
    if name is None:
        return None
    assert _VERSION_RE.fullmatch(name) and not name.startswith("."), name
    path = root / artifact_versions.VERSIONS / name
    assert path.is_dir(), f"CURRENT names {name}, which is not in versions/"
    artifact.verify(path)
    ScoringModel.load(path)  # loads and scores a probe
    return name


class CurrentWatcher(threading.Thread):
    """Reads CURRENT every ~2 ms for the whole test: every name it ever holds must be a complete version."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.violations = root, set(), []
        self._stop_event = threading.Event()

    def run(self) -> None:
        path = self.root / artifact_versions.CURRENT
        while not self._stop_event.is_set():
            try:
                name = path.read_text().strip()
            except OSError:
                name = ""
            if name and name not in self.seen:
                manifest = self.root / artifact_versions.VERSIONS / name / artifact_manifest.MANIFEST
                ok = _VERSION_RE.fullmatch(name) and not name.startswith(".") and manifest.is_file()
                if not ok:
                    try:
                        again = path.read_text().strip()
                    except OSError:
                        again = ""
                    if again == name:  # not a publish that moved on (and pruned) between the two reads
                        self.violations.append(name)
                self.seen.add(name)
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


# -- (a) SIGKILL of `streamrec refresh --now` ----------------------------------------------------------------
PUBLISH_POINTS = ("publish:before_rename", "publish:renamed", "publish:current_tmp", "publish:current",
                  "publish:pruning")
OTHER_POINTS = ("build:cold_half", "build:staged", "last_run")
AFTER_CURRENT = ("publish:current", "publish:pruning", "last_run")  # CURRENT already names the new version


def _killed_refresh(rf: Refresh, point: str | None, rnd: random.Random) -> tuple[str | None, str]:
    """Run `streamrec refresh --now` and SIGKILL it: at ``point`` (the hook kills itself there) or, for None,
    at a random instant after it loaded the checkpoint. Returns (where it died or None if it finished, stderr)."""
    delay = rnd.uniform(0.0, 1.2)
    for _ in range(5):  # a timer that fired after the run finished is tried again, earlier
        env = rf.env(STREAMREC_TEST_KILL_AT=point) if point else rf.env()
        proc = subprocess.Popen(rf.cmd(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = Lines(proc.stderr)
        if point is None:
            assert lines.wait_for("refresh: checkpoint", 120), lines.text()[-3000:]
            time.sleep(delay)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        lines.join(10)
        if proc.returncode == -signal.SIGKILL:
            return point or f"timer+{delay:.2f}s", lines.text()
        assert point is None, f"hook point {point} never reached (exit {proc.returncode}): {lines.text()[-3000:]}"
        assert proc.returncode == 0, lines.text()[-3000:]
        delay /= 3
    return None, lines.text()


def test_sigkill_of_refresh_at_random_points_never_makes_a_partial_version_current(
        tmp_path: Path, redis_server: Service, fault_rounds: int) -> None:
    rf = make_refresh(tmp_path, redis_server)
    rnd = random.Random(1000 + fault_rounds)
    publish_points, other_points = list(PUBLISH_POINTS), list(OTHER_POINTS)
    rnd.shuffle(publish_points)
    rnd.shuffle(other_points)
    watcher = CurrentWatcher(rf.root)
    watcher.start()
    kills: Counter[str] = Counter()
    cleaned: list[str] = []
    finished = 0
    try:
        for k in range(3 * fault_rounds):
            kind = ("timer", "publish", "other")[k % 3]
            point = None if kind == "timer" else (publish_points if kind == "publish" else other_points)[
                (k // 3) % (len(PUBLISH_POINTS) if kind == "publish" else len(OTHER_POINTS))]
            before = artifact_versions.current_version(rf.root)
            where, err = _killed_refresh(rf, point, rnd)
            if where is None:
                finished += 1
            else:
                kills[where if point else "timer"] += 1
            now = assert_current_sound(rf.root)  # a complete version, or nothing before the first publish
            if before is not None:
                assert now is not None, f"{where}: CURRENT is gone"
            if point in AFTER_CURRENT:
                assert now is not None and now != before and (before is None or now > before), (point, before, now)
            elif point is not None:
                assert now == before, f"{point}: CURRENT moved from {before} to {now} before the publish was done"
            # the next run cleans up after the killed one and publishes
            summary = job.run_once(*rf.settings())
            cleaned += summary["cleaned"]
            assert summary["published"] and artifact_versions.current_version(rf.root) == summary["version"]
            assert assert_current_sound(rf.root) == summary["version"]
            assert leftovers(rf.root) == [], leftovers(rf.root)
            # keep 1: the killed runs' orphans too
            assert artifact_versions.list_versions(rf.root) == [summary["version"]]
    finally:
        watcher.stop()
    assert watcher.violations == [], f"CURRENT named incomplete versions: {watcher.violations}"
    total = sum(kills.values())
    print(f"\nrefresh SIGKILLs: {total} ({dict(kills)}), finished before the timer: {finished}, reruns "
          f"published: {3 * fault_rounds}, leftovers removed by the reruns: {len(cleaned)}, distinct CURRENT "
          f"values watched: {len(watcher.seen)}")
    assert total >= 3 * fault_rounds - finished and total >= 2 * fault_rounds


def _signalled_refresh(rf: Any, point: str, sig: signal.Signals) -> tuple[int, str, str]:
    """`streamrec refresh --now` held at the fault hook ``point``, sent ``sig`` there: (exit code, stdout, stderr)."""
    proc = subprocess.Popen(rf.cmd(), env=rf.env(STREAMREC_TEST_PAUSE_AT=point), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = Lines(proc.stderr)
    try:
        assert lines.wait_for(f"paused at {point}", 120), lines.text()[-3000:]
        os.kill(proc.pid, sig)
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines.join(10)
    return proc.returncode, out, lines.text()


def test_a_stop_signal_during_the_publish_of_refresh_now_lets_the_run_publish(
        tmp_path: Path, redis_server: Service) -> None:
    """From the publish on, SIGTERM to `streamrec refresh --now` lets the run finish (the publish is atomic and
    short; after it the run has published): exit 0 with the new version current and complete."""
    rf = make_refresh(tmp_path, redis_server)
    code, out, err = _signalled_refresh(rf, "publish:before_rename", signal.SIGTERM)
    assert code == 0, (code, err[-3000:])
    assert "SIGTERM during the refresh's publish" in err
    assert assert_current_sound(rf.root) == json.loads(out)["version"]
    assert leftovers(rf.root) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("point", ["build:staged"])
def test_a_stop_signal_during_refresh_now_ends_the_run_as_a_failed_run(
        tmp_path: Path, redis_server: Service, sig: signal.Signals, point: str) -> None:
    """SIGTERM or SIGINT to `streamrec refresh --now` while it runs (the hook waits at ``point`` for the signal) ends it
    as a failed run ends: an error line naming the stage, a refresh_failed alert, nothing made current, what was staged
    removed (or left for the next run, as a kill leaves it), exit 1 (EXIT_FAILED, as the scheduler's abandoned run:
    scheduler.EXIT_ABANDONED). Before, the default action killed the process at once (exit -15): no line, no alert,
    no metric."""
    rf = make_refresh(tmp_path, redis_server)
    first = job.run_once(*rf.settings())  # a live version the stopped run must leave current
    code, _, err = _signalled_refresh(rf, point, sig)
    assert code == 1, (code, err[-3000:])
    stage = point.split(":")[0]
    assert f'refresh_failed{{stage="{stage}"}}' in err, err[-3000:]
    assert signal.Signals(sig).name in err, err[-3000:]
    assert "streamrec refresh: error:" in err, err[-3000:]
    assert artifact_versions.current_version(rf.root) == first["version"]
    assert_current_sound(rf.root)
    assert artifact_versions.list_versions(rf.root) == [first["version"]]
    # a stage directory the signal caught before the run knew it (inside the build) is left, as a kill leaves it:
    # the next run removes it and publishes
    left = leftovers(rf.root)
    again = job.run_once(*rf.settings())
    assert again["published"] and sorted(again["cleaned"]) == left
    assert leftovers(rf.root) == [], leftovers(rf.root)


# -- (b) SIGKILL of `streamrec serve` ------------------------------------------------------------------------
class Client(threading.Thread):
    """Sends score requests in a loop, reconnecting when the server is gone; records what came back."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.statuses: Counter[int] = Counter()
        self.refused = 0
        self.bad: list[Any] = []
        self.halt = threading.Event()

    def run(self) -> None:
        conn = None
        body = json.dumps(REQ).encode()
        while not self.halt.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("POST", "/v1/score", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                out = json.loads(r.read())
            except (OSError, http.client.HTTPException, ValueError):
                self.refused += 1  # the server is down (killed, restarting): expected, and counted
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.02)
                continue
            self.statuses[r.status] += 1
            if (r.status >= 500 and r.status != 503) or (r.status == 503 and "error" not in out):
                self.bad.append((r.status, out))
            if r.status == 200 and not (len(out["scores"]) == 4 and all(0 < s < 1 for s in out["scores"])):
                self.bad.append(out)
            time.sleep(0.005)


def _get(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _score(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/score", json.dumps(REQ).encode(), {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200, out
        return out
    finally:
        conn.close()


def _wait_serving(port: int, version: str, seq: int, timeout_s: float = 60) -> dict:
    """Wait until serving answers with ``version`` at delta ``seq``; returns a score response."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            status, ready = _get(port, "/readyz")
            if status == 200 and (ready["model_version"], ready["delta_seq"]) == (version, seq):
                return _score(port)
            last = (status, ready)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.05)
    raise AssertionError(f"serving did not reach {version} at delta {seq}: {last}")


def test_sigkill_of_serve_during_requests_swaps_and_deltas_then_it_serves_the_current_artifact(
        tmp_path: Path, fault_rounds: int) -> None:
    learner = TinyLearner(seed=11)
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600, keep=5)
    n = 1
    publish_version(learner, root, f"v{n:03d}")
    state = {"seq": 0}  # the delta serving must reach on the current artifact (0: none newer than it)
    port = free_port()
    env = dict(os.environ, STREAMREC_SERVE_POLL_S="0.05")
    env.pop("STREAMREC_TEST_KILL_AT", None)
    base = ["serve", "--port", str(port), "--publish-root", str(root), "--deltas-dir", str(deltas), "--no-redis",
            "--log-level", "warning"]

    def start(kill_at: str = "") -> subprocess.Popen:
        e = dict(env, STREAMREC_TEST_KILL_AT=kill_at) if kill_at else env
        proc = subprocess.Popen([*HOOK, *base], env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, 60)
        return proc

    def train_delta() -> None:
        learner.train(1, users=["bob"] * 16, label=1)
        writer.mark(torch.arange(CFG.num_rows))  # every row: serving equals the learner after it, whatever it skipped
        assert writer.write(learner.model, learner.trainer.samples) is not None
        state["seq"] = writer.seq

    def publish_next() -> str:
        nonlocal n
        learner.train(1)
        n += 1
        publish_version(learner, root, f"v{n:03d}")
        state["seq"] = 0  # every delta so far is inside the new artifact
        return f"v{n:03d}"

    rnd = random.Random(2000 + fault_rounds)
    plan = [("random", "swap", "delta")[k % 3] for k in range(3 * fault_rounds)]

    def hook_for(kind: str | None) -> str:
        """Where the next process kills itself: inside the next swap or delta apply (none for a timer kill)."""
        return {"swap": f"swap:v{n + 1:03d}", "delta": f"delta:{writer.seq + 1}"}.get(kind or "", "")

    client = Client(port)
    kills: Counter[str] = Counter()
    recoveries = 0
    proc = start(hook_for(plan[0]))
    client.start()
    try:
        before = _wait_serving(port, f"v{n:03d}", 0)
        for k, kind in enumerate(plan):
            if kind == "random":  # swaps and deltas under way, and a kill at a random instant among them
                stop = threading.Event()

                def churn(stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        if rnd.random() < 0.6:
                            train_delta()
                        else:
                            publish_next()
                        time.sleep(rnd.uniform(0.02, 0.15))

                t = threading.Thread(target=churn, daemon=True)
                t.start()
                time.sleep(rnd.uniform(0.2, 1.5))
                os.kill(proc.pid, signal.SIGKILL)
                stop.set()
                t.join(30)
            elif kind == "swap":  # it dies inside the swap: the new version loaded beside the live one
                publish_next()
            else:  # it dies inside the delta apply
                train_delta()
            proc.wait(timeout=60)
            assert proc.returncode == -signal.SIGKILL, f"{kind}: serve exited {proc.returncode}"
            kills[kind] += 1
            # restarted by its supervisor (armed for the next planned kill, which it does not reach yet)
            proc = start(hook_for(plan[k + 1] if k + 1 < len(plan) else None))
            want = eager(learner)
            after = _wait_serving(port, artifact_versions.current_version(root), state["seq"])
            assert np.allclose(after["scores"], want, atol=TOL, rtol=0), (kind, after, want)
            if kind == "random" and (after["model_version"], after["delta_seq"]) == (
                    before["model_version"], before["delta_seq"]):
                assert after["scores"] == before["scores"]
            recoveries += 1
            before = after
        time.sleep(0.3)
    finally:
        client.halt.set()
        client.join(15)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert client.bad == [], client.bad[:5]
    assert client.statuses[200] > 20 and not any(s >= 500 and s != 503 for s in client.statuses)
    print(f"\nserve SIGKILLs: {sum(kills.values())} ({dict(kills)}), recoveries {recoveries}, client answers "
          f"{dict(client.statuses)}, connection refused/reset while down {client.refused}, "
          f"5xx: {sum(c for s, c in client.statuses.items() if s >= 500)}")
    assert sum(kills.values()) == 3 * fault_rounds == recoveries


# -- (c) Redis stopped and restarted ------------------------------------------------------------------------
def test_redis_down_during_a_refresh_retries_then_fails_cleanly_and_the_next_run_succeeds(
        tmp_path: Path, redis_server: Service, fault_rounds: int) -> None:
    rf = make_refresh(tmp_path, redis_server, seed=3, keep=3)
    first = job.run_once(*rf.settings())
    live = first["version"]
    for r in range(fault_rounds):
        stop_redis(redis_server, hard=r % 2 == 1)
        # down past the retries: a failure that names the stage and the reason, and publishes nothing
        out = subprocess.run(rf.cmd(), env=rf.env(STREAMREC_REFRESH_REDIS_ATTEMPTS="3"), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 1, out.stderr[-3000:]
        assert "refresh failed at hot_set" in out.stderr and "unreachable after 3 attempt(s)" in out.stderr
        assert out.stderr.count("retrying in") == 2  # 3 attempts: 2 waits
        assert assert_current_sound(rf.root) == live and leftovers(rf.root) == []
        # down when the next run starts, back while it retries: it waits and publishes
        proc = subprocess.Popen(rf.cmd(), env=rf.env(STREAMREC_REFRESH_REDIS_ATTEMPTS="8",
                                                    STREAMREC_REFRESH_REDIS_BACKOFF_S="0.25"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = Lines(proc.stderr)
        assert lines.wait_for("retrying in", 120), lines.text()[-3000:]
        redis_server.start()
        stdout = proc.stdout.read()  # type: ignore[union-attr]
        proc.wait(timeout=120)
        lines.join(10)
        assert proc.returncode == 0, lines.text()[-3000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        # notified once Redis was back: sent (no serving process subscribes here, so no receiver)
        assert summary["published"] and summary["notify_receivers"] == 0 and summary["version"] != live
        assert assert_current_sound(rf.root) == summary["version"] and leftovers(rf.root) == []
        live = summary["version"]
    print(f"\nrefresh with Redis down: {fault_rounds} failed run(s) publishing nothing, {fault_rounds} run(s) that "
          "waited for Redis and published")


def test_redis_down_during_serving_scores_without_history_and_uses_it_again_when_back(
        tmp_path: Path, redis_server: Service, fault_rounds: int) -> None:
    learner = TinyLearner(seed=5)
    root = tmp_path / "serving"
    publish_version(learner, root, "v001")
    url, prefix = f"redis://127.0.0.1:{redis_server.port}/0", f"t{uuid.uuid4().hex[:8]}"
    history = [hash_value(i) for i in (7, 9, 11)]
    client = redis.Redis.from_url(url)
    UserHistory(client, prefix=prefix, max_len=200).append_many([hash_value("bob")] * 3, history, [1, 2, 3])
    client.close()
    with_hist, without = eager(learner, history=history), eager(learner)
    assert not np.allclose(with_hist, without, atol=1e-4)  # the history matters to these scores
    # Redis down is refused at once (its port closed), so no timeout is waited for here; a timeout of 0.2 s failed the
    # 20 reads with history after it came back whenever one took longer on a loaded machine (reproduced by
    # SIGSTOPping Redis for 0.4 s before them)
    ss = ServeSettings(port=0, publish_root=root, poll_s=0.05, redis_timeout_s=10.0, history_retry_after_s=0.2)

    def unavailable(svc: ScoringService) -> float:
        return svc.metrics.registry.get_sample_value("streamrec_serving_history_unavailable_total") or 0.0

    def scores_until(svc: ScoringService, want: np.ndarray, timeout_s: float) -> int:
        deadline, n = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            out = _score(svc.port)
            n += 1
            if np.allclose(out["scores"], want, atol=TOL, rtol=0):
                return n
            time.sleep(0.02)
        raise AssertionError(f"scores never became {want}")

    answered = 0
    with ScoringService(ss, RedisSettings(url=url, prefix=prefix)) as svc:
        answered += scores_until(svc, with_hist, 10)
        for r in range(fault_rounds):
            stop_redis(redis_server, hard=r % 2 == 0)
            down0 = unavailable(svc)
            t_end = time.monotonic() + 1.5
            while time.monotonic() < t_end:  # every request answers, with the scores of no history
                out = _score(svc.port)
                answered += 1
                assert np.allclose(out["scores"], without, atol=TOL, rtol=0), out
            assert unavailable(svc) > down0
            redis_server.start()
            answered += scores_until(svc, with_hist, 15)  # history is used again
            settled = unavailable(svc)
            for _ in range(20):
                assert np.allclose(_score(svc.port)["scores"], with_hist, atol=TOL, rtol=0)
                answered += 1
            assert unavailable(svc) == settled  # no more degraded reads
        errors_5xx = sum(svc.metrics.registry.get_sample_value(
            "streamrec_serving_requests_total", {"endpoint": "/v1/score", "status": str(s)}) or 0 for s in (500, 503))
    assert errors_5xx == 0
    print(f"\nserving with Redis down {fault_rounds}x: {answered} requests answered 200, degraded history reads "
          f"{int(settled)}, 5xx 0")


# -- (d) a full or read-only publish root ----------------------------------------------------------------------
FAULTS = {"ENOSPC:build": ("at build", "the file system is full"),
          "ENOSPC:publish": ("at publish", "the file system is full"),
          "EROFS": ("at build", "the file system is read-only")}


def test_a_full_or_read_only_publish_root_fails_the_refresh_and_serving_keeps_serving(
        tmp_path: Path, redis_server: Service) -> None:
    rf = make_refresh(tmp_path, redis_server, seed=4, keep=3)
    live = job.run_once(*rf.settings())["version"]
    fault = tmp_path / "fault"
    want = eager(rf.learner)
    said: list[str] = []
    ss = ServeSettings(port=0, publish_root=rf.root, poll_s=0.05)
    with ScoringService(ss, None) as svc:
        before = _score(svc.port)
        assert before["model_version"] == live and np.allclose(before["scores"], want, atol=TOL, rtol=0)
        for mode, (stage, words) in FAULTS.items():
            fault.write_text(mode)
            out = subprocess.run(rf.cmd(), env=rf.env(STREAMREC_TEST_PUBLISH_FAULT=str(fault)), capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 1, (mode, out.stderr[-3000:])
            err = out.stderr
            assert f"refresh failed {stage}" in err and words in err and "nothing was published" in err, (mode, err)
            said.append(next(ln for ln in err.splitlines() if ln.startswith("streamrec refresh: error:")))
            assert assert_current_sound(rf.root) == live
            assert artifact_versions.list_versions(rf.root) == [live] and leftovers(rf.root) == [], leftovers(rf.root)
            svc.updater.check_now()
            status, ready = _get(svc.port, "/readyz")
            assert status == 200 and ready["model_version"] == live
            assert _score(svc.port) == before  # the same model, the same scores
        fault.unlink()  # space is back
        summary = job.run_once(*rf.settings())
        assert summary["published"] and assert_current_sound(rf.root) == summary["version"] != live
        after = _wait_serving(svc.port, summary["version"], 0, timeout_s=10)
        assert np.allclose(after["scores"], want, atol=TOL, rtol=0)
    print(f"\nfull/read-only publish root: {len(FAULTS)} refreshes failed with their reason, CURRENT stayed "
          f"{live}; the next run published {summary['version']}\n" + "\n".join(said))


# -- a scheduled refresh while an operator's rollback pin holds ------------------------------------------------
def test_a_scheduled_refresh_does_not_end_an_operators_rollback_and_refresh_now_does(
        tmp_path: Path, redis_server: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    from streamrec.cli import main

    rf = make_refresh(tmp_path, redis_server, seed=6, keep=5)
    rs, kafka, rds = rf.settings()
    v1 = job.run_once(rs, kafka, rds)["version"]
    v2 = job.run_once(rs, kafka, rds)["version"]
    assert rollback(rf.root) == v1  # the operator rolls back: v1 pinned
    caplog.set_level(logging.WARNING, logger="streamrec.refresh")  # a warning alert logs at WARNING (monitor's LogSink)

    # the 03:00 run: builds and validates, publishes nothing, says so
    summary = job.scheduled_run(rs, kafka, rds)
    assert summary is not None and summary["published"] is False and summary["current"] == v1
    assert summary["pin_held"]["version"] == v1 and summary["pin_held"]["rolled_back_from"] == v2
    assert summary["probe"]["max_abs_diff"] <= rs.validate_tolerance  # it did validate
    assert artifact_versions.current_version(rf.root) == v1 and artifact_versions.pin_holding(rf.root) is not None
    assert artifact_versions.list_versions(rf.root) == [v1, v2] and leftovers(rf.root) == []
    assert any("FIRING warning refresh_pinned" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert any("did not publish" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    held = run_records.read_last_run(rf.root)["pin_held"]
    assert held["built"] == summary["built"] and held["pinned"] == v1
    assert run_records.read_last_success(rf.root) is not None  # the last publish is still the last success

    # the same through the scheduler command: the cron job is the pin-respecting run
    import cache_refresh.scheduler as scheduler

    monkeypatch.setattr(scheduler, "run_forever", lambda fn, *a, **kw: (fn(), 0)[1])  # (returns the exit code)
    cfg_flags = [*rf.flags(), "--config", str(_config(tmp_path / "c.toml", rf))]
    assert main(["refresh", *cfg_flags]) == 0
    assert artifact_versions.current_version(rf.root) == v1 and artifact_versions.list_versions(rf.root) == [v1, v2]
    capsys.readouterr()
    assert main(["refresh", "--status", "--json", *cfg_flags]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["current"] == v1 and st["pinned"]["version"] == v1 and "do not publish" in st["pinned"]["scheduled_runs"]
    assert st["last_pin_held"]["pinned"] == v1

    # an operator's --now publishes over the pin and ends it
    assert main(["refresh", "--now", "--json", *cfg_flags]) == 0
    now = json.loads(capsys.readouterr().out)
    assert now["published"] and now["unpinned"] == {"version": v1, "rolled_back_from": v2}
    assert artifact_versions.read_pin(rf.root) is None and artifact_versions.current_version(rf.root) == now["version"]
    assert "pin_held" not in run_records.read_last_run(rf.root)
    # and with no pin the schedule publishes again
    again = job.scheduled_run(rs, kafka, rds)
    assert again is not None and again["published"] and again["unpinned"] is None

    # a stale pin (naming another version than CURRENT: a crash inside a rollback) does not hold
    (rf.root / artifact_versions.PIN).write_text(json.dumps({"version": v1, "rolled_back_from": v2, "at": 1.0}))
    stale = job.scheduled_run(rs, kafka, rds)
    assert stale is not None and stale["published"]
    # an unreadable pin holds (fail closed)
    (rf.root / artifact_versions.PIN).write_bytes(b"\xff not a pin")
    unreadable = job.scheduled_run(rs, kafka, rds)
    assert unreadable is not None and not unreadable["published"] and unreadable["pin_held"]["problem"]


def _config(path: Path, rf: Refresh) -> Path:
    path.write_text(f'[redis]\nprefix = "{rf.prefix}"\n[refresh]\nholdout_messages = 0\nalerts_topic = ""\n'
                    f'hot_items = 10\nhot_users = 5\nsmall_field_rows = 0\nkeep_versions = {rf.keep}\n'
                    'redis_attempts = 2\nredis_backoff_s = 0.05\nschedule = "0 3 * * *"\n')
    return path


def test_two_refreshes_at_once_the_second_fails_at_once_naming_the_first(tmp_path: Path) -> None:
    root = tmp_path / "serving"
    with refresh_lock(root):
        with pytest.raises(artifact_versions.ArtifactError, match=rf"another refresh \(pid {os.getpid()}\) is running"):
            with refresh_lock(root):
                pass
    with refresh_lock(root):  # released
        pass


@pytest.mark.slow
def test_serve_frozen_with_a_request_in_flight_and_a_swap_and_delta_waiting_answers_right_after(
        tmp_path: Path) -> None:
    """``streamrec serve`` stopped (SIGSTOP: a long GC pause, a stalled host) for 2x the Kafka group session while a
    request is in flight and a new version and then a delta are published; woken (SIGCONT), the request in flight is
    answered 200, and serving reaches the new version at the delta with the learner's scores. Out of CI
    (``-m slow``)."""
    learner = TinyLearner(seed=12)
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    writer = DeltaWriter(deltas, CFG.num_rows, every_s=3600, keep=5)
    publish_version(learner, root, "v001")
    port = free_port()
    env = dict(os.environ, STREAMREC_SERVE_POLL_S="0.05")
    env.pop("STREAMREC_TEST_KILL_AT", None)
    proc = subprocess.Popen([*HOOK, "serve", "--port", str(port), "--publish-root", str(root), "--deltas-dir",
                             str(deltas), "--no-redis", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stall_s = 2 * KafkaSettings().session_timeout_ms / 1000
    try:
        wait_port(port, 60)
        _wait_serving(port, "v001", 0)
        answers: queue.Queue = queue.Queue()

        def in_flight() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=stall_s + 60)
            try:
                conn.request("POST", "/v1/score", json.dumps(REQ).encode(), {"Content-Type": "application/json"})
                r = conn.getresponse()
                answers.put((r.status, json.loads(r.read())))
            except Exception as exc:  # noqa: BLE001 - the test reports it
                answers.put((None, repr(exc)))
            finally:
                conn.close()

        try:
            proc.send_signal(signal.SIGSTOP)
            client = threading.Thread(target=in_flight, daemon=True)
            client.start()  # sent while it is stopped: in flight across the stall
            learner.train(1)
            publish_version(learner, root, "v002")  # a swap waiting for it
            learner.train(1, users=["bob"] * 16, label=1)
            writer.mark(torch.arange(CFG.num_rows))
            assert writer.write(learner.model, learner.trainer.samples) is not None  # and a delta after it
            time.sleep(stall_s)
        finally:
            proc.send_signal(signal.SIGCONT)
        client.join(stall_s + 90)
        status, body = answers.get_nowait()
        assert status == 200, body
        after = _wait_serving(port, "v002", writer.seq)
        assert np.allclose(after["scores"], eager(learner), atol=TOL, rtol=0), after
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
