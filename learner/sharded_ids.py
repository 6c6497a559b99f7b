"""Dynamic ids (admission, eviction, the hash-bucket fallback) on N ranks: the id maps of ``learner/row_mapper.py``
kept identical on every rank, the rows they hand out living in TorchRec's row-wise shards.

Every round each rank sends the hashed keys of its batch's dynamic fields to all ranks (one all-gather), and every
rank runs the SAME ``RowMapper.lookup`` over the concatenation in rank order, at the same event time (the newest of
the round): the maps stay equal replicas by construction, and each rank cuts its own batch's rows out of the
result. The row changes the maps decide are applied where the rows live:

* optimizer state of rows evicted or handed to a new id: fbgemm's row-wise sum set back to its starting value on
  the rank holding the row (``sharded_model.fused_state``);
* bucket decay (``bucket_half_life_s``): the rank holding a bucket row scales it;
* a newly admitted row starts as its bucket's vector (``init = "bucket"``): the bucket rows of every field are
  gathered with one all-reduce per round (each row lives on exactly one rank, the others add zeros), then the rank
  holding the new row writes it; ``init = "zero"`` needs no exchange.

The semantics are the single-process ones (module docstring of ``learner/id_map.py``), with the round, not the
DataLoader batch, as the unit of one lookup call. Checkpoints store the map once (rank 0's ``rank-0.pt``);
every rank loads it, whatever the world size, so resharding needs nothing more, and the unshard to one process
carries it (the refresh job's artifact maps ids like the learner).

Cost: two collectives per round (the keys' all-gather and, when a row was admitted from its bucket, the
all-reduce), each a few milliseconds on a loaded 2-core machine, where both ranks must be scheduled to finish one
(``bench/scaling.py --id-capacity``; bench/README.md).

Known limit: the maps are replicated, not sharded: each rank holds every field's whole map (``IdMap.nbytes``:
about 180 bytes per own row at capacity 1 M, against the row's 4 * W bytes on its one rank). TorchRec's
managed-collision modules shard the map with the rows, but have their own admission and eviction rules, not
these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from learner.batch import TensorBatch
from learner.distributed import all_gather_objects
from learner.id_map import LookupResult
from learner.row_mapper import MapStats, RowMapper
from learner.sharded_model import fused_state, local_pieces, table_weight


def _within(rows: np.ndarray, start: int, local: torch.Tensor) -> np.ndarray:
    """(n,) bool: which global ``rows`` lie in the local shard that starts at ``start`` and holds ``local``."""
    return (rows >= start) & (rows < start + len(local))


class ShardedRowMapper:
    """One rank's replica of the id maps (module docstring). ``initial_sum``: fbgemm's starting row-wise sum
    (``initial_accumulator * state_scale``), what a reset row's state goes back to."""

    def __init__(self, mapper: RowMapper, initial_sum: float) -> None:
        self.mapper = mapper
        self.initial_sum = initial_sum
        self.now = float("-inf")  # event time (s) of the last round that had rows: the same on every rank

    @property
    def active(self) -> bool:
        return self.mapper.active

    def apply(self, tb: TensorBatch, dmp: Any) -> MapStats:
        """Collective, every rank every round (``tb`` may be empty): rewrite ``tb.values`` of the dynamic fields
        to rows, counting, admitting and evicting over every rank's keys; the rows' changes applied in the shards."""
        if not self.mapper.active:
            return MapStats()
        slots = self.mapper.slots
        has_keys = len(tb) > 0 and tb.keys is not None
        spans = self.mapper.spans(tb) if has_keys else [(0, 0)] * len(slots)
        mine = [np.asarray(tb.keys[s:e]) if has_keys else np.empty(0, np.int64)  # type: ignore[index]
                for s, e in spans]
        newest = float(tb.ts.max()) / 1000.0 if len(tb) else float("-inf")  # event time drives ids' ages
        gathered = all_gather_objects((mine, newest))  # [(per-field keys (n_r,), newest)] in rank order
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.now = max([self.now] + [g[1] for g in gathered])
        keys = [np.concatenate([g[0][j] for g in gathered]) for j in range(len(slots))]  # (sum n_r,) per field
        results, stats = self.mapper.lookup(keys, self.now, train=True)
        values = tb.values.numpy()  # shares memory with the tensor: written in place
        changed = []
        for j, ((_, owner, first, own_field), (s, e), res) in enumerate(zip(slots, spans, results, strict=True)):
            if res is None:
                continue
            before = sum(len(g[0][j]) for g in gathered[:rank])  # this rank's keys start here in the field's call
            if e > s:
                values[s:e] = first + res.rows[before:before + e - s]
            if own_field:
                changed.append((owner, first, res))
        self._apply_rows(changed, dmp)
        return stats

    def decay_idle(self, dmp: Any) -> None:
        """Every bucket's decay brought up to the last round's time in the shards (before a checkpoint; the same
        call on every rank, so the replicas stay equal)."""
        if self.now == float("-inf"):
            return
        local = local_pieces(table_weight(dmp))
        for _, owner, first, own_field in self.mapper.slots:
            if own_field:
                self._decay(first, self.mapper.maps[owner].decay_idle_buckets(self.now), local)

    # -- the rows, where they live ---------------------------------------------------------------------------
    @torch.no_grad()
    def _apply_rows(self, changed: list[tuple[str, int, LookupResult]], dmp: Any) -> None:
        """The row changes of one round's lookups (``(owner, first row, result)`` per field that trains its map),
        the same list on every rank: resets, decay, then the admitted rows' starting vectors with ONE all-reduce
        for all fields (entered by every rank or none: whether any row is admitted is the same everywhere)."""
        if not changed:
            return
        local = local_pieces(table_weight(dmp))  # (first global row, rows (R, W)) per local shard
        reset = np.concatenate([first + np.concatenate([r.evicted_rows, r.admitted_rows]) for _, first, r in changed])
        if reset.size:  # (R,) global rows handed out or freed: their row-wise sums start again
            for start, sums in local_pieces(fused_state(dmp)["momentum1"]):
                sums[torch.from_numpy(reset[_within(reset, start, sums)] - start)] = self.initial_sum
        for _, first, res in changed:  # before the copies: an admitted row starts from what its bucket serves now
            self._decay(first, res, local)
        admitted = [(owner, first, r) for owner, first, r in changed if r.admitted_rows.size]
        if not admitted:
            return
        dst = np.concatenate([first + r.admitted_rows for _, first, r in admitted])  # (A,) global
        width = local[0][1].shape[1]
        vectors = torch.zeros(len(dst), width)  # (A, W): the bucket's vector, or zeros (init = "zero")
        from_bucket = np.concatenate([np.full(len(r.admitted_rows), self.mapper.maps[o].init == "bucket")
                                      for o, _, r in admitted])  # (A,)
        if from_bucket.any():
            src = np.concatenate([first + r.admitted_from_bucket for _, first, r in admitted])  # (A,) global
            for start, rows in local:  # each bucket row from the one rank holding it, the others add zeros
                sel = from_bucket & _within(src, start, rows)
                vectors[torch.from_numpy(sel)] = rows[torch.from_numpy(src[sel] - start)].float().cpu()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(vectors)
        for start, rows in local:
            sel = _within(dst, start, rows)
            if sel.any():
                rows[torch.from_numpy(dst[sel] - start)] = vectors[torch.from_numpy(sel)].to(rows.device, rows.dtype)

    @staticmethod
    def _decay(first: int, res: LookupResult, local: list[tuple[int, torch.Tensor]]) -> None:
        if not res.decayed_buckets.size:
            return
        rows_g = first + res.decayed_buckets  # (D,) global
        for start, rows in local:
            sel = _within(rows_g, start, rows)
            if sel.any():
                factor = torch.from_numpy(res.decay[sel]).to(rows.device, rows.dtype).unsqueeze(1)  # (d, 1)
                rows[torch.from_numpy(rows_g[sel] - start)] *= factor

    # -- persistence -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``id_maps`` in the single-process checkpoint's format (``RowMapper.state_dict``) and the maps' clock."""
        return {"id_maps": self.mapper.state_dict(), "ids_now": self.now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mapper.load_state_dict(state.get("id_maps") or {})
        self.now = float(state.get("ids_now", float("-inf")))
