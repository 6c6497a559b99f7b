"""The boost of young rows (``boost > 0``: cold start's fast fine-tuning) on N ranks, around fbgemm's fused row-wise
Adagrad, which has no boost.

The single process's rule (``learner/optim.py``, ``RowWiseAdagrad``): every row counts its updates, and a touched
row's step is multiplied by ``1 + boost * 2 ** (-updates / boost_half_life)`` (updates before this step). The step
is linear in that factor, so the boosted row is the plain row plus ``boost * 2 ** (-u / h)`` times the plain step:

    before the backward   every rank's step rows are all-gathered (one collective per step); the rank holding a
                          touched row keeps a copy of it                                   w0 (T, W)
    the backward          fbgemm's fused row-wise Adagrad updates the rows where they live  w1 = w0 + d
    after it              w1 += boost * 2 ** (-counts / boost_half_life) * (w1 - w0); counts += 1

on each rank's own shard of the table, with the counts (int32 per row, :attr:`ShardedBoost.counts`, a
``ShardedTensor`` sharded like fbgemm's row-wise sums) in the DCP checkpoint as ``table_state.updates``, resharded
with the rows, and carried by the unshard into the single process's optimizer state (``updates``). The id maps
zero the counts of rows they hand out or free, as ``RowWiseAdagrad.reset_rows`` does, and move them with the rows
they move (``learner/sharded_ids.py``, ``ShardedRowMapper.counts``).

Cost: the all-gather of the step's row ids, and a copy of the touched rows (the step's rows, not the table).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from learner.sharded_model import TouchedRows, fused_state, local_pieces, touched_rows


class ShardedBoost:
    """This rank's part of the boost (module docstring). Collective construction (the counts' ShardedTensor)."""

    def __init__(self, dmp: Any, boost: float, half_life: float) -> None:
        if boost <= 0 or half_life <= 0:
            raise ValueError(f"ShardedBoost needs boost > 0 and boost_half_life > 0, got {boost}, {half_life}")
        self.dmp, self.boost, self.half_life = dmp, boost, half_life
        sums = fused_state(dmp)["momentum1"]  # (num_rows,) sharded like the table
        shards = [Shard(torch.zeros(s.tensor.shape[0], dtype=torch.int32, device=s.tensor.device), s.metadata)
                  for s in sums.local_shards()]
        with warnings.catch_warnings():  # the table and its sums are ShardedTensors too (TorchRec's DMP): the same
            warnings.simplefilter("ignore", FutureWarning)  # type, not torch's advice to move to DTensor
            self.counts = init_from_local_shards(shards, sums.size(0))  # (num_rows,) int32: updates per row
        self._touched: TouchedRows = []

    def before(self, values: torch.Tensor) -> TouchedRows:
        """Collective, every rank every step, before the backward: ``values`` (N,) the rows this rank's step looks
        up. Keeps a copy of the touched rows this rank holds (:func:`touched_rows`), and returns it (the trainer's
        update norm reads the same copy)."""
        self._touched = touched_rows(self.dmp, values)
        return self._touched

    @torch.no_grad()
    def after(self) -> None:
        """After the backward: the boosted part of each touched row's step, and the rows' update counts."""
        counts = dict(local_pieces(self.counts))
        for start, rows, idx, w0 in self._touched:
            if not len(idx):
                continue
            c = counts[start]
            factor = self.boost * torch.exp2(c[idx].float() / -self.half_life)  # (t,)
            rows[idx] += (factor.unsqueeze(1) * (rows[idx].float() - w0.float())).to(rows.dtype)
            c[idx] += 1
        self._touched = []
