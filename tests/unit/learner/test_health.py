"""The learner's health computations (``learner/health.py``) and the trainer's gradient/update norms."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from learner.batch import TensorBatch
from learner.features import FeatureConfig, FieldSpec
from learner.health import (
    FieldCoverage,
    GradNorms,
    GrowthRate,
    MemoryMonitor,
    PositiveRate,
    UpdateNorms,
    field_blocks,
    rss_bytes,
)
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from stream.features import MISSING
from tests.unit.learner.test_fused_update import small_batch, small_config

MIB = 1 << 20


# -- memory ---------------------------------------------------------------------------------------------------
def test_rss_is_this_process_resident_set() -> None:
    rss = rss_bytes()
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    vm_rss = int(status["VmRSS"].split()[0]) * 1024
    assert 20 * MIB < rss < 64 * 1024 * MIB and abs(rss - vm_rss) < 64 * MIB


def test_growth_rate_is_the_slope_per_hour_and_nan_until_the_window_is_half_full() -> None:
    g = GrowthRate(window_s=60)
    for t in range(0, 29):
        g.add(float(t), 1e9 + t * 1000.0)
    assert math.isnan(g.per_hour())  # 28 s of a 60 s window
    for t in range(29, 200):
        g.add(float(t), 1e9 + t * 1000.0 + (5e5 if t % 2 else -5e5))  # 1 kB/s under +-500 kB of noise
    assert g.per_hour() == pytest.approx(3.6e6, rel=0.05)
    for t in range(200, 300):  # the leak stopped: a flat line once the window has moved past it
        g.add(float(t), 1e9 + 199 * 1000.0)
    assert g.per_hour() == pytest.approx(0.0, abs=1.0)


def test_a_leaking_process_grows_by_what_it_leaks_per_hour() -> None:
    """The memory monitor over a fake RSS reader and clock: 2 MiB a second is 7200 MiB an hour; a one-off
    allocation of 1 GiB at the start is no growth once the window has passed it."""
    clock = [0.0]
    rss = [500 * MIB]
    mon = MemoryMonitor(torch.device("cpu"), read_rss=lambda: rss[0], clock=lambda: clock[0], window_s=120)
    for _ in range(300):
        out = mon.sample()
        assert out == {"rss": float(rss[0])}
        clock[0] += 1.0
        rss[0] += 2 * MIB
    assert mon.growth_per_hour()["rss"] == pytest.approx(7200 * MIB, rel=1e-6)
    rss[0] += 1024 * MIB  # a step: the model grew once
    for _ in range(300):
        mon.sample()
        clock[0] += 1.0
    assert mon.growth_per_hour()["rss"] == pytest.approx(0.0, abs=1.0)
    assert set(mon.growth_per_hour()) == {"rss"}  # no device memory on the CPU


# -- gradient and update norms -------------------------------------------------------------------------------
def test_embedding_grad_norm_per_field_block() -> None:
    """Rows 0-6 are user_id's, 7-15 item_id's (history shares them): per-field norms add up to the table's."""
    cfg = small_config()
    assert field_blocks(cfg) == (["user_id", "item_id"], [0, 7])
    norms = GradNorms(*field_blocks(cfg))
    rows = torch.tensor([1, 6, 7, 15])
    sums = torch.tensor([[3.0, 0.0], [0.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    norms.sample_blocks = True
    norms.embedding(rows, sums)
    norms.end_step([torch.tensor(1.5), torch.tensor(2.0)])  # the dense tensors' norms: 2.5 in all
    norms.end_step()  # a step without any gradient: zeros, not "nothing"
    norms.sample_blocks = False
    norms.embedding(rows, sums)  # not sampled: the table's norm only
    norms.end_step([torch.tensor(1.0)])
    steps, blocks = norms.drain()
    assert steps == [(2.5, pytest.approx(math.sqrt(26))), (0.0, 0.0), (1.0, pytest.approx(math.sqrt(26)))]
    assert blocks == [{"user_id": 5.0, "item_id": 1.0}, {"user_id": 0.0, "item_id": 0.0}]
    assert norms.drain() == ([], [])


def test_pending_norms_are_bounded_when_nobody_drains_them() -> None:
    norms = GradNorms(keep=8)
    for i in range(100):
        norms.end_step([torch.tensor(float(i))])
    assert [d for d, _ in norms.drain()[0]] == [float(i) for i in range(92, 100)]


def trainer(mode: str, lr: float = 0.1, freeze: bool = False) -> Trainer:
    model = DeepFM(small_config(), mlp=(8,), seed=1, autocast_dtype=None)
    if freeze:
        model.sparse.bag.weight.requires_grad_(False)
    sparse, dense = make_optimizers(model, lr, lr / 10)
    t = Trainer(model, sparse, dense, fused_sparse_update=mode)
    t.update_norms.every_s = 0.0  # every step sampled
    return t


@pytest.mark.parametrize("mode", ["on", "off"])
def test_every_step_has_its_gradient_norms_fused_or_not(mode: str) -> None:
    """The fused backward's per-row sums and the unfused coalesced gradient give the same norms: those of the
    gradient the (unfused) step applies, computed here from the model's own autograd."""
    t = trainer(mode)
    ref = trainer("off")
    batch = small_batch(0)
    t.test_then_train(batch)
    b = batch
    ref.model.train()
    logits = ref.model(b.values, b.offsets, b.dense)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels).backward()
    table = ref.model.sparse.bag.weight.grad.coalesce()  # type: ignore[union-attr]
    dense = torch.nn.utils.get_total_norm([p.grad for p in ref.model.dense_parameters() if p.grad is not None])
    rows, vals = table.indices()[0], table.values()
    ((d, e),), (per_field,) = t.grad_norms.drain()
    assert t.sparse_update == ("fused" if mode == "on" else "unfused")
    assert d == pytest.approx(float(dense), rel=1e-5) and e == pytest.approx(float(vals.norm()), rel=1e-5)
    users = rows < 7
    assert per_field["user_id"] == pytest.approx(float(vals[users].norm()), rel=1e-5)
    assert per_field["item_id"] == pytest.approx(float(vals[~users].norm()), rel=1e-5)
    assert e > 0 and d > 0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_zero_learning_rate_leaves_gradients_but_no_update(mode: str) -> None:
    moving, frozen = trainer(mode), trainer(mode, lr=0.0)
    for t in (moving, frozen):
        for i in range(3):
            t.test_then_train(small_batch(i))
    upd = moving.update_norms.drain()
    assert upd["dense"] > 0 and upd["embedding"] > 0
    assert frozen.update_norms.drain() == {"dense": 0.0, "embedding": 0.0}
    assert all(d > 0 and e > 0 for d, e in frozen.grad_norms.drain()[0])  # the gradients are still there


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_frozen_table_has_zero_embedding_gradient_and_update(mode: str) -> None:
    t = trainer(mode, freeze=True)
    for i in range(3):
        t.test_then_train(small_batch(i))
    steps, blocks = t.grad_norms.drain()
    assert len(steps) == 3 and all(e == 0.0 and d > 0 for d, e in steps)
    assert blocks == [{"user_id": 0.0, "item_id": 0.0}] * 3
    upd = t.update_norms.drain()
    assert upd["embedding"] == 0.0 and upd["dense"] > 0


def test_updates_are_sampled_at_most_every_interval() -> None:
    clock = [0.0]
    u = UpdateNorms(every_s=1.0, clock=lambda: clock[0])
    starts = []
    for _ in range(10):
        starts.append(u.start())
        u.finish(torch.zeros(3, 2))
        clock[0] += 0.3
    assert starts == [True, False, False, False, True, False, False, False, True, False]


@pytest.mark.slow
def test_gradient_norms_cost_little_per_step() -> None:
    """What the norms add to a daemon-sized step (256 rows, ~3,600 lookups, 400-400-400 MLP), timed (the best of
    several rounds: this machine is shared) and printed (`pytest -m slow -s`): a measurement, not asserted (a bound
    on wall time fails on a loaded machine); what is asserted is that every timed step was recorded."""
    cfg = FeatureConfig((FieldSpec("user_id", "single", 2000), FieldSpec("item_id", "single", 2000),
                         FieldSpec("history", "sequence", shares="item_id"), FieldSpec("ctx.device", "single", 16)),
                        embedding_dim=16)
    model = DeepFM(cfg, mlp=(400, 400, 400), seed=0, autocast_dtype=None)
    norms = GradNorms.of(model)
    rows = torch.unique(torch.randint(0, 4016, (3600,)))
    sums = torch.randn(len(rows), 17)
    for p in model.dense_parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in model.dense_parameters()]

    def per_step(sampled: bool, n: int = 100) -> float:
        norms.sample_blocks = sampled
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                norms.embedding(rows, sums)
                norms.end_step(torch._foreach_norm(grads))
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    every, sampled = per_step(False), per_step(True)
    pending = len(norms.pending)
    t0 = time.perf_counter()
    steps, _ = norms.drain()
    drain = time.perf_counter() - t0
    print(f"gradient norms: {every * 1e6:.0f} us per step, {sampled * 1e6:.0f} us on a sampled step (per field), "
          f"drain of {pending} steps {drain * 1e6:.0f} us")
    assert len(steps) == pending == 1000 and all(math.isfinite(d) and t > 0 for d, t in steps)


# -- coverage and label balance ------------------------------------------------------------------------------
def coverage_batch(cfg: FeatureConfig, users: list[int], devices: list[int] | None, hist: list[int],
                   keys: bool) -> TensorBatch:
    """One batch of ``cfg`` (user_id, history, ctx.device) with raw hashed values; ``devices=None``: the column
    did not arrive (empty bags; ``to_tensors`` gives a single-valued field MISSING rows then, also not carried)."""
    b = len(users)
    blocks = cfg.blocks
    raw = [np.array(users), np.arange(sum(hist)) + 1, np.array(devices or [], dtype=np.int64)]
    lengths = [np.ones(b, np.int64), np.array(hist), np.ones(b, np.int64) if devices is not None else np.zeros(b, int)]
    values = np.concatenate([first + np.remainder(v, rows) for v, (first, rows) in zip(raw, blocks, strict=True)])
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    return TensorBatch(torch.from_numpy(values.astype(np.int64)), torch.from_numpy(offsets.astype(np.int64)),
                       torch.from_numpy(np.array([[1.0], [0.0], [2.0], [0.0]][:b], np.float32)),
                       torch.zeros(b), np.array([str(i) for i in range(b)], dtype=object), np.zeros(b, np.int64),
                       keys=np.concatenate(raw).astype(np.int64) if keys else None)


@pytest.mark.parametrize("keys", [True, False])
def test_coverage_is_the_share_of_samples_carrying_each_field(keys: bool) -> None:
    cfg = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("history", "sequence", 100),
                         FieldSpec("ctx.device", "single", 10)), dense=("age",), embedding_dim=4)
    cov = FieldCoverage(cfg, window=8)
    cov.observe(coverage_batch(cfg, [5, MISSING, 7, 9], [1, 2, MISSING, 3], [2, 0, 0, 1], keys))
    assert cov.shares() == {"user_id": 0.75, "history": 0.5, "ctx.device": 0.75, "dense.age": 0.5}
    cov.observe(coverage_batch(cfg, [5, 6, 7, 9], None, [1, 1, 1, 1], keys))  # ctx.device stops arriving
    assert cov.shares()["ctx.device"] == 3 / 8
    for _ in range(3):
        cov.observe(coverage_batch(cfg, [5, 6, 7, 9], None, [1, 1, 1, 1], keys))
    assert cov.shares() == {"user_id": 1.0, "history": 1.0, "ctx.device": 0.0, "dense.age": 0.5}


def test_a_field_that_never_arrived_is_not_listed() -> None:
    cfg = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("history", "sequence", 100),
                         FieldSpec("ctx.device", "single", 10)), embedding_dim=4)
    cov = FieldCoverage(cfg, window=8)
    cov.observe(coverage_batch(cfg, [5, 6, 7, 9], None, [0, 0, 0, 0], keys=True))
    assert cov.shares() == {"user_id": 1.0}


def test_positive_rate_over_the_window_and_nan_until_enough_samples() -> None:
    pr = PositiveRate(window=1000, min_samples=300)
    pr.observe(np.zeros(200))
    assert math.isnan(pr.rate)  # 200 negatives are no imbalance yet
    pr.observe(np.array([1.0, 0.0] * 100))
    assert pr.rate == 0.25
    for _ in range(10):
        pr.observe(np.ones(100))
    assert pr.rate == 1.0 and pr.samples == 1000
