"""Optimizers: row-wise Adagrad for the sparse embedding table, fused Adam for the dense weights.

Row-wise Adagrad (as in torchrec/fbgemm's ``EXACT_ROWWISE_ADAGRAD``) keeps ONE float of state per
row: the running sum of the row's mean squared gradient. Per step, for every touched row r with
(duplicates summed) gradient g_r of width D:

    state[r] += mean(g_r ** 2)
    w[r]     -= lr * g_r / (sqrt(state[r]) + eps)

so optimizer memory is 1/D of the table (SparseAdam keeps two table-sized tensors). :meth:`RowWiseAdagrad.step`
gets (rows, g) from the table's sparse gradient (``coalesce``); ``learner/fused_update.py`` computes them in the
lookup's backward and calls :meth:`RowWiseAdagrad.update_rows` (fbgemm's fused ``EXACT_ROWWISE_ADAGRAD``), the
same update on the same state, leaving no gradient for ``step``.

Fast fine-tuning of young rows (cold start, ``boost > 0``): the optimizer also counts each row's updates
(``state["updates"]``, int32 per row) and multiplies a touched row's step by
``1 + boost * 2 ** (-updates / boost_half_life)`` (updates before this step), so a freshly admitted row
learns up to ``1 + boost`` times faster and the boost halves every ``boost_half_life`` updates.
``reset_rows`` (rows handed to new ids) zeroes the counts too. ``boost == 0`` (the default) is exactly
the plain update, with no extra state. The counts stay int32 through ``load_state_dict`` (torch's casts
every floating-point-parameter state tensor but ``step`` to the parameter's dtype; float32 counts would
stop counting at 2**24).

:class:`SparseAdam` is ``torch.optim.SparseAdam`` (lazy: only touched rows' moments move) with
``reset_rows``, which zeroes the given rows' ``exp_avg``/``exp_avg_sq``. Its step count is one per
parameter (global, as in torch), not per row, so bias correction uses the table's step count: a reset row
learns exactly like a row this optimizer has never touched (a new row of a long-running table), not like
a row of a freshly built optimizer. Its first update is ``(1 - beta1) / (1 - beta1**t) *
sqrt((1 - beta2**t) / (1 - beta2))`` times a fresh optimizer's first (``lr``-sized) one at table step ``t``:
about 0.5 to 1 for t <= 100 at the default betas, 2.5 at t = 1000, and ``(1 - beta1) / sqrt(1 - beta2)``
(3.16) in a long-running table, the same as for any row the table meets late; it settles as the row's own
moments build up (about 1/(1 - beta2) of its updates).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RowWiseAdagrad(torch.optim.Optimizer):
    """For parameters whose ``.grad`` is sparse (``nn.EmbeddingBag(sparse=True)``)."""

    def __init__(self, params: Any, lr: float = 0.05, eps: float = 1e-8, initial_accumulator: float = 0.0,
                 boost: float = 0.0, boost_half_life: float = 0.0) -> None:
        # finite, not only signed: NaN passes `< 0` and `<= 0` (a NaN boost was silently none, a NaN half-life made
        # every boosted step NaN) and an infinite boost steps a young row to inf
        if not (math.isfinite(boost) and boost >= 0) or (
                boost > 0 and not (math.isfinite(boost_half_life) and boost_half_life > 0)):
            raise ValueError(f"RowWiseAdagrad needs a finite boost >= 0 and, when boost > 0, a finite boost_half_life "
                             f"> 0 (updates); got boost={boost}, boost_half_life={boost_half_life}")
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator": initial_accumulator,
                                  "boost": boost, "boost_half_life": boost_half_life})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # noqa: D102 - no closure form
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:  # no gradient, or one the fused lookup already applied (learner/fused_update.py)
                    continue
                rows, g = self.touched_rows(p.grad)  # (U,), (U, D)
                self._update(p, group, rows, g)

    @torch.no_grad()
    def update_rows(self, p: torch.Tensor, rows: torch.Tensor, g: torch.Tensor) -> None:
        """The step for ``p``'s unique ``rows`` (U,) with their summed gradients ``g`` (U, D): what :meth:`step`
        does with a gradient that touched those rows, and what the fused lookup (``learner/fused_update.py``)
        calls from its backward instead of building the gradient. ``p`` must be one of this optimizer's."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                self._update(p, group, rows, g)
                return
        raise ValueError("update_rows: the tensor is not one of this optimizer's parameters")

    def _update(self, p: torch.Tensor, group: dict[str, Any], rows: torch.Tensor, g: torch.Tensor) -> None:
        """The module docstring's update of ``rows`` (U,), unique, with summed gradients ``g`` (U, D)."""
        lr, eps = group["lr"], group["eps"]
        state = self.state[p]
        if "sum" not in state:
            state["sum"] = torch.full((p.shape[0],), group["initial_accumulator"], dtype=torch.float32,
                                      device=p.device)
        acc = state["sum"]
        acc.index_add_(0, rows, g.pow(2).mean(dim=1))
        scale = lr / (acc[rows].sqrt() + eps)  # (U,)
        boost = group.get("boost", 0.0)  # .get: optimizer states saved before the boost existed
        if boost > 0:
            if "updates" not in state:
                state["updates"] = torch.zeros(p.shape[0], dtype=torch.int32, device=p.device)
            updates = state["updates"]
            if updates.dtype != torch.int32:  # a state set by hand (load_state_dict keeps int32)
                state["updates"] = updates = updates.round().to(torch.int32)
            young = updates[rows].float() / -group["boost_half_life"]  # (U,) rows are unique here
            scale = scale * (1 + boost * torch.exp2(young))
            updates[rows] += 1
        p.index_add_(0, rows, -g * scale.unsqueeze(1))

    @staticmethod
    def touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique rows (U,), their summed gradients (U, D)) of a sparse or dense gradient."""
        if grad.is_sparse:
            grad = grad.coalesce()  # sum duplicate rows
            return grad.indices()[0], grad.values()
        rows = grad.abs().sum(dim=1).nonzero().squeeze(1)  # a dense gradient: rows with a nonzero gradient
        return rows, grad[rows]

    def reset_rows(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """Forget the state of ``rows`` (rows handed to new ids)."""
        if "sum" in self.state[p]:
            self.state[p]["sum"][rows] = self.param_groups[0]["initial_accumulator"]
        if "updates" in self.state[p]:
            self.state[p]["updates"][rows] = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the int32 ``updates`` counts kept exact: torch casts them to the (float32) parameter's
        dtype, so the saved counts are put back as they were (a state saved float32 by an older version is
        turned back into int32 counts)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        counts = {i: state_dict["state"][i]["updates"] for i in saved_ids
                  if isinstance(state_dict["state"].get(i), dict) and "updates" in state_dict["state"][i]}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, c in counts.items():
            p = params[saved_ids.index(i)]
            self.state[p]["updates"] = torch.as_tensor(c).to(device=p.device, dtype=torch.int32, copy=True)


class SparseAdam(torch.optim.SparseAdam):
    """``torch.optim.SparseAdam`` with :meth:`reset_rows` (see the module docstring for its global step)."""

    @torch.no_grad()
    def reset_rows(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """Zero the moments of ``rows`` (rows handed to new ids); the step count is the table's, untouched."""
        state = self.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                state[name][rows] = 0


def make_optimizers(model: nn.Module, lr_sparse: float, lr_dense: float, sparse_optimizer: str = "rowwise_adagrad",
                    weight_decay: float = 0.0, boost: float = 0.0, boost_half_life: float = 0.0,
                    initial_accumulator: float = 0.0) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(sparse optimizer over model.sparse_parameters(), fused Adam over model.dense_parameters())."""
    sparse_params = model.sparse_parameters()  # type: ignore[operator]
    if sparse_optimizer == "rowwise_adagrad":
        sparse: torch.optim.Optimizer = RowWiseAdagrad(sparse_params, lr=lr_sparse, boost=boost,
                                                       boost_half_life=boost_half_life,
                                                       initial_accumulator=initial_accumulator)
    elif sparse_optimizer == "sparse_adam":
        sparse = SparseAdam(sparse_params, lr=lr_sparse)
    else:
        raise ValueError(f"sparse_optimizer must be rowwise_adagrad or sparse_adam, got {sparse_optimizer!r}")
    dense_params = model.dense_parameters()  # type: ignore[operator]
    try:
        dense: torch.optim.Optimizer = torch.optim.Adam(dense_params, lr=lr_dense, weight_decay=weight_decay,
                                                        fused=True)
    except (RuntimeError, TypeError):  # fused Adam unsupported for this device/dtype
        dense = torch.optim.Adam(dense_params, lr=lr_dense, weight_decay=weight_decay)
    return sparse, dense
