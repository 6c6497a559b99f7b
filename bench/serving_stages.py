"""Where one request's time goes inside a running scoring server: the HTTP side of issue 17's latency target.

``bench/serving.py`` times requests from the client, and each stage of a request in a tight loop in its own process;
neither says what a running server spends beyond the scoring. This script starts the service (``ScoringService``, the
threading server, as ``streamrec serve`` does) in a process of its own, drives it with the same keep-alive
``http.client`` loop (1 user x 100 candidates, Zipf traffic), and times each stage inside the server (wall time,
``perf_counter``, p50/p99 over the measured requests). The same server in three modes, one after the other:

* ``real``: the service as it serves.
* ``noop``: the model's ``score_arrays`` (``score_request`` before it) returns zeros: HTTP, JSON, validation,
  encoding, the history read and the metrics are left.
* ``fixed``: ``ScoringApp.handle`` returns a fixed answer of the real size: the HTTP server alone.

Stages (nested: ``request`` holds the others): ``request`` (``_Handler._one_request``: request line to answer
written), ``head`` (request line and headers), ``app`` (``ScoringApp.handle``), ``json_in`` (JSON decode +
validation), ``hist_send`` (``HistoryReader.start``: the Redis read sent), ``encode`` (``FeatureEncoder.check``,
which ends by collecting the history; ``encode`` before the split), ``history`` (inside ``encode``: waiting for
Redis's answer and parsing it, ``HistoryReader._finish``), ``score`` (``ScoringModel.score_arrays``, what the app
scores with; ``score_request`` before it), inside it ``rows`` (``ScoringModel._given_at``: the hot/cold/override
lookup) and ``ort`` (``OnnxScorer.score_rows``: the ONNX formats' one ONNX Runtime call), ``send`` (writing the
answer: on a busy machine this includes the client being scheduled on its wake-up). Run in a checkout from before
the read was split, ``history`` is the whole read.

The tail: after the table, the slowest 1% of requests (by ``request``) with the mean of each stage over them beside
its median over all requests, and the garbage collections (how many, the longest, in how many of the slowest
requests): which stage a p99 comes from. ``--pin`` (a diagnostic) puts the server process on the last CPU and the
client and Redis on the others.

Reproduce::

    .venv/bin/python bench/serving_stages.py                    # 200 k rows, onnx_int8, Redis history, 2000 requests
    .venv/bin/python bench/serving_stages.py --format torchscript --no-redis --modes real,fixed

Figures are noisy on a shared machine: run it twice, or interleave it with another checkout's run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = ("request", "head", "app", "json_in", "hist_send", "encode", "history", "score", "rows", "ort", "send")
TAIL = 0.01  # the slowest share of requests whose stages are logged (--tail)


class _Record(threading.local):
    """The stages of the request the current thread serves (one dict per request, started by ``request``)."""

    current: dict[str, float] | None = None


def _timed(times: dict[str, list[float]], key: str, fn: Callable[..., Any], record: _Record | None = None,
           per_request: list[dict[str, float]] | None = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if key == "request" and record is not None and per_request is not None:
            record.current = {}
            per_request.append(record.current)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            times[key].append(dt)
            cur = record.current if record is not None else None
            if cur is not None:
                cur[key] = cur.get(key, 0.0) + dt

    return wrapper


def serve(publish_root: str, mode: str, redis_url: str) -> int:
    """The server process: the service with a timer around each stage; at SIGTERM one JSON line of p50/p99 (us)."""
    import torch

    import serving.app as app_mod
    import serving.http_threaded as http_mod
    from serving.features import FeatureEncoder
    from serving.history import HistoryReader
    from serving.model import ScoringModel
    from serving.service import ScoringService
    from serving.settings import ServeSettings
    from stream.config import RedisSettings

    torch.set_num_threads(1)  # as `streamrec serve` with the default [serve] threads
    rs = RedisSettings(url=redis_url, prefix="bench") if redis_url else None
    svc = ScoringService(ServeSettings(port=0, publish_root=Path(publish_root), lookup_counts=False), rs).start()
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    record, per_request = _Record(), []  # per_request: each request's stages (the tail's breakdown)
    gcs: list[float] = []  # each garbage collection's wall time (its share of the tail)

    def on_gc(phase: str, info: dict[str, Any], _t: list[float] = [0.0]) -> None:  # noqa: B006
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            dt = time.perf_counter() - _t[0]
            gcs.append(dt)
            cur = record.current
            if cur is not None:
                cur["gc"] = cur.get("gc", 0.0) + dt

    import gc

    gc.callbacks.append(on_gc)
    H, A = http_mod._Handler, app_mod.ScoringApp
    H._one_request = _timed(times, "request", H._one_request, record, per_request)  # type: ignore[method-assign]
    H.parse_request = _timed(times, "head", H.parse_request, record)  # type: ignore[method-assign]
    H._send = _timed(times, "send", H._send, record)  # type: ignore[method-assign]
    A.handle = _timed(times, "app", A.handle, record)  # type: ignore[method-assign]
    if hasattr(HistoryReader, "start"):  # the read sent before encoding, collected by the encoder (last)
        HistoryReader.start = _timed(times, "hist_send", HistoryReader.start, record)  # type: ignore[method-assign]
        HistoryReader._finish = _timed(times, "history", HistoryReader._finish, record)  # type: ignore[method-assign]
    else:  # a checkout from before (run this script there to compare)
        A._histories = _timed(times, "history", A._histories, record)  # type: ignore[method-assign]
    if hasattr(app_mod, "read_request"):  # JSON decode + validation in one call (bytes in)
        app_mod.read_request = _timed(times, "json_in", app_mod.read_request, record)
    else:  # a checkout from before: json.loads in the app, then the checks
        app_mod.parse_request = _timed(times, "json_in", app_mod.parse_request, record)
    step = "check" if hasattr(FeatureEncoder, "check") else "encode"  # the app calls check, then rows (the lookups)
    setattr(FeatureEncoder, step, _timed(times, "encode", getattr(FeatureEncoder, step), record))
    # what the app scores with: score_arrays (numpy in and out) where it exists, score_request before it
    entry = "score_arrays" if hasattr(ScoringModel, "score_arrays") else "score_request"
    if mode == "noop":
        zeros = (lambda self, v, o, dense, **_: np.zeros(len(dense), np.float32)) if entry == "score_arrays" else (
            lambda self, v, o, dense, **_: torch.zeros(dense.shape[0]))
        setattr(ScoringModel, entry, zeros)
    setattr(ScoringModel, entry, _timed(times, "score", getattr(ScoringModel, entry), record))
    ScoringModel._given_at = _timed(times, "rows", ScoringModel._given_at, record)  # type: ignore[method-assign]
    try:
        from learner.onnx_scorer import OnnxScorer
    except ImportError:
        pass
    else:
        if hasattr(OnnxScorer, "score_rows"):
            OnnxScorer.score_rows = _timed(times, "ort", OnnxScorer.score_rows, record)  # type: ignore[method-assign]
    if mode == "fixed":
        answer = (200, app_mod.JSON, json.dumps({"scores": [0.5] * 100, "model_version": "x" * 22,
                                                 "delta_seq": 0}).encode())
        A.handle = _timed(times, "app", lambda self, method, path, body: answer, record)  # type: ignore[method-assign]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"serving on http://127.0.0.1:{svc.port} ({mode})", file=sys.stderr, flush=True)
    stop.wait()
    svc.stop(0.5)
    skip = 100  # the client's warm-up requests
    out = {k: [float(np.percentile(v[skip:], q) * 1e6) for q in (50, 99)] for k, v in times.items() if len(v) > skip}
    reqs = [r for r in per_request[skip:] if "request" in r]
    reqs.sort(key=lambda r: r["request"])
    tail = reqs[-max(1, int(len(reqs) * TAIL)):]  # the slowest requests: the mean of each stage over them
    keys = sorted({k for r in reqs for k in r}, key=lambda k: (STAGES + ("gc",)).index(k))
    out["tail"] = {k: float(np.mean([r.get(k, 0.0) for r in tail]) * 1e6) for k in keys}
    out["median_request"] = {k: float(np.median([r.get(k, 0.0) for r in reqs]) * 1e6) for k in keys}
    out["gc"] = [len(gcs), float(np.max(gcs) * 1e6) if gcs else 0.0, sum(1 for r in tail if "gc" in r), len(tail)]
    print(json.dumps(out), flush=True)
    return 0


def drive(port: int, bodies: list[bytes], n: int, warmup: int = 100) -> list[float]:
    """Client p50/p90/p99 ms over ``n`` requests on one keep-alive connection, after ``warmup``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/score", bodies[i % len(bodies)], {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
        if i >= warmup:
            lat.append(time.perf_counter() - t0)
    a = np.array(lat) * 1000
    return [float(np.percentile(a, q)) for q in (50, 90, 99)]


def main() -> int:
    if "--serve" in sys.argv:
        i = sys.argv.index("--serve")
        return serve(*sys.argv[i + 1:i + 4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the fused table (default 200 k)")
    ap.add_argument("--format", default="onnx_int8")
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per mode (default 2000)")
    ap.add_argument("--modes", default="real,noop,fixed")
    ap.add_argument("--no-redis", action="store_true", help="no history read (no Redis started)")
    ap.add_argument("--pin", action="store_true",
                    help="a diagnostic: the server process on the last CPU, this client (and Redis) on the others")
    args = ap.parse_args()

    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", Path(__file__).with_name("serving.py"))
    assert spec is not None and spec.loader is not None
    bs = importlib.util.module_from_spec(spec)  # bench/serving.py's model and traffic (bench/ is no package)
    spec.loader.exec_module(bs)
    from stream.config import RedisSettings
    from stream.features import hash_value
    from stream.history import UserHistory
    from stream.redis_client import connect
    from streamrec.stack import LocalStack, StackSettings, free_port

    work = Path(tempfile.mkdtemp(prefix="streamrec-bench-stages-"))
    cfg = bs.feature_config(args.rows)
    traffic = bs.Traffic(cfg)
    root = work / "publish"
    bs.publish(root, bs.build_artifact(bs.checkpoint(cfg), root, traffic.hot_rows(cfg, 0.1), format=args.format),
               keep=1)
    bodies = traffic.requests(300)
    stack, redis_url = None, ""
    if not args.no_redis:
        stack = LocalStack(StackSettings(state_dir=work / "stack", kafka_port=free_port(), redis_port=free_port()))
        stack.up()
        redis_url = stack.redis_url
        hist = UserHistory(connect(RedisSettings(url=redis_url)), prefix="bench", max_len=200)
        for u in {json.loads(b)["user_id"] for b in bodies}:
            items = traffic.draw(20, traffic.items_n)
            hist.append_many([hash_value(u)] * 20, [hash_value(int(i)) for i in items], list(range(20)))
    try:
        print(f"{args.rows:,} rows, {args.format}, {'no history' if args.no_redis else '20-click history from Redis'}"
              f", {args.requests} requests per mode, load average {os.getloadavg()[0]:.1f}")
        print(f"{'mode':<6} {'client p50/p90/p99 ms':>22}  " + "  ".join(f"{s:>12}" for s in STAGES)
              + "   (server stages: p50/p99 us)")
        cpus = sorted(os.sched_getaffinity(0))
        pinned = args.pin and len(cpus) > 1
        server_cpus, other_cpus = set(cpus[-1:]), set(cpus[:-1])
        for mode in args.modes.split(","):
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(root), mode, redis_url],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if pinned else None)
            if pinned:
                os.sched_setaffinity(0, other_cpus)
                info = stack._read_pid("redis") if stack is not None else None
                if info:
                    os.sched_setaffinity(int(info["pid"]), other_cpus)
            assert proc.stderr is not None and proc.stdout is not None
            line = ""
            while "serving on" not in line:
                line = proc.stderr.readline()
                if not line and proc.poll() is not None:
                    raise RuntimeError("the server exited at start")
            port = int(line.split("127.0.0.1:")[1].split()[0])
            try:
                client = drive(port, bodies, args.requests)
            finally:
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=60)
            stages = json.loads(out.strip().splitlines()[-1])
            cells = [f"{stages[s][0]:>5.0f}/{stages[s][1]:<6.0f}" if s in stages else f"{'-':>12}" for s in STAGES]
            print(f"{mode:<6} {'/'.join(f'{x:.3f}' for x in client):>22}  " + "  ".join(cells))
            if "tail" in stages:  # the slowest 1% of requests inside the server: where their time went
                n_gc, gc_max, tail_gc, n_tail = stages["gc"]
                print(f"       slowest {n_tail} requests, mean us: " + ", ".join(
                    f"{k} {v:.0f} (p50 {stages['median_request'].get(k, 0.0):.0f})" for k, v in stages["tail"].items())
                    + f"; collections: {n_gc} (longest {gc_max:.0f} us), in {tail_gc} of the slowest")
    finally:
        if stack is not None:
            stack.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
