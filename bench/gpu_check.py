"""The learner on a CUDA GPU: fp16 autocast + GradScaler, bf16, pinned host->device copies, torch.export.

A prepared check for a machine with a CUDA GPU; the project's CI machines have none, and there the script
says so and exits 0 without checking anything. A few minutes on one GPU (most of it building the data
on the CPU). Prints one JSON line; exits 1 if a check failed.

Workload: the one of bench/learner.py (26 fields x 384,615 rows = 10 M rows, dim 16 + first order, batch
4096, Zipf(1.05) ids, labels from a hidden logistic model of two fields, so the loss can go down).

  fp16          DeepFM(autocast_dtype=float16) on cuda; learner.trainer.Trainer builds a GradScaler for it.
                Every loss finite, mean loss of the last 20 steps below the first 20, embedding table finite;
                examples/s (median step after warm-up; each step syncs when it copies predictions to the host)
  fp16_overflow one step with the loss scale forced to 2**40, the overflow GradScaler exists to absorb: the
                step must be skipped (scale halves) and the embedding table must stay finite, then training
                goes on with finite losses. (Until 2026-11-29 the Trainer stepped the sparse optimizer outside
                the scaler, so scaled, possibly inf, sparse gradients reached RowWiseAdagrad; the dry run caught it.)
  sparse_grad   (information) |sparse grad| with the loss scaled vs not: ~scale if the sparse grads are scaled
  bf16          the same as fp16 with bfloat16 autocast (no scaler)
  fp32          the same in float32 (no autocast): the baseline the two mixed precisions are compared with
  same_update_fp32  the fused row-wise Adagrad (fused_sparse_update = on) against the optimizer's own step (off)
                from one initial state: after one step rel. L2 of the tables' difference <= 1e-5; after 20 steps
                the divergence, beside two unfused runs' (the device's run-to-run nondeterminism)
  fused_ab_bf16, fused_ab_fp32  fused against unfused in one process, 7 interleaved rounds of 30 steps: median
                ex/s, per-round ratios and their median, and the device's time per step (profiler)
  floor_bf16, floor_fp32  bench/learner.py's floor on the device (touched rows gathered once, the dense part,
                gradients reduced per row and scattered into the table): what the step cannot go below
  profile_*, host_profile_fp32  (--profile) the top ops by device time, and cProfile's top functions by own
                time on the host (a GPU step is bound by the host)
  h2d           TensorBatch.pin_memory().to("cuda", non_blocking=True) vs pageable .to("cuda"): ms per batch and
                GB/s, plus one 256 MiB tensor each way for the link's bandwidth
  export        torch.export.export of the trained fp16 model (eval) on cuda with a dynamic batch size,
                torch.export.save/load round trip, outputs of the loaded program vs the model (batch 4096 and 1000)
  tensorrt      serving's ``onnx`` artifact (learner/onnx_scorer.py) of the trained fp32 model loaded on cuda: where
                onnxruntime-gpu has the TensorRT execution provider, ONNX Runtime builds a TensorRT engine (fp16
                allowed) from the dense graph; the check reports the providers it runs on, the engine's first-use
                build time, scores against the same artifact on the CPU (max |diff| <= 2e-3 for fp16 kernels), and
                p50/p99 of ScoringModel.score for 1 user x 100 candidates and for a 4096 batch, against the
                TorchScript artifact on the same GPU. Without TensorRT (a CPU machine, or the CPU onnxruntime
                wheel) it says so and why, and checks nothing (not a failure: the path is optional).

    python bench/gpu_check.py                       # on a GPU machine
    python bench/gpu_check.py --steps 300 --total-rows 10000000
    python bench/gpu_check.py --dry-run-cpu         # only to develop this script: small, on CPU, bf16 + export
    bash bench/gpu_session.sh                       # a lent GPU's whole session: batch 4096 and 32768
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from learner.batch import TensorBatch, to_tensors  # noqa: E402
from learner.model import DeepFM  # noqa: E402
from learner.optim import make_optimizers  # noqa: E402
from learner.trainer import Trainer  # noqa: E402


def _bench_learner():
    """bench/learner.py by path (its module name would shadow the learner package)."""
    spec = importlib.util.spec_from_file_location("bench_learner", Path(__file__).with_name("learner.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_batches(args) -> tuple[Any, list[TensorBatch]]:
    bl = _bench_learner()
    rows = args.total_rows // args.fields
    ids, labels = bl.make_workload(args.seed, args.batches * args.batch, args.fields, rows, args.zipf)
    cfg = bl.feature_config(args.fields, rows, args.dim)
    b = args.batch
    tbs = [to_tensors(bl.sample_batch(ids[i * b:(i + 1) * b], labels[i * b:(i + 1) * b], i * b), cfg)
           for i in range(args.batches)]
    return cfg, tbs


def make_trainer(cfg, device: str, dtype: torch.dtype | None, fused: str = "auto") -> Trainer:
    torch.manual_seed(0)
    model = DeepFM(cfg, mlp=(400, 400, 400), seed=0, autocast_dtype=dtype).to(device)
    sparse_opt, dense_opt = make_optimizers(model, lr_sparse=0.05, lr_dense=1e-3)
    return Trainer(model, sparse_opt, dense_opt, device=device, fused_sparse_update=fused)


def train(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None, steps: int, warmup: int,
          cpu_scaler: bool = False, fused: str = "auto") -> tuple[Trainer, dict[str, Any]]:
    trainer = make_trainer(cfg, device, dtype, fused)
    model = trainer.model
    if cpu_scaler:  # dry run only: what Trainer builds on cuda for fp16
        trainer.scaler = torch.amp.GradScaler("cpu")
    losses, times, scales = [], [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        trainer.test_then_train(tbs[i % len(tbs)])  # copies predictions to the host: a sync per step
        times.append(time.perf_counter() - t0)
        losses.append(trainer.last_loss)
        scales.append(trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None)
    k = min(20, len(losses) // 2)
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    table_finite = bool(torch.isfinite(model.sparse.bag.weight).all())
    res = {"dtype": str(dtype or torch.float32).removeprefix("torch."), "scaler": trainer.scaler.is_enabled(),
           "sparse_update": trainer.sparse_update,
           "ex_per_s": round(len(tbs[0]) / statistics.median(times[warmup:])),
           "step_ms_median": round(statistics.median(times[warmup:]) * 1e3, 3),
           "loss_first": round(first, 4), "loss_last": round(last, 4),
           "all_losses_finite": bool(np.isfinite(losses).all()), "table_finite": table_finite,
           "final_scale": scales[-1], "scale_decreases": sum(1 for a, b in zip(scales, scales[1:], strict=False)
                                                              if a is not None and b is not None and b < a)}
    res["ok"] = res["all_losses_finite"] and table_finite and last < first
    return trainer, res


def _tables_after(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None, fused: str,
                  marks: tuple[int, ...]) -> tuple[str, dict[int, torch.Tensor]]:
    trainer = make_trainer(cfg, device, dtype, fused)
    out = {}
    for i in range(1, max(marks) + 1):
        trainer.test_then_train(tbs[(i - 1) % len(tbs)])
        if i in marks:
            out[i] = trainer.model.sparse.bag.weight.detach().float().clone()
    return trainer.sparse_update, out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def same_update(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None, steps: int = 20
                ) -> dict[str, Any]:
    """The fused row-wise Adagrad (``learner/fused_update.py``) against the optimizer's own step on ``device``:
    trainers from one initial state on the same batches. After one step the tables may differ only by the order
    in which a row's lookups are summed (float rounding: rel. L2 <= 1e-5 is the check). Over ``steps`` steps
    such differences grow through the dense part (Adam divides by the root of small second moments), so the
    divergence after ``steps`` is reported beside the same measure between two unfused runs (the device's own
    run-to-run nondeterminism: CUDA's atomics sum in no fixed order)."""
    marks = (1, steps)
    path_f, fused = _tables_after(cfg, tbs, device, dtype, "on", marks)
    path_u, unfused = _tables_after(cfg, tbs, device, dtype, "off", marks)
    _, again = _tables_after(cfg, tbs, device, dtype, "off", marks)
    res = {"paths": [path_f, path_u], "steps": steps,
           "rel_l2_fused_vs_unfused": {str(k): _rel(fused[k], unfused[k]) for k in marks},
           "max_abs_fused_vs_unfused": {str(k): float((fused[k] - unfused[k]).abs().max()) for k in marks},
           "rel_l2_unfused_run_to_run": {str(k): _rel(again[k], unfused[k]) for k in marks},
           "table_max_abs": float(unfused[steps].abs().max())}
    res["ok"] = path_f == "fused" and path_u == "unfused" and res["rel_l2_fused_vs_unfused"]["1"] <= 1e-5
    return res


def fused_ab(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None, rounds: int = 7,
             block: int = 30) -> dict[str, Any]:
    """Fused against unfused in one process, interleaved: ``rounds`` blocks of ``block`` steps each, alternating
    which goes first, so drift of the shared machine (clocks, other tenants) falls on both. Median ex/s per
    block, the per-round ratios and their median."""
    trainers = {"fused": make_trainer(cfg, device, dtype, "on"), "unfused": make_trainer(cfg, device, dtype, "off")}
    for t in trainers.values():
        for tb in tbs[:10]:
            t.test_then_train(tb)
    speeds: dict[str, list[float]] = {k: [] for k in trainers}
    n = len(tbs[0])
    for r in range(rounds):
        for name in (("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")):
            t = trainers[name]
            ts = []
            for i in range(block):
                t0 = time.perf_counter()
                t.test_then_train(tbs[(r * block + i) % len(tbs)])
                ts.append(time.perf_counter() - t0)
            speeds[name].append(n / statistics.median(ts))
    ratios = [f / u for f, u in zip(speeds["fused"], speeds["unfused"], strict=True)]
    paths = {k: t.sparse_update for k, t in trainers.items()}
    devt = {k: profile_steps(t, tbs, steps=10, top=0)["per_step_ms"] for k, t in trainers.items()}
    return {"dtype": str(dtype or torch.float32).removeprefix("torch."), "paths": paths,
            "ex_per_s_median": {k: round(statistics.median(v)) for k, v in speeds.items()},
            "ratio_fused_unfused_per_round": [round(x, 3) for x in ratios],
            "ratio_median": round(statistics.median(ratios), 3), "device_ms_per_step": devt,
            "ok": paths == {"fused": "fused", "unfused": "unfused"}}


def host_profile(trainer: Trainer, tbs: list[TensorBatch], steps: int = 30, top: int = 18) -> dict[str, Any]:
    """Where the host's time goes in a training step (cProfile, by own time): on a GPU the step waits on the
    host (launches, Python, the metrics' numpy) far longer than the device computes."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for tb in tbs[:steps]:
        trainer.test_then_train(tb)
    pr.disable()
    wall = (time.perf_counter() - t0) / steps
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # (file, line, fn) -> (cc, nc, tt, ct)
    return {"wall_ms_per_step": round(wall * 1e3, 3),
            "top_own_ms_per_step": [[f"{Path(k[0]).name}:{k[1]}:{k[2]}"[:70], round(v[2] / steps * 1e3, 3), v[1]
                                     // steps] for k, v in rows[:top]], "ok": True}


def floor_stepper(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None) -> Callable[[int], float]:
    """bench/learner.py's floor on ``device`` as a step function (step ``i`` trains on batch ``i mod len(tbs)`` and
    returns its loss): the batch's touched rows gathered once (deduplicated here, before any step), expanded to the
    lookups, the dense part (FM + MLP fwd + bwd + fused Adam) under ``dtype`` autocast, the lookups' gradients
    reduced per touched row and scattered into the table (plain SGD). What moving the rows and the dense math cost
    on this device; the same sync per step as the trainer (loss.item())."""
    bl = _bench_learner()
    bl.DENSE_DTYPE = None  # its head autocasts on the CPU only; the device's autocast is set here
    fields, dim, b = cfg.num_fields, cfg.embedding_dim, len(tbs[0])
    table = torch.empty(cfg.num_rows, dim + 1, device=device)
    with torch.no_grad():
        table.normal_(0.0, 0.01)
        table[:, dim].zero_()
    head = bl.make_head(fields, dim).to(device)
    opt = torch.optim.Adam(head.parameters(), lr=bl.LR_DENSE, fused=True)
    inputs = []
    for tb in tbs:
        v = tb.values.to(device)
        uniq, inv = torch.unique(v, sorted=True, return_inverse=True)
        inputs.append((uniq, inv.view(fields, b).t().contiguous().view(-1), tb.labels.to(device)))

    def step(i: int) -> float:
        uniq, inv, y = inputs[i % len(inputs)]
        block = table.index_select(0, uniq)  # (U, D+1): the touched rows
        x = block.index_select(0, inv).view(b, fields, dim + 1).requires_grad_()  # (B, F, D+1)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = head(x[..., :dim], x[..., dim])  # (B,)
        loss = F.binary_cross_entropy_with_logits(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        g = torch.zeros_like(block).index_put_((inv,), x.grad.view(-1, dim + 1), accumulate=True)  # (U, D+1)
        table.index_add_(0, uniq, g, alpha=-bl.LR_SPARSE)
        return float(loss.item())

    return step


def floor(cfg, tbs: list[TensorBatch], device: str, dtype: torch.dtype | None, steps: int, warmup: int
          ) -> dict[str, Any]:
    """The floor (:func:`floor_stepper`) timed: the median step after ``warmup``."""
    step = floor_stepper(cfg, tbs, device, dtype)
    b = len(tbs[0])
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[warmup:])
    return {"dtype": str(dtype or torch.float32).removeprefix("torch."), "ex_per_s": round(b / med),
            "step_ms_median": round(med * 1e3, 3), "loss_first": round(float(np.mean(losses[:20])), 4),
            "loss_last": round(float(np.mean(losses[-20:])), 4), "ok": bool(np.isfinite(losses).all())}


def profile_steps(trainer: Trainer, tbs: list[TensorBatch], steps: int = 10, top: int = 12) -> dict[str, Any]:
    """Where a training step's time goes: the ops with the most self time (device time on cuda)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for tb in tbs[:steps]:
            trainer.test_then_train(tb)
    key = "self_device_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    ev = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in ev) or 1.0
    return {"per_step_ms": round(total / steps / 1e3, 3), "by": key,
            "top": [[e.key[:60], round(getattr(e, key) / steps / 1e3, 3), round(100 * getattr(e, key) / total, 1)]
                    for e in ev[:top]], "ok": True}


def sparse_grad_scale(trainer: Trainer, tb: TensorBatch) -> dict[str, Any]:
    m, dev = trainer.model, trainer.device
    b = tb.to(dev)
    out = {}
    for name, scaled in (("scaled", True), ("unscaled", False)):
        m.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(m(b.values, b.offsets, b.dense).float(), b.labels)
        (trainer.scaler.scale(loss) if scaled else loss).backward()
        out[name] = float(m.sparse.bag.weight.grad.coalesce().values().abs().max())
    m.zero_grad(set_to_none=True)
    out["ratio"] = out["scaled"] / out["unscaled"]
    out["loss_scale"] = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None
    return out


def overflow_step(trainer: Trainer, tbs: list[TensorBatch]) -> dict[str, Any]:
    """Force one overflowing loss scale; GradScaler must skip the step and nothing may turn non-finite."""
    scaler = trainer.scaler
    scaler.update(new_scale=2.0 ** 40)
    res: dict[str, Any] = {"forced_scale": 2.0 ** 40}
    try:
        trainer.test_then_train(tbs[0])
        res["scale_after"] = scaler.get_scale()
        res["table_finite_after_overflow"] = bool(torch.isfinite(trainer.model.sparse.bag.weight).all())
        for tb in tbs[1:6]:
            trainer.test_then_train(tb)
        res["losses_after"] = trainer.last_loss
        res["ok"] = res["table_finite_after_overflow"] and res["scale_after"] < 2.0 ** 40
    except (FloatingPointError, ValueError) as exc:  # NaN predictions reach the metrics, or a NaN loss
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["table_finite"] = bool(torch.isfinite(trainer.model.sparse.bag.weight).all())
        res["ok"] = False
    return res


def h2d(tbs: list[TensorBatch], device: str, n: int = 30) -> dict[str, Any]:
    batches = [TensorBatch(t.values.clone(), t.offsets.clone(), t.dense.clone(), t.labels.clone(), t.impression_ids,
                           t.ts) for t in tbs[:n]]
    nbytes = sum(x.nbytes for x in (batches[0].values, batches[0].offsets, batches[0].dense, batches[0].labels))
    sync = torch.cuda.synchronize

    def per_batch(bs: list[TensorBatch], non_blocking: bool) -> float:
        ts = []
        for x in bs:
            t0 = time.perf_counter()
            x.to(device, non_blocking=non_blocking)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[3:])

    pageable = per_batch(batches, False)
    t0 = time.perf_counter()
    pinned_bs = [TensorBatch(x.values, x.offsets, x.dense, x.labels, x.impression_ids, x.ts).pin_memory()
                 for x in batches]
    pin_ms = (time.perf_counter() - t0) / len(batches) * 1e3
    pinned = per_batch(pinned_bs, True)
    # All batches queued without a sync in between: what the non_blocking copies buy when they overlap.
    t0 = time.perf_counter()
    for x in pinned_bs:
        x.to(device, non_blocking=True)
    sync()
    pinned_queued = (time.perf_counter() - t0) / len(pinned_bs)
    big = torch.empty(256 * 2**20 // 4, dtype=torch.float32)
    big_pinned = big.pin_memory()
    bw = {}
    for name, src, nb in (("pageable", big, False), ("pinned", big_pinned, True)):
        src.to(device, non_blocking=nb)
        sync()
        t0 = time.perf_counter()
        src.to(device, non_blocking=nb)
        sync()
        bw[name] = round(big.nbytes / (time.perf_counter() - t0) / 1e9, 2)
    return {"batch_bytes": nbytes, "pageable_ms": round(pageable * 1e3, 3), "pinned_ms": round(pinned * 1e3, 3),
            "pinned_queued_ms": round(pinned_queued * 1e3, 3), "pin_memory_ms": round(pin_ms, 3),
            "pageable_gb_s": round(nbytes / pageable / 1e9, 2), "pinned_gb_s": round(nbytes / pinned / 1e9, 2),
            "big_256mib_gb_s": bw, "ok": True}


def export_check(trainer: Trainer, tbs: list[TensorBatch], num_fields: int) -> dict[str, Any]:
    model, dev = trainer.model, trainer.device
    model.eval()
    b = tbs[0].to(dev)
    args = (b.values, b.offsets, b.dense)
    res: dict[str, Any] = {}
    batch = torch.export.Dim("batch", min=2, max=1 << 16)
    nnz = torch.export.Dim("nnz", min=2, max=1 << 24)
    dynamic = {"values": {0: nnz}, "offsets": {0: num_fields * batch + 1}, "dense": {0: batch}}
    t0 = time.perf_counter()
    try:
        ep = torch.export.export(model, args, dynamic_shapes=dynamic)
        res["dynamic_batch"] = True
    except Exception as exc:  # noqa: BLE001 - report, then try a static export
        res["dynamic_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        res["dynamic_batch"] = False
        ep = torch.export.export(model, args)
    res["export_s"] = round(time.perf_counter() - t0, 2)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "deepfm.pt2"
        torch.export.save(ep, str(path))
        res["file_mib"] = round(path.stat().st_size / 2**20, 1)
        loaded = torch.export.load(str(path)).module()
    diffs = {}
    cases = [tbs[1]]
    if res["dynamic_batch"]:
        cases.append(tbs[2].select(np.arange(len(tbs[2])) < 1000))  # another batch size
    with torch.no_grad():
        for tb in cases:
            x = tb.to(dev)
            ref = model(x.values, x.offsets, x.dense).float()
            got = loaded(x.values, x.offsets, x.dense).float()
            diffs[str(len(tb))] = float((ref - got).abs().max())
    res["max_abs_diff"] = diffs
    res["ok"] = all(v <= 1e-3 for v in diffs.values())
    model.train()
    return res


def _latency(model: Any, tb: TensorBatch, n: int) -> dict[str, float]:
    times = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        model.score(tb.values, tb.offsets, tb.dense)
        if i >= 5:  # score() returns host-visible scores: each call is synchronised
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": round(times[len(times) // 2], 3), "p99_ms": round(times[int(len(times) * 0.99) - 1], 3)}


def tensorrt_check(trainer: Trainer, cfg: Any, tbs: list[TensorBatch], device: str) -> dict[str, Any]:
    """The ``onnx`` artifact of the trained model on ``device`` through ONNX Runtime's TensorRT provider."""
    from learner import onnx_scorer
    from learner.artifact import build_artifact
    from serving.model import ScoringModel

    try:
        have = onnx_scorer._ort().get_available_providers()
    except onnx_scorer.OnnxUnavailable as exc:
        return {"ok": True, "checked": False, "reason": f"TensorRT not checked: {exc}"}
    note = None
    trt = device == "cuda" and "TensorrtExecutionProvider" in have
    onnx_device = device if trt else "cpu"
    if device == "cuda" and not trt:  # still times TorchScript on the GPU and the onnx artifact on the CPU provider
        note = (f"TensorRT not checked: onnxruntime {onnx_scorer._ort().__version__} has no TensorRT execution "
                f"provider ({have}); pip install onnxruntime-gpu tensorrt. The onnx artifact was timed on the CPU "
                f"provider instead")
    if device != "cuda":
        note = "no CUDA device: the dry run scored the onnx artifact on the CPU provider instead of TensorRT"
    model = trainer.model.float().eval()
    meta = {"feature_config": cfg.to_dict(), "samples_trained": 0, "offsets": {"0": 0}, "topic": "gpu-check",
            "model": {"mlp": "400,400,400", "dropout": 0.0, "amp": False, "seed": 0}}
    ckpt = {"meta": meta, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "path": "gpu-check"}
    hot = np.arange(0, cfg.num_rows, 10)  # a tenth of the rows hot, the rest from the cold file
    res: dict[str, Any] = {"note": note} if note else {}
    one = tbs[0].select(np.arange(len(tbs[0])) < 100)  # 100 candidates
    big = tbs[1]
    with tempfile.TemporaryDirectory() as d:
        onnx_dir = build_artifact(ckpt, Path(d) / "onnx", hot, format="onnx")
        ts_dir = build_artifact(ckpt, Path(d) / "ts", hot, format="torchscript")
        t0 = time.perf_counter()
        on_dev = ScoringModel.load(onnx_dir, device=onnx_device)
        on_dev.score(big.values, big.offsets, big.dense)  # the TensorRT engine is built on first use
        res["load_and_engine_build_s"] = round(time.perf_counter() - t0, 2)
        res["providers"] = on_dev._live.scorer.execution_providers
        on_cpu = ScoringModel.load(onnx_dir, device="cpu")
        ts = ScoringModel.load(ts_dir, device=device)
        diff = float((on_dev.score(big.values, big.offsets, big.dense).cpu()
                      - on_cpu.score(big.values, big.offsets, big.dense)).abs().max())
        res["max_abs_diff_vs_cpu"] = diff
        for name, m in (("onnx", on_dev), ("torchscript", ts)):
            res[name] = {"100": _latency(m, one, 300), str(len(big)): _latency(m, big, 50)}
    res["checked"] = trt
    res["ok"] = diff <= 2e-3 and (not trt or "TensorrtExecutionProvider" in res["providers"])
    return res


SKIP: set[str] = set()  # --skip


def run_check(name: str, fn, results: dict[str, Any]) -> Any:
    if name in SKIP:
        return None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
        return None
    res = out[1] if isinstance(out, tuple) else out
    res["s"] = round(time.perf_counter() - t0, 1)
    results[name] = res
    print(f"[{name}] {'ok' if res.get('ok', True) else 'FAILED'}: {json.dumps(res)[:400]}", file=sys.stderr,
          flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fields", type=int, default=26)
    ap.add_argument("--total-rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--batches", type=int, default=100, help="distinct batches (cycled)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="also profile 10 steps of each dtype (top ops)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="develop this script without a GPU (small, CPU)")
    ap.add_argument("--skip", default="", help="checks not to run, comma-separated (e.g. tensorrt,export)")
    args = ap.parse_args()
    SKIP.update(filter(None, args.skip.split(",")))

    if args.dry_run_cpu:
        device = "cpu"
        args.total_rows, args.batch, args.batches, args.steps, args.warmup = 260_000, 1024, 12, 30, 3
        torch.set_num_threads(2)
    elif not torch.cuda.is_available():
        msg = (f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
               "bench/gpu_check.py only runs on a machine with a GPU; nothing was checked")
        msg += " (TensorRT included: it needs a CUDA device and onnxruntime-gpu with TensorRT)"
        print(msg, file=sys.stderr)
        print(json.dumps({"bench": "gpu_check", "skipped": True, "reason": msg}))
        return 0
    else:
        device = "cuda"
    summary: dict[str, Any] = {"bench": "gpu_check", "device": device, "torch": torch.__version__,
                               "cuda": torch.version.cuda,
                               "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    t0 = time.perf_counter()
    cfg, tbs = build_batches(args)
    summary["data_s"] = round(time.perf_counter() - t0, 1)
    summary["workload"] = {"fields": args.fields, "rows": cfg.num_rows, "dim": args.dim, "batch": args.batch,
                           "steps": args.steps, "distinct_batches": args.batches}
    checks: dict[str, Any] = {}
    fp16 = run_check("fp16", lambda: train(cfg, tbs, device, torch.float16, args.steps, args.warmup,
                                           cpu_scaler=args.dry_run_cpu), checks)
    if fp16 is not None:
        fp16_trainer: Trainer = fp16[0]
        if args.profile:
            run_check("profile_fp16", lambda: profile_steps(fp16_trainer, tbs), checks)
        run_check("sparse_grad", lambda: sparse_grad_scale(fp16_trainer, tbs[0]), checks)
        if device == "cuda":
            run_check("export", lambda: export_check(fp16_trainer, tbs, cfg.num_fields), checks)
        run_check("fp16_overflow", lambda: overflow_step(fp16_trainer, tbs), checks)
    fp16 = None  # free the fp16 model before the bf16 one
    bf16 = run_check("bf16", lambda: train(cfg, tbs, device, torch.bfloat16, args.steps, args.warmup), checks)
    if bf16 is not None and device == "cpu":  # dry run: export on CPU (bf16 model)
        bf16_trainer: Trainer = bf16[0]
        run_check("export", lambda: export_check(bf16_trainer, tbs, cfg.num_fields), checks)
    if bf16 is not None and args.profile:
        run_check("profile_bf16", lambda: profile_steps(bf16[0], tbs), checks)
    bf16 = None
    # The table's update inside the lookup's backward (fused_sparse_update = on; auto's choice on the CPU) against
    # the optimizer's own step after a sparse gradient and its coalesce (off; auto's choice on CUDA since this
    # check measured it faster there).
    run_check("same_update_fp32", lambda: same_update(cfg, tbs, device, None), checks)
    for name, dt in (("fused_ab_bf16", torch.bfloat16), ("fused_ab_fp32", None)):
        run_check(name, lambda dt=dt: fused_ab(cfg, tbs, device, dt), checks)
    for name, dt in (("floor_bf16", torch.bfloat16), ("floor_fp32", None)):
        run_check(name, lambda dt=dt: floor(cfg, tbs, device, dt, args.steps, args.warmup), checks)
    fp32 = run_check("fp32", lambda: train(cfg, tbs, device, None, args.steps, args.warmup), checks)
    if fp32 is not None and args.profile:
        run_check("profile_fp32", lambda: profile_steps(fp32[0], tbs), checks)
        run_check("host_profile_fp32", lambda: host_profile(fp32[0], tbs), checks)
    speed = {k: checks[k]["ex_per_s"] for k in ("fp16", "bf16", "fp32") if "ex_per_s" in checks.get(k, {})}
    if "fp32" in speed:
        summary["speedup_vs_fp32"] = {k: round(v / speed["fp32"], 2) for k, v in speed.items() if k != "fp32"}
    eps = {k: v["ex_per_s"] for k, v in checks.items() if "ex_per_s" in v}
    summary["ratios"] = {f"{a} / {b}": round(eps[a] / eps[b], 2)
                         for a, b in (("bf16", "floor_bf16"), ("fp32", "floor_fp32")) if a in eps and b in eps}
    summary["ratios"].update({f"fused / unfused ({k.removeprefix('fused_ab_')})": v["ratio_median"]
                              for k, v in checks.items() if k.startswith("fused_ab_") and "ratio_median" in v})
    if fp32 is not None:
        run_check("tensorrt", lambda: tensorrt_check(fp32[0], cfg, tbs, device), checks)
    fp32 = None
    if device == "cuda":
        run_check("h2d", lambda: h2d(tbs, device), checks)
    summary["checks"] = {k: {kk: vv for kk, vv in v.items() if kk != "trace"} for k, v in checks.items()}
    summary["failed"] = sorted(k for k, v in checks.items() if not v.get("ok", True))
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
