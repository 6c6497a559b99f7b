"""In-process scoring throughput at 1 and 8 threads, per artifact format, without HTTP: the model's cost apart from
the server's.

``bench/serving.py`` measures requests over HTTP (a server process, a client process on the same 2 cores); this script
loads the same synthetic model (``bench/serving.py``'s DeepFM, MLP 400-400-400, Zipf traffic, 1 user x 100
candidates, a 20-click history) as TorchScript, ONNX Runtime fp32 and ONNX Runtime INT8 artifacts into this process and
runs, for each, ``threads`` Python threads that each score requests back to back for ``--seconds``:

* ``model``: ``ScoringModel.score_request`` on requests encoded beforehand: the rows given (hot/cold lookup), the
  pooling, the dense part (what the GIL and the format decide);
* ``app``: what ``ScoringApp._score`` does but the HTTP server and the Redis read: JSON in, validation, encoding
  (hashing, row mapping), ``score_request``, JSON out.

Torch runs 1 intra-op thread, as ``streamrec serve --threads 1`` does (ONNX Runtime's intra-op threads follow it).
Requests/s summed over the threads, and each format's ratio to TorchScript's at the same thread count. A format
whose 8-thread rate is far above its 1-thread rate releases the GIL in its compute (ONNX Runtime does in ``run``;
TorchScript's interpreter does per op); what is left between ``model`` and ``app`` is per-request Python.

Reproduce::

    .venv/bin/python bench/serving_threads.py                       # 1 M rows, 3 s per cell, 2 rounds
    .venv/bin/python bench/serving_threads.py --rows 10000000 --seconds 5

Noisy on a shared 2-core machine: rounds are interleaved (every format once per round) and each cell's best round is
reported beside its median; record ``uptime``'s load with the figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serving import HISTORY, Traffic, checkpoint, feature_config  # noqa: E402
from learner.artifact import build_artifact  # noqa: E402
from serving.features import FeatureEncoder  # noqa: E402
from serving.model import ScoringModel  # noqa: E402
from serving.request import decode_json, parse_request  # noqa: E402
from stream.features import hash_value  # noqa: E402

FORMATS = "torchscript,onnx,onnx_int8"


def rate(work: Callable[[int], object], threads: int, seconds: float) -> float:
    """Calls of ``work(i)`` per second, summed over ``threads`` threads running for ``seconds``."""
    counts = [0] * threads
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)

    def loop(k: int) -> None:
        barrier.wait()
        i, n = k * 7919, 0
        while not stop.is_set():
            work(i + n)
            n += 1
        counts[k] = n

    pool = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the fused table (default 1 M)")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--seconds", type=float, default=3.0, help="per cell and round (default 3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hot-share", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(1)  # streamrec serve --threads 1
    import orjson

    cfg = feature_config(args.rows)
    ckpt = checkpoint(cfg)
    traffic = Traffic(cfg)
    hot = traffic.hot_rows(cfg, args.hot_share)
    bodies = traffic.requests(500)
    history = [hash_value(int(i)) for i in traffic.draw(HISTORY, traffic.items_n)]
    formats = args.formats.split(",")
    thread_counts = [int(x) for x in args.threads.split(",")]
    work: dict[tuple[str, str], Callable[[int], object]] = {}
    with tempfile.TemporaryDirectory(prefix="streamrec-bench-threads-") as tmp:
        for fmt in formats:
            model = ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format=fmt))
            enc = FeatureEncoder(model)
            reqs = [parse_request(decode_json(b), 1000) for b in bodies]
            encoded = [tuple(torch.from_numpy(a) for a in enc.encode(r, history)) for r in reqs]

            def scored(i: int, model: ScoringModel = model, encoded: list = encoded) -> torch.Tensor:
                return model.score_request(*encoded[i % len(encoded)])

            def app(i: int, model: ScoringModel = model, enc: FeatureEncoder = enc) -> bytes:
                req = parse_request(decode_json(bodies[i % len(bodies)]), 1000)
                v, o, d = enc.encode(req, history)
                p = model.score_request(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(d))
                return orjson.dumps({"scores": p.numpy().astype(np.float64), "model_version": model.version,
                                     "delta_seq": model.delta_seq}, option=orjson.OPT_SERIALIZE_NUMPY)

            for i in range(50):  # warm up
                scored(i)
                app(i)
            work[(fmt, "model")], work[(fmt, "app")] = scored, app
        print(f"{args.rows:,} rows, hot set {len(hot):,} rows, 1 user x 100 candidates, {HISTORY}-click history, "
              f"torch threads 1; {args.rounds} rounds x {args.seconds:.0f} s per cell", file=sys.stderr)
        got: dict[tuple[str, str, int], list[float]] = {}
        for r in range(args.rounds):
            for fmt in formats:
                for stage in ("model", "app"):
                    for n in thread_counts:
                        got.setdefault((fmt, stage, n), []).append(rate(work[(fmt, stage)], n, args.seconds))
            print(f"round {r + 1} done", file=sys.stderr)
    cols = [(stage, n) for stage in ("model", "app") for n in thread_counts]
    print("\nrequests/s, best of the rounds (median); x = ratio to torchscript's best at the same cell\n")
    print("| format | " + " | ".join(f"{stage} {n} thr" for stage, n in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for fmt in formats:
        cells = []
        for stage, n in cols:
            xs = got[(fmt, stage, n)]
            base = got.get(("torchscript", stage, n))
            ratio = f", {max(xs) / max(base):.2f}x" if base and fmt != "torchscript" else ""
            cells.append(f"{max(xs):.0f} ({float(np.median(xs)):.0f}){ratio}")
        print(f"| {fmt} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
