"""Layered vs in-process serving: the cost of reading cold rows from Redis instead of a memory-mapped file.

One synthetic DeepFM artifact (MLP 400-400-400, a fused table of ``--rows`` rows x 17 floats, static user and item
fields as bench/serving.py builds them), published once; its non-hot rows written to a Redis this script starts
(``write_version``, float32, so both modes score identically). Traffic: Zipf(1.1) users and items, 1 user x 100
candidates + a 20-item history + 3 context fields per request; the hot set is the most frequent ``--hot-share``
of rows of a traffic sample, as the nightly refresh ranks them. Each request is timed in this process as serving
handles it, features to probabilities (``FeatureEncoder.encode`` + ``ScoringModel.score_request``), for:

* ``in_process``: cold rows from the memory-mapped file (pages warm after the warm-up);
* ``layered``: cold rows from the LRU (``--cache-rows``, warmed by the warm-up requests) and one MGET per request
  for the rest;
* ``layered_no_lru``: the LRU off: every request's cold rows cross to Redis (the worst case).

The modes are interleaved request by request, so machine noise falls on all of them alike. The Redis round-trip
share is the sum of the round trips' seconds (``streamrec_serving_embedding_store_fetch_seconds``) over the sum of
the layered requests' seconds. HTTP parsing and the response are the same for both modes and are left out
(bench/serving.py measures them). Target (issue 17): layered p99 within 1 ms of in-process.

The Redis this script starts runs as the local stack's (``streamrec.stack.redis_server_args``: ``activerehashing
no``). The rows are written just before the requests, and a keyspace that has just grown past a power of two is
being moved into a bigger table for minutes after: with Redis's default ``activerehashing yes`` that move takes 1 ms
of every 100 ms in the server's cron, and ~1% of the MGETs wait behind it (``--active-rehashing both`` shows both).

Reproduce::

    .venv/bin/python bench/layered.py                    # 1 M rows, 2000 requests per mode
    .venv/bin/python bench/layered.py --rows 10000000    # 10 M rows (~4 GB of memory while the rows are written)
    .venv/bin/python bench/layered.py --rows 10000000 --active-rehashing both  # the stack's Redis, Redis's default

``measure_layered(rows=..., requests=..., ...)`` returns the figures as a dict (for bench/serving.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cache_refresh.publish import publish  # noqa: E402
from learner.artifact import build_artifact  # noqa: E402
from learner.features import FeatureConfig  # noqa: E402
from serving.embedding_store import RedisEmbeddingStore  # noqa: E402
from serving.features import FeatureEncoder  # noqa: E402
from serving.metrics import ServingMetrics  # noqa: E402
from serving.model import ScoringModel  # noqa: E402
from serving.request import parse_request  # noqa: E402
from serving.settings import RowDtype  # noqa: E402
from serving.stored_versions import delete_version, write_version  # noqa: E402
from stream.features import hash_value  # noqa: E402
from stream.redis_client import wait_until_up  # noqa: E402
from streamrec.stack import free_port, redis_binary, redis_server_args  # noqa: E402

CANDIDATES = 100
HISTORY = 20


def _serving_bench() -> Any:
    """bench/serving.py as a module: its synthetic model and traffic (one definition for both benchmarks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", Path(__file__).resolve().parent / "serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SERVING = _serving_bench()
feature_config, checkpoint = SERVING.feature_config, SERVING.checkpoint


def zipf(rng: np.random.Generator, n: int, space: int) -> np.ndarray:
    return (rng.zipf(1.1, n) - 1) % space


def requests(cfg: FeatureConfig, n: int, rng: np.random.Generator) -> list[tuple[dict[str, Any], list[int]]]:
    users_n, items_n = cfg.fields[0].num_buckets, cfg.fields[1].num_buckets
    out = []
    for _ in range(n):
        req = {"user_id": int(zipf(rng, 1, users_n)[0]), "items": zipf(rng, CANDIDATES, items_n).tolist(),
               "context": {"device": "ios", "hour": 20, "genres": ["Drama"]}}
        history = [hash_value(int(x)) for x in zipf(rng, HISTORY, items_n)]
        out.append((req, history))
    return out


class _Redis:
    """A redis-server of this benchmark's own, on a free port."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", self.port), *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        up = wait_until_up(client, 10)
        client.close()
        if not up:
            raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def measure_layered(rows: int = 1_000_000, requests_per_mode: int = 2000, warmup: int = 500, hot_share: float = 0.1,
                    cache_rows: int = 200_000, redis_url: str | None = None, threads: int = 1,
                    seed: int = 0, active_rehashing: bool = False) -> dict[str, Any]:
    """p50/p99 (ms) of 1 user x 100 candidates for in_process, layered and layered_no_lru on one artifact, the
    Redis round-trip share of the layered latency, and setup figures. Starts (and stops) its own redis-server
    unless ``redis_url`` is given (then the rows go under a fresh prefix there and are deleted at the end); its own
    runs as the local stack's (``streamrec.stack.redis_server_args``), or with Redis's default ``activerehashing
    yes`` when ``active_rehashing``."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    own = _Redis(("--activerehashing", "yes") if active_rehashing else ()) if redis_url is None else None
    url = own.url if own is not None else str(redis_url)
    prefix = f"bench{int(time.time() * 1000)}"
    clients: list[redis.Redis] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = feature_config(rows)
            hot = SERVING.Traffic(cfg, seed).hot_rows(cfg, hot_share)
            root = Path(tmp) / "serving"
            path = publish(root, build_artifact(checkpoint(cfg), root, hot, version="bench"), keep=2)
            in_process = ScoringModel.load(path, verify_files=False)
            writer = redis.Redis.from_url(url)
            clients.append(writer)
            t0 = time.perf_counter()
            meta = write_version(writer, prefix, "bench", in_process.table, in_process.non_hot_rows(),
                                 RowDtype.FLOAT32)
            write_s = time.perf_counter() - t0
            used = int(writer.info("memory")["used_memory"])
            stores, models = {}, {}
            for name, cache in (("layered", cache_rows), ("layered_no_lru", 0)):
                c = redis.Redis.from_url(url, socket_timeout=0.05)
                clients.append(c)
                stores[name] = RedisEmbeddingStore(c, prefix, cache_rows=cache, metrics=ServingMetrics(lambda: None))
                models[name] = ScoringModel.load(path, verify_files=False, store=stores[name])
            models["in_process"] = in_process
            order = ["in_process", "layered", "layered_no_lru"]
            encoders = {name: FeatureEncoder(m) for name, m in models.items()}
            reqs = requests(cfg, warmup + requests_per_mode, rng)
            times: dict[str, list[float]] = {name: [] for name in order}
            scores_equal = True
            for k, (req, history) in enumerate(reqs):
                parsed = parse_request(req, 1000)
                got = {}
                for name in (order if k % 2 == 0 else order[::-1]):  # alternate who goes first
                    t = time.perf_counter()
                    v, o, d = encoders[name].encode(parsed, history)
                    p = models[name].score_request(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(d))
                    dt = time.perf_counter() - t
                    if k >= warmup:
                        times[name].append(dt)
                    got[name] = p
                scores_equal &= all(torch.equal(got["in_process"], got[n]) for n in order[1:])
                if k == warmup - 1:  # the round trips of the measured requests only
                    fetch_before = {n: _hist(stores[n]) for n in stores}
            out: dict[str, Any] = {
                "active_rehashing": active_rehashing if own is not None else None,
                "rows": rows, "hot_rows": in_process.hot_rows, "cache_rows": cache_rows, "requests": requests_per_mode,
                "redis_rows_written": meta["stored"], "redis_write_s": round(write_s, 2),
                "redis_used_memory_mb": round(used / 1e6, 1), "scores_equal": bool(scores_equal)}
            for name in order:
                out[name] = {"p50_ms": round(_pct(times[name], 50), 3), "p99_ms": round(_pct(times[name], 99), 3)}
            for name in stores:
                n_fetch, s_fetch = (a - b for a, b in zip(_hist(stores[name]), fetch_before[name], strict=True))
                out[name]["round_trips_per_request"] = round(n_fetch / requests_per_mode, 3)
                out[name]["redis_share"] = round(s_fetch / sum(times[name]), 3)
                out[name]["lru_hit_rate"] = _hit_rate(stores[name])
            out["layered_p99_minus_in_process_ms"] = round(out["layered"]["p99_ms"] - out["in_process"]["p99_ms"], 3)
            out["layered_no_lru_p99_minus_in_process_ms"] = round(
                out["layered_no_lru"]["p99_ms"] - out["in_process"]["p99_ms"], 3)
            return out
    finally:
        if own is None and clients:  # someone else's Redis: leave it as it was
            try:
                delete_version(clients[0], prefix, "bench")
            except redis.RedisError as exc:
                print(f"bench/layered.py: could not delete {prefix}:emb:bench:* ({exc})", file=sys.stderr)
        for c in clients:
            c.close()
        if own is not None:
            own.stop()


def _hist(store: RedisEmbeddingStore) -> tuple[float, float]:
    """(count, sum seconds) of the store's round trips so far."""
    h = store.metrics.embedding_store_fetch_seconds
    samples = {s.name: s.value for mf in h.collect() for s in mf.samples}
    return samples["streamrec_serving_embedding_store_fetch_seconds_count"], \
        samples["streamrec_serving_embedding_store_fetch_seconds_sum"]


def _hit_rate(store: RedisEmbeddingStore) -> float:
    c = store.metrics.embedding_cache_rows
    hit, miss = c.labels("hit")._value.get(), c.labels("miss")._value.get()
    return round(hit / (hit + miss), 3) if hit + miss else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the fused table (default 1 M)")
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per mode (default 2000)")
    ap.add_argument("--warmup", type=int, default=500, help="requests before measuring (default 500)")
    ap.add_argument("--hot-share", type=float, default=0.1, help="share of rows in the hot set (default 0.1)")
    ap.add_argument("--cache-rows", type=int, default=200_000, help="the layered LRU's rows (default 200000)")
    ap.add_argument("--redis-url", help="an existing Redis (default: start one)")
    ap.add_argument("--active-rehashing", choices=("no", "yes", "both"), default="no",
                    help="the started Redis's activerehashing: no (the local stack's setting, default), yes (Redis's "
                         "default: 1 ms of every 100 ms spent rehashing a growing keyspace), or both, one after the "
                         "other in this run")
    ap.add_argument("--json", action="store_true", help="print the dict (a list with --active-rehashing both) as JSON")
    args = ap.parse_args()
    settings = {"no": [False], "yes": [True], "both": [False, True]}[args.active_rehashing]
    runs = [measure_layered(args.rows, args.requests, args.warmup, args.hot_share, args.cache_rows, args.redis_url,
                            active_rehashing=a) for a in settings]
    if args.json:
        print(json.dumps(runs if len(runs) > 1 else runs[0], indent=2))
        return
    for r in runs:
        _print(r)


def _print(r: dict[str, Any]) -> None:
    rehash = {None: "", False: ", activerehashing no", True: ", activerehashing yes"}[r["active_rehashing"]]
    print(f"layered vs in-process: {r['rows']:,} rows x 17 floats, hot set {r['hot_rows']:,} rows, "
          f"MLP 400-400-400, 1 user x {CANDIDATES} candidates + {HISTORY}-item history, {r['requests']} requests "
          f"per mode, interleaved (encode + score, no HTTP)")
    print(f"Redis{rehash}: {r['redis_rows_written']:,} rows written in {r['redis_write_s']} s, used_memory "
          f"{r['redis_used_memory_mb']} MB; scores equal in every mode: {r['scores_equal']}")
    print(f"{'mode':<16}{'p50 ms':>9}{'p99 ms':>9}{'MGET/req':>10}{'Redis share':>13}{'LRU hits':>10}")
    for name in ("in_process", "layered", "layered_no_lru"):
        m = r[name]
        print(f"{name:<16}{m['p50_ms']:>9.3f}{m['p99_ms']:>9.3f}{m.get('round_trips_per_request', 0):>10.2f}"
              f"{m.get('redis_share', 0):>13.1%}{m.get('lru_hit_rate', 0):>10.1%}")
    print(f"layered p99 - in-process p99: {r['layered_p99_minus_in_process_ms']:+.3f} ms (target <= 1 ms); "
          f"without the LRU {r['layered_no_lru_p99_minus_in_process_ms']:+.3f} ms")


if __name__ == "__main__":
    main()
