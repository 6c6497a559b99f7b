"""The daemon's training step in fp32 and under bf16 autocast, side by side on this machine.

Why it exists: the learner autocast its dense part to bf16 on every CPU. A CPU without native bf16
(AVX2 only: no AVX512-BF16, no AMX) emulates bf16 matmuls, and the daemon then trained ~1.5 k samples/s in
``make demo``. ``[learner] amp = auto`` now picks bf16 only where oneDNN reports native support; this script
shows what each choice costs here.

Workload: the daemon's default model (DeepFM, dim 16, MLP 400-400-400, row-wise Adagrad 0.05 on the
table, fused Adam 1e-3) on ML-1M-shaped batches (user, item, a 50-item history bag and 4 context fields;
rows drawn from a seeded generator), step 256 rows (the default) and 4096, each precision in turn for
--rounds rounds (alternating order); samples/s from the median step. Also the bare 256x400 @ 400x400 matmul.

    python bench/precision.py            # ~1 min on 2 cores
    python bench/precision.py --rounds 3 --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# bench/learner.py would shadow the learner package when this runs as a script from bench/
sys.path[:1] = [str(Path(__file__).resolve().parents[1])]

from learner.batch import TensorBatch, to_tensors  # noqa: E402
from learner.features import FeatureConfig, FieldKind, default_config  # noqa: E402
from learner.model import DeepFM, native_cpu_bf16  # noqa: E402
from learner.optim import make_optimizers  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from stream.samples import SampleBatch  # noqa: E402

CONTEXT: dict[str, FieldKind] = {"gender": "single", "age": "single", "occupation": "single", "genres": "multi"}


def _batch(cfg: FeatureConfig, rows: int, rng: np.random.Generator) -> TensorBatch:
    hist = [rng.integers(0, 1 << 40, rng.integers(1, 51)).tolist() for _ in range(rows)]
    genres = [rng.integers(0, 1 << 40, rng.integers(1, 4)).tolist() for _ in range(rows)]
    sb = SampleBatch.from_columns(
        impression_id=[f"i{j}" for j in range(rows)], ts=np.arange(rows), label=rng.random(rows) < 0.57,
        label_delay_ms=np.zeros(rows), user_id=rng.integers(0, 1 << 40, rows), item_id=rng.integers(0, 1 << 40, rows),
        history=hist, context={"gender": rng.integers(0, 2, rows), "age": rng.integers(0, 7, rows),
                               "occupation": rng.integers(0, 21, rows), "genres": genres})
    return to_tensors(sb, cfg)


def _step_times(dtype: torch.dtype | None, rows: int, steps: int, warmup: int) -> list[float]:
    cfg = default_config(CONTEXT)
    model = DeepFM(cfg, seed=0, autocast_dtype=dtype)
    sparse, dense = make_optimizers(model, 0.05, 1e-3)
    trainer = Trainer(model, sparse, dense)
    rng = np.random.default_rng(0)
    batches = [_batch(cfg, rows, rng) for _ in range(8)]
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        trainer.test_then_train(batches[i % len(batches)])
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def _matmul_ms(dtype: torch.dtype) -> float:
    a, w = torch.randn(256, 400, dtype=dtype), torch.randn(400, 400, dtype=dtype)
    for _ in range(3):
        a @ w
    t = time.perf_counter()
    for _ in range(20):
        a @ w
    return (time.perf_counter() - t) / 20 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    matmul = {"float32": _matmul_ms(torch.float32), "bfloat16": _matmul_ms(torch.bfloat16)}
    out: dict[str, object] = {"native_cpu_bf16": native_cpu_bf16(),
                              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "matmul_ms": matmul}
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = [None, torch.bfloat16] if r % 2 == 0 else [torch.bfloat16, None]
        for rows in (256, 4096):
            for dtype in order:
                key = f"{'bfloat16' if dtype else 'float32'}@{rows}"
                med = statistics.median(_step_times(dtype, rows, args.steps if rows == 256 else args.steps // 3,
                                                    args.warmup))
                results.setdefault(key, []).append(rows / med)
    best = {k: max(v) for k, v in results.items()}
    out["samples_per_s"] = {k: round(v) for k, v in best.items()}
    out["fp32_over_bf16"] = {rows: round(best[f"float32@{rows}"] / best[f"bfloat16@{rows}"], 2) for rows in (256, 4096)}
    for k, v in sorted(best.items()):
        print(f"{k:>16}: {v:10,.0f} samples/s")
    print(f"matmul 256x400@400x400: fp32 {matmul['float32']:.2f} ms, bf16 {matmul['bfloat16']:.2f} ms; "
          f"native bf16: {out['native_cpu_bf16']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
