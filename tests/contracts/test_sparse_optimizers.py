"""Contract: the sparse optimizers the learner can use (``make_optimizers(sparse_optimizer=...)`` in
learner/optim.py) update only the rows a batch touched and keep their state bounded and resettable.

Implementations: ``rowwise_adagrad`` (plain, with ``initial_accumulator``, and with the young-row ``boost``)
and ``sparse_adam`` (``torch.optim.SparseAdam``).

* A step leaves every row it did not touch bitwise unchanged, in the parameters and in the optimizer state;
  it changes the rows it touched (duplicates in a batch summed into one update).
* Optimizer state size: learner/optim.py promises ONE float per row for row-wise Adagrad ("optimizer memory is
  1/D of the table"), plus one int32 update count per row with ``boost``, and says SparseAdam keeps two
  table-sized tensors. The numbers asserted are exactly those: 1/(D+1) and 2/(D+1) of the table (each row holds
  D embedding values and 1 first-order weight) for row-wise Adagrad, <= 0.2x for the default width; SparseAdam
  is 2x the table, ten times over a 0.2x budget (reported, not hidden).
* ``reset_rows`` (what RowMapper calls for rows handed to new ids) resets exactly the given rows' state,
  leaves the parameters and every other row's state bitwise unchanged, and a reset row then learns exactly as a
  row of a fresh optimizer does. SparseAdam keeps one step count per table (torch's), which its bias correction
  uses, so for it "fresh" is a row an optimizer of the same age has never touched (learner/optim.py says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers

ROWS, WIDTH = 64, 17  # the default embedding_dim 16 + 1 first-order weight


class Table(nn.Module):
    """The sparse part of DeepFM (one EmbeddingBag, sparse=True), and a dense head for make_optimizers."""

    def __init__(self, rows: int = ROWS, width: int = WIDTH) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.bag = nn.EmbeddingBag(rows, width, mode="sum", sparse=True, include_last_offset=True)
        with torch.no_grad():
            self.bag.weight.normal_(0.0, 0.1, generator=g)
        self.head = nn.Linear(width, 1)

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [self.bag.weight]

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters())


@dataclass(frozen=True)
class Impl:
    sparse_optimizer: str
    boost: float = 0.0
    initial_accumulator: float = 0.0

    def make(self, model: nn.Module) -> torch.optim.Optimizer:
        sparse, _ = make_optimizers(model, 0.05, 0.01, self.sparse_optimizer, boost=self.boost,
                                    boost_half_life=4.0 if self.boost else 0.0,
                                    initial_accumulator=self.initial_accumulator)
        return sparse


IMPLS = {
    "rowwise_adagrad": Impl("rowwise_adagrad"),
    "rowwise_adagrad_initial_accumulator": Impl("rowwise_adagrad", initial_accumulator=0.1),
    "rowwise_adagrad_boost": Impl("rowwise_adagrad", boost=3.0),
    "sparse_adam": Impl("sparse_adam"),
}
ROWWISE = sorted(n for n in IMPLS if n.startswith("rowwise"))


def backward(model: Table, rows: list[int], seed: int) -> None:
    """A sparse gradient on ``rows`` (repeats allowed: they sum), nonzero on every one of them."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor(rows, dtype=torch.int64)
    offsets = torch.tensor([0, len(rows)], dtype=torch.int64)
    out = model.bag(values, offsets)  # (1, WIDTH)
    target = torch.randn(1, WIDTH, generator=g)
    ((out - target) ** 2).sum().backward()


def state_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-parameter state as tensors (cloned), the scalar step included."""
    out = {}
    for k, v in opt.state[p].items():
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def per_row(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if v.dim() >= 1 and v.shape[0] == rows}


def drive(impl: Impl, steps: list[list[int]]) -> tuple[Table, torch.optim.Optimizer]:
    model = Table()
    opt = impl.make(model)
    for i, rows in enumerate(steps):
        backward(model, rows, seed=i)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


WARMUP = [[1, 2, 3, 5, 8], [2, 3, 13, 21, 21], [1, 34, 55, 3]]


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_a_step_leaves_untouched_rows_bitwise_unchanged_and_moves_the_touched_ones(name: str) -> None:
    model, opt = drive(IMPLS[name], WARMUP)
    w = model.bag.weight
    before_w, before_s = w.detach().clone(), per_row(state_of(opt, w), ROWS)
    assert before_s, "the optimizer keeps per-row state"
    touched = [3, 7, 7, 40, 63]  # 3 seen before, 7 twice, 40 and 63 new
    backward(model, touched, seed=99)
    opt.step()
    after_w, after_s = w.detach(), per_row(state_of(opt, w), ROWS)
    hit = torch.zeros(ROWS, dtype=torch.bool)
    hit[touched] = True
    assert torch.equal(after_w[~hit], before_w[~hit])
    for k, v in after_s.items():
        assert torch.equal(v[~hit], before_s[k][~hit]), k
    assert bool((after_w[hit] != before_w[hit]).any(dim=1).all()), "every touched row moved"


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_duplicates_in_a_batch_make_one_update_of_their_summed_gradient(name: str) -> None:
    """Row 7 twice in one bag == one row whose gradient is twice as large: the same single update."""
    a_model = Table()
    a_opt = IMPLS[name].make(a_model)
    backward(a_model, [7, 7], seed=1)
    a_opt.step()
    b_model = Table()
    b_opt = IMPLS[name].make(b_model)
    backward(b_model, [7, 7], seed=1)
    assert not b_model.bag.weight.grad.is_coalesced()  # the bag's gradient holds row 7 twice ...
    b_model.bag.weight.grad = b_model.bag.weight.grad.coalesce()  # ... this one holds it once, summed
    b_opt.step()
    assert torch.equal(a_model.bag.weight, b_model.bag.weight)
    if name != "sparse_adam":  # SparseAdam coalesces too; row-wise counts one update for the row
        assert torch.equal(state_of(a_opt, a_model.bag.weight)["sum"], state_of(b_opt, b_model.bag.weight)["sum"])


# -- state size ---------------------------------------------------------------------------------------
EXPECTED_STATE_RATIO = {  # optimizer state bytes / parameter bytes, as learner/optim.py documents it
    "rowwise_adagrad": 1 / WIDTH,  # one float32 per row
    "rowwise_adagrad_initial_accumulator": 1 / WIDTH,
    "rowwise_adagrad_boost": 2 / WIDTH,  # + one int32 update count per row
    "sparse_adam": 2.0,  # exp_avg and exp_avg_sq, each table-sized (plus a scalar step)
}


def state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    return sum(v.numel() * v.element_size() for v in per_row(state_of(opt, p), p.shape[0]).values())


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_optimizer_state_is_the_documented_fraction_of_the_table(name: str) -> None:
    model, opt = drive(IMPLS[name], WARMUP)
    w = model.bag.weight
    ratio = state_bytes(opt, w) / (w.numel() * w.element_size())
    assert ratio == pytest.approx(EXPECTED_STATE_RATIO[name], rel=1e-9), ratio
    scalars = {k: v for k, v in state_of(opt, w).items() if k not in per_row(state_of(opt, w), ROWS)}
    assert all(v.numel() == 1 for v in scalars.values()), scalars  # nothing else table-sized hides in it


@pytest.mark.parametrize("name", ROWWISE)
def test_rowwise_state_stays_within_a_fifth_of_the_table_at_the_default_width(name: str) -> None:
    model, opt = drive(IMPLS[name], WARMUP)
    w = model.bag.weight
    assert state_bytes(opt, w) <= 0.2 * w.numel() * w.element_size()


def test_sparse_adam_state_is_ten_times_over_a_fifth_of_the_table() -> None:
    """Documented, not a bug of the code: SparseAdam (``sparse_optimizer = "sparse_adam"``) keeps two
    table-sized moments, 2x the table; only row-wise Adagrad meets a 0.2x state budget."""
    model, opt = drive(IMPLS["sparse_adam"], WARMUP)
    w = model.bag.weight
    assert state_bytes(opt, w) == 2 * w.numel() * w.element_size() > 0.2 * w.numel() * w.element_size()


def test_the_learners_own_model_has_the_same_state_ratio_as_this_table() -> None:
    """DeepFM's table at the default embedding_dim is D + 1 = 17 wide, as assumed above."""
    cfg = FeatureConfig((FieldSpec("user_id", "single", 10),))
    model = DeepFM(cfg, mlp=(4,), autocast_dtype=None)
    assert model.sparse.bag.weight.shape[1] == WIDTH == cfg.embedding_dim + 1


# -- reset_rows --------------------------------------------------------------------------------------
RESET = [2, 21, 40]  # 2 and 21 trained, 40 never touched


def _reset_rows(opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    return opt.reset_rows  # type: ignore[attr-defined]


def _names_with_reset() -> list[object]:
    return sorted(IMPLS)


@pytest.mark.parametrize("name", _names_with_reset())
def test_reset_rows_resets_exactly_the_given_rows_state(name: str) -> None:
    impl = IMPLS[name]
    model, opt = drive(impl, WARMUP)
    w = model.bag.weight
    reset_rows = _reset_rows(opt)
    before_w, before = w.detach().clone(), per_row(state_of(opt, w), ROWS)
    fresh_model, fresh_opt = drive(impl, [[0]])  # the state of rows a fresh optimizer has (never-touched rows)
    fresh = per_row(state_of(fresh_opt, fresh_model.bag.weight), ROWS)
    assert any(not torch.equal(before[k][RESET[:2]], fresh[k][RESET[:2]]) for k in before), "trained rows differ"
    reset_rows(w, torch.tensor(RESET))
    after = per_row(state_of(opt, w), ROWS)
    assert torch.equal(w.detach(), before_w), "reset_rows touches the optimizer state only"
    mask = torch.zeros(ROWS, dtype=torch.bool)
    mask[RESET] = True
    for k in before:
        assert torch.equal(after[k][mask], fresh[k][mask]), k
        assert torch.equal(after[k][~mask], before[k][~mask]), k


@pytest.mark.parametrize("name", _names_with_reset())
def test_a_reset_row_learns_exactly_like_a_row_of_a_fresh_optimizer(name: str) -> None:
    impl = IMPLS[name]
    model, opt = drive(impl, WARMUP)
    w = model.bag.weight
    _reset_rows(opt)(w, torch.tensor([2]))
    fresh_model = Table()
    fresh_opt = impl.make(fresh_model)
    if name == "sparse_adam":  # one step count per table: compare with a row a table as old never touched
        fresh_model, fresh_opt = drive(impl, [[r for r in rows if r != 2] for rows in WARMUP])
    with torch.no_grad():
        fresh_model.bag.weight.copy_(w)  # same starting vector, fresh state
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        backward(m, [2], seed=7)
        o.step()
    assert torch.equal(model.bag.weight[2], fresh_model.bag.weight[2])
