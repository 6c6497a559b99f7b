"""What online calibration (learner/calibration.py) costs the daemon's training step, side by side.

Workload: the daemon's default model (DeepFM, dim 16, MLP 400-400-400, row-wise Adagrad 0.05, fused Adam 1e-3)
in fp32 on ML-1M-shaped ``fake_negative`` batches of 256 rows (9 in 10 an OBSERVED 0, 1 in 10 a DELAYED_POSITIVE
of an earlier row; event time advancing 40 ms a row: past the first 300 s impressions wait and are fitted as they
mature), with calibration off and on, alternating for --rounds rounds; samples/s from the median step, and the
calibration's own time per row (``OnlineCalibration.observe``, timed alone on the same batches).

    python bench/calibration.py            # ~1 min on 2 cores
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
from learner.calibration import OnlineCalibration  # noqa: E402
from learner.features import FeatureConfig, FieldKind, default_config  # noqa: E402
from learner.model import DeepFM  # noqa: E402
from learner.optim import make_optimizers  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from stream.samples import DELAYED_POSITIVE, OBSERVED, SampleBatch  # noqa: E402

CONTEXT: dict[str, FieldKind] = {"gender": "single", "age": "single", "occupation": "single", "genres": "multi"}
ROWS = 256


def _batches(cfg: FeatureConfig, n: int, rng: np.random.Generator) -> list[TensorBatch]:
    out = []
    for k in range(n):
        kinds = np.where(rng.random(ROWS) < 0.1, DELAYED_POSITIVE, OBSERVED).astype(np.int8)
        ids = [f"i{k}_{j}" if kinds[j] == OBSERVED else f"i{max(k - 50, 0)}_{j}" for j in range(ROWS)]
        ts = 400_000 + (k * ROWS + np.arange(ROWS)) * 40
        sb = SampleBatch.from_columns(
            impression_id=ids, ts=ts, label=kinds == DELAYED_POSITIVE, label_delay_ms=np.zeros(ROWS),
            user_id=rng.integers(0, 1 << 40, ROWS), item_id=rng.integers(0, 1 << 40, ROWS),
            history=[rng.integers(0, 1 << 40, rng.integers(1, 51)).tolist() for _ in range(ROWS)],
            context={"gender": rng.integers(0, 2, ROWS), "age": rng.integers(0, 7, ROWS),
                     "occupation": rng.integers(0, 21, ROWS),
                     "genres": [rng.integers(0, 1 << 40, rng.integers(1, 4)).tolist() for _ in range(ROWS)]},
            kind=kinds)
        out.append(to_tensors(sb, cfg))
    return out


def _step_times(batches: list[TensorBatch], cfg: FeatureConfig, calibrate: bool, warmup: int) -> list[float]:
    model = DeepFM(cfg, seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.05, 1e-3, initial_accumulator=1e-5)
    trainer = Trainer(model, sparse, dense, calibration=OnlineCalibration() if calibrate else None)
    times = []
    for i, b in enumerate(batches):
        t = time.perf_counter()
        trainer.test_then_train(b)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def _observe_us_per_row(batches: list[TensorBatch]) -> float:
    cal = OnlineCalibration()
    rng = np.random.default_rng(1)
    logits = [rng.normal(-2, 1, ROWS) for _ in batches]
    t = time.perf_counter()
    for b, z in zip(batches, logits, strict=True):
        cal.observe(b.impression_ids, b.kinds, b.labels.numpy(), z, b.ts, b.label_delay_ms)
    return (time.perf_counter() - t) / (len(batches) * ROWS) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = default_config(CONTEXT)
    batches = _batches(cfg, args.steps + args.warmup, np.random.default_rng(0))
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for calibrate in ((False, True) if r % 2 == 0 else (True, False)):
            med = statistics.median(_step_times(batches, cfg, calibrate, args.warmup))
            results.setdefault("calibration on" if calibrate else "calibration off", []).append(ROWS / med)
    best = {k: max(v) for k, v in results.items()}
    out = {"samples_per_s": {k: round(v) for k, v in best.items()},
           "on_over_off": round(best["calibration on"] / best["calibration off"], 3),
           "observe_us_per_row": round(_observe_us_per_row(batches), 2)}
    for k, v in sorted(best.items()):
        print(f"{k:>16}: {v:10,.0f} samples/s")
    print(f"calibration on / off: {out['on_over_off']}; OnlineCalibration.observe {out['observe_us_per_row']} us/row")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
