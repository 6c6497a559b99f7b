"""Where a CUDA training step's time goes: wall time, kernel time and launches per step, the trainer against the floor.

    python bench/gpu_profile.py > prof.json          # on a machine with CUDA (bench/README.md, "GPU")

For batch 32,768 and 4,096 (bench/learner.py's workload: 26 fields x 10 M rows, dim 16, MLP 400-400-400; the batches
pinned, as the daemon pins them): three trainers (bf16 unfused, `auto`'s path on CUDA; bf16 fused; fp32 unfused) and
bench/gpu_check.py's floor (bf16). For each, the median wall time of 40 steps, then 10 steps under torch.profiler: the
kernels' own time per step (CUDA events only, so an op and its kernels are not counted twice, as the totals of
gpu_check's ``profile_steps`` are), kernels and aten calls per step, and the ops and kernels with the most device
time. A step whose wall time is far above its kernel time is bound by the host (its launches and Python), not by
the device. Progress goes to stderr, one JSON object to stdout. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench.gpu_check as gc  # noqa: E402

WORKLOADS = ((32_768, 24), (4_096, 60))  # (batch, distinct batches)
TRAINERS = (("bf16_unfused", torch.bfloat16, "off"), ("bf16_fused", torch.bfloat16, "on"),
            ("fp32_unfused", None, "off"))


def profiled(step: Callable[[int], Any], steps: int, top: int = 22) -> dict[str, Any]:
    """``steps`` calls of ``step`` under the profiler: kernel time, kernels and aten calls, per step."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
    ops = [e for e in ka if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]

    def rows(events: list[Any], n: int) -> list[list[Any]]:
        return [[e.key[:70], round(e.self_device_time_total / steps / 1e3, 3), e.count // steps]
                for e in sorted(events, key=lambda e: -e.self_device_time_total)[:n]]

    return {"kernel_ms_per_step": round(sum(e.self_device_time_total for e in kernels) / steps / 1e3, 3),
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
            "aten_calls_per_step": round(sum(e.count for e in ka if e.device_type == DeviceType.CPU
                                             and e.key.startswith("aten::")) / steps, 1),
            "top_ops": rows(ops, top), "top_kernels": rows(kernels, top // 2)}


def wall_ms(step: Callable[[int], Any], steps: int) -> float:
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def measure(step: Callable[[int], Any]) -> dict[str, Any]:
    for i in range(10):  # warm-up: allocator, cuBLAS handles, autotuning
        step(i)
    return {"wall_ms": wall_ms(step, 40), **profiled(step, 10)}


def main() -> int:
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): bench/gpu_profile.py only runs on a GPU; nothing measured",
              file=sys.stderr)
        return 0
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for batch, distinct in WORKLOADS:
        args = type("Args", (), {"fields": 26, "total_rows": 10_000_000, "dim": 16, "batch": batch, "zipf": 1.05,
                                 "batches": distinct, "seed": 7})()
        cfg, tbs = gc.build_batches(args)
        tbs = [tb.pin_memory() for tb in tbs]
        for name, dtype, fused in TRAINERS:
            trainer = gc.make_trainer(cfg, "cuda", dtype, fused)
            out[f"{batch}_{name}"] = measure(lambda i, t=trainer, b=tbs: t.test_then_train(b[i % len(b)]))
            print(batch, name, json.dumps(out[f"{batch}_{name}"]), file=sys.stderr, flush=True)
            del trainer
        out[f"{batch}_floor_bf16"] = measure(gc.floor_stepper(cfg, tbs, "cuda", torch.bfloat16))
        print(batch, "floor_bf16", json.dumps(out[f"{batch}_floor_bf16"]), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
