"""Hashed ids -> rows of the fused table for dynamic fields (cold start), batch by batch.

The feature config marks a field dynamic with ``capacity > 0``; :class:`RowMapper` keeps one
:class:`~learner.id_map.IdMap` per such field and rewrites the field's slice of ``TensorBatch.values``
(bags are field-major, so a field's values are one contiguous slice) from the batch's ``keys``:

* an id not yet admitted keeps its bucket row (``to_tensors`` already put it there), so a brand-new
  user gets a learned, shared vector from its first request; with ``bucket_half_life_s`` a bucket idle
  for a while shrinks towards zero first (its last occupants say nothing about the next one);
* an id seen ``admit_after`` times gets its own row, initialised to its bucket's vector (or zero) with
  its optimizer state reset; young rows learn faster (``RowWiseAdagrad(boost=...)``);
* rows evicted (TTL in event time, or least recently seen when full) get their optimizer state reset and
  their ids fall back to the buckets.

A field that shares another's rows (history shares item_id) is looked up read-only: the items in a
user's history neither count towards admission nor refresh their rows' age.

:class:`ColdTracker` says which samples come from a cold user (fewer than ``k`` earlier impressions),
with the same bounded structure (an IdMap whose "admission" is the (k+1)-th sighting).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from learner.batch import TensorBatch
from learner.features import FeatureConfig, FieldSpec
from learner.id_map import IdMap, LookupResult, first_seen_of, to_global

log = logging.getLogger("streamrec.train")


@dataclass
class MapStats:
    """What one :meth:`RowMapper.apply` did, per owning field name."""

    # the owning field's own keys (not a sharing field's, such as history's items): the bucket share's new ids
    lookups: dict[str, int] = field(default_factory=dict)
    bucket_lookups: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    evicted: dict[str, int] = field(default_factory=dict)
    # event seconds from each admitted id's first sight as a candidate to its admission (IdMap.lookup's
    # admitted_delay_s), of the admissions whose first sight is known: not those counted before a checkpoint
    # written without first-seen times (learner/id_map.py), whose delay is unknown and left out, not guessed
    time_to_admission: dict[str, np.ndarray] = field(default_factory=dict)
    # (R,) global rows handed to another id in this call (evicted or admitted): ``DeltaWriter.hold`` them
    reassigned: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # (D,) global bucket rows this call's decay scaled (bucket_half_life_s): an admitted id's bucket is in no row of
    # the batch (the id reads its own row), so the daemon marks these for the deltas apart
    decayed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def id_map_of(spec: FieldSpec, capacity: int | None = None, decay: bool = True, lookups_only: bool = False) -> IdMap:
    """The id map a dynamic field's spec asks for; ``capacity``: a part of its own rows (the distributed mode's
    shard of the map, with candidates in proportion), ``decay=False``: without the buckets' decay clock (kept
    apart there), ``lookups_only``: for read-only lookups (serving; ``IdMap``)."""
    cap = spec.capacity if capacity is None else capacity
    return IdMap(cap, spec.num_buckets, admit_after=spec.admit_after, ttl_s=spec.ttl_s, init=spec.init,
                 bucket_half_life_s=spec.bucket_half_life_s if decay else None, lookups_only=lookups_only)


class RowMapper:
    def __init__(self, cfg: FeatureConfig, lookups_only: bool = False) -> None:
        self.cfg = cfg
        self.maps: dict[str, IdMap] = {f.name: id_map_of(f, lookups_only=lookups_only) for f in dynamic_fields(cfg)}
        self._slots = mapped_slots(cfg)
        # (first row, bucket rows, owner's name) per field, for rows(): serving maps ~6 fields per request
        self._plain = [(*cfg.blocks[i], cfg.owner(f).name) for i, f in enumerate(cfg.fields)]

    @property
    def active(self) -> bool:
        return bool(self.maps)

    def apply(self, tb: TensorBatch, now: float, train: bool = True,
              model: torch.nn.Module | None = None, sparse_opt: torch.optim.Optimizer | None = None) -> MapStats:
        """Rewrite ``tb.values`` in place for the dynamic fields. With ``train``, ids are counted and admitted,
        rows evicted; ``model``/``sparse_opt`` then get the new rows initialised and their state reset."""
        if not self.maps or tb.keys is None or len(tb) == 0:
            return MapStats()
        spans = self.spans(tb)
        results, stats = self.lookup([tb.keys[start:end] for start, end in spans], now, train)
        values = tb.values.numpy()  # shares memory with the tensor: written in place
        reassigned, decayed = [stats.reassigned], [stats.decayed]
        for (_, owner, first, own_field), (start, end), res in zip(self._slots, spans, results, strict=True):
            if res is None:
                continue
            values[start:end] = first + res.rows
            if train and own_field:
                reassigned.append(first + np.concatenate([res.evicted_rows, res.admitted_rows]))
                if model is not None:
                    self._init_rows(owner, first, res, model, sparse_opt)
                    decayed.append(first + res.decayed_buckets)
        stats.reassigned, stats.decayed = np.concatenate(reassigned), np.concatenate(decayed)
        return stats

    @property
    def slots(self) -> list[tuple[int, str, int, bool]]:
        """(field index, owner name, first row of the owner's block, trains the map?) per mapped field, in order."""
        return list(self._slots)

    def spans(self, tb: TensorBatch) -> list[tuple[int, int]]:
        """(start, end) of each mapped field's values in ``tb.values`` (bags are field-major), in ``slots`` order."""
        return field_spans(tb, self._slots)

    def lookup(self, keys: list[np.ndarray], now: float, train: bool = True,
               ) -> tuple[list[LookupResult | None], MapStats]:
        """Each mapped field's hashed keys (``slots`` order) through its owner's map, in order: a field that shares
        another's rows only reads. Returns each field's result (None for no keys) and the counts."""
        stats = MapStats()
        results: list[LookupResult | None] = []
        for (_, owner, _, own_field), k in zip(self._slots, keys, strict=True):
            if not len(k):
                results.append(None)
                continue
            res = self.maps[owner].lookup(k, now, train=train and own_field)
            results.append(res)
            if not own_field:  # a sharing field's reads (history) say nothing of new ids: not in the bucket share
                continue
            stats.lookups[owner] = stats.lookups.get(owner, 0) + len(k)
            stats.bucket_lookups[owner] = stats.bucket_lookups.get(owner, 0) + res.bucket_lookups
            if train:
                stats.admitted[owner] = len(res.admitted_rows)
                stats.evicted[owner] = len(res.evicted_rows)
                stats.time_to_admission[owner] = known_delays(res.admitted_delay_s)
        return results, stats

    @torch.no_grad()
    def _init_rows(self, owner: str, first: int, res: LookupResult, model: torch.nn.Module,
                   sparse_opt: torch.optim.Optimizer | None) -> None:
        weight: torch.Tensor = model.sparse.bag.weight  # type: ignore[union-attr,assignment]
        reset = np.concatenate([res.evicted_rows, res.admitted_rows])
        if reset.size:  # the id that left a row takes its gradient still waiting for the step (accumulation) along
            drop_pending_grad(weight, torch.from_numpy(first + reset).to(weight.device))
        if reset.size and sparse_opt is not None:
            # Both sparse optimizers of learner.optim have it; one without would silently hand the evicted id's
            # optimizer state to the new one, so it is refused instead.
            reset_rows = getattr(sparse_opt, "reset_rows", None)
            if reset_rows is None:
                raise TypeError(f"{type(sparse_opt).__name__} has no reset_rows(weight, rows): rows handed to new ids "
                                "would keep the previous id's optimizer state; build it with "
                                "learner.optim.make_optimizers")
            reset_rows(weight, torch.from_numpy(first + reset).to(weight.device))
        self.maps[owner].decay_buckets(weight, res, first_row=first)
        self.maps[owner].init_admitted(weight, res, first_row=first)

    @torch.no_grad()
    def decay_idle_buckets(self, model: torch.nn.Module, now: float) -> torch.Tensor:
        """Apply every field's bucket decay up to ``now`` to the table (fields with ``bucket_half_life_s``). Returns
        the global rows it scaled (R,) int64: changed outside any trained batch, they are the deltas' to send too
        (the daemon marks them), or serving kept them undecayed until the next artifact."""
        weight: torch.Tensor = model.sparse.bag.weight  # type: ignore[union-attr,assignment]
        firsts = {owner: first for _, owner, first, own in self._slots if own}
        scaled = [torch.zeros(0, dtype=torch.int64)]
        for name, m in self.maps.items():
            res = m.decay_idle_buckets(now)
            m.decay_buckets(weight, res, first_row=firsts[name])
            scaled.append(to_global(firsts[name], res.decayed_buckets))
        return torch.cat(scaled)

    def rows(self, field_index: int, hashed: np.ndarray) -> np.ndarray:
        """Global rows of field ``field_index``'s hashed values, read-only (serving, refresh): admitted ids
        their own rows, the others their buckets. Static fields: ``first + value mod buckets``."""
        first, buckets, owner = self._plain[field_index]
        hashed = np.asarray(hashed, dtype=np.int64)
        id_map = self.maps.get(owner)
        if id_map is None:
            return first + np.remainder(hashed, buckets)
        return first + id_map.lookup(hashed, 0.0, train=False).rows

    @classmethod
    def from_state(cls, cfg: FeatureConfig, state: dict[str, Any] | None, lookups_only: bool = False) -> RowMapper:
        """The mapper of a checkpoint (``ckpt["id_maps"]``; None or {} for a static config). ``lookups_only``: one that
        only maps ids (``train=False``): serving's, built for every delta with maps, at under half the memory."""
        mapper = cls(cfg, lookups_only)
        if mapper.maps or state:
            mapper.load_state_dict(state or {})
        return mapper

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: m.stats() for name, m in self.maps.items()}

    def state_dict(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in self.maps.items()}

    def owned_rows(self) -> torch.Tensor:
        """(K,) int64 global rows of every admitted id (``DeltaWriter.restored``)."""
        firsts = {owner: first for _, owner, first, own in self._slots if own}
        return torch.from_numpy(np.concatenate([firsts[n] + m.owned_rows() for n, m in self.maps.items()]
                                               or [np.zeros(0, np.int64)]))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.maps):
            raise ValueError(f"id maps in the checkpoint are for {sorted(state)}, this config has {sorted(self.maps)}")
        for name, m in self.maps.items():
            m.load_state_dict(state[name])


@torch.no_grad()
def drop_pending_grad(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """Forget the gradient ``rows`` (R,) int64 of ``weight`` hold while it waits for the optimizer step (gradient
    accumulation over micro-batches): rows handed to another id. Applied at the step, it moved the new id's fresh row
    by the gradient the id that left it had learned in the step's earlier micro-batches."""
    grad = weight.grad
    if grad is None or not len(rows):
        return
    if not grad.is_sparse:
        grad[rows] = 0
        return
    grad = grad.coalesce()  # (what the step does first) one entry per row; values() is a view of it
    grad.values()[torch.isin(grad.indices()[0], rows)] = 0
    weight.grad = grad


def known_delays(delays: np.ndarray) -> np.ndarray:
    """The admissions' times to admission whose first sight is known (NaN: counted before a checkpoint without
    first-seen times), float64."""
    d = np.asarray(delays, dtype=np.float64)
    return d[~np.isnan(d)]


def dynamic_fields(cfg: FeatureConfig) -> list[FieldSpec]:
    """The fields that own an id map (``capacity > 0``, not sharing another's rows), in config order."""
    return [f for f in cfg.fields if f.shares is None and f.capacity > 0]


def mapped_slots(cfg: FeatureConfig) -> list[tuple[int, str, int, bool]]:
    """(field index, owner name, first row of the owner's block, trains the map?) of every field whose rows an id
    map hands out (its own, or the one of the field it shares), in config order."""
    owners = {f.name for f in dynamic_fields(cfg)}
    blocks = cfg.blocks
    return [(i, cfg.owner(f).name, blocks[i][0], f.shares is None)
            for i, f in enumerate(cfg.fields) if cfg.owner(f).name in owners]


def field_spans(tb: TensorBatch, slots: list[tuple[int, str, int, bool]]) -> list[tuple[int, int]]:
    """(start, end) of each slot's field values in ``tb.values`` (bags are field-major)."""
    b = len(tb)
    offsets = tb.offsets.numpy()
    return [(int(offsets[i * b]), int(offsets[(i + 1) * b])) for i, _, _, _ in slots]


def earlier_rows(keys: np.ndarray) -> np.ndarray:
    """(N,) int64: how many earlier rows (in input order) have the same key as each row."""
    keys = np.asarray(keys).reshape(-1)
    order = np.argsort(keys, kind="stable")  # by key, input order kept within a key
    sk = keys[order]
    first = np.ones(len(sk), bool)
    first[1:] = sk[1:] != sk[:-1]
    pos = np.arange(len(sk))
    out = np.empty(len(sk), np.int64)
    out[order] = pos - np.maximum.accumulate(np.where(first, pos, 0))
    return out


class ColdTracker:
    """Which samples come from a user with fewer than ``k`` earlier impressions (bounded memory).

    A user's impressions are counted one by one, in row order, also within a batch: MovieLens users rate in
    bursts, and counting a batch's rows of a user as one sighting (the id map admits a key on its batch's
    count) took a burst's first ten impressions for warm ones (5,806 cold impressions in the demo where the
    protocol's definition gives 60,400).

    ``capacity`` (``[learner] cold_tracker_capacity``) warm users are remembered (the id map's own rows: ~217 bytes a
    user, ``IdMap.nbytes``). Full, the id map evicts the least recently seen warm users (:attr:`evictions` counts
    them): one that comes back is cold again for ``k`` impressions. Users still cold are counted in the id map's two
    candidate generations of ``capacity // 2`` users each: a cold user unseen for that many other new users starts
    counting again (cold longer). A state of another capacity loads (:meth:`load_state_dict`)."""

    def __init__(self, k: int, capacity: int) -> None:
        self.k = k
        self._seen = IdMap(capacity, 1, admit_after=k + 1) if k > 0 else None

    @property
    def capacity(self) -> int:
        """Warm users remembered at most (0 with ``k = 0``: nothing is tracked)."""
        return 0 if self._seen is None else self._seen.capacity

    @property
    def evictions(self) -> int:
        """Warm users forgotten so far to make room (the state's count: checkpoints carry it)."""
        return 0 if self._seen is None else self._seen.counters.evictions_lru

    def cold(self, user_keys: np.ndarray, now: float, counted: np.ndarray | None = None) -> np.ndarray:
        """(B,) bool for the users of a batch, in order. Rows where ``counted`` (default: all) is set are
        impressions and count as seen; the others (an impression's later sample) only read the state."""
        b = len(user_keys)
        if self._seen is None:
            return np.zeros(b, bool)
        counted = np.ones(b, bool) if counted is None else np.asarray(counted, bool)
        out = self._seen.lookup(user_keys[~counted], now, train=False).rows < 1 if (~counted).any() else None
        idx = np.flatnonzero(counted)
        keys = user_keys[idx]
        rank = earlier_rows(keys)  # earlier rows of the user in this batch
        cold = np.zeros(b, bool)
        if out is not None:
            cold[~counted] = out
        for j in range(min(self.k + 1, int(rank.max()) + 1 if len(rank) else 0)):  # one sighting per layer
            layer = rank == j
            cold[idx[layer]] = self._seen.lookup(keys[layer], now).rows < 1  # still on the "bucket": not warm
        return cold  # a row with k or more earlier rows of its user in this batch is warm

    def state_dict(self) -> dict[str, Any]:
        return {} if self._seen is None else self._seen.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From :meth:`state_dict`. A state of another capacity (``cold_tracker_capacity`` changed across a restart)
        keeps its most recently seen warm users up to this capacity and, of each candidate generation, the users
        closest to warm up to this one's size. One of another ``k`` (``cold_k`` changed: no shape setting) is not
        loaded: the tracker starts over (logged), every user cold again for its next ``k`` impressions; refused, it
        made every checkpoint fail to load as if damaged."""
        if self._seen is None or not state:
            return
        written = dict(state["config"])
        if written.get("admit_after") != self._seen.admit_after:  # another k: its counts mean another threshold
            log.warning("the checkpoint's cold tracker counted to cold_k = %s, [learner] cold_k is %d now: it starts "
                        "over, every user cold again for its next %d impressions", written.get("admit_after", 1) - 1,
                        self.k, self.k)
            return
        if written.get("capacity") == self._seen.capacity:
            self._seen.load_state_dict(state)
            return
        old = IdMap(**written)
        old.load_state_dict(state)  # checks the state's version and config
        mine, theirs = self._seen.config(), old.config()
        if {**theirs, "capacity": 0, "candidates": 0} != {**mine, "capacity": 0, "candidates": 0}:
            raise ValueError(f"cold tracker state was written with config {theirs}, this tracker has {mine}")
        keys, seen = state["row_key"].numpy(), state["row_seen"].numpy()
        live = np.flatnonzero(keys >= 0)
        keep = live[np.argsort(-seen[live], kind="stable")[:self._seen.capacity]]  # most recently seen first
        candidates = {}
        for gen in ("cur", "prev"):
            k, c, t = f"{gen}_keys", f"{gen}_counts", f"{gen}_first_seen"
            top = np.argsort(-state[c].numpy(), kind="stable")[:self._seen.candidates]
            candidates[k], candidates[c] = state[k].numpy()[top], state[c].numpy()[top]
            candidates[t] = first_seen_of(state, gen)[top]
        self._seen.load_entries(keys[keep], np.arange(keep.size), seen[keep], candidates,
                                float(state["last_sweep"]), dict(state["counters"]))
        if keep.size < live.size:
            log.warning("the checkpoint's cold tracker remembers %d warm users, [learner] cold_tracker_capacity is %d "
                        "now: the %d least recently seen are forgotten (cold again for their next %d impressions)",
                        live.size, self._seen.capacity, live.size - keep.size, self.k)


def user_keys(tb: TensorBatch, cfg: FeatureConfig, field_name: str = "user_id") -> np.ndarray | None:
    """(B,) hashed user ids of a batch (one value per sample), or None without keys or the field."""
    names = [f.name for f in cfg.fields]
    if tb.keys is None or field_name not in names:
        return None
    i, b = names.index(field_name), len(tb)
    offsets = tb.offsets.numpy()
    start, end = int(offsets[i * b]), int(offsets[(i + 1) * b])
    return tb.keys[start:end] if end - start == b else None
