"""Dynamic ids (admission, eviction, the hash-bucket fallback) on N ranks: each field's id map sharded with its
rows, the way TorchRec's managed-collision modules shard theirs, with the single process's rules
(``learner/id_map.py``).

A dynamic field's block is ``num_buckets`` bucket rows then ``capacity`` own rows; TorchRec's row-wise plan cuts
the table into contiguous row ranges, so each rank holds a contiguous part of the field's own rows (its
:class:`Share`: possibly none). A key belongs to one rank for good: the share that ``position(key)``, a hash of the
key spread uniformly over ``[0, capacity)``, falls in (:func:`owner_index`), so every rank gets keys in proportion to
its own rows. That rank's ``IdMap`` (capacity: its share) counts the key, admits it onto a row of its share, and
evicts it (TTL, or least recently seen among the SHARE's rows when the share is full: LRU per shard, as in TorchRec;
everything else is the single process's rule, since a key always meets the same map; a share sweeps expired ids at
its own lookups, so in a round where it owns no key its expired ids wait for the next).

One round (a collective, every rank, ``tb`` may be empty)::

    1. all-gather  the hashed keys of every rank's batch (per field) and its newest event time
    2. each rank   looks up the keys it owns, in rank order, in its map: rows (own rows shifted to its share),
                   the rows it admitted (with their buckets) and evicted
    3. all-gather  those answers; every rank puts the rows back in key order and cuts out its own batch's
    4. the rows' changes, where the rows live (every rank holds the same list):
       - the row-wise sums (fbgemm's ``momentum1``) of rows evicted or handed out, reset by their owner (always
         in its own shard);
       - bucket decay (``bucket_half_life_s``): ONE clock per field, replicated (:class:`~learner.id_map.
         BucketDecay`), touched with every rank's bucket rows, so every rank takes the same decision; the rank
         holding a bucket row scales it;
       - an admitted row starts as its bucket's vector (``init = "bucket"``): one all-reduce of the admitted rows'
         bucket vectors (each bucket row lives on one rank, the others add zeros), written by the row's owner.

Memory: a rank's map holds its share only: ``IdMap.nbytes`` is ~215 bytes per own row, so 2 ranks each hold half
(they held every row before). The maps and the bucket clocks are checkpointed per rank (``rank-<r>.pt``); a restore
on another world size or plan (or from a checkpoint of the replicated maps written before) merges every rank's
parts and splits them again: a key whose new owner's share does not hold its row moves to a free row of that
share (vector and row-wise sum moved with one all-reduce), and a share with more keys than rows keeps the most
recently seen. The unshard, and the id maps that serving's deltas carry, are the parts merged into ONE map of the
whole capacity (:func:`whole_maps`), the single process's format.

Cost: three collectives a round (two object all-gathers, the all-reduce only when a row was admitted from its
bucket), each a few ms on a loaded 2-core machine (``bench/scaling.py --id-capacity``; bench/README.md). Known
limit: the whole maps a delta carries (every ``deltas_id_maps_every_s``) are built on rank 0 as full-capacity
``IdMap``s, a transient of one unsharded map's size (``IdMap.nbytes``) on that rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from learner.batch import TensorBatch
from learner.distributed import all_gather_objects
from learner.event_clock import QUORUM, EventClock, largest
from learner.features import FeatureConfig, FieldSpec
from learner.id_map import BucketDecay, IdMap, first_seen_of
from learner.row_mapper import MapStats, dynamic_fields, field_spans, id_map_of, known_delays, mapped_slots
from learner.sharded_model import fused_state, local_pieces, row_ranges, table_weight

_MIX = np.uint64(0xD6E8FEB86659FD93)  # odd multiplier; not IdMap's Fibonacci hashing, so a shard's keys still
#                                       spread over its own table's slots


@dataclass(frozen=True)
class Share:
    """One rank's part of a dynamic field's own rows: ``count`` rows from own row ``start`` (0-based)."""

    rank: int
    start: int
    count: int


def shares_of(first_own: int, capacity: int, ranges: list[tuple[int, int, int]]) -> list[Share]:
    """The shares of own rows ``[first_own, first_own + capacity)`` (global rows) in the table's row ranges
    ``(rank, first row, end row)`` (:func:`~learner.sharded_model.row_ranges`), by row; ranks without any: none."""
    out = []
    for rank, lo, hi in ranges:
        a, b = max(lo, first_own), min(hi, first_own + capacity)
        if b > a:
            out.append(Share(rank, a - first_own, b - a))
    out.sort(key=lambda s: s.start)
    ends = [0] + [s.start + s.count for s in out]
    if ends[-1] != capacity or any(s.start != e for s, e in zip(out, ends, strict=False)):
        raise ValueError(f"the table's row ranges {ranges} do not cover own rows [{first_own}, "
                         f"{first_own + capacity}) once: not a row-wise plan")
    return out


def position(keys: np.ndarray, capacity: int) -> np.ndarray:
    """(N,) int64 in ``[0, capacity)``: where each hashed key falls in a field's own rows, spread uniformly (a
    64-bit mix of the key, so consecutive ids scatter)."""
    h = np.asarray(keys, dtype=np.int64).view(np.uint64).copy()
    h ^= h >> np.uint64(32)
    h *= _MIX
    h ^= h >> np.uint64(29)
    return (h % np.uint64(capacity)).astype(np.int64)


def owner_index(keys: np.ndarray, shares: list[Share]) -> np.ndarray:
    """(N,) index into ``shares`` of the share that owns each key (:func:`position` inside it)."""
    capacity = shares[-1].start + shares[-1].count
    ends = np.array([s.start + s.count for s in shares], dtype=np.int64)
    return np.searchsorted(ends, position(keys, capacity), side="right")


@dataclass
class _Parts:
    """Every rank's part of one field's map, merged: admitted ``keys`` (K,) on own rows ``rows`` (K,) (0-based over
    the whole capacity) last seen ``seen`` (K,); candidates' keys and counts per generation; the sweep clock and
    the counters summed."""

    keys: np.ndarray
    rows: np.ndarray
    seen: np.ndarray
    candidates: dict[str, np.ndarray]
    last_sweep: float
    counters: dict[str, int]

    @classmethod
    def of(cls, parts: list[tuple[int, Mapping[str, Any]]]) -> _Parts:
        """From ``(first own row of the part, IdMap.state_dict())`` pairs."""
        keys, rows, seen = [], [], []
        cand: dict[str, list[np.ndarray]] = {k: [] for k in ("cur_keys", "cur_counts", "cur_first_seen", "prev_keys",
                                                             "prev_counts", "prev_first_seen")}
        counters: dict[str, int] = {}
        for start, st in parts:
            rk = np.asarray(st["row_key"], dtype=np.int64)
            own = np.flatnonzero(rk >= 0)
            keys.append(rk[own])
            rows.append(start + own)
            seen.append(np.asarray(st["row_seen"], dtype=np.float64)[own])
            for gen in ("cur", "prev"):
                cand[f"{gen}_keys"].append(np.asarray(st[f"{gen}_keys"], dtype=np.int64))
                cand[f"{gen}_counts"].append(np.asarray(st[f"{gen}_counts"], dtype=np.int64))
                cand[f"{gen}_first_seen"].append(first_seen_of(st, gen))
            for k, v in dict(st["counters"]).items():
                counters[k] = counters.get(k, 0) + int(v)
        return cls(np.concatenate(keys), np.concatenate(rows), np.concatenate(seen),
                   {k: np.concatenate(v) for k, v in cand.items()},
                   max(float(st["last_sweep"]) for _, st in parts), counters)

    def candidates_of(self, keep: Callable[[np.ndarray], np.ndarray] | None, limit: int) -> dict[str, np.ndarray]:
        """The candidates (each generation: those where ``keep(keys)``, at most ``limit``, the highest counts), with
        their first-seen times."""
        out = {}
        for gen in ("cur", "prev"):
            k, c = self.candidates[f"{gen}_keys"], self.candidates[f"{gen}_counts"]
            t = self.candidates[f"{gen}_first_seen"]
            if keep is not None:
                sel = keep(k)
                k, c, t = k[sel], c[sel], t[sel]
            if k.size > limit:
                top = np.argsort(-c, kind="stable")[:limit]
                k, c, t = k[top], c[top], t[top]
            out[f"{gen}_keys"], out[f"{gen}_counts"], out[f"{gen}_first_seen"] = k, c, t
        return out


def _parts_of_states(states: Sequence[Mapping[str, Any]], owner: str) -> tuple[list[tuple[int, Mapping[str, Any]]],
                                                                           np.ndarray | None]:
    """One field's map parts in per-rank checkpoint states (``ShardedRowMapper.state_dict``, or a checkpoint of
    the replicated maps written before: ``id_maps`` in rank 0's, the whole capacity) and its bucket clock."""
    parts = [(int(p["start"]), p["map"]) for s in states for p in [(s.get("id_shards") or {}).get(owner)] if p]
    clock = next((np.asarray(s["id_buckets"][owner]) for s in states if owner in (s.get("id_buckets") or {})), None)
    if not parts and states and (states[0].get("id_maps") or {}).get(owner):
        whole = states[0]["id_maps"][owner]
        parts, clock = [(0, whole)], np.asarray(whole["bucket_seen"]) if "bucket_seen" in whole else None
    return parts, clock


def _ids_now(rank: int, state: Mapping[str, Any]) -> float:
    """Rank ``rank``'s ``ids_now`` (``-inf``, the default: no round with rows yet), else a ValueError naming it: a
    bool, a text, NaN or +inf is no event time (``float()`` read ``true`` as 1.0 s and ``"5"`` as 5.0 s)."""
    v = state.get("ids_now", float("-inf"))
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating) or not v < float("inf"):
        raise ValueError(f"rank {rank}'s ids_now is {v!r:.80}, not an event time in seconds: the state is damaged")
    return float(v)


def whole_maps(cfg: FeatureConfig, states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's map parts (per-rank checkpoint states) merged into ONE map per field, of the whole capacity:
    ``RowMapper.state_dict``, what the unshard writes and a delta carries to serving."""
    out = {}
    for spec in dynamic_fields(cfg):
        parts, clock = _parts_of_states(states, spec.name)
        m = id_map_of(spec)
        if parts:
            p = _Parts.of(parts)
            m.load_entries(p.keys, p.rows, p.seen, p.candidates_of(None, m.max_candidates), p.last_sweep,
                           p.counters)
        if clock is not None:
            m.buckets.seen[:] = clock
        out[spec.name] = m.state_dict()
    return out


def merged_stats(parts: list[Mapping[str, Mapping[str, float]]], capacities: Mapping[str, int]) -> dict[str, Any]:
    """Every rank's ``IdMap.stats()`` per field as the stats of one map of the field's whole capacity."""
    out: dict[str, dict[str, float]] = {}
    for name, cap in capacities.items():
        ps = [p[name] for p in parts if name in p]
        tot = {k: float(sum(p[k] for p in ps)) for k in ("live_rows", "candidates", "lookups", "admissions",
                                                         "evictions", "evictions_ttl", "evictions_lru")}
        buckets = sum(p["bucket_share"] * p["lookups"] for p in ps)
        out[name] = {**tot, "occupancy": tot["live_rows"] / cap,
                     "bucket_share": buckets / tot["lookups"] if tot["lookups"] else 0.0}
    return out


def _within(rows: np.ndarray, start: int, local: torch.Tensor) -> np.ndarray:
    """(n,) bool: which global ``rows`` lie in the local shard that starts at ``start`` and holds ``local``."""
    return (rows >= start) & (rows < start + len(local))


@dataclass
class _Field:
    """One dynamic field on this rank: its spec, first global row, every rank's share, this rank's map (None:
    no share here) and the replicated bucket clock."""

    spec: FieldSpec
    first: int
    shares: list[Share]
    mine: Share | None
    map: IdMap | None
    clock: BucketDecay

    @property
    def own0(self) -> int:
        """Global row of the field's own row 0."""
        return self.first + self.spec.num_buckets


class ShardedRowMapper:
    """One rank's shards of the id maps (module docstring). ``ranges``: the table's ``(rank, first row, end row)``
    (:func:`~learner.sharded_model.row_ranges`); ``initial_sum``: fbgemm's starting row-wise sum
    (``initial_accumulator * state_scale``), what a reset row's state goes back to."""

    def __init__(self, cfg: FeatureConfig, ranges: list[tuple[int, int, int]], rank: int, initial_sum: float) -> None:
        self.cfg, self.rank, self.initial_sum = cfg, rank, initial_sum
        self.slots = mapped_slots(cfg)
        blocks = cfg.blocks
        firsts = {cfg.fields[i].name: blocks[i][0] for i, _, _, own in self.slots if own}
        self.fields: dict[str, _Field] = {}
        for spec in dynamic_fields(cfg):
            shares = shares_of(firsts[spec.name] + spec.num_buckets, spec.capacity, ranges)
            mine = next((s for s in shares if s.rank == rank), None)
            self.fields[spec.name] = _Field(spec, firsts[spec.name], shares, mine,
                                            id_map_of(spec, mine.count, decay=False) if mine else None,
                                            BucketDecay(spec.num_buckets, spec.bucket_half_life_s))
        self.now = float("-inf")  # event time (s) of the last round that had rows: the same on every rank
        self._clock = EventClock()  # every rank's rows' event time (learner/event_clock.py), the same on each rank
        self.occupancy: dict[str, float] = {}  # per field, the whole map's, after the last round
        # the boost's update counts per row (learner/sharded_boost.py; a ShardedTensor (num_rows,) int32, sharded
        # like the table), zeroed for rows handed out or freed and moved with moved rows; None without a boost
        self.counts: Any = None

    @classmethod
    def of(cls, cfg: FeatureConfig, dmp: Any, initial_sum: float) -> ShardedRowMapper:
        """The mapper of the sharded model ``dmp`` (its table's row ranges), for this rank."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(cfg, row_ranges(table_weight(dmp)), rank, initial_sum)

    @property
    def active(self) -> bool:
        return bool(self.fields)

    def nbytes(self) -> int:
        """Bytes this rank's maps hold (its shares only)."""
        return sum(f.map.nbytes() for f in self.fields.values() if f.map is not None)

    # -- one round ---------------------------------------------------------------------------------------------
    def apply(self, tb: TensorBatch, dmp: Any) -> MapStats:
        """Collective, every rank every round (``tb`` may be empty): rewrite ``tb.values`` of the dynamic fields to
        rows, each key counted, admitted and evicted by the rank that owns it; the rows' changes applied where the
        rows live. Returns the whole round's counts (every rank's keys) and, the same on every rank, every rank's
        rows given to another id (``MapStats.reassigned``: for ``ShardedDeltas.hold``)."""
        if not self.fields:
            return MapStats()
        has_keys = len(tb) > 0 and tb.keys is not None
        spans = field_spans(tb, self.slots) if has_keys else [(0, 0)] * len(self.slots)
        mine = [np.asarray(tb.keys[s:e]) if has_keys else np.empty(0, np.int64)  # type: ignore[index]
                for s, e in spans]
        # 1. [(per-field keys (n_r,), the rank's newest times (<= QUORUM,))] in rank order; every rank's clock takes
        # every rank's newest times, in rank order: one clock, the one a single process over all the rows would have
        newest = largest(np.asarray(tb.ts, np.int64), QUORUM) if len(tb) else np.empty(0, np.int64)
        gathered = all_gather_objects((mine, newest))
        for _, times in gathered:
            self._clock.advance(times)
        if self._clock.now_s is not None:  # event time drives ids' ages
            self.now = max(self.now, self._clock.now_s)
        keys = [np.concatenate([g[0][j] for g in gathered]) for j in range(len(self.slots))]  # (sum n_r,) per slot
        owners: list[np.ndarray] = []
        answers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None] = []
        resets: list[np.ndarray] = []
        for (_, name, _, own_field), k in zip(self.slots, keys, strict=True):  # 2. the keys this rank owns
            f = self.fields[name]
            who = np.array([s.rank for s in f.shares], dtype=np.int64)[owner_index(k, f.shares)] if len(k) else \
                np.empty(0, np.int64)  # (n,) owning rank per key
            owners.append(who)
            sel = who == self.rank
            if f.map is None or not sel.any():
                answers.append(None)
                continue
            assert f.mine is not None
            res = f.map.lookup(k[sel], self.now, train=own_field)
            nb, shift = f.spec.num_buckets, f.mine.start  # the map's own row r -> the field's own row start + r
            rows = np.where(res.rows >= nb, res.rows + shift, res.rows)  # field-local rows
            if own_field:
                resets.append(f.own0 - nb + shift + np.concatenate([res.evicted_rows, res.admitted_rows]))
            answers.append((rows, res.admitted_rows + shift, res.admitted_from_bucket, res.evicted_rows + shift,
                            known_delays(res.admitted_delay_s)))
        live = {n: f.map.stats()["live_rows"] for n, f in self.fields.items() if f.map is not None}
        gathered2 = all_gather_objects((answers, live))  # 3. [(per slot: answer or None, live rows)] in rank order
        replies = [g[0] for g in gathered2]
        stats, changed = MapStats(), []
        reassigned: list[np.ndarray] = []
        values = tb.values.numpy()  # shares memory with the tensor: written in place
        for j, ((_, name, first, own_field), (s, e), k, who) in enumerate(zip(self.slots, spans, keys, owners,
                                                                               strict=True)):
            if not len(k):
                continue
            f = self.fields[name]
            rows = np.empty(len(k), dtype=np.int64)  # (n,) field-local rows of every rank's keys, key order
            for r, reply in enumerate(replies):
                if reply[j] is not None:
                    rows[who == r] = reply[j][0]
            start = sum(len(g[0][j]) for g in gathered[:self.rank])  # this rank's keys in the field's call
            if e > s:
                values[s:e] = first + rows[start:start + e - s]
            if not own_field:  # a sharing field's reads (history): not in the bucket share (RowMapper.lookup)
                continue
            nb = f.spec.num_buckets
            stats.lookups[name] = stats.lookups.get(name, 0) + len(k)
            stats.bucket_lookups[name] = stats.bucket_lookups.get(name, 0) + int(np.count_nonzero(rows < nb))
            answered = [reply[j] for reply in replies if reply[j] is not None]
            dst = np.concatenate([a[1] for a in answered])  # (A,) field-local own rows handed out, every rank's
            src = np.concatenate([a[2] for a in answered])  # (A,) their buckets
            decayed, factor = f.clock.touch(np.concatenate([rows[rows < nb], src]), self.now)
            changed.append((f, dst, src, decayed, factor))
            stats.decayed = np.concatenate([stats.decayed, f.first + decayed])  # (global, for the deltas)
            stats.admitted[name] = len(dst)
            stats.evicted[name] = sum(len(a[3]) for a in answered)
            # every rank's rows given to another id, global: the same list on every rank (rank 0's writer holds them)
            reassigned.append(f.first + np.concatenate([dst, *(a[3] for a in answered)]))
            stats.time_to_admission[name] = np.concatenate([a[4] for a in answered])  # every rank's, as one map's
            self.occupancy[name] = sum(g[1].get(name, 0.0) for g in gathered2) / f.spec.capacity
        if reassigned:
            stats.reassigned = np.concatenate(reassigned)
        self._apply_rows(changed, np.concatenate(resets) if resets else np.empty(0, np.int64), dmp)
        return stats

    def decay_idle(self, dmp: Any) -> np.ndarray:
        """Every bucket's decay brought up to the last round's time in the shards (before a checkpoint; the same
        call on every rank, on the replicated clocks). Returns the global rows scaled (R,) int64, the same on every
        rank: changed outside any trained batch, the deltas send them too (``RowMapper.decay_idle_buckets``)."""
        if self.now == float("-inf"):
            return np.zeros(0, np.int64)
        local = local_pieces(table_weight(dmp))
        scaled = [np.zeros(0, np.int64)]
        for f in self.fields.values():
            decayed, factor = f.clock.idle(self.now)
            self._decay(f.first, decayed, factor, local)
            scaled.append(f.first + decayed)
        return np.concatenate(scaled)

    # -- the rows, where they live ---------------------------------------------------------------------------
    @torch.no_grad()
    def _apply_rows(self, changed: list[tuple[_Field, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                    reset: np.ndarray, dmp: Any) -> None:
        """One round's row changes: ``reset`` (R,) global rows this rank's maps evicted or handed out (in its own
        shard); per field (the same list on every rank) the admitted own rows and their buckets (field-local) and
        the buckets' decay. Resets, decay, then the admitted rows' starting vectors with ONE all-reduce for all
        fields (entered by every rank or none: whether any row is admitted is the same everywhere)."""
        if not changed:
            return
        local = local_pieces(table_weight(dmp))  # (first global row, rows (R, W)) per local shard
        if reset.size:  # rows handed out or freed: their row-wise sums (and the boost's counts) start again
            for start, sums in local_pieces(fused_state(dmp)["momentum1"]):
                sums[torch.from_numpy(reset[_within(reset, start, sums)] - start)] = self.initial_sum
            for start, counts in local_pieces(self.counts) if self.counts is not None else []:
                counts[torch.from_numpy(reset[_within(reset, start, counts)] - start)] = 0
        for f, _, _, decayed, factor in changed:  # before the copies: an admitted row starts from its bucket's now
            self._decay(f.first, decayed, factor, local)
        admitted = [(f, dst, src) for f, dst, src, _, _ in changed if dst.size]
        if not admitted:
            return
        dst = np.concatenate([f.first + d for f, d, _ in admitted])  # (A,) global
        from_bucket = np.concatenate([np.full(len(d), f.spec.init == "bucket") for f, d, _ in admitted])  # (A,)
        src = np.concatenate([f.first + s for f, _, s in admitted])  # (A,) global bucket rows
        width = local[0][1].shape[1]
        vectors = torch.zeros(len(dst), width)  # (A, W): the bucket's vector, or zeros (init = "zero")
        if from_bucket.any():
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
    def _decay(first: int, decayed: np.ndarray, factor: np.ndarray, local: list[tuple[int, torch.Tensor]]) -> None:
        """Scale the field's bucket rows ``decayed`` (D,) (field-local) by ``factor`` (D,) where they live."""
        if not decayed.size:
            return
        rows_g = first + decayed  # (D,) global
        for start, rows in local:
            sel = _within(rows_g, start, rows)
            if sel.any():
                f = torch.from_numpy(factor[sel]).to(rows.device, rows.dtype).unsqueeze(1)  # (d, 1)
                rows[torch.from_numpy(rows_g[sel] - start)] *= f

    @torch.no_grad()
    def _move_rows(self, src: np.ndarray, dst: np.ndarray, dmp: Any) -> None:
        """Collective (every rank the same lists): copy global rows ``src`` (M,) to ``dst`` (M,), their vectors,
        row-wise sums and boost counts, wherever each lives (one all-reduce; every source read before any destination
        written)."""
        local = local_pieces(table_weight(dmp))
        states = [local_pieces(fused_state(dmp)["momentum1"])]  # row-wise states, sharded like the table
        if self.counts is not None:
            states.append(local_pieces(self.counts))
        width = local[0][1].shape[1]
        box = torch.zeros(len(src), width + len(states), dtype=torch.float64)  # (M, W + S): vector, then states
        for k, (start, rows) in enumerate(local):
            sel = _within(src, start, rows)
            idx = torch.from_numpy(src[sel] - start)
            box[torch.from_numpy(sel), :width] = rows[idx].double().cpu()
            for j, st in enumerate(states):
                box[torch.from_numpy(sel), width + j] = st[k][1][idx].double().cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(box)
        for k, (start, rows) in enumerate(local):
            sel = _within(dst, start, rows)
            if sel.any():
                idx = torch.from_numpy(dst[sel] - start)
                rows[idx] = box[torch.from_numpy(sel), :width].to(rows.device, rows.dtype)
                for j, st in enumerate(states):
                    t = st[k][1]
                    t[idx] = box[torch.from_numpy(sel), width + j].to(t.device, t.dtype)

    # -- persistence -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's parts (``id_shards``: its share's first own row and map per field), the bucket clocks
        (``id_buckets``, the same on every rank) and the maps' clock."""
        return {"id_shards": {n: {"start": f.mine.start, "map": f.map.state_dict()}
                              for n, f in self.fields.items() if f.map is not None and f.mine is not None},
                "id_buckets": {n: torch.from_numpy(f.clock.seen.copy()) for n, f in self.fields.items()},
                "ids_now": self.now, "ids_clock": self._clock.state()}

    def stats_part(self) -> dict[str, dict[str, float]]:
        """This rank's maps' ``IdMap.stats()`` (:func:`merged_stats` makes the whole maps' of every rank's)."""
        return {n: f.map.stats() for n, f in self.fields.items() if f.map is not None}

    def capacities(self) -> dict[str, int]:
        return {n: f.spec.capacity for n, f in self.fields.items()}

    def owned_rows(self) -> torch.Tensor:
        """(K,) int64 global rows of the ids admitted in this rank's shares (``DeltaWriter.restored``)."""
        return torch.from_numpy(np.concatenate(
            [f.own0 - f.spec.num_buckets + f.mine.start + f.map.owned_rows()
             for f in self.fields.values() if f.map is not None and f.mine is not None] or [np.zeros(0, np.int64)]))

    def load_state_dict(self, states: Sequence[Mapping[str, Any]], dmp: Any) -> None:
        """Collective: this rank's shares from every rank's checkpoint state (``states``, rank order), whatever the
        world size or plan that wrote them (module docstring); the rows that must change rank move."""
        self.move_rows(self.load_shares(states), dmp)

    def load_shares(self, states: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """This rank's shares from every rank's checkpoint state (:meth:`load_state_dict`), no collective: a share only
        its rank reads (its counters, free stack, candidates) refused there must be refused by every rank before the
        rows move (``sharded_checkpoint.loaded_together``), or the others wait in that move for a rank that left.
        Returns the rows that must change rank, global (src (M,), dst (M,)), the same on every rank
        (:meth:`move_rows`)."""
        moves_src, moves_dst = [], []
        for name, f in self.fields.items():
            parts, clock = _parts_of_states(states, name)
            if clock is not None:
                f.clock.seen[:] = clock
            if not parts:
                continue
            for s, st in parts:  # else a key on a row past them moved another field's row (vector, sum) onto its own
                if s < 0 or s + len(st["row_key"]) > f.spec.capacity:
                    raise ValueError(f"{name}'s id map part at own row {s} has {len(st['row_key'])} rows, outside the "
                                     f"field's {f.spec.capacity} own rows: the state is malformed")
            p = _Parts.of(parts)
            same = sorted((s, int(st["row_key"].shape[0])) for s, st in parts) == \
                [(s.start, s.count) for s in f.shares]
            who = owner_index(p.keys, f.shares)  # (K,) new share of every admitted key
            for si, share in enumerate(f.shares):
                m = np.flatnonzero(who == si)
                if m.size > share.count:  # more keys than the share has rows: the most recently seen stay
                    m = m[np.argsort(-p.seen[m], kind="stable")[:share.count]]
                inside = (p.rows[m] >= share.start) & (p.rows[m] < share.start + share.count)
                rows = p.rows[m].copy()
                free = np.setdiff1d(np.arange(share.start, share.start + share.count), rows[inside])
                rows[~inside] = free[:int(np.count_nonzero(~inside))]  # the lowest free rows of the share
                moves_src.append(f.own0 + p.rows[m[~inside]])
                moves_dst.append(f.own0 + rows[~inside])
                if share.rank != self.rank or f.map is None:
                    continue
                if same:  # the same plan: this share's own counters, sweep clock and free stack back
                    written = next(st for s, st in parts if s == share.start)
                    own, swept = dict(written["counters"]), float(written["last_sweep"])
                    stack: np.ndarray | None = np.asarray(written["free"]) if "free" in written else None
                else:  # another plan: the first share carries the field's counters; every share the latest sweep
                    own, swept, stack = (p.counters if si == 0 else {}), p.last_sweep, None

                def keep(k: np.ndarray, si: int = si, f: _Field = f) -> np.ndarray:
                    return owner_index(k, f.shares) == si

                f.map.load_entries(p.keys[m], rows - share.start, p.seen[m],
                                   p.candidates_of(keep, f.map.max_candidates), swept, own, stack)
        self.now = max((_ids_now(r, s) for r, s in enumerate(states)), default=float("-inf"))
        self._clock.load([t for s in states for t in s.get("ids_clock", [])])  # every rank's is the same clock
        if not moves_src:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(moves_src), np.concatenate(moves_dst)

    def move_rows(self, moves: tuple[np.ndarray, np.ndarray], dmp: Any) -> None:
        """Collective: the rows :meth:`load_shares` found on another rank's share (src (M,), dst (M,)) moved there."""
        src, dst = moves
        if src.size:  # the same on every rank: every rank computed every share's plan
            self._move_rows(src, dst, dmp)
