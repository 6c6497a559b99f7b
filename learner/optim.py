"""Optimizers: row-wise Adagrad for the sparse embedding table, fused Adam for the dense weights.

Row-wise Adagrad (as in torchrec/fbgemm's ``EXACT_ROWWISE_ADAGRAD``) keeps ONE float of state per
row: the running sum of the row's mean squared gradient. Per step, for every touched row r with
(duplicates summed) gradient g_r of width D:

    state[r] += mean(g_r ** 2)
    w[r]     -= lr * g_r / (sqrt(state[r]) + eps)

so optimizer memory is 1/D of the table (SparseAdam keeps two table-sized tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RowWiseAdagrad(torch.optim.Optimizer):
    """For parameters whose ``.grad`` is sparse (``nn.EmbeddingBag(sparse=True)``)."""

    def __init__(self, params: Any, lr: float = 0.05, eps: float = 1e-8, initial_accumulator: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator": initial_accumulator})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.full((p.shape[0],), group["initial_accumulator"], dtype=torch.float32,
                                              device=p.device)
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()  # sum duplicate rows
                    rows, g = grad.indices()[0], grad.values()  # (U,), (U, D)
                else:  # a dense gradient: every row with a nonzero gradient
                    rows = grad.abs().sum(dim=1).nonzero().squeeze(1)
                    g = grad[rows]
                acc = state["sum"]
                acc.index_add_(0, rows, g.pow(2).mean(dim=1))
                scale = lr / (acc[rows].sqrt() + eps)  # (U,)
                p.index_add_(0, rows, -g * scale.unsqueeze(1))

    def reset_rows(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """Forget the state of ``rows`` (rows handed to new ids)."""
        if "sum" in self.state[p]:
            self.state[p]["sum"][rows] = self.param_groups[0]["initial_accumulator"]


def make_optimizers(model: nn.Module, lr_sparse: float, lr_dense: float, sparse_optimizer: str = "rowwise_adagrad",
                    weight_decay: float = 0.0) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(sparse optimizer over model.sparse_parameters(), fused Adam over model.dense_parameters())."""
    sparse_params = model.sparse_parameters()  # type: ignore[operator]
    if sparse_optimizer == "rowwise_adagrad":
        sparse: torch.optim.Optimizer = RowWiseAdagrad(sparse_params, lr=lr_sparse)
    elif sparse_optimizer == "sparse_adam":
        sparse = torch.optim.SparseAdam(sparse_params, lr=lr_sparse)
    else:
        raise ValueError(f"sparse_optimizer must be rowwise_adagrad or sparse_adam, got {sparse_optimizer!r}")
    dense_params = model.dense_parameters()  # type: ignore[operator]
    try:
        dense: torch.optim.Optimizer = torch.optim.Adam(dense_params, lr=lr_dense, weight_decay=weight_decay,
                                                        fused=True)
    except (RuntimeError, TypeError):  # fused Adam unsupported for this device/dtype
        dense = torch.optim.Adam(dense_params, lr=lr_dense, weight_decay=weight_decay)
    return sparse, dense
