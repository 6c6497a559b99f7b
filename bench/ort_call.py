"""The ONNX Runtime call of one request, graph against graph: a paired, interleaved loop in one process.

Why it exists (issue 17): the ORT call is the largest part of a served INT8 request (bench/README.md, "## serving"),
and on this shared 2-core machine HTTP figures move more between runs than a graph change does. Here each variant
graph scores the same captured requests in turn (the order alternating per request), so the machine's load falls on
all of them alike; what is reported is each variant's p50/p99 per call and the paired difference against the first
variant (p25/p50/p75 of the per-request differences, negative: faster), and each variant's scores against the
first's (max |diff|) and its AUC/logloss on a holdout (``cache_refresh.validate.quality``, the refresh's metric).

Variants (``--variants``):

* ``scatter_elements``: the INT8 pooling graph as written before the forty-third session (each bag summed by a
  ``ScatterElements`` add over an index expanded to every element).
* ``current``: this checkout's INT8 graph (``learner.onnx_scorer.export_request``).
* ``static``: this checkout's fp32 graph quantized statically (QOperator, ``QGemm`` with fixed activation scales,
  the ReLUs folded into them) calibrated on the first ``--calib`` holdout batches (scored by none of the AUCs):
  ``learner.onnx_scorer.quantize_int8_static``, what the ``onnx_int8_static`` format writes (that format's graph is
  calibrated on the refresh job's older holdout samples).

Workload: bench/onnx_int8.py's (the default DeepFM, dim 16, MLP 400-400-400 trained test-then-train on a stream with
a planted signal); the requests are 1 user x ``--batch`` candidates (``probe_inputs`` with an empty user row, half
the rows hot) run through ``ScoringModel.score_arrays`` once to capture ``OnnxScorer.score_rows``' feeds; each
variant runs in a session made as the server makes it (``learner.onnx_scorer.session``, ``--threads`` intra-op).

    python bench/ort_call.py                          # ~2 min on 2 cores
    python bench/ort_call.py --pairs 8000 --variants scatter_elements,current --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# bench/learner.py would shadow the learner package when this runs as a script from bench/
sys.path[:1] = [str(Path(__file__).resolve().parents[1])]

from bench.onnx_int8 import ITEMS, stream_batch, train  # noqa: E402
from cache_refresh.validate import probe_inputs, quality  # noqa: E402
from learner import onnx_scorer  # noqa: E402
from learner.artifact import build_artifact  # noqa: E402
from learner.config import parse_mlp  # noqa: E402
from learner.features import default_config  # noqa: E402
from learner.scorer import Held, with_empty_user_row  # noqa: E402
from serving.model import ScoringModel  # noqa: E402

Feeds = onnx_scorer.Feeds


def _legacy_forward(self: onnx_scorer.RequestHead, table: torch.Tensor, pos: torch.Tensor, given: torch.Tensor,
                    given_mask: torch.Tensor, seg: torch.Tensor, inv_len: torch.Tensor,
                    dense: torch.Tensor) -> torch.Tensor:
    """``RequestHead.forward`` before the forty-third session: the bags summed by ``scatter_add`` (exported as an
    Expand of the index and a ScatterElements add)."""
    rows = torch.where(given_mask.unsqueeze(1), given, table[pos])  # (N, D + 1)
    summed = torch.zeros(inv_len.shape[0], self.dim + 1).scatter_add(
        0, seg.unsqueeze(1).expand(-1, self.dim + 1), rows)  # (F + F*B, D + 1)
    pooled = summed * inv_len.unsqueeze(1)
    user = pooled[: self.num_fields].unsqueeze(0)  # (1, F, D + 1)
    cand = pooled[self.num_fields:].reshape(self.num_fields, -1, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)
    return self.head(cand + user, dense)  # (B,)


@contextlib.contextmanager
def legacy_pooling() -> Iterator[None]:
    current = onnx_scorer.RequestHead.forward
    onnx_scorer.RequestHead.forward = _legacy_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        onnx_scorer.RequestHead.forward = current  # type: ignore[method-assign]


@contextlib.contextmanager
def captured_feeds(into: list[Feeds]) -> Iterator[None]:
    """Record the feeds of every ``OnnxScorer.score_rows`` call (as it builds them) while inside."""
    current = onnx_scorer.OnnxScorer.score_rows

    def record(self: onnx_scorer.OnnxScorer, pos: np.ndarray, given: np.ndarray, given_mask: np.ndarray,
               offsets: np.ndarray, dense: np.ndarray) -> np.ndarray:
        lengths = offsets[1:] - offsets[:-1]
        into.append({"table": self._hot_table(), "pos": pos.copy(), "given": np.ascontiguousarray(given),
                     "given_mask": given_mask.copy(),
                     "seg": np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
                     "inv_len": 1.0 / np.maximum(lengths, 1).astype(np.float32),
                     "dense": np.ascontiguousarray(dense)})
        return current(self, pos, given, given_mask, offsets, dense)

    onnx_scorer.OnnxScorer.score_rows = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        onnx_scorer.OnnxScorer.score_rows = current  # type: ignore[method-assign]


def paired_us(runs: dict[str, Callable[[Feeds], Any]], feeds: list[Feeds], pairs: int,
              warmup: int) -> dict[str, list[float]]:
    """Per-call microseconds of each run on the same feeds, the variants' order rotated per request."""
    names = list(runs)
    out: dict[str, list[float]] = {n: [] for n in names}
    from time import perf_counter

    for i in range(pairs + warmup):
        feed = feeds[i % len(feeds)]
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t0 = perf_counter()
            runs[name](feed)
            if i >= warmup:
                out[name].append((perf_counter() - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlp", default="400,400,400")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--holdout", type=int, default=20_000, help="unseen rows scored by each variant")
    ap.add_argument("--calib", type=int, default=5, help="holdout batches of 1000 calibrating `static` (not scored)")
    ap.add_argument("--batch", type=int, default=100, help="candidates per request")
    ap.add_argument("--requests", type=int, default=300, help="distinct captured requests, cycled")
    ap.add_argument("--pairs", type=int, default=4000, help="timed requests per variant")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (serving: 1)")
    ap.add_argument("--variants", default="scatter_elements,current,static")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    item_pop = rng.normal(0, 0.7, ITEMS)
    cfg = default_config({"device": "single"}, buckets=20_000, ctx_buckets=5, embedding_dim=args.dim, dense=("age",))
    ckpt = train(cfg, parse_mlp(args.mlp), args.train_steps, rng, item_pop)
    batches = [stream_batch(rng, 1000, item_pop) for _ in range(args.calib + max(1, args.holdout // 1000))]
    calib_batches, holdout = batches[: args.calib], batches[args.calib:]
    hot = np.arange(0, cfg.num_rows, 2)
    with tempfile.TemporaryDirectory() as tmp:
        model = ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format="onnx"))
    scorer = model._live.scorer
    assert isinstance(scorer, onnx_scorer.OnnxScorer) and scorer.pools
    feeds: list[Feeds] = []
    with captured_feeds(feeds):
        for s in range(args.requests):
            v, o, d = probe_inputs(cfg, args.batch, seed=100 + s, hot_rows=hot)
            model.score_arrays(v.numpy(), with_empty_user_row(o, cfg.num_fields).numpy(), d.numpy())
    graphs: dict[str, bytes] = {}
    for name in args.variants.split(","):
        if name == "scatter_elements":
            with legacy_pooling():
                graphs[name] = onnx_scorer.export_request(scorer, int8=True)
        elif name == "current":
            graphs[name] = onnx_scorer.export_request(scorer, int8=True)
        elif name == "static":
            calib: list[Feeds] = []
            with captured_feeds(calib):
                quality(model, calib_batches)
            logging.getLogger().setLevel(logging.ERROR)  # quantize_static's pre-processing advice
            graphs[name] = onnx_scorer.export_request(scorer, calibration=calib)
        else:
            ap.error(f"--variants: unknown {name!r} (scatter_elements, current, static)")
    sessions = {n: onnx_scorer.session(g, threads=args.threads) for n, g in graphs.items()}
    first = next(iter(sessions.values()))
    out: dict[str, Any] = {"batch": args.batch, "threads": args.threads, "pairs": args.pairs,
                           "values_per_request": float(np.mean([len(f["pos"]) for f in feeds])), "variants": {}}
    fp32 = quality(model, holdout)
    out["onnx_fp32_holdout"] = {"auc": fp32["auc"], "logloss": fp32["logloss"]}
    for name, sess in sessions.items():
        diff = max(float(np.abs(sess.run(None, f)[0] - first.run(None, f)[0]).max()) for f in feeds)
        scorer._box = Held(sess)  # the holdout scored through this variant's graph
        q = quality(model, holdout)
        out["variants"][name] = {"graph_bytes": len(graphs[name]), "max_abs_diff_vs_first": diff,
                                 "auc_minus_fp32": q["auc"] - fp32["auc"],
                                 "logloss_minus_fp32": q["logloss"] - fp32["logloss"]}
    times = paired_us({n: (lambda f, s=s: s.run(None, f)) for n, s in sessions.items()}, feeds, args.pairs,
                      warmup=200)
    base = np.array(next(iter(times.values())))
    for name, t in times.items():
        a = np.array(t)
        d = a - base
        out["variants"][name].update(
            p50_us=round(float(np.median(a)), 1), p99_us=round(float(np.percentile(a, 99)), 1),
            diff_vs_first_us={q: round(float(np.percentile(d, p)), 1) for q, p in (("p25", 25), ("p50", 50),
                                                                                   ("p75", 75))})
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
