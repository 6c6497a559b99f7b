"""What INT8 costs: ONNX Runtime fp32 and INT8 (dynamic quantization of the dense part) against eager fp32.

Why it exists (issue 17 item 2): the ``onnx`` artifact format (learner/onnx_scorer.py) runs the dense part
(FM + MLP) in ONNX Runtime; ``quantize_dynamic`` turns its Gemms into int8 MatMulIntegers. INT8 is not exact,
so its cost is measured here as the issue asks, on a holdout: AUC and logloss against fp32, and the latency of a
request's batch (1 user x 100 candidates) beside it.

Workload: the daemon's default model (DeepFM, dim 16, MLP 400-400-400; --mlp to change) trained
test-then-train (learner.trainer, as the daemon trains) on a synthetic stream with a planted signal (users and
items fall into groups; a click is likely when the groups match, plus per-item popularity and a dense feature),
--train-steps steps of 512 rows; the holdout is --holdout unseen rows of the same stream. The trained checkpoint
becomes an eager and an onnx artifact (learner/artifact.py, as `streamrec refresh` builds them); the INT8 variant
is the onnx artifact's dense graph quantized; ``onnx_int8_static`` the artifact of that format, calibrated on
--calib rows of the same stream drawn after the holdout (none of them scored). Scored with
serving.model.ScoringModel (the serving path) and cache_refresh.validate.quality (the refresh's holdout metric).

    python bench/onnx_int8.py                 # ~1 min on 2 cores
    python bench/onnx_int8.py --train-steps 400 --holdout 50000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

# bench/learner.py would shadow the learner package when this runs as a script from bench/
sys.path[:1] = [str(Path(__file__).resolve().parents[1])]

from cache_refresh.validate import probe_inputs, quality  # noqa: E402
from learner.artifact import build_artifact, eager_model  # noqa: E402
from learner.batch import to_tensors  # noqa: E402
from learner.config import parse_mlp  # noqa: E402
from learner.features import FeatureConfig, default_config  # noqa: E402
from learner.model import DeepFM  # noqa: E402
from learner.onnx_scorer import OnnxScorer, export_dense, session  # noqa: E402
from learner.optim import make_optimizers  # noqa: E402
from learner.scorer import with_empty_user_row  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from serving.model import ScoringModel  # noqa: E402
from stream.samples import SampleBatch  # noqa: E402

USERS, ITEMS, GROUPS = 2000, 1000, 8


def stream_batch(rng: np.random.Generator, n: int, item_pop: np.ndarray) -> SampleBatch:
    """Rows of the planted-signal stream: P(click) = sigmoid(-2 + 2.5 [user group = item group] + pop + age)."""
    u, i = rng.integers(0, USERS, n), rng.integers(0, ITEMS, n)
    age = rng.random(n).astype(np.float32)
    z = -2.0 + 2.5 * ((u % GROUPS) == (i % GROUPS)) + item_pop[i] + 0.8 * (age - 0.5)
    label = rng.random(n) < 1 / (1 + np.exp(-z))
    hist = [((rng.integers(0, ITEMS // GROUPS, rng.integers(0, 6)) * GROUPS + uu % GROUPS) + 10_000).tolist()
            for uu in u]  # a user's history: items of its own group
    return SampleBatch.from_columns(
        impression_id=[uuid.uuid4().hex for _ in range(n)], ts=np.full(n, 1_750_000_000_000),
        label=label.astype(np.int8), label_delay_ms=np.zeros(n, np.int64), user_id=u + 1_000_000,
        item_id=i + 10_000, history=hist, context={"device": rng.integers(0, 3, n)}, dense={"age": age})


def train(cfg: FeatureConfig, mlp: tuple[int, ...], steps: int, rng: np.random.Generator,
          item_pop: np.ndarray) -> dict[str, Any]:
    model = DeepFM(cfg, mlp=mlp, seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, lr_sparse=0.1, lr_dense=1e-3)
    trainer = Trainer(model, sparse, dense)
    for _ in range(steps):
        trainer.test_then_train(to_tensors(stream_batch(rng, 512, item_pop), cfg))
    meta = {"feature_config": cfg.to_dict(), "samples_trained": trainer.samples,
            "model": {"mlp": ",".join(map(str, mlp)), "dropout": 0.0}}
    return {"meta": meta, "model": model.state_dict(), "path": "bench"}


def with_int8(model: ScoringModel) -> ScoringModel:
    """``model`` (an onnx artifact) with its dense graph dynamically quantized to INT8."""
    scorer = model._live.scorer
    assert isinstance(scorer, OnnxScorer)
    scorer.int8 = True
    scorer.rebuild_session()
    return model


def per_call_ms(fn: Any, repeats: int) -> dict[str, float]:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 4), "p99_ms": round(times[int(0.99 * (len(times) - 1))], 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlp", default="400,400,400")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--holdout", type=int, default=20_000, help="unseen rows scored by each variant")
    ap.add_argument("--calib", type=int, default=5000, help="rows calibrating onnx_int8_static (not scored)")
    ap.add_argument("--batch", type=int, default=100, help="rows per timed call (1 user x 100 candidates)")
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--threads", type=int, default=0, help="torch and ORT intra-op threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    item_pop = rng.normal(0, 0.7, ITEMS)
    cfg = default_config({"device": "single"}, buckets=20_000, ctx_buckets=5, embedding_dim=args.dim, dense=("age",))
    t0 = time.monotonic()
    ckpt = train(cfg, parse_mlp(args.mlp), args.train_steps, rng, item_pop)
    train_s = time.monotonic() - t0
    holdout = [stream_batch(rng, 1000, item_pop) for _ in range(max(1, args.holdout // 1000))]

    out: dict[str, Any] = {"model": {"mlp": args.mlp, "dim": args.dim, "train_steps": args.train_steps,
                                     "train_rows": args.train_steps * 512, "train_s": round(train_s, 1)},
                           "threads": torch.get_num_threads(), "holdout_rows": 1000 * len(holdout),
                           "torch": torch.__version__}
    import onnxruntime

    out["onnxruntime"] = onnxruntime.__version__
    hot = np.arange(0, cfg.num_rows, 2)  # half the rows hot: both lookups paths
    with tempfile.TemporaryDirectory() as tmp:
        models = {"eager_fp32": ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format="eager")),
                  "onnx_fp32": ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format="onnx"))}
        models["onnx_int8"] = with_int8(ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format="onnx")))
        calib = [stream_batch(rng, 1000, item_pop) for _ in range(max(1, args.calib // 1000))]  # after the holdout
        models["onnx_int8_static"] = ScoringModel.load(build_artifact(ckpt, Path(tmp), hot, format="onnx_int8_static",
                                                                      calibration=calib))
        q = {name: quality(m, holdout) for name, m in models.items()}
        ref = q["eager_fp32"]
        values, offsets, dense = probe_inputs(cfg, 4096, seed=1, hot_rows=hot)
        want = models["eager_fp32"].score(values, offsets, dense)
        with torch.no_grad():
            learner = torch.sigmoid(eager_model(ckpt)(values, offsets, dense))
        out["holdout"] = {name: {"auc": round(r["auc"], 6), "logloss": round(r["logloss"], 6),
                                 "auc_minus_fp32": r["auc"] - ref["auc"],
                                 "logloss_minus_fp32": r["logloss"] - ref["logloss"],
                                 "probe_max_abs_diff_vs_eager": float((m.score(values, offsets, dense) - want)
                                                                      .abs().max()),
                                 "probe_max_abs_diff_vs_learner": float((m.score(values, offsets, dense) - learner)
                                                                        .abs().max())}
                          for (name, r), m in zip(q.items(), models.values(), strict=True)}

        # latency: one request's batch (B rows) through ScoringModel.score, and the dense part alone
        b = args.batch
        v, o, d = probe_inputs(cfg, b, seed=2, hot_rows=hot)
        out["latency_score"] = {name: per_call_ms(lambda m=m: m.score(v, o, d), args.repeats)
                                for name, m in models.items()}
        scorer = models["onnx_fp32"]._live.scorer
        assert isinstance(scorer, OnnxScorer)
        given, mask = models["onnx_fp32"]._given(models["onnx_fp32"]._live, v.numpy())
        with torch.inference_mode():
            # the scorer pools the request layout: the training batch's bags after an empty user row
            pooled = scorer.pool(v, with_empty_user_row(o, cfg.num_fields), torch.from_numpy(given),
                                 torch.from_numpy(mask))
            head_in = {"pooled": pooled.contiguous().numpy(), "dense": d.numpy()}
            from learner.onnx_scorer import DenseHead

            head = DenseHead(scorer).eval()
            sessions = {"onnx_fp32": session(export_dense(scorer)), "onnx_int8": session(export_dense(scorer, True))}
            out["latency_dense_part"] = {"eager_fp32": per_call_ms(lambda: head(pooled, d), args.repeats)}
            for name, s in sessions.items():
                out["latency_dense_part"][name] = per_call_ms(lambda s=s: s.run(None, head_in), args.repeats)
        out["graph_bytes"] = {"onnx_fp32": len(export_dense(scorer)), "onnx_int8": len(export_dense(scorer, True))}
    out["batch"] = b
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
