"""The table's row-wise Adagrad fused into the backward of its lookup: the pooled ``EmbeddingBag`` lookup as a
``torch.autograd.Function`` whose backward sums the gradient per unique row and applies the update to those rows
in place, returning no gradient for the table.

This is what fbgemm's table-batched embedding (TBE) does with ``EXACT_ROWWISE_ADAGRAD`` (torchrec's
``FusedEmbeddingBagCollection``): the optimizer runs inside the backward, so the table's gradient is never
materialised. The unfused path builds a sparse (L, D + 1) gradient of the table, ``coalesce``s it (a sort and a
sum of the L lookups) and only then updates; here the backward works on the batch's lookups directly:

    pooled gradient (N, D + 1), N = bags  --/ bag length (mean pooling)-->  per-bag share (N, D + 1)
    values (L,) --stable sort--> sorted rows, permutation; run starts --> unique rows (U,), segments (U + 1,)
    per-row sums (U, D + 1) = one sum-pooling embedding_bag over the per-bag shares, gathered by
                              offset2bag[permutation] and cut at the segments (no (L, D + 1) tensor is built)
    RowWiseAdagrad.update_rows(table, rows, sums): the optimizer's own update (learner/optim.py)

``SparseArch`` (``learner/model.py``) hands the fused lookup its bags batch-major (:func:`batch_major`, an index
gather of the (L,) values), so the pooled (B * F, D + 1) is already (B, F, D + 1) and its gradient arrives without
the transposing copy the field-major bag needs; with the split of the pooled rows into embedding and first-order
weight (one ``cat`` in the backward) the step makes no full-size zero fill of the (B, F, D + 1) gradient.

The update is the optimizer's (same code, same state: ``sum`` and the boost's ``updates`` stay in the
``RowWiseAdagrad``'s ``state``, so checkpoints, ``reset_rows`` and ``state_dict`` see no difference); only the
order in which a row's lookups are summed may differ (float rounding). ``step`` then finds no gradient on the
table and leaves it alone, so the update is applied exactly once.

It is the same update only where the step applies each backward's gradient at once and unscaled: one micro-batch
per step (``accumulation = 1``) and no fp16 loss scaling (a GradScaler unscales and may skip a step after the
backward). :func:`fused_applies` says whether it does; ``learner.trainer.Trainer`` uses it through the setting
``[learner] fused_sparse_update`` (``learner.config.FusedSparseUpdate``) and :func:`fused_lookups`.

An ``observe`` callable given to :func:`fused_lookups` sees each backward's ``(table, unique rows (U,), summed
gradients (U, D + 1))`` just before the update (``learner/health.py`` takes the embedding gradient norm from
them: the sums exist anyway, so the norm costs a reduction of (U, D + 1), not a gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from learner.optim import RowWiseAdagrad

RowGradientObserver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (table, rows (U,), sums (U, D+1))
_observers: dict[int, RowGradientObserver] = {}  # id(optimizer) -> observer, while inside fused_lookups


def batch_major(values: torch.Tensor, offsets: torch.Tensor, num_fields: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Field-major bags (bag f * B + b; values (L,), offsets (F * B + 1,), last offset included) reordered
    batch-major (bag b * F + f), each bag's lookups in their order: the pooled lookup is then already (B, F, D + 1)
    and its gradient needs no transposing copy (a (B, F, D + 1) float copy against an (L,) index gather)."""
    n_bags = offsets.numel() - 1
    b = n_bags // num_fields
    lengths = offsets[1:] - offsets[:-1]  # (F * B,)
    if values.numel() == n_bags and bool(lengths.eq(1).all()):  # one lookup per bag: a transpose of the values
        return values.view(num_fields, b).t().reshape(-1), offsets
    lengths_bm = lengths.view(num_fields, b).t().reshape(-1)  # (B * F,)
    starts = offsets[:-1].view(num_fields, b).t().reshape(-1)  # (B * F,) where each bag's lookups start in values
    offsets_bm = torch.zeros_like(offsets)  # (B * F + 1,)
    torch.cumsum(lengths_bm, 0, out=offsets_bm[1:])
    shift = torch.repeat_interleave(starts - offsets_bm[:-1], lengths_bm, output_size=values.numel())  # (L,)
    return values[torch.arange(values.numel(), device=values.device) + shift], offsets_bm


def stable_sort(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(values, stable=True)`` of non-negative row indices (L,): (sorted (L,), permutation (L,)).

    On the CPU, when a row index and a position fit one int64 together, each lookup becomes one key
    ``row << bits | position`` (all keys distinct, so any sort is stable) and numpy sorts the keys in place: numpy's
    SIMD sort of plain int64 keys (x86-simd-sort, AVX-512/AVX2) is ~2x faster than torch's stable sort with its
    permutation (bench/README.md, learner, fourteenth session: 106 k lookups, 1.49 -> 0.65 ms). The result is
    identical to torch's; anything else (CUDA, negative or huge indices, an empty batch) takes torch's sort."""
    n = values.numel()
    bits = max(1, (n - 1).bit_length())
    if values.device.type != "cpu" or values.dtype != torch.int64 or n < 2:
        return torch.sort(values, stable=True)
    lo, hi = torch.aminmax(values)
    if int(lo) < 0 or int(hi) >> (63 - bits):
        return torch.sort(values, stable=True)
    keys = np.left_shift(values.numpy(), bits)  # (L,) a fresh array: row << bits
    np.bitwise_or(keys, _positions(n), out=keys)  # | position
    keys.sort()
    packed = torch.from_numpy(keys)
    return packed >> bits, packed & ((1 << bits) - 1)


def _positions(n: int) -> np.ndarray:
    """0 .. n - 1 as int64, kept across steps (batches repeat their size)."""
    global _arange
    if len(_arange) < n:
        _arange = np.arange(max(n, 2 * len(_arange)), dtype=np.int64)
    return _arange[:n]


_arange = np.arange(0, dtype=np.int64)


def row_gradients(grad: torch.Tensor, values: torch.Tensor, offset2bag: torch.Tensor | None, bag_size: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows (U,) ascending, their summed gradients (U, D + 1)) of a mean-pooled lookup, from the pooled
    gradient ``grad`` (N, D + 1), the lookups ``values`` (L,), each lookup's bag ``offset2bag`` (L,; None when
    lookup i is bag i) and each bag's length ``bag_size`` (N,). A row's lookups are summed in lookup order."""
    if offset2bag is None:  # every bag one lookup: its gradient is the lookup's
        share = grad  # (N, D + 1)
    else:  # mean pooling: each lookup of a bag gets the bag's gradient over the bag's length
        share = grad / bag_size.clamp(min=1).unsqueeze(1).to(grad.dtype)  # (N, D + 1)
    sorted_rows, order = stable_sort(values)  # (L,), (L,)
    n = sorted_rows.numel()
    first = torch.ones(n, dtype=torch.bool, device=values.device)  # (L,) first lookup of each row in sorted order
    torch.ne(sorted_rows[1:], sorted_rows[:-1], out=first[1:])
    rows = sorted_rows[first]  # (U,)
    segments = torch.cat([first.nonzero().squeeze(1), torch.tensor([n], device=values.device)])  # (U + 1,)
    bag_of = order if offset2bag is None else offset2bag.index_select(0, order)  # (L,) sorted lookups' bags
    sums = F.embedding_bag(bag_of, share.contiguous(), segments, mode="sum", include_last_offset=True)  # (U, D + 1)
    return rows, sums


class FusedRowWiseAdagradLookup(torch.autograd.Function):
    """``nn.EmbeddingBag(mode="mean", include_last_offset=True)``'s lookup whose backward applies row-wise Adagrad
    to ``weight`` in place (through ``optimizer.update_rows``) and returns no gradient for it."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                optimizer: RowWiseAdagrad) -> torch.Tensor:
        pooled = F.embedding_bag(values, weight, offsets, mode="mean", include_last_offset=True)  # (N, D + 1)
        bag_size = offsets[1:] - offsets[:-1]  # (N,)
        if values.numel() == len(bag_size) and bool(bag_size.eq(1).all()):
            offset2bag = None  # one lookup per bag (single-valued fields only): lookup i is bag i
        else:
            offset2bag = torch.repeat_interleave(torch.arange(len(bag_size), device=values.device), bag_size,
                                                 output_size=values.numel())  # (L,) each lookup's bag
        ctx.save_for_backward(values, offset2bag, bag_size)
        # The table itself is not saved (its version moves when the backward updates it) but held.
        ctx.weight, ctx.optimizer = weight, optimizer
        ctx.observe = _observers.get(id(optimizer))  # the backward runs after fused_lookups has been left
        return pooled

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:  # type: ignore[override]
        values, offset2bag, bag_size = ctx.saved_tensors
        if values.numel():
            rows, sums = row_gradients(grad, values, offset2bag, bag_size)  # (U,), (U, D + 1)
            if ctx.observe is not None:
                ctx.observe(ctx.weight, rows, sums)
            ctx.optimizer.update_rows(ctx.weight, rows, sums)
        return None, None, None, None  # the table's gradient was applied, not returned


def fused_lookup(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                 optimizer: RowWiseAdagrad) -> torch.Tensor:
    """Mean-pooled bags (N, D + 1) of ``weight`` (rows, D + 1) at ``values`` (L,), bags cut at ``offsets`` (N + 1,)
    with the last offset included; the backward updates ``weight`` with ``optimizer``."""
    out = FusedRowWiseAdagradLookup.apply(weight, values, offsets, optimizer)
    assert isinstance(out, torch.Tensor)
    return out


def fused_applies(sparse_opt: torch.optim.Optimizer, accumulation: int, scaler_enabled: bool) -> str | None:
    """None when the fused update is the same update as ``sparse_opt``'s step on this trainer, else why not."""
    if not isinstance(sparse_opt, RowWiseAdagrad):
        return f"the sparse optimizer is {type(sparse_opt).__name__}, not row-wise Adagrad"
    if accumulation != 1:
        return f"accumulation = {accumulation} (gradients of several micro-batches make one step)"
    if scaler_enabled:
        return "fp16 loss scaling (the step unscales the gradients and skips those that overflowed)"
    return None


@contextmanager
def fused_lookups(model: nn.Module, optimizer: RowWiseAdagrad,
                  observe: RowGradientObserver | None = None) -> Iterator[None]:
    """While inside, ``model.sparse`` (a ``learner.model.SparseArch``) looks up through :func:`fused_lookup` with
    ``optimizer`` when it trains with gradients on; the model holds the optimizer only meanwhile. The backward
    of a lookup made inside calls ``observe(table, rows, summed gradients)`` before it updates those rows."""
    sparse = model.get_submodule("sparse")
    setattr(sparse, "fused_optimizer", optimizer)  # noqa: B010 - SparseArch's attribute (model.py imports this module)
    if observe is not None:
        _observers[id(optimizer)] = observe
    try:
        yield
    finally:
        setattr(sparse, "fused_optimizer", None)  # noqa: B010
        if observe is not None:
            _observers.pop(id(optimizer), None)
