"""Serving's history read inside the app, two ways paired in one process: ``ScoringApp.handle`` of the same requests
against one real redis-server, the two apps sharing one loaded model and differing only in how the user's history
reaches the encoder.

* ``flat``: ``UserHistory.as_of_flat_later``'s arrays turned into lists (``_to_lists``): what ``as_of_later`` gave
  before the forty-third session (the list's parse, ``np.asarray``, ``np.tile``, ``.tolist()``).
* ``lists``: ``UserHistory.as_of_later`` as it is: one user's every click from the list's own parse, as lists.

Each pair runs both on one request (which goes first alternates), the answers compared byte for byte; the model is
``bench/serving.py``'s (1 user x 100 candidates, 20 clicks of history). Printed: each way's p50/p99 of ``handle``
(us), the paired difference ``lists - flat`` (p25/p50/p75), and per way the history stages: ``send``
(``HistoryReader.start``), ``wait`` (the reply's ``read_response`` at collect: how much of the round trip is still
left when the encoder reaches the history) and ``collect`` (``HistoryReader._finish``: the wait, the parse, the
checks).

Reproduce::

    .venv/bin/python bench/history_read.py                        # 200 k rows, onnx_int8, 3 rounds x 3000 pairs
    .venv/bin/python bench/history_read.py --format torchscript --rounds 2

Figures are noisy on a shared machine: read the paired difference, and run it twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("flat", "lists")
STAGES = ("handle", "send", "wait", "collect")


class FlatHistory:
    """A ``UserHistory`` whose ``as_of_later`` goes through ``as_of_flat_later``'s arrays (the ``flat`` way)."""

    def __init__(self, history: Any) -> None:
        self.history = history

    def as_of(self, users: list[int], times: list[int]) -> list[list[int]]:
        return self.history.as_of(users, times)

    def as_of_later(self, users: list[int], times: list[int]) -> Callable[[], list[list[int]]]:
        from stream.history import _to_lists

        flat_later = self.history.as_of_flat_later(users, times)
        return lambda: _to_lists(*flat_later())


def _timer(times: dict[str, list[float]], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - t0)

    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the fused table (default 200 k)")
    ap.add_argument("--format", default="onnx_int8")
    ap.add_argument("--pairs", type=int, default=3000, help="measured pairs per round (default 3000)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    spec = importlib.util.spec_from_file_location("bench_serving", Path(__file__).with_name("serving.py"))
    assert spec is not None and spec.loader is not None
    bs = importlib.util.module_from_spec(spec)  # bench/serving.py's model and traffic (bench/ is no package)
    spec.loader.exec_module(bs)
    import stream.redis_deadline as deadline
    from serving.app import ScoringApp
    from serving.history import HistoryReader
    from serving.metrics import ServingMetrics
    from serving.settings import ServeSettings
    from serving.swap import ModelHolder, ModelUpdater
    from stream.config import RedisSettings
    from stream.features import hash_value
    from stream.history import UserHistory
    from stream.redis_client import connect
    from streamrec.stack import free_port, redis_binary, redis_server_args

    torch.set_num_threads(1)  # as `streamrec serve` with the default [serve] threads
    work = Path(tempfile.mkdtemp(prefix="streamrec-bench-history-read-"))
    cfg = bs.feature_config(args.rows)
    traffic = bs.Traffic(cfg)
    root = work / "publish"
    bs.publish(root, bs.build_artifact(bs.checkpoint(cfg), root, traffic.hot_rows(cfg, 0.1), format=args.format),
               keep=1)
    bodies = traffic.requests(300)
    port = free_port()
    proc = subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", port)], stdout=subprocess.DEVNULL)
    try:
        rs = RedisSettings(url=f"redis://127.0.0.1:{port}/0", prefix="bench")
        seed = UserHistory(connect(rs), prefix="bench", max_len=200)
        for _ in range(100):
            try:
                seed.client.ping()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        for u in {json.loads(b)["user_id"] for b in bodies}:
            items = traffic.draw(bs.HISTORY, traffic.items_n)
            seed.append_many([hash_value(u)] * bs.HISTORY, [hash_value(int(i)) for i in items], list(range(20)))
        ss = ServeSettings(port=0, publish_root=root, device="cpu", lookup_counts=False)
        holder = ModelHolder()
        metrics = ServingMetrics(holder.model)
        ModelUpdater(holder, metrics, root, None, device="cpu").check_now()
        # serving's own client: the request path's timeout, no retries, whole-reply reads (serving/service.py)
        history = UserHistory(connect(rs, timeout_s=ss.redis_timeout_s, retries=0, whole_reply=True), prefix="bench",
                              max_len=200)
        apps = {"flat": ScoringApp(ss, holder, metrics, FlatHistory(history)),  # type: ignore[arg-type]
                "lists": ScoringApp(ss, holder, metrics, history)}
        times = {w: {s: [] for s in STAGES} for w in WAYS}
        current = {"way": "flat"}  # which way the timers below record
        for name, cls, attr in (("send", HistoryReader, "start"), ("collect", HistoryReader, "_finish"),
                                ("wait", deadline._WholeReply, "read_response")):
            original = getattr(cls, attr)

            def timed(*a: Any, _name: str = name, _fn: Callable[..., Any] = original, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    times[current["way"]][_name].append(time.perf_counter() - t0)

            setattr(cls, attr, timed)
        print(f"{args.rows:,} rows, {args.format}, {bs.HISTORY}-click history from a local redis-server, "
              f"{args.pairs} pairs x {args.rounds} rounds")
        print(f"{'round':<6} " + "  ".join(f"{w + ' ' + s + ' p50/p99':>24}" for w in WAYS for s in STAGES[:1])
              + f"  {'lists - flat p25/p50/p75 us':>28}  " + "  ".join(
                  f"{w + ' ' + s:>16}" for w in WAYS for s in STAGES[1:]) + "   (stages p50 us)")
        for rnd in range(args.rounds):
            for w in WAYS:
                for s in STAGES:
                    times[w][s].clear()
            diffs = []
            warmup = 200
            for i in range(warmup + args.pairs):
                body = bodies[i % len(bodies)]
                order = WAYS if i % 2 == 0 else WAYS[::-1]
                got: dict[str, tuple[float, bytes]] = {}
                for w in order:
                    current["way"] = w
                    t0 = time.perf_counter()
                    status, _, out = apps[w].handle("POST", "/v1/score", body)
                    got[w] = (time.perf_counter() - t0, out)
                    if status != 200:
                        raise RuntimeError(f"{w}: HTTP {status}: {out[:200]!r}")
                if got["flat"][1] != got["lists"][1]:
                    raise RuntimeError(f"the two ways answered request {i % len(bodies)} differently")
                if i >= warmup:
                    for w in WAYS:
                        times[w]["handle"].append(got[w][0])
                    diffs.append(got["lists"][0] - got["flat"][0])
                elif i == warmup - 1:
                    for w in WAYS:
                        for s in STAGES[1:]:
                            times[w][s].clear()

            def us(values: list[float], q: float) -> float:
                return float(np.percentile(values, q) * 1e6)

            print(f"{rnd + 1:<6} " + "  ".join(f"{us(times[w]['handle'], 50):>15.0f}/{us(times[w]['handle'], 99):<8.0f}"
                                               for w in WAYS)
                  + f"  {us(diffs, 25):>12.0f}/{us(diffs, 50):.0f}/{us(diffs, 75):<8.0f}  "
                  + "  ".join(f"{us(times[w][s], 50):>16.0f}" for w in WAYS for s in STAGES[1:]))
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
