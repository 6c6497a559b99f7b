"""Serving deltas in the distributed mode: the rows every rank's batches touched since the last delta, read from
the ranks whose shards hold them, written by rank 0 as ONE delta with ``learner/deltas.py``'s writer.

    every rank    mark(values)  -> touched (num_rows,) bool: the rows ITS batches looked up (they may live on
                                   any rank's shard: the row-wise lookup fetches them from their owner)
    delta round   (LockStep: some rank's every_s passed; every rank enters it)
      1. all-gather each rank's touched row ids (rank 0's include the rows its DeltaWriter already holds:
         flushed at a checkpoint, or restored from the pending list after a restart)       -> the union, on all;
         without the id maps, less the rows rank 0's writer holds (given to another id since the last maps:
         ``MapStats.reassigned`` -> :meth:`ShardedDeltas.hold` -> ``DeltaWriter.hold``), which wait, marked there,
         for the delta that carries the maps (serving maps ids with the last maps it got)
      2. each rank keeps the union's rows inside its shard's row range (:func:`rows_in_shard`) and reads their
         first D + 1 columns (embedding + first-order weight; the padding is dropped) from its local shard
      3. gather (rows, vectors, samples trained; with dynamic ids, when rank 0's writer says the id maps are due,
         each rank's shares of the maps, merged by rank 0 into the whole maps: ``sharded_ids.whole_maps``) to
         rank 0, which writes them with the dense weights (the
         DDP-replicated part, the same on every rank, under DeepFM's names: :func:`delta_dense_state`) through
         ``DeltaWriter.write_rows``: the single process's file format, seq numbering, lineage, keep, signing
         and Redis announcement, unchanged

``samples_trained`` of a delta is the job's (every rank's samples, rank 0 adding the runs before), the count the
sharded checkpoints and their unsharded export carry, so serving skips by name the deltas already in an
artifact exactly as in the single-process mode. Pending rows survive a restart as there: at each checkpoint
round (:meth:`ShardedDeltas.sync`, a collective) every rank's touched ids go to rank 0's writer, which appends
them to its pending list and fsyncs it before the checkpoint is written. The deltas directory is rank 0's
alone (no shared mount needed); after an elastic restart rank 0 continues its numbering.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from learner.calibration import identity
from learner.delta_writer import DeltaWriter, dense_weights
from learner.distributed import all_gather_objects, gather_objects
from learner.features import FeatureConfig
from learner.sharded_ids import whole_maps
from learner.sharded_model import local_pieces, table_weight
from stream.config import RedisSettings

log = logging.getLogger("streamrec.deltas")


def union_rows(parts: list[np.ndarray]) -> np.ndarray:
    """The sorted distinct row ids of every rank's part, (R,) int64."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))


def rows_in_shard(rows: np.ndarray, start: int, end: int) -> np.ndarray:
    """The ``rows`` this rank sends: those in its shard's row range ``[start, end)`` (row-wise sharding gives every
    row to exactly one rank, so the ranks' picks partition the union)."""
    return rows[(rows >= start) & (rows < end)]


class ShardedDeltas:
    """One rank's part of the distributed mode's serving deltas (module docstring). ``writer``: rank 0's
    ``DeltaWriter`` (None on the other ranks)."""

    def __init__(self, num_rows: int, dim: int, every_s: float, writer: DeltaWriter | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.touched = torch.zeros(num_rows, dtype=torch.bool)  # (num_rows,) rows this rank's batches looked up
        self.dim, self.every_s, self.writer, self.clock = dim, every_s, writer, clock
        self._last = clock()
        # dynamic ids: the feature config and this rank's shares of the id maps (ShardedRowMapper.state_dict),
        # merged on rank 0 into the whole maps a delta carries when its writer says they are due
        self.id_maps: tuple[FeatureConfig, Callable[[], dict[str, Any]]] | None = None

    @classmethod
    def from_settings(cls, ls: Any, num_rows: int, dim: int, rank: int,
                      redis_settings: RedisSettings | None = None) -> ShardedDeltas | None:
        """From ``LearnerSettings`` (``deltas_*``; None when ``deltas_every_s`` is 0); only rank 0 builds the
        writer (its directory, lineage, signing key and Redis announcement: ``DeltaWriter.from_settings``)."""
        if ls.deltas_every_s <= 0:
            return None
        writer = DeltaWriter.from_settings(ls, num_rows, redis_settings=redis_settings) if rank == 0 else None
        return cls(num_rows, dim, ls.deltas_every_s, writer)

    def mark(self, values: torch.Tensor) -> None:
        """Row ids of one of this rank's trained batches (``TensorBatch.values``, (N,) int64)."""
        if len(values):
            self.touched[values.to(self.touched.device)] = True

    def hold(self, rows: np.ndarray) -> None:
        """Rows (global, (R,) int64) the id maps gave to another id this round (``MapStats.reassigned``, the same
        on every rank): rank 0's writer holds them (``DeltaWriter.hold``) until a delta that carries the maps."""
        if self.writer is not None:
            self.writer.hold(rows)

    def due(self) -> bool:
        """This rank's wish for a delta round (``LockStep.agree``'s ``wants_delta``)."""
        return self.clock() - self._last >= self.every_s

    def _exchange(self) -> tuple[np.ndarray, bool]:
        """Collective: the union of every rank's touched rows (and rank 0's writer's), on every rank, and whether
        rank 0's writer wants the id maps with the next delta (never with no row touched); rank 0's writer marks
        the rows (so they reach its pending list), every rank clears its own marks. Without the maps, the rows rank
        0's writer holds (:meth:`hold`) are left out of the union returned: still marked there, they go with the
        maps."""
        mine = self.touched.nonzero().squeeze(1).numpy()  # (r,)
        wants_maps, held = False, np.zeros(0, np.int64)
        if self.writer is not None:
            mine = np.union1d(mine, self.writer.touched.nonzero().squeeze(1).numpy())
            wants_maps = self.id_maps is not None and self.writer.maps_due()
            if not wants_maps:
                held = self.writer.held.nonzero().squeeze(1).numpy()  # (h,)
        gathered = all_gather_objects((mine, wants_maps, held))
        union = union_rows([g[0] for g in gathered])
        self.touched.zero_()
        if self.writer is not None and len(union):
            self.writer.mark(torch.from_numpy(union))
        # (nothing touched: no delta, so no maps built for it, on any rank, at every due time while idle)
        return np.setdiff1d(union, gathered[0][2]), gathered[0][1] and len(union) > 0

    def sync(self) -> None:
        """Collective, at every checkpoint round before the checkpoint is written: every rank's touched rows go
        to rank 0's pending list, made durable (``DeltaWriter.sync``)."""
        self._exchange()
        if self.writer is not None:
            self.writer.sync()

    @torch.no_grad()
    def write(self, dmp: Any, model: nn.Module, samples: int, calibration: torch.Tensor | None = None) -> Path | None:
        """Collective: one delta of every row touched since the last one (module docstring). ``model``: the
        ``ShardedDeepFM`` inside ``dmp`` (its dense weights); ``samples``: this rank's ``samples_trained()``;
        ``calibration``: the served ``(a, b)`` (None: the identity). Rank 0 returns the path written (None when
        nothing was touched); the other ranks None."""
        self._last = self.clock()
        union, wants_maps = self._exchange()
        rows, vectors = [], []
        for start, local in local_pieces(table_weight(dmp)):  # local: (rows on this rank, W)
            picked = rows_in_shard(union, start, start + local.shape[0])  # (r,)
            idx = torch.from_numpy(picked - start).to(local.device)
            rows.append(picked)
            vectors.append(local[idx, :self.dim + 1].float().cpu().numpy())  # (r, D + 1): padding dropped
        gathered = gather_objects((np.concatenate(rows) if rows else np.zeros(0, np.int64),
                                   np.concatenate(vectors) if vectors else np.zeros((0, self.dim + 1), np.float32),
                                   int(samples), self.id_maps[1]() if wants_maps and self.id_maps else None))
        if self.writer is None or gathered is None:
            return None
        all_rows = np.concatenate([g[0] for g in gathered])  # (R,)
        all_vectors = np.concatenate([g[1] for g in gathered])  # (R, D + 1)
        if len(all_rows) != len(union) or not np.array_equal(np.sort(all_rows), union):
            raise RuntimeError(f"delta round: the ranks' shards returned {len(all_rows)} of the {len(union)} touched "
                               "rows; the shards' row ranges do not cover the table (a sharding plan that is not "
                               "row-wise?)")
        if len(all_rows) == 0:
            return None
        order = np.argsort(all_rows, kind="stable")
        maps = whole_maps(self.id_maps[0], [g[3] for g in gathered]) if wants_maps and self.id_maps else None
        return self.writer.write_rows(torch.from_numpy(all_rows[order]),
                                      torch.from_numpy(np.ascontiguousarray(all_vectors[order])),
                                      delta_dense_state(model, calibration), sum(g[2] for g in gathered), maps)


def delta_dense_state(model: nn.Module, calibration: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The dense weights of a ``ShardedDeepFM`` under a single-process ``DeepFM``'s names, which serving's
    ``apply_delta`` requires all of: its own (``dense_arch.*``, ``bias``) and ``calibration``, the served Platt
    ``(a, b)`` (shape (2,); the identity without online calibration)."""
    return {**dense_weights(model), "calibration": identity() if calibration is None else calibration.clone()}
