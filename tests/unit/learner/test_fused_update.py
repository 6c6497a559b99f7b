"""The table's row-wise Adagrad fused into the lookup's backward (``learner/fused_update.py``) is the optimizer's own
update, applied exactly once, and runs only where it is the same update (``[learner] fused_sparse_update``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from learner.batch import TensorBatch
from learner.config import FusedSparseUpdate, LearnerSettings
from learner.features import FeatureConfig, FieldSpec
from learner.fused_update import fused_lookups, row_gradients, stable_sort
from learner.model import DeepFM, SparseArch
from learner.optim import RowWiseAdagrad, make_optimizers
from learner.trainer import Trainer
from stream.errors import ConfigError
from streamrec.settings import Sources

# Three fields over one table of 30 rows (D = 4, rows of 5): a multi-valued history field first (so the first bag
# holds several lookups), with empty bags, over the item rows 10-24 (so a row is looked up from two fields), then
# user rows 0-9 and the item rows.
ROWS, DIM, B, FIELDS = 30, 4, 6, 3


def bags(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Field-major bags (values (L,), offsets (F * B + 1,)) with duplicate rows within a bag, across bags and
    across fields, and empty bags."""
    g = torch.Generator().manual_seed(seed)
    users = torch.randint(0, 4, (B,), generator=g)  # (B,) few distinct: repeated across bags
    items = torch.randint(10, 14, (B,), generator=g)  # (B,)
    lengths = torch.tensor([3, 0, 2, 4, 0, 1])  # (B,) history bags, two empty
    history = torch.randint(10, 14, (int(lengths.sum()),), generator=g)  # the item rows again, repeats in a bag
    values = torch.cat([history, users, items])  # (L,)
    sizes = torch.cat([lengths, torch.ones(2 * B, dtype=torch.int64)])  # (F * B,)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])  # (F * B + 1,)
    return values, offsets


def loss_of(emb: torch.Tensor, first: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    target = torch.randn(emb.shape, generator=g)  # (B, F, D)
    return ((emb - target) ** 2).sum() + (first * torch.randn(first.shape, generator=g)).sum()


def train(arch: SparseArch, opt: RowWiseAdagrad, steps: int, fused: bool) -> None:
    for s in range(steps):
        values, offsets = bags(s)
        opt.zero_grad(set_to_none=True)
        if fused:
            with fused_lookups(nn.ModuleDict({"sparse": arch}), opt):
                emb, first = arch(values, offsets)
        else:
            emb, first = arch(values, offsets)
        loss_of(emb, first, s).backward()
        if fused:
            assert arch.bag.weight.grad is None  # applied in the backward, not left for the step
        opt.step()


def pair(boost: float, initial_accumulator: float) -> list[tuple[SparseArch, RowWiseAdagrad]]:
    base = SparseArch(ROWS, DIM, FIELDS, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # first-order weights away from 0 so they carry a gradient from the start too
        base.bag.weight[:, DIM].normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(2):
        arch = copy.deepcopy(base)
        out.append((arch, RowWiseAdagrad(arch.parameters(), lr=0.1, boost=boost, boost_half_life=2.0,
                                         initial_accumulator=initial_accumulator)))
    return out


@pytest.mark.parametrize("boost, initial_accumulator", [(0.0, 0.0), (0.0, 0.1), (3.0, 0.0), (3.0, 1e-3)])
def test_fused_update_equals_the_optimizers_step_over_several_steps(boost: float, initial_accumulator: float) -> None:
    (a, opt_a), (b, opt_b) = pair(boost, initial_accumulator)
    train(a, opt_a, 5, fused=False)
    train(b, opt_b, 5, fused=True)
    moved = (a.bag.weight != pair(boost, initial_accumulator)[0][0].bag.weight).any(dim=1)  # (ROWS,)
    assert 8 <= int(moved.sum()) < ROWS  # the test moves rows of every field, and not all rows
    torch.testing.assert_close(b.bag.weight, a.bag.weight, rtol=1e-6, atol=1e-7)
    sa, sb = opt_a.state[a.bag.weight], opt_b.state[b.bag.weight]
    assert set(sa) == set(sb) == ({"sum", "updates"} if boost else {"sum"})  # the state stays the optimizer's
    torch.testing.assert_close(sb["sum"], sa["sum"], rtol=1e-6, atol=1e-9)
    if boost:
        assert torch.equal(sb["updates"], sa["updates"]) and sb["updates"].dtype == torch.int32


def test_per_row_sums_are_the_coalesced_gradient_of_the_mean_bag() -> None:
    bag = nn.EmbeddingBag(ROWS, DIM + 1, mode="mean", sparse=True, include_last_offset=True)
    values, offsets = bags(3)
    out = bag(values, offsets)  # (N, D + 1)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    want = bag.weight.grad.coalesce()
    bag_size = offsets.diff()  # (N,)
    offset2bag = torch.repeat_interleave(torch.arange(len(bag_size)), bag_size)  # (L,)
    rows, sums = row_gradients(grad, values, offset2bag, bag_size)  # (U,), (U, D + 1)
    assert torch.equal(rows, want.indices()[0])
    torch.testing.assert_close(sums, want.values(), rtol=1e-6, atol=1e-7)


def test_one_batch_updates_each_touched_row_exactly_once() -> None:
    """Would fail if the fused update were skipped (counts 0, table unmoved) or applied twice (counts 2), by the
    backward and again by the step or a checkpoint's ``Trainer.step``."""
    cfg, batch = small_config(), small_batch(0)
    ref, fused = DeepFM(cfg, mlp=(8,), seed=1, autocast_dtype=None), DeepFM(cfg, mlp=(8,), seed=1, autocast_dtype=None)
    trainers = []
    for model, mode in ((ref, "off"), (fused, "on")):
        sparse, dense = make_optimizers(model, 0.1, 0.01, boost=2.0, boost_half_life=4.0)
        trainers.append(Trainer(model, sparse, dense, fused_sparse_update=mode))
        trainers[-1].test_then_train(batch)
        trainers[-1].step()  # what a checkpoint does between batches: nothing is pending
    assert [t.sparse_update for t in trainers] == ["unfused", "fused"]
    counts = trainers[1].sparse_opt.state[fused.sparse.bag.weight]["updates"]  # (rows,)
    touched = torch.unique(batch.values)
    assert counts[touched].tolist() == [1] * len(touched) and int(counts.sum()) == len(touched)
    torch.testing.assert_close(fused.sparse.bag.weight, ref.sparse.bag.weight, rtol=1e-6, atol=1e-7)
    once = ref.sparse.bag.weight.detach() - DeepFM(cfg, mlp=(8,), seed=1).sparse.bag.weight.detach()  # (rows, D+1)
    assert once[touched].abs().amax(dim=1).gt(0).all()  # every touched row moved


def test_trainers_fused_and_unfused_train_the_same_model() -> None:
    cfg = small_config()
    models = [DeepFM(cfg, mlp=(8,), seed=2, autocast_dtype=None) for _ in range(2)]
    for model, mode in zip(models, ("off", "auto"), strict=True):
        sparse, dense = make_optimizers(model, 0.1, 0.01, initial_accumulator=1e-3)
        t = Trainer(model, sparse, dense, fused_sparse_update=mode)
        for i in range(4):
            t.test_then_train(small_batch(i))
        assert t.sparse_update == ("fused" if mode == "auto" else "unfused") and t.steps == 4
    for (name, p1), (_, p2) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        torch.testing.assert_close(p2, p1, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["accumulation", "sparse_adam", "loss_scaling"])
def test_auto_falls_back_where_the_fused_update_is_not_the_same(case: str) -> None:
    model = DeepFM(small_config(), mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01, "sparse_adam" if case == "sparse_adam" else "rowwise_adagrad")
    t = Trainer(model, sparse, dense, accumulation=2 if case == "accumulation" else 1)
    if case == "loss_scaling":  # what fp16 on CUDA gets; the CPU scaler takes the same code path
        t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    t.test_then_train(small_batch(0))
    assert t.sparse_update == "unfused"
    assert model.sparse.bag.weight.grad is not None or t.steps == 1  # a gradient pending or stepped: unfused
    assert model.sparse.fused_optimizer is None


@pytest.mark.parametrize(("mode", "want"), [("auto", "unfused"), ("on", "fused"), ("off", "unfused")])
def test_auto_leaves_the_fused_update_off_on_cuda_where_it_measured_slower(mode: str, want: str) -> None:
    """bench/README.md, GPU: on an H200 the fused step lost 2-15% of the wall time. The trainer is only built here
    (a device name needs no device); ``sparse_update`` is the path its first batch would take."""
    model = DeepFM(small_config(), mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    assert Trainer(model, sparse, dense, device="cuda", fused_sparse_update=mode).sparse_update == want
    assert Trainer(model, sparse, dense, device="cpu", fused_sparse_update=mode).sparse_update == (
        "unfused" if mode == "off" else "fused")


def test_on_where_it_cannot_apply_is_a_config_error() -> None:
    model = DeepFM(small_config(), mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    with pytest.raises(ConfigError, match="accumulation = 2"):
        Trainer(model, sparse, dense, accumulation=2, fused_sparse_update="on")


def test_the_setting_reads_from_file_and_environment_and_defaults_to_auto() -> None:
    assert LearnerSettings().fused_sparse_update is FusedSparseUpdate.AUTO
    src = Sources(file_data={"learner": {"fused_sparse_update": "on"}},
                  environ={"STREAMREC_LEARNER_FUSED_SPARSE_UPDATE": "off"})
    assert src.build(LearnerSettings, "learner").fused_sparse_update is FusedSparseUpdate.OFF
    file_only = Sources(file_data={"learner": {"fused_sparse_update": False}}, environ={})
    assert file_only.build(LearnerSettings, "learner").fused_sparse_update is FusedSparseUpdate.OFF
    with pytest.raises(ConfigError, match="fused_sparse_update"):
        LearnerSettings(fused_sparse_update="sometimes")  # type: ignore[arg-type]


def test_evaluation_and_prediction_never_update_the_table() -> None:
    model = DeepFM(small_config(), mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    t = Trainer(model, sparse, dense)
    before = model.sparse.bag.weight.detach().clone()
    t.predict(small_batch(0))
    assert torch.equal(model.sparse.bag.weight, before) and model.sparse.fused_optimizer is None


# -- a small DeepFM batch -----------------------------------------------------------------------------------
def small_config() -> FeatureConfig:
    return FeatureConfig((FieldSpec("user_id", "single", 7), FieldSpec("item_id", "single", 9),
                          FieldSpec("history", "multi", shares="item_id")), dense=("x",), embedding_dim=DIM)


def small_batch(seed: int, b: int = 24) -> TensorBatch:
    """Field-major bags over the config's rows: users 0-6, items 7-15, history (the item rows, 0-4 per bag)."""
    g = torch.Generator().manual_seed(seed)
    users, items = torch.randint(0, 7, (b,), generator=g), torch.randint(7, 16, (b,), generator=g)
    lengths = torch.randint(0, 5, (b,), generator=g)
    history = torch.randint(7, 16, (int(lengths.sum()),), generator=g)
    sizes = torch.cat([torch.ones(2 * b, dtype=torch.int64), lengths])
    return TensorBatch(values=torch.cat([users, items, history]),
                       offsets=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                       dense=torch.randn(b, 1, generator=g), labels=(torch.rand(b, generator=g) < 0.4).float(),
                       impression_ids=np.array([f"i{seed}-{k}" for k in range(b)], dtype=object),
                       ts=np.arange(b, dtype=np.int64))


@pytest.mark.parametrize("multi", [True, False])
def test_the_fused_lookup_pools_exactly_what_the_bag_pools(multi: bool) -> None:
    """Batch-major bags (learner.fused_update.batch_major) pool to the same (B, F, D), (B, F) as the field-major bag,
    with several lookups per bag (the general reorder) and with one per bag (the transpose)."""
    (arch, opt), _ = pair(0.0, 0.0)
    values, offsets = bags(4)
    if not multi:  # only the user and item fields: one lookup per bag
        values, offsets = values[-2 * B:], torch.arange(2 * B + 1)
        arch.num_fields = 2
    want = arch(values, offsets)
    with fused_lookups(nn.ModuleDict({"sparse": arch}), opt):
        got = arch(values, offsets)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("case", ["zipf", "all_equal", "one", "empty", "huge", "negative", "strided", "int32"])
def test_stable_sort_is_torchs_stable_sort(case: str) -> None:
    """The packed-key numpy sort gives torch's stable sort exactly: sorted rows and, among equal rows, lookup order
    (the order a row's gradients are summed in); indices it cannot pack take torch's sort."""
    g = torch.Generator().manual_seed(3)
    values = {
        "zipf": torch.randint(0, 50, (5000,), generator=g) ** 3,  # many repeats, uneven
        "all_equal": torch.full((1000,), 7, dtype=torch.int64),
        "one": torch.tensor([5]),
        "empty": torch.zeros(0, dtype=torch.int64),
        "huge": torch.tensor([1 << 61, 3, 1 << 61, 0]),  # no room for the position bits
        "negative": torch.tensor([-1, 4, -1, 2]),
        "strided": torch.randint(0, 9, (40, 3), generator=g).t()[1],  # a non-contiguous view
        "int32": torch.randint(0, 9, (100,), generator=g, dtype=torch.int32),
    }[case]
    got_rows, got_order = stable_sort(values)
    want_rows, want_order = torch.sort(values, stable=True)
    assert torch.equal(got_rows, want_rows) and torch.equal(got_order, want_order)
    assert got_rows.dtype == values.dtype and got_order.dtype == torch.int64
