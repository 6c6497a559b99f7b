"""Soak run: the whole pipeline under paced, churning input for N minutes, with injected faults.

What runs, supervised by this script (each a subprocess with its log under the run directory):

* its own local stack (Tansu broker + Redis on free ports, state in ``<out>/stack``);
* ``streamrec replay --dataset synthetic --rate R``: paced events with id churn (100 M user ids, 30% of
  impressions from brand-new users) and a share of malformed messages, long enough for the whole run;
* ``streamrec join --driver kafka`` (metrics port) and ``streamrec train`` (metrics port, serving deltas
  every 5 s, checkpoints in ``<out>/checkpoints``; bf16 autocast only on CPUs with bf16 instructions and one
  torch thread, see ``--learner-amp`` and ``--learner-threads``: with streamrec's defaults the learner fell
  behind at 1500 events/s on a 2-core AVX2 machine, bench/README.md "Soak");
* once the learner has a checkpoint: ``streamrec refresh --now`` and ``streamrec serve`` (with the deltas);
* a probe thread: one ``POST /v1/score`` (1 user x ``--candidates`` items) per second, latency measured
  by the client over a keep-alive connection.

Faults (times from the start of the run; flags change them): SIGKILL of the joiner every
``--joiner-kill-every`` seconds, restarted at once as a supervisor would; one SIGKILL of the learner at
``--learner-kill-at`` (share of the run), restarted; one Redis restart at ``--redis-restart-at``
(redis-server stopped, down for ``--redis-down-s``, started again on the same port, empty). A child that
exits on its own is restarted too and counted as an unexpected exit.

Every ``--interval`` seconds one row goes to ``soak.csv`` (and a progress line to stderr):

* RSS (VmRSS from /proc/<pid>/status) of joiner, learner, serving, and of the broker and Redis;
* joiner lag: events in impressions + clicks (counted by a tail consumer that reads every message of the
  topics, so the count is exact; the local broker's high watermarks are not, see
  ``stream/kafka.py: resume_offsets``) minus the joiner group's committed offsets;
* learner lag: sample rows in ``samples`` (the tail consumer decodes each Arrow message's row count)
  minus rows the learner has consumed (rows in the checkpoint it resumed from + its
  ``streamrec_learner_samples_total`` + ``..._duplicates_total`` from /metrics; while it is down, the
  newest checkpoint's rows); also the lag of its checkpoint offsets in messages;
* probe p50/p99 over the interval, probe errors;
* dead letters per ``.dlq`` topic (messages, and distinct source offsets), malformed messages seen in the
  input topics, faults injected so far.

At the end: ``summary.json`` (RSS max and growth per process, slope after the joiner's state is full and
over the second half, lag recovery after each fault, probe latency, DLQ counts, faults, restore times from
the logs) and ``soak.png`` (one panel per series, faults as vertical lines); the progress lines are kept
in ``soak.log``, every child's output in ``logs/<name>-<start>.log``. Everything is stopped in a
``finally`` (also on Ctrl-C and SIGTERM): every child gets SIGTERM, then SIGKILL, and the stack is stopped.

Reproduce::

    nice -n 10 .venv/bin/python bench/soak.py              # 30 minutes (make soak)
    nice -n 10 .venv/bin/python bench/soak.py --minutes 3  # the quick version
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stream.config import KafkaSettings  # noqa: E402
from stream.dlq import DeadLetter  # noqa: E402
from streamrec.stack import LocalStack, StackSettings, free_port  # noqa: E402

JOIN_GROUP = "soak-joiner"
LEARN_GROUP = "soak-learner"
EVENTS_PER_IMPRESSION = 1.1  # synthetic: ~0.11 clicks (incl. duplicates, orphans) + malformed per impression


_LOG: list[Path] = []  # the run's soak.log, once the run directory exists


def log(msg: str) -> None:
    line = f"[soak {time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if _LOG:
        with _LOG[0].open("a") as fh:
            fh.write(line + "\n")


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return float("nan")


def scrape(port: int | None, timeout: float = 2.0) -> dict[str, float] | None:
    """Prometheus text -> {'name{labels}': value}; None when the endpoint does not answer."""
    if port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except Exception:  # noqa: BLE001 - a process being restarted does not answer
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def metric_sum(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


# -- supervised children ----------------------------------------------------------------------------------
class Child:
    """One supervised subprocess; every (re)start appends to its own numbered log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.cmd, self.env, self.logs = name, cmd, env, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.unexpected_exits: list[tuple[float, int]] = []
        self.started_at = 0.0
        self.started_wall: list[float] = []

    def start(self) -> None:
        self.starts += 1
        self.started_wall.append(time.time())
        path = self.logs / f"{self.name}-{self.starts}.log"
        with path.open("ab") as fh:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name} did not stop within {timeout:.0f}s of SIGTERM: SIGKILL")
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them torch emulates bf16 matmuls."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def wait_http(url: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    return False


# -- the topic tail ----------------------------------------------------------------------------------------
class Tail:
    """Reads every message of the input, samples and dead-letter topics from the beginning (its own
    consumer, nothing committed) and counts: log end per partition (last offset + 1), malformed input
    messages (decoded with the joiner's own validators), sample rows per partition and offset, DLQ
    messages and their distinct source offsets."""

    def __init__(self, kafka: KafkaSettings) -> None:
        from confluent_kafka import Consumer

        self.kafka = kafka
        self.c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "soak-tail",
                           "enable.auto.commit": False, "auto.offset.reset": "earliest",
                           "fetch.wait.max.ms": 100, "log_level": 0})
        self.lock = threading.Lock()
        self.end: dict[tuple[str, int], int] = {}
        self.messages: dict[str, int] = {}
        self.malformed: dict[str, int] = {}
        self.sample_rows: dict[int, int] = {}  # partition -> rows
        self.dlq_sources: dict[str, set[tuple[str, int, int]]] = {}
        self.errors = 0
        self._assigned: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.c.close()

    def _wanted(self, topic: str) -> bool:
        k = self.kafka
        return topic in (k.impressions_topic, k.clicks_topic, k.samples_topic) or topic.endswith(k.dlq_suffix)

    def _assign_new(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        md = self.c.list_topics(timeout=5).topics
        new = [TopicPartition(t, p, OFFSET_BEGINNING) for t, tm in md.items() if self._wanted(t)
               for p in tm.partitions if (t, p) not in self._assigned]
        if new:
            self.c.incremental_assign(new)
            self._assigned.update((tp.topic, tp.partition) for tp in new)

    def _run(self) -> None:
        import pyarrow as pa

        from stream.events import decode_click, decode_impression

        k = self.kafka
        decoders = {k.impressions_topic: decode_impression, k.clicks_topic: decode_click}
        last_md = 0.0
        while not self._stop.is_set():
            if time.monotonic() - last_md > 5:
                with contextlib.suppress(Exception):
                    self._assign_new()
                last_md = time.monotonic()
            try:
                msgs = self.c.consume(2000, 0.2)
            except Exception:  # noqa: BLE001
                self.errors += 1
                time.sleep(0.5)
                continue
            with self.lock:
                for m in msgs:
                    if m.error():
                        continue
                    t, p, o = m.topic(), m.partition(), m.offset()
                    self.end[(t, p)] = max(self.end.get((t, p), 0), o + 1)
                    self.messages[t] = self.messages.get(t, 0) + 1
                    dec = decoders.get(t)
                    if dec is not None:
                        try:
                            dec(m.value(), key=m.key())
                        except Exception:  # noqa: BLE001 - what the joiner dead-letters
                            self.malformed[t] = self.malformed.get(t, 0) + 1
                    elif t == k.samples_topic:
                        try:
                            rows = pa.ipc.open_stream(pa.py_buffer(m.value())).read_all().num_rows
                        except Exception:  # noqa: BLE001
                            rows = 0
                        self.sample_rows[p] = self.sample_rows.get(p, 0) + rows
                    elif t.endswith(k.dlq_suffix):
                        try:  # ours after the source message's own headers (stream/dlq.py)
                            d = DeadLetter.from_headers(m.headers())
                            src = (d.source_topic, d.source_partition, d.source_offset)
                        except (KeyError, ValueError):  # not a dead letter this code wrote
                            src = ("?", -1, -1)
                        self.dlq_sources.setdefault(t, set()).add(src)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"end": dict(self.end), "messages": dict(self.messages), "malformed": dict(self.malformed),
                    "sample_rows": sum(self.sample_rows.values()),
                    "dlq_distinct": {t: len(s) for t, s in self.dlq_sources.items()}}


class Offsets:
    """Committed offsets of a consumer group (read without joining it)."""

    def __init__(self, kafka: KafkaSettings, group: str) -> None:
        from confluent_kafka import Consumer

        self.c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
                           "enable.auto.commit": False, "log_level": 0})

    def committed(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int] | None:
        from confluent_kafka import TopicPartition

        if not tps:
            return {}
        try:
            got = self.c.committed([TopicPartition(t, p) for t, p in tps], timeout=5)
        except Exception:  # noqa: BLE001 - broker busy: no reading this interval
            return None
        return {(tp.topic, tp.partition): max(tp.offset, 0) for tp in got}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.c.close()


# -- the probe ---------------------------------------------------------------------------------------------
class Probe:
    """One scoring request (1 user x N candidates) per ``every_s`` on a keep-alive connection."""

    def __init__(self, port: int, pool: dict[str, Any], candidates: int, every_s: float, seed: int) -> None:
        self.port, self.pool, self.k, self.every = port, pool, candidates, every_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.results: list[tuple[float, float, bool]] = []  # (monotonic, ms, ok)
        self.last_error = ""
        self.model_version = ""
        self.delta_seq = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def body(self) -> bytes:
        users, items, item_ctx, ctx = self.pool["users"], self.pool["items"], self.pool["item_ctx"], self.pool["ctx"]
        idx = self.rng.sample(range(len(items)), self.k)
        return json.dumps({"user_id": self.rng.choice(users), "context": self.rng.choice(ctx),
                           "items": [{"item_id": items[i], "context": item_ctx[i]} for i in idx]}).encode()

    def _run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        nxt = time.monotonic()
        while not self._stop.is_set():
            body = self.body()
            t0 = time.perf_counter()
            ok = False
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("POST", "/v1/score", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                ok = resp.status == 200
                if ok:
                    out = json.loads(data)
                    ok = len(out.get("scores", [])) == self.k
                    self.model_version, self.delta_seq = str(out.get("model_version")), int(out.get("delta_seq", -1))
                else:
                    self.last_error = f"HTTP {resp.status}: {data[:200]!r}"
            except Exception as exc:  # noqa: BLE001 - counted as an error, reconnect next time
                self.last_error = f"{type(exc).__name__}: {exc}"
                if conn is not None:
                    conn.close()
                conn = None
            ms = (time.perf_counter() - t0) * 1000.0
            with self.lock:
                self.results.append((time.monotonic(), ms, ok))
            nxt += self.every
            self._stop.wait(max(0.0, nxt - time.monotonic()))
        if conn is not None:
            conn.close()

    def since(self, t: float) -> list[tuple[float, float, bool]]:
        with self.lock:
            return [r for r in self.results if r[0] >= t]


def probe_pool(args: argparse.Namespace) -> dict[str, Any]:
    """Realistic request contents: users, items with their tags and request contexts from a small synthetic
    table built with the soak's own settings (so about 30% of probe users are brand new)."""
    from stream.replay.config import ClickDelay, SyntheticSettings
    from stream.replay.synthetic import build_synthetic

    s = SyntheticSettings(impressions=20_000, users=args.syn_users, new_user_share=args.syn_new_user_share,
                          malformed_share=0.0)
    t = build_synthetic(s, ClickDelay(), seed=args.seed + 1)
    n = t.n_impressions
    merged: list[dict[str, Any]] = [{} for _ in range(n)]
    for part in t.context:
        idx = part.index.tolist()
        for i in range(n):
            merged[i].update(part.dicts[idx[i]])
    item_ctx: dict[int, dict[str, Any]] = {}
    for i, item in enumerate(t.item_id.tolist()):
        item_ctx.setdefault(int(item), {k: v for k, v in merged[i].items() if k == "tags"})
    items = list(item_ctx)
    return {"users": [int(u) for u in t.user_id.tolist()], "items": items, "item_ctx": [item_ctx[i] for i in items],
            "ctx": [{k: v for k, v in c.items() if k != "tags"} for c in merged[:2000]]}


# -- faults ------------------------------------------------------------------------------------------------
@dataclass
class Fault:
    at_s: float
    kind: str  # joiner_kill | learner_kill | redis_restart
    done_at_s: float | None = None
    note: str = ""


def schedule(args: argparse.Namespace, duration_s: float) -> list[Fault]:
    if args.no_faults:
        return []
    settle = min(90.0, 0.25 * duration_s)  # no fault so late that its recovery cannot be seen
    every = args.joiner_kill_every
    if every is None:
        every = 300.0 if duration_s >= 900 else duration_s / 3
    out: list[Fault] = []
    if every > 0:
        t = args.first_joiner_kill if args.first_joiner_kill is not None else every
        while t <= duration_s - settle:
            out.append(Fault(t, "joiner_kill"))
            t += every
    for share, kind in ((args.learner_kill_at, "learner_kill"), (args.redis_restart_at, "redis_restart")):
        if share is not None and 0 < share < 1:
            out.append(Fault(share * duration_s, kind))
    return sorted(out, key=lambda f: f.at_s)


# -- analysis ----------------------------------------------------------------------------------------------
def _col(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) if r.get(key) not in (None, "") else np.nan for r in rows], dtype=float)


def rss_summary(rows: list[dict[str, Any]], key: str, duration_s: float) -> dict[str, Any]:
    t, v = _col(rows, "t_s"), _col(rows, key)
    ok = np.isfinite(v)
    if not ok.any():
        return {"samples": 0}
    half = t >= duration_s / 2
    sel = ok & half
    slope = float(np.polyfit(t[sel] / 60.0, v[sel], 1)[0]) if sel.sum() >= 3 else float("nan")
    first = float(v[ok][0])
    out = {"first_mb": round(first, 1), "max_mb": round(float(np.nanmax(v)), 1), "last_mb": round(float(v[ok][-1]), 1),
           "growth_mb": round(float(v[ok][-1]) - first, 1),
           "second_half_slope_mb_per_min": round(slope, 2),
           "second_half_growth_mb": round(slope * (duration_s / 2) / 60.0, 1) if math.isfinite(slope) else None}
    if sel.any():
        out["second_half_max_mb"] = round(float(np.nanmax(v[sel])), 1)
        out["second_half_min_mb"] = round(float(np.nanmin(v[sel])), 1)
    return out


def incarnations(rows: list[dict[str, Any]], key: str, starts_key: str, warmup_s: float) -> list[dict[str, Any]]:
    """RSS per process lifetime (restarts split it): max and slope after a warm-up."""
    t, v, s = _col(rows, "t_s"), _col(rows, key), _col(rows, starts_key)
    out = []
    for n in sorted({int(x) for x in s[np.isfinite(s)]}):
        sel = (s == n) & np.isfinite(v)
        if not sel.any():
            continue
        t0 = t[sel][0]
        warm = sel & (t >= t0 + warmup_s)
        slope = float(np.polyfit(t[warm] / 60.0, v[warm], 1)[0]) if warm.sum() >= 3 else float("nan")
        out.append({"start": n, "from_s": round(float(t0), 1), "to_s": round(float(t[sel][-1]), 1),
                    "max_mb": round(float(v[sel].max()), 1), "last_mb": round(float(v[sel][-1]), 1),
                    "slope_after_warmup_mb_per_min": round(slope, 2)})
    return out


def recovery(rows: list[dict[str, Any]], faults: list[Fault], key: str, threshold: float,
             end_s: float) -> list[dict[str, Any]]:
    """Per fault: the peak of ``key`` before the next fault, and the seconds from the fault until ``key`` is back
    at or under ``threshold`` after having risen above it (0 when it never rose above it before the next fault;
    None when it never came back before the end). ``overlapped``: it came back only after the next fault."""
    t, v = _col(rows, "t_s"), _col(rows, key)
    out = []
    done = [f for f in faults if f.done_at_s is not None]
    for i, f in enumerate(done):
        until = done[i + 1].at_s if i + 1 < len(done) else end_s
        win = (t > f.at_s) & (t <= until) & np.isfinite(v)
        before = (t <= f.at_s) & (t > f.at_s - 60) & np.isfinite(v)
        rec: dict[str, Any] = {"fault": f.kind, "at_s": round(f.at_s, 1),
                               "lag_before": int(np.median(v[before])) if before.any() else None,
                               "peak": int(v[win].max()) if win.any() else None, "threshold": int(threshold),
                               "next_fault_after_s": round(until - f.at_s, 1) if i + 1 < len(done) else None}
        above = np.nonzero(win & (v > threshold))[0]
        if not len(above):
            rec["recovered_after_s"], rec["overlapped"] = 0.0, False
        else:
            back = np.nonzero((t > t[above[0]]) & np.isfinite(v) & (v <= threshold))[0]
            rec["recovered_after_s"] = round(float(t[back[0]] - f.at_s), 1) if len(back) else None
            rec["overlapped"] = bool(len(back) and t[back[0]] > until)
        out.append(rec)
    return out


def no_nan(x: Any) -> Any:
    """NaN is not JSON: null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [no_nan(v) for v in x]
    return x


def restarts_from_logs(logs: Path, child: Child, pattern: str, numbers: bool = True) -> list[dict[str, Any]]:
    """Per start of ``child``: the rounds of log lines matching ``pattern`` (the joiner's per-partition
    state restore, the learner's resume), each with its seconds from the launch; lines less than 2 s
    apart are one round. For the joiner a round also carries the pending impressions restored (sum over
    partitions) and the most state chunks of a partition."""
    import re
    from datetime import datetime

    out = []
    for n, wall in enumerate(child.started_wall, start=1):
        path = logs / f"{child.name}-{n}.log"
        if not path.is_file():
            continue
        rounds: list[dict[str, Any]] = []
        prev = -1e9
        seen: set[int] = set()
        for line in path.read_text(errors="replace").splitlines():
            if pattern not in line:
                continue
            try:
                ts = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            part = re.search(r"partition (\d+):", line)
            pnum = int(part.group(1)) if part else -1
            if ts - prev > 20.0 or pnum in seen or pnum < 0:  # a partition restored again: a new round
                rounds.append({"after_launch_s": 0.0, "pending": 0, "chunks": 0})
                seen = set()
            seen.add(pnum)
            prev = ts
            r = rounds[-1]
            r["after_launch_s"] = round(ts - wall, 1)
            if numbers:
                m = re.search(r"restored (\d+) pending impressions from (\d+) state chunks", line)
                if m:
                    r["pending"] += int(m.group(1))
                    r["chunks"] = max(r["chunks"], int(m.group(2)))
        if not numbers:
            for r in rounds:
                r.pop("pending"), r.pop("chunks")
        out.append({"start": n, "rounds": rounds})
    return out


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def plot(rows: list[dict[str, Any]], faults: list[Fault], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _col(rows, "t_s") / 60.0
    panels: list[tuple[str, list[tuple[str, str]]]] = [
        ("joiner RSS (MB)", [("joiner_rss_mb", "joiner")]),
        ("learner RSS (MB)", [("learner_rss_mb", "learner")]),
        ("serving RSS (MB)", [("serving_rss_mb", "serving")]),
        ("broker / Redis RSS (MB)", [("broker_rss_mb", "broker (Tansu, in memory)"), ("redis_rss_mb", "redis")]),
        ("joiner lag (events)", [("joiner_lag_events", "impressions + clicks"),
                                 ("joiner_lag_impressions", "impressions")]),
        ("learner lag (sample rows)", [("learner_lag_rows", "rows produced - consumed")]),
        ("probe latency (ms)", [("probe_p50_ms", "p50"), ("probe_p99_ms", "p99")]),
        ("probe errors per interval", [("probe_errors", "errors")]),
        ("DLQ messages", [("dlq_impressions", "impressions.dlq"), ("dlq_clicks", "clicks.dlq"),
                          ("dlq_samples", "samples.dlq"), ("malformed_input", "malformed in input")]),
        ("throughput (events/s, rows/s)", [("input_rate", "input events/s"), ("samples_rate", "sample rows/s")]),
        ("faults injected", [("faults", "faults so far")]),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.3 * len(panels)), sharex=True)
    colors = {"joiner_kill": "tab:red", "learner_kill": "tab:purple", "redis_restart": "tab:green"}
    for ax, (name, series) in zip(axes, panels, strict=True):
        for key, label in series:
            ax.plot(t, _col(rows, key), label=label, lw=1.2)
        for f in faults:
            if f.done_at_s is not None:
                ax.axvline(f.at_s / 60.0, color=colors.get(f.kind, "k"), ls="--", lw=0.9, alpha=0.8)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    from matplotlib.lines import Line2D

    handles = [Line2D([0], [0], color=c, ls="--", label=k) for k, c in colors.items()]
    axes[0].legend(handles=[*axes[0].get_legend_handles_labels()[0], *handles], fontsize=7, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------------------------
@dataclass
class Soak:
    args: argparse.Namespace
    out: Path
    duration_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    duration_s = args.minutes * 60.0
    out = Path(args.out) if args.out else ROOT / ".streamrec" / "soak" / time.strftime("%Y%m%dT%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    _LOG[:] = [out / "soak.log"]  # what goes to stderr, also kept with the run
    soak = Soak(args, out, duration_s, faults=schedule(args, duration_s))
    stack = LocalStack(StackSettings(state_dir=out / "stack", kafka_port=free_port(), redis_port=free_port()))
    children: dict[str, Child] = {}
    tail: Tail | None = None
    groups: list[Offsets] = []
    csv_fh = None
    interrupted = ""
    stopping = threading.Event()
    serving: dict[str, Any] | None = None
    starter: threading.Thread | None = None

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started in the background, where SIGINT is ignored
    log(f"run directory {out}; {args.minutes:g} min at {args.rate:g} events/s; faults: "
        + (", ".join(f"{f.kind}@{f.at_s:.0f}s" for f in soak.faults) or "none"))
    try:
        stack.up()
        kafka = KafkaSettings(bootstrap_servers=stack.bootstrap_servers)
        from stream.kafka_topics import ensure_topics

        ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic, kafka.samples_topic])
        env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=stack.bootstrap_servers,
                   STREAMREC_REDIS_URL=stack.redis_url, PYTHONUNBUFFERED="1",
                   STREAMREC_LEARNER_GROUP_ID=LEARN_GROUP,
                   STREAMREC_LEARNER_DELTAS_EVERY_S=str(args.deltas_every_s),
                   STREAMREC_LEARNER_DELTAS_DIR=str(out / "deltas"),
                   STREAMREC_LEARNER_DELTAS_REDIS_URL=stack.redis_url)
        py = [sys.executable, "-m", "streamrec.cli"]
        impressions = int(math.ceil(args.rate * (duration_s + 120) / EVENTS_PER_IMPRESSION))
        join_port, learn_port, serve_port = free_port(), free_port(), free_port()
        children["replay"] = Child("replay", [
            *py, "replay", "--dataset", "synthetic", "--rate", str(args.rate), "--seed", str(args.seed),
            "--no-progress", "--json", "--syn-impressions", str(impressions), "--syn-users", str(args.syn_users),
            "--syn-new-user-share", str(args.syn_new_user_share),
            "--syn-malformed-share", str(args.syn_malformed_share)], env, out / "logs")
        children["joiner"] = Child("joiner", [
            *py, "join", "--driver", "kafka", "--app-id", JOIN_GROUP, "--metrics-port", str(join_port),
            "--log-level", "info"], env, out / "logs")
        amp = args.learner_amp if args.learner_amp != "auto" else ("on" if native_bf16() else "off")
        learner_env = dict(env, STREAMREC_LEARNER_AMP="true" if amp == "on" else "false")
        if args.learner_threads > 0:
            learner_env.update(OMP_NUM_THREADS=str(args.learner_threads), MKL_NUM_THREADS=str(args.learner_threads))
        soak.notes.append(f"learner: bf16 autocast {amp} (--learner-amp {args.learner_amp}; native bf16 on this CPU: "
                          f"{native_bf16()}), torch threads {args.learner_threads or 'torch default'}")
        children["learner"] = Child("learner", [
            *py, "train", "--checkpoint-dir", str(out / "checkpoints"), "--metrics-port", str(learn_port),
            "--log-level", "info"], learner_env, out / "logs")
        children["serving"] = Child("serving", [
            *py, "serve", "--port", str(serve_port), "--publish-root", str(out / "serving"),
            "--deltas-dir", str(out / "deltas"), "--log-level", "warning"], env, out / "logs")
        pool = probe_pool(args)
        tail = Tail(kafka)
        tail.start()
        join_offsets, learn_offsets = Offsets(kafka, JOIN_GROUP), Offsets(kafka, LEARN_GROUP)
        groups = [join_offsets, learn_offsets]

        t0 = time.monotonic()
        for name in ("replay", "joiner", "learner"):
            children[name].start()
        learner_base = 0  # rows the running learner resumed with (from its checkpoint)
        serving = {"up": False, "probe": None}
        next_sample = t0 + args.interval
        last: dict[str, Any] = {}
        fields: list[str] | None = None
        csv_fh = (out / "soak.csv").open("w", newline="")
        writer: csv.DictWriter | None = None
        from learner.checkpoint_read import latest_meta

        def ckpt_rows() -> tuple[int, dict[int, int]]:
            meta = latest_meta(out / "checkpoints")
            if meta is None:
                return 0, {}
            return sum(int(v) for v in meta["partition_rows"].values()), {int(p): int(o)
                                                                          for p, o in meta["offsets"].items()}

        def restart(name: str) -> None:
            nonlocal learner_base
            if name == "learner":
                learner_base = ckpt_rows()[0]
            children[name].start()

        def restart_redis(f: Fault) -> None:
            """Stop redis-server (SIGTERM), leave it down, start it again on the same port (empty: no
            persistence); the main loop goes on sampling meanwhile."""
            info = json.loads((stack.state_dir / "redis.pid.json").read_text())
            pid = int(info["pid"])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # the stack's child: reap it
                time.sleep(0.05)
            stopping.wait(args.redis_down_s)
            if stopping.is_set():
                return
            stack.up()  # idempotent: the broker is left alone, Redis starts again on the same port
            new = json.loads((stack.state_dir / "redis.pid.json").read_text())["pid"]
            f.note = (f"redis pid {pid} stopped (SIGTERM), down {args.redis_down_s:g}s, restarted as pid {new} "
                      f"on port {stack.s.redis_port} at {time.monotonic() - t0:.1f}s")
            log(f"FAULT redis_restart done: {f.note}")

        def bring_up_serving() -> None:
            for attempt in range(1, 11):
                if stopping.is_set():
                    return
                ref = children[f"refresh-{attempt}"] = Child(f"refresh-{attempt}", [
                    *py, "refresh", "--now", "--checkpoint-dir", str(out / "checkpoints"),
                    "--publish-root", str(out / "serving"), "--json"], env, out / "logs")
                ref.start()
                assert ref.proc is not None
                code = ref.proc.wait()
                if stopping.is_set():
                    return
                if code != 0:
                    log(f"refresh --now failed (code {code}; logs/{ref.name}-1.log), retrying in 30 s")
                    stopping.wait(30)
                    continue
                children["serving"].start()
                ready = wait_http(f"http://127.0.0.1:{serve_port}/readyz", 120, stopping)
                if stopping.is_set():
                    return
                if ready:
                    soak.notes.append(f"serving ready at {time.monotonic() - t0:.0f}s (refresh attempt {attempt})")
                    log(soak.notes[-1])
                    p = Probe(serve_port, pool, args.candidates, args.probe_every_s, args.seed)
                    serving["probe"] = p
                    serving["up"] = True
                    p.start()
                    return
                log("serving did not become ready within 120 s (see logs/serving-*.log); retrying")
                children["serving"].stop()
                stopping.wait(30)
            soak.notes.append("serving never came up (10 attempts)")

        while True:
            now = time.monotonic()
            el = now - t0
            if el >= duration_s:
                break
            # faults due
            for f in soak.faults:
                if f.done_at_s is None and el >= f.at_s:
                    if f.kind in ("joiner_kill", "learner_kill"):
                        name = f.kind.split("_")[0]
                        ch = children[name]
                        f.note = f"pid {ch.pid} (start #{ch.starts}), rss {rss_mb(ch.pid):.0f} MB"
                        ch.kill()
                        time.sleep(args.restart_delay_s)
                        restart(name)
                    elif f.kind == "redis_restart":
                        threading.Thread(target=restart_redis, args=(f,), name="redis-restart", daemon=True).start()
                    f.done_at_s = time.monotonic() - t0
                    log(f"FAULT {f.kind} at {f.at_s:.0f}s: {f.note or 'started'}")
            # unexpected exits: restart as a supervisor would (the replay is not restarted: it is the input)
            for name, ch in list(children.items()):
                code = ch.exited()
                if code is None or name == "replay" or name.startswith("refresh") or ch.proc is None:
                    continue
                if name == "serving" and not serving["up"]:
                    continue
                ch.unexpected_exits.append((round(el, 1), code))
                tail_log = (out / "logs" / f"{name}-{ch.starts}.log").read_text(errors="replace")[-1500:]
                log(f"{name} exited on its own with code {code} at {el:.0f}s; restarting. Log tail:\n{tail_log}")
                restart(name)
            if children["replay"].exited() is not None and "replay_exit" not in last:
                last["replay_exit"] = (round(el, 1), children["replay"].exited())
                soak.notes.append(f"replay exited with code {children['replay'].exited()} at {el:.0f}s")
                log(soak.notes[-1])
            # serving once the learner has a checkpoint (refresh + start in the background)
            if starter is None and latest_meta(out / "checkpoints") is not None:
                starter = threading.Thread(target=bring_up_serving, name="serving-up", daemon=True)
                starter.start()
            # one sample per interval
            if now >= next_sample:
                next_sample += args.interval
                probe = serving["probe"]
                row = sample(soak, children, stack, tail, join_offsets, learn_offsets, probe, learn_port, join_port,
                             learner_base, ckpt_rows, now - t0, last)
                soak.rows.append(row)
                if writer is None:
                    fields = list(row)
                    writer = csv.DictWriter(csv_fh, fieldnames=fields)
                    writer.writeheader()
                writer.writerow(row)
                csv_fh.flush()
                log(progress_line(row))
            time.sleep(0.2)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "Ctrl-C"
        log(f"interrupted ({interrupted}); stopping everything")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        stopping.set()
        for name, ch in list(children.items()):
            if name.startswith("refresh"):
                ch.stop()
        if starter is not None:
            starter.join(timeout=60)  # it starts nothing once stopping is set
        probe = serving["probe"] if serving is not None else None
        if probe is not None:
            probe.stop()
        stop_codes: dict[str, Any] = {}
        for name in ("replay", "serving", "joiner", "learner"):
            ch = children.get(name)
            if ch is not None:
                with contextlib.suppress(Exception):
                    stop_codes[name] = ch.stop()
        if tail is not None:
            tail.stop()
        for g in groups:
            g.close()
        with contextlib.suppress(Exception):
            stack.down()
        if csv_fh is not None:
            csv_fh.close()
        # written also when the run failed, from what was sampled until then
        summary = summarize(soak, children, probe, stop_codes, interrupted)
        (out / "summary.json").write_text(json.dumps(no_nan(summary), indent=2))
        if soak.rows:
            plot(soak.rows, soak.faults, out / "soak.png",
                 f"streamrec soak: {args.minutes:g} min, {args.rate:g} events/s, "
                 f"{summary['verdict']['faults_injected']} faults")
        if not args.keep_state:  # ~1 GB of checkpoints, deltas and artifacts per 30 minutes
            import shutil

            for sub in ("checkpoints", "deltas", "serving"):
                shutil.rmtree(out / sub, ignore_errors=True)
        log(f"wrote {out / 'soak.csv'}, {out / 'summary.json'}, {out / 'soak.png'}")
    print(json.dumps(summary["verdict"], indent=2))
    return 0 if not interrupted else 130


def sample(soak: Soak, children: dict[str, Child], stack: LocalStack, tail: Tail, join_offsets: Offsets,
           learn_offsets: Offsets, probe: Probe | None, learn_port: int, join_port: int, learner_base: int,
           ckpt_rows: Any, t_s: float, last: dict[str, Any]) -> dict[str, Any]:
    kafka = tail.kafka
    snap = tail.snapshot()
    end = snap["end"]

    def produced(topic: str) -> dict[tuple[str, int], int]:
        return {k: v for k, v in end.items() if k[0] == topic}

    imp, clk = produced(kafka.impressions_topic), produced(kafka.clicks_topic)
    committed = join_offsets.committed([*imp, *clk]) if (imp or clk) else {}
    if committed is None:
        committed = last.get("join_committed", {})
    last["join_committed"] = committed
    lag_imp = sum(max(0, e - committed.get(k, 0)) for k, e in imp.items())
    lag_clk = sum(max(0, e - committed.get(k, 0)) for k, e in clk.items())

    base_rows, ckpt_offsets = ckpt_rows()
    lm = scrape(learn_port)
    rows_produced = snap["sample_rows"]
    if lm is not None and children["learner"].pid is not None:
        consumed = learner_base + metric_sum(lm, "streamrec_learner_samples_total") + metric_sum(
            lm, "streamrec_learner_duplicates_total")
    else:
        consumed = base_rows  # down or starting: what the newest checkpoint holds
    samples_end = produced(kafka.samples_topic)
    ckpt_lag_msgs = sum(max(0, e - ckpt_offsets.get(p, 0)) for (_, p), e in samples_end.items())
    jm = scrape(join_port)

    probes = probe.since(last.get("probe_t", 0.0)) if probe is not None else []
    last["probe_t"] = time.monotonic()
    lat = [ms for _, ms, ok in probes if ok]
    stack_pids = {}
    for name in ("kafka", "redis"):
        with contextlib.suppress(Exception):
            stack_pids[name] = int(json.loads((stack.state_dir / f"{name}.pid.json").read_text())["pid"])
    dlq = snap["messages"]
    input_total = sum(imp.values()) + sum(clk.values())
    dt = t_s - last.get("t_s", 0.0)
    row = {
        "t_s": round(t_s, 1),
        "joiner_rss_mb": round(rss_mb(children["joiner"].pid), 1),
        "learner_rss_mb": round(rss_mb(children["learner"].pid), 1),
        "serving_rss_mb": round(rss_mb(children["serving"].pid), 1),
        "broker_rss_mb": round(rss_mb(stack_pids.get("kafka")), 1),
        "redis_rss_mb": round(rss_mb(stack_pids.get("redis")), 1),
        "replay_rss_mb": round(rss_mb(children["replay"].pid), 1),
        "impressions_produced": sum(imp.values()),
        "clicks_produced": sum(clk.values()),
        "joiner_committed": sum(committed.values()),
        "joiner_lag_events": lag_imp + lag_clk,
        "joiner_lag_impressions": lag_imp,
        "joiner_pending_impressions": int(metric_sum(jm, "streamrec_join_pending_impressions")) if jm else "",
        "samples_rows_produced": rows_produced,
        "learner_rows_consumed": int(consumed),
        "learner_lag_rows": max(0, int(rows_produced - consumed)),
        "learner_ckpt_lag_rows": max(0, rows_produced - base_rows),
        "learner_ckpt_lag_msgs": ckpt_lag_msgs,
        "learner_auc": round(lm.get("streamrec_learner_progressive_auc", float("nan")), 4) if lm else "",
        "learner_user_occupancy": round(lm.get('streamrec_learner_id_occupancy{field="user_id"}', float("nan")), 4)
        if lm else "",
        "learner_item_occupancy": round(lm.get('streamrec_learner_id_occupancy{field="item_id"}', float("nan")), 4)
        if lm else "",
        "input_rate": round((input_total - last.get("input_total", 0)) / dt, 1) if dt > 0 else "",
        "samples_rate": round((rows_produced - last.get("rows_produced", 0)) / dt, 1) if dt > 0 else "",
        "probe_ok": len(lat),
        "probe_errors": len(probes) - len(lat),
        "probe_p50_ms": round(percentile(lat, 50), 2) if lat else "",
        "probe_p99_ms": round(percentile(lat, 99), 2) if lat else "",
        "probe_delta_seq": probe.delta_seq if probe is not None else "",
        "dlq_impressions": dlq.get(kafka.dlq_topic(kafka.impressions_topic), 0),
        "dlq_clicks": dlq.get(kafka.dlq_topic(kafka.clicks_topic), 0),
        "dlq_samples": dlq.get(kafka.dlq_topic(kafka.samples_topic), 0),
        "dlq_distinct": sum(snap["dlq_distinct"].values()),
        "malformed_input": sum(snap["malformed"].values()),
        "faults": sum(1 for f in soak.faults if f.done_at_s is not None),
        "joiner_starts": children["joiner"].starts,
        "learner_starts": children["learner"].starts,
        "serving_starts": children["serving"].starts,
    }
    last.update(t_s=t_s, input_total=input_total, rows_produced=rows_produced)
    if probe is not None and len(probes) > len(lat):
        row_err = probe.last_error
        if row_err != last.get("probe_error_logged"):
            log(f"probe errors this interval: {len(probes) - len(lat)}; last: {row_err}")
            last["probe_error_logged"] = row_err
    return row


def progress_line(r: dict[str, Any]) -> str:
    m, s = divmod(int(r["t_s"]), 60)
    p = f"p50 {r['probe_p50_ms']} p99 {r['probe_p99_ms']} ms ({r['probe_ok']} ok, {r['probe_errors']} err)" \
        if r["probe_ok"] or r["probe_errors"] else "probe not started"
    return (f"{m:3d}:{s:02d} rss MB joiner {r['joiner_rss_mb']:.0f} learner {r['learner_rss_mb']:.0f} "
            f"serving {r['serving_rss_mb']:.0f} broker {r['broker_rss_mb']:.0f} | in {r['impressions_produced']:,}+"
            f"{r['clicks_produced']:,} | lag joiner {r['joiner_lag_events']:,} ev, learner {r['learner_lag_rows']:,} "
            f"rows | {p} | dlq {r['dlq_impressions'] + r['dlq_clicks'] + r['dlq_samples']} "
            f"(malformed in {r['malformed_input']}) | faults {r['faults']}")


def num(x: Any) -> Any:
    """A CSV cell (or a live value) as a number where it is one."""
    if isinstance(x, str):
        try:
            f = float(x)
        except ValueError:
            return x if x else None
        return int(f) if f.is_integer() else f
    return x


def warmup_s(args: argparse.Namespace) -> float:
    """Wall seconds until the joiner's state is full: it holds an impression for the attribution window and then
    its id for ``late_retention_s`` (to tell late clicks from orphans), both in event time, which the paced
    synthetic stream advances ``rate / events per impression / impressions_per_s`` times faster than the wall."""
    from stream.joiner.config import JoinerSettings
    from stream.replay.config import SyntheticSettings

    js, syn = JoinerSettings(), SyntheticSettings()
    speed = args.rate / EVENTS_PER_IMPRESSION / syn.impressions_per_s
    return (js.attribution_window_s + js.late_retention_s) / speed


def analyze(rows: list[dict[str, Any]], faults: list[Fault], args: argparse.Namespace,
            duration_s: float) -> dict[str, Any]:
    """Everything the summary derives from the sampled rows (also rerun by --reanalyze on soak.csv)."""
    end_s = float(num(rows[-1]["t_s"])) if rows else 0.0
    warm = warmup_s(args)
    since = max(warm, duration_s / 2)  # RSS is judged after the warm-up, and on the second half at least
    rss = {k: rss_summary(rows, f"{k}_rss_mb", duration_s) for k in ("joiner", "learner", "serving", "broker",
                                                                      "redis")}
    per_life = {"joiner": incarnations(rows, "joiner_rss_mb", "joiner_starts", 60.0),
                "learner": incarnations(rows, "learner_rss_mb", "learner_starts", 60.0)}
    thr_join = args.recovered_lag_s * args.rate
    thr_learn = args.recovered_lag_s * args.rate / EVENTS_PER_IMPRESSION
    rec_join = recovery(rows, faults, "joiner_lag_events", thr_join, end_s)
    rec_learn = recovery(rows, faults, "learner_lag_rows", thr_learn, end_s)
    last = {k: num(v) for k, v in rows[-1].items()} if rows else {}
    t = _col(rows, "t_s")

    def after(name: str) -> dict[str, Any]:
        """Growth of ``name``'s RSS after ``since``: fitted slope x span, max - min, flat or not."""
        v = _col(rows, f"{name}_rss_mb")
        sel = (t >= since) & np.isfinite(v)
        if sel.sum() < 3:
            return {"flat": None}
        slope = float(np.polyfit(t[sel] / 60.0, v[sel], 1)[0])
        growth = slope * (t[sel][-1] - t[sel][0]) / 60.0
        return {"from_s": round(since, 1), "slope_mb_per_min": round(slope, 2), "fitted_growth_mb": round(growth, 1),
                "min_mb": round(float(v[sel].min()), 1), "max_mb": round(float(v[sel].max()), 1),
                "flat": bool(growth <= max(20.0, 0.05 * float(v[sel].max())))}

    # The joiner is restarted every few minutes, so its RSS is a saw: judge it by the peaks of the lifetimes
    # that began after the warm-up (each one restores the full state).
    j_life = [x for x in per_life["joiner"] if x["from_s"] >= warm and x["to_s"] - x["from_s"] >= 120]
    j_peaks = [x["max_mb"] for x in j_life]
    joiner_flat: dict[str, Any] = {"lifetimes_after_warmup": len(j_life), "peaks_mb": j_peaks, "flat": None}
    if len(j_peaks) >= 2:
        joiner_flat["flat"] = bool(max(j_peaks) - min(j_peaks) <= max(20.0, 0.05 * max(j_peaks)))
    verdict = {
        "warmup_s": round(warm, 1),
        "rss_after_warmup": {"joiner": joiner_flat, "learner": after("learner"), "serving": after("serving"),
                             "broker": after("broker")},
        "rss_max_mb": {k: v.get("max_mb") for k, v in rss.items()},
        "joiner_lag_recovered_after_s": [r["recovered_after_s"] for r in rec_join],
        "learner_lag_recovered_after_s": [r["recovered_after_s"] for r in rec_learn],
        "all_recovered": all(r["recovered_after_s"] is not None for r in rec_join + rec_learn),
        "lag_at_end": {"joiner_events": last.get("joiner_lag_events"), "learner_rows": last.get("learner_lag_rows")},
        "faults_injected": sum(1 for f in faults if f.done_at_s is not None),
    }
    return {
        "verdict": verdict, "rss": rss, "rss_per_lifetime": per_life,
        "recovery": {"joiner_lag_events": rec_join, "learner_lag_rows": rec_learn,
                     "thresholds": {"joiner_events": thr_join, "learner_rows": thr_learn,
                                    "meaning": f"{args.recovered_lag_s:g} s of input"}},
        "dlq": {"impressions.dlq": last.get("dlq_impressions"), "clicks.dlq": last.get("dlq_clicks"),
                "samples.dlq": last.get("dlq_samples"), "distinct_source_offsets": last.get("dlq_distinct"),
                "malformed_in_input": last.get("malformed_input")},
        "totals": {k: last.get(k) for k in ("impressions_produced", "clicks_produced", "samples_rows_produced",
                                            "learner_rows_consumed", "joiner_starts", "learner_starts")},
    }


def summarize(soak: Soak, children: dict[str, Child], probe: Probe | None, stop_codes: dict[str, Any],
              interrupted: str) -> dict[str, Any]:
    args, rows, d = soak.args, soak.rows, soak.duration_s
    a = analyze(rows, soak.faults, args, d)
    all_lat = [ms for _, ms, ok in probe.results if ok] if probe is not None else []
    errors = sum(1 for _, _, ok in probe.results if not ok) if probe is not None else 0
    a["verdict"].update({
        "probe_p50_ms": round(percentile(all_lat, 50), 2) if all_lat else None,
        "probe_p99_ms": round(percentile(all_lat, 99), 2) if all_lat else None,
        "probe_errors": errors,
        "unexpected_exits": {n: c.unexpected_exits for n, c in children.items() if c.unexpected_exits},
    })
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": dict(vars(args)),
        "run_dir": str(soak.out), "duration_s": d, "sampled_until_s": rows[-1]["t_s"] if rows else 0.0,
        "interrupted": interrupted or None,
        **a,
        "probe": {"requests": len(probe.results) if probe else 0, "ok": len(all_lat), "errors": errors,
                  "p50_ms": a["verdict"]["probe_p50_ms"], "p99_ms": a["verdict"]["probe_p99_ms"],
                  "max_ms": round(max(all_lat), 2) if all_lat else None,
                  "last_error": probe.last_error if probe else "",
                  "model_version": probe.model_version if probe else "",
                  "last_delta_seq": probe.delta_seq if probe else None},
        "faults": [{"kind": f.kind, "at_s": round(f.at_s, 1),
                    "done_at_s": None if f.done_at_s is None else round(f.done_at_s, 1), "note": f.note}
                   for f in soak.faults],
        "restarts": {
            "joiner": restarts_from_logs(soak.out / "logs", children["joiner"], "pending impressions from")
            if "joiner" in children else [],
            "learner": restarts_from_logs(soak.out / "logs", children["learner"], "resumed from", numbers=False)
            if "learner" in children else [],
            "launched_at": {n: c.started_wall for n, c in children.items() if n in ("joiner", "learner")},
            "meaning": "rounds: the joiner's state restores ('restored N pending impressions from M state chunks' "
                       "log lines: seconds from launch to the round's last line, N summed over partitions, M the "
                       "most of one partition; a second round in one lifetime follows an in-process recovery) / "
                       "the learner's 'resumed from'",
        },
        "notes": soak.notes, "stop_codes": stop_codes,
    }


def reanalyze(run_dir: Path) -> int:
    """Recompute the derived parts of RUN_DIR/summary.json from soak.csv (after a change of the analysis), keep
    what only the live run knew (probe latencies, restarts, exits), redraw the PNG."""
    with (run_dir / "soak.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = [Fault(f["at_s"], f["kind"], f["done_at_s"], f["note"]) for f in summary["faults"]]
    args = argparse.Namespace(**summary["settings"])
    a = analyze(rows, faults, args, float(summary["duration_s"]))
    keep = {k: summary["verdict"][k] for k in ("probe_p50_ms", "probe_p99_ms", "probe_errors", "unexpected_exits")
            if k in summary["verdict"]}
    a["verdict"].update(keep)
    summary.update(a)
    (run_dir / "summary.json").write_text(json.dumps(no_nan(summary), indent=2))
    log(f"rewrote {run_dir / 'summary.json'}")
    replot(run_dir)
    print(json.dumps(no_nan(summary["verdict"]), indent=2))
    return 0


def replot(run_dir: Path) -> int:
    with (run_dir / "soak.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = [Fault(f["at_s"], f["kind"], f["done_at_s"], f["note"]) for f in summary["faults"]]
    st = summary["settings"]
    plot(rows, faults, run_dir / "soak.png", f"streamrec soak: {st['minutes']:g} min, {st['rate']:g} events/s, "
         f"{summary['verdict']['faults_injected']} faults")
    log(f"wrote {run_dir / 'soak.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the run (default %(default)s)")
    ap.add_argument("--rate", type=float, default=1500.0,
                    help="replay pace, events (impressions + clicks) per wall-clock second (default %(default)s)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default %(default)s)")
    ap.add_argument("--out", help="run directory (default .streamrec/soak/<time>)")
    ap.add_argument("--keep-state", action="store_true",
                    help="keep the learner's checkpoints and deltas and the serving artifacts in the run directory "
                         "(deleted at the end by default; logs, soak.csv, summary.json and soak.png stay)")
    g = ap.add_argument_group("input (streamrec replay --dataset synthetic)")
    g.add_argument("--syn-users", type=int, default=100_000_000, help="user id cardinality (default %(default)s)")
    g.add_argument("--syn-new-user-share", type=float, default=0.3,
                   help="share of impressions from brand-new users (default %(default)s)")
    g.add_argument("--syn-malformed-share", type=float, default=0.002,
                   help="share of malformed messages (default %(default)s)")
    g.add_argument("--seed", type=int, default=7, help="seed of the synthetic stream (default %(default)s)")
    g = ap.add_argument_group("learner and serving")
    g.add_argument("--deltas-every-s", type=float, default=5.0,
                   help="learner serving deltas every this many seconds (default %(default)s)")
    g.add_argument("--learner-amp", choices=["auto", "on", "off"], default="auto",
                   help="the learner's bf16 autocast ([learner] amp, on in streamrec's defaults): auto = on only where "
                        "the CPU has bf16 instructions; emulated bf16 made the MLP 7x slower than fp32 on an AVX2-only "
                        "CPU and the learner fell behind at 1500 events/s (default %(default)s)")
    g.add_argument("--learner-threads", type=int, default=1,
                   help="torch threads of the learner (OMP_NUM_THREADS); 0 = torch's default (one per core). On 2 "
                        "shared cores 2 threads were 2-4x slower than 1 (default %(default)s)")
    g.add_argument("--candidates", type=int, default=100, help="items per probe request (default %(default)s)")
    g.add_argument("--probe-every-s", type=float, default=1.0, help="seconds between probes (default %(default)s)")
    g = ap.add_argument_group("faults (times from the start of the run)")
    g.add_argument("--joiner-kill-every", type=float, default=None,
                   help="SIGKILL the joiner every this many seconds and restart it; 0 = never (default 300, or a "
                        "third of the run for runs under 15 minutes)")
    g.add_argument("--first-joiner-kill", type=float, default=None,
                   help="seconds to the first joiner kill (default: --joiner-kill-every)")
    g.add_argument("--learner-kill-at", type=float, default=0.4,
                   help="SIGKILL the learner once at this share of the run and restart it; 0 = never "
                        "(default %(default)s)")
    g.add_argument("--redis-restart-at", type=float, default=0.6,
                   help="restart Redis once at this share of the run; 0 = never (default %(default)s)")
    g.add_argument("--redis-down-s", type=float, default=5.0,
                   help="seconds Redis stays down (default %(default)s)")
    g.add_argument("--restart-delay-s", type=float, default=1.0,
                   help="seconds between a kill and the restart (default %(default)s)")
    g.add_argument("--no-faults", action="store_true", help="inject nothing (a baseline run)")
    g.add_argument("--recovered-lag-s", type=float, default=3.0,
                   help="a lag of at most this many seconds of input counts as recovered (~0) (default %(default)s)")
    ap.add_argument("--replot", metavar="RUN_DIR",
                    help="only redraw RUN_DIR/soak.png from its soak.csv and summary.json")
    ap.add_argument("--reanalyze", metavar="RUN_DIR",
                    help="recompute RUN_DIR/summary.json's analysis from soak.csv, then redraw the PNG")
    args = ap.parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    if args.reanalyze:
        return reanalyze(Path(args.reanalyze))
    if args.minutes <= 0 or args.rate <= 0 or args.interval <= 0:
        ap.error("--minutes, --rate and --interval must be > 0")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
