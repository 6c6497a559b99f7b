"""Dynamic id-to-row map for one categorical field: hash-bucket fallback, admission, eviction.

Local row layout of a field's block in the fused embedding table::

    [0, num_buckets)                          shared fallback buckets: key mod num_buckets
    [num_buckets, num_buckets + capacity)     own rows of admitted ids (handed out from a free list)

A key is a hashed id (non-negative int64, ``stream.ids.stable_hash``; raw ids are hashed by
``stream.features`` only, the one definition the joiner and serving share). A key not yet admitted maps
to its bucket. It is admitted once it has been seen ``admit_after`` times (0 or 1: on first sight) and
gets its own row, which it keeps until it is evicted: unseen for
``ttl_s`` seconds (a vectorized sweep), or least recently seen when the table is full and new keys need
rows (evicted in chunks of ``capacity // 32`` or more). An evicted key falls back to its bucket and has to
be seen ``admit_after`` times again. Admission happens in the ``lookup`` call in which the key's count
reaches the threshold, and every occurrence of the key in that call already gets the new row (a call with
more than ``candidates // 4`` occurrences of unadmitted keys counts them in chunks, in order, and then
only the occurrences from the admitting chunk on do).

Design (chosen by measurement, see bench/id_map.py): open-addressing hash tables with linear probing
(Fibonacci hashing of the key) kept in numpy arrays, every operation vectorized over the whole batch: a
probe round handles all keys still unresolved at once; at load <= 0.4 most keys resolve at their home
slot, the rest in one or two more rounds that gather 8 slots per key. Key and value of a slot sit side by
side, so a probe is one gather. Inserting keys of one batch that race for a slot: every racer writes, the
surviving write wins, the losers probe on. Sorted keys + ``searchsorted`` were the alternative: every
lookup is ~log2(n) dependent gathers instead of ~1.3, and each admission or eviction batch needs an
O(capacity) merge. No per-id Python anywhere; Python loops run over probe rounds and chunks only.

* Own rows: table ``key -> row`` (slots >= capacity / 0.4, a power of two; evicted keys leave tombstones,
  purged by rebuilding the table when live + tombstones exceed half the slots) and per-row arrays
  ``row_key``, ``row_seen`` (last lookup time, seconds), ``row_slot`` (an eviction needs no probing), and
  the free list (a stack: freed rows are handed out again first).
* LRU eviction, exact without sorting the table: a threshold from 8192 sampled last-seen times selects a
  few more than k rows in one pass, and the k oldest of those are the k oldest of all.
* Admission counts: two generations of a candidate table ``key -> count`` of ``candidates`` keys each
  (default capacity // 2). When the current generation holds ``candidates`` keys it becomes the previous
  one and a cleared table takes its place; a key first seen in the new generation carries its count over.
  So a key is admitted once seen ``admit_after`` times within the last 1-2 generations of distinct
  not-yet-admitted keys, and memory is bounded whatever the churn. An admitted key's count drops to 0.
* Time to admission: each candidate slot also holds the EVENT time (``now`` of ``lookup``, the samples' clock
  that ages the rows) at which its key started counting (first sight, carried over from the previous generation
  with the count, restarted when an admitted-then-evicted key counts again). An admission reports ``now`` minus
  it (``LookupResult.admitted_delay_s``): 8 B per candidate slot, i.e. 50-100 B per candidate of ``candidates``
  (two generations, each of 3.1-6.3 slots per candidate: candidates + a chunk at load <= 0.4, a power of two;
  32 MiB at capacity 1 M) and 8 B per live candidate in the state. A state written
  before it existed has no first-seen times: its candidates' delay is unknown (NaN), never a made-up one.

Memory (``nbytes()``, allocated once): 16 B per main slot, 2 x 24 B per candidate slot, 32 B per own row,
4 B of scratch per slot: 207 MiB for capacity 1 M (4 M main slots, 2 x 2 M candidate slots). Not
thread-safe: one learner thread owns a map.

Lookups only (``lookups_only=True``, serving): a map that only answers ``lookup(train=False)`` needs the main table
and the own rows, not the candidates (their state is still checked, then dropped) nor the scratch: 95 MiB instead of
207 at capacity 1 M. Serving builds one per dynamic field for every delta that carries the maps, beside the live one
(measured in bench/README.md, "Delta memory").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

EMPTY = -1
TOMBSTONE = -2
_LRU_SAMPLE = 8192  # last-seen times sampled to find the LRU threshold
MAX_LOAD = 0.4  # live keys per slot at most (tables are powers of two, so often less): short probes
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier
_STATE_VERSION = 1


def to_global(field_first_row: int, local_rows: np.ndarray) -> torch.Tensor:
    """Local rows of a field -> rows of the fused table (an int64 tensor of the same shape)."""
    return torch.from_numpy(local_rows) + field_first_row


class _Table:
    """Open-addressing hash table (linear probing) of int64 keys >= 0 -> int64 values; batch operations.

    Key and value of a slot sit side by side (``kv`` (S, 2)), so a probe is one gather, one cache line.
    """

    WINDOW = 8  # slots gathered at once per key for the few keys not resolved at their home slot

    def __init__(self, min_slots: int) -> None:
        self.bits = max(4, int(np.ceil(np.log2(max(min_slots, 2)))))
        self.size = 1 << self.bits
        self.mask = self.size - 1
        self.kv = np.zeros((self.size, 2), dtype=np.int64)  # (S, 2): key, value
        self.kv[:, 0] = EMPTY
        self.flat = self.kv.reshape(-1)  # a view: key of slot s at 2s, its value at 2s + 1
        self.live = 0
        self.dead = 0  # tombstones
        self._shift = np.uint64(64 - self.bits)
        self._window = np.arange(self.WINDOW, dtype=np.int64)

    def clear(self) -> None:
        self.kv[:, 0] = EMPTY
        self.kv[:, 1] = 0
        self.live = self.dead = 0

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        return self.flat.take(2 * slots)

    def vals_at(self, slots: np.ndarray) -> np.ndarray:
        return self.flat.take(2 * slots + 1)

    def set_keys(self, slots: np.ndarray, keys: np.ndarray | int) -> None:
        self.flat[2 * slots] = keys

    def set_vals(self, slots: np.ndarray, vals: np.ndarray | int) -> None:
        self.flat[2 * slots + 1] = vals

    def add_one(self, slots: np.ndarray) -> None:
        """Values of ``slots`` += 1, duplicates counted (an int64 scalar keeps numpy's fast path: 40x)."""
        np.add.at(self.flat, 2 * slots + 1, np.int64(1))

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.kv[:, 0] >= 0)

    def home(self, keys: np.ndarray) -> np.ndarray:
        """Home slot of each key (Fibonacci hashing: top bits of key * golden ratio), int64 (N,)."""
        h = keys.view(np.uint64) * _GOLDEN
        h >>= self._shift
        return h.view(np.int64)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, value) of each key (N,), both -1 where absent."""
        pos = self.home(keys)
        w = self.kv.take(pos, axis=0)  # (N, 2)
        seen = w[:, 0]
        hit = seen == keys
        slot = np.where(hit, pos, -1)
        val = w[:, 1].copy()
        hit = ~hit
        val[hit] = -1
        hit &= seen != EMPTY
        rest = np.flatnonzero(hit)  # neither found nor absent: probe on, WINDOW slots at a time
        start = pos[rest] + 1
        while rest.size:
            win = (start[:, None] + self._window) & self.mask  # (M, W)
            w = self.kv.take(win, axis=0)  # (M, W, 2)
            k = keys[rest]
            stop = (w[:, :, 0] == k[:, None]) | (w[:, :, 0] == EMPTY)
            j = stop.argmax(axis=1)  # first match or empty slot in the window
            m = np.arange(rest.size)
            done = stop[m, j]
            found = done & (w[m, j, 0] == k)
            slot[rest[found]] = win[m[found], j[found]]
            val[rest[found]] = w[m[found], j[found], 1]
            rest, start = rest[~done], start[~done] + self.WINDOW
        return slot, val

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct absent keys; returns their slots (N,). The caller sets the values."""
        out, _ = self._claim(keys, tombstones=True)
        self.live += keys.size
        return out

    def find_or_insert(self, keys: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots of keys (duplicates allowed; no tombstones in this table), inserting absent ones.

        Returns ``(slots (N,), new_slots (U,))``: the distinct slots claimed by keys new to the table.
        """
        slots, _ = self.find(keys)
        absent = np.flatnonzero(slots < 0)
        if not absent.size:
            return slots, absent
        slots[absent], new = self._claim(keys[absent], tombstones=False)
        new = new[_first_of_each(scratch, new)]
        self.live += new.size
        return slots, new

    def _claim(self, keys: np.ndarray, tombstones: bool) -> tuple[np.ndarray, np.ndarray]:
        """Probe from the home slots, claiming free slots (EMPTY, or TOMBSTONE too); racing keys of the
        batch each keep one write per slot and the losers probe on. Duplicates of a key end in one slot.

        Returns (slot of each key (N,), claimed slots (with repeats where keys repeat)).
        """
        out = np.empty(keys.size, dtype=np.int64)
        claimed = []
        idx = np.arange(keys.size)
        pos, k = self.home(keys), keys
        width = 1  # the home slot first, then WINDOW slots at a time
        while idx.size:
            if width == 1:
                p = pos
                s = self.flat.take(2 * p)
                stopped = s == k
                stopped |= (s < 0) if tombstones else (s == EMPTY)
            else:
                win = (pos[:, None] + self._window) & self.mask  # (M, W)
                seen = self.flat.take(2 * win)  # (M, W) keys
                stop = seen == k[:, None]
                stop |= (seen < 0) if tombstones else (seen == EMPTY)
                j = stop.argmax(axis=1)  # first match or free slot in the window
                m = np.arange(idx.size)
                stopped = stop[m, j]
                p, s = win[m, j], seen[m, j]  # (M,)
            done = stopped & (s == k)  # a duplicate of the key claimed it in an earlier round
            free = np.flatnonzero(stopped & ~done)
            if free.size:
                fp = p[free]
                self.flat[2 * fp] = k[free]  # racing keys: one write per slot survives
                got = self.flat.take(2 * fp) == k[free]
                claimed.append(fp[got])
                done[free[got]] = True
                if tombstones:
                    self.dead -= int(np.count_nonzero(s[free[got]] == TOMBSTONE))
            out[idx[done]] = p[done]
            nxt = np.where(stopped, p + 1, pos + width) & self.mask  # lost a race: on past it
            keep = ~done
            idx, pos, k = idx[keep], nxt[keep], k[keep]
            width = self.WINDOW
        return out, (np.concatenate(claimed) if claimed else np.empty(0, dtype=np.int64))


def without_admitted(state: Mapping[str, Any]) -> dict[str, Any]:
    """An :meth:`IdMap.state_dict` with no id admitted (every key on its bucket, every own row free), the rest as it
    was: the maps a delta sent in parts carries first, so no id reads an own row until the last part's maps
    (``learner/deltas.py``, "Parts")."""
    capacity = len(state["row_key"])
    return {**state, "row_key": torch.full((capacity,), EMPTY, dtype=torch.int64),
            "row_seen": torch.zeros_like(state["row_seen"]), "free": torch.arange(capacity - 1, -1, -1)}


def first_seen_of(state: Mapping[str, Any], gen: str) -> np.ndarray:
    """(K,) float64: the first-seen event times of a state's ``gen`` ("cur" or "prev") candidates, NaN (unknown) in a
    state written before they were kept."""
    first = state.get(f"{gen}_first_seen")
    return np.full(len(state[f"{gen}_keys"]), np.nan) if first is None else np.asarray(first, dtype=np.float64)


class _Candidates(_Table):
    """A candidate generation: ``key -> count`` and, per slot, the event time its key started counting
    (``first_seen``, NaN: unknown, a state written before it existed). Slots are never freed (the table is
    cleared whole), so a slot's time is set whenever its key (re)starts counting and needs no clearing."""

    def __init__(self, min_slots: int) -> None:
        super().__init__(min_slots)
        self.first_seen = np.full(self.size, np.nan)  # (S,) float64 event seconds


def _first_of_each(scratch: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Mask with exactly one True per distinct value (values index ``scratch``); O(N), no sort."""
    order = np.arange(values.size, dtype=np.int32)
    scratch[values] = order  # one of the duplicates' writes survives, whichever
    return scratch.take(values) == order


def _no_rows() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


class BucketDecay:
    """When each bucket row of one field was last touched, and by how much a touch at ``now`` shrinks it:
    ``0.5 ** (idle time / half_life_s)`` (``IdMap``'s ``bucket_half_life_s``; None: never, and no state).
    Its own class because the distributed mode keeps one clock per field on every rank while the field's id
    map is split over the ranks (``learner/sharded_ids.py``)."""

    def __init__(self, num_buckets: int, half_life_s: float | None) -> None:
        self.half_life_s = half_life_s
        self.seen = np.full(num_buckets, -np.inf)  # (num_buckets,) last touch per bucket row; -inf: never
        self._mark = np.zeros(num_buckets if half_life_s is not None else 0, dtype=bool)

    @property
    def active(self) -> bool:
        return self.half_life_s is not None

    def touch(self, buckets: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Touch ``buckets`` (local bucket rows, repeats allowed) at ``now``: returns the distinct ones that shrink
        (D,) and their factors (D,) float32."""
        if self.half_life_s is None:
            return _no_rows(), np.empty(0, dtype=np.float32)
        self._mark[buckets] = True  # dedupe in O(n + touched) with a reused mask, not a sort
        touched = np.flatnonzero(self._mark)  # (D,)
        self._mark[touched] = False
        seen = self.seen[touched]
        idle = np.maximum(now - np.where(np.isfinite(seen), seen, now), 0.0)
        factor = np.exp2(-idle / self.half_life_s)
        self.seen[touched] = np.maximum(seen, now)  # an earlier time never undoes a later touch
        shrink = factor < 1.0
        return touched[shrink], factor[shrink].astype(np.float32)

    def idle(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Every touched bucket's decay brought up to ``now`` (exact: the decay is memoryless)."""
        return self.touch(np.flatnonzero(np.isfinite(self.seen)), now)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.seen, self._mark


@dataclass
class LookupResult:
    """What one ``IdMap.lookup`` did (or, from ``decay_idle_buckets``, only the decay part). All rows are
    LOCAL rows of the field (buckets first)."""

    rows: np.ndarray = field(default_factory=_no_rows)  # int64, shape of keys
    admitted_rows: np.ndarray = field(default_factory=_no_rows)  # (A,) own rows handed out in this call
    admitted_from_bucket: np.ndarray = field(default_factory=_no_rows)  # (A,) each admitted key's bucket row
    # (A,) float64 event seconds from each admitted key's first sight as a candidate to this call; NaN: unknown
    admitted_delay_s: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float64))
    evicted_rows: np.ndarray = field(default_factory=_no_rows)  # (E,) own rows freed in this call (reset
    #               their optimizer state first; a row may be evicted and handed out again in the same call)
    bucket_lookups: int = 0
    own_lookups: int = 0
    # bucket_half_life_s: bucket rows touched in this call (D,) and the factor to scale each by (D,)
    decayed_buckets: np.ndarray = field(default_factory=_no_rows)
    decay: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))


@dataclass
class _Counters:
    lookups: int = 0
    bucket_lookups: int = 0
    admissions: int = 0
    evictions_ttl: int = 0
    evictions_lru: int = 0
    rotations: int = 0
    rebuilds: int = 0


class IdMap:
    """Hashed ids of one field -> local rows (bucket fallback + admitted own rows), vectorized."""

    def __init__(self, capacity: int, num_buckets: int, admit_after: int = 1, ttl_s: float | None = None,
                 init: str = "bucket", candidates: int | None = None,
                 bucket_half_life_s: float | None = None, lookups_only: bool = False) -> None:
        if capacity < 1 or num_buckets < 1:
            raise ValueError(f"IdMap needs capacity >= 1 and num_buckets >= 1, got {capacity}, {num_buckets}")
        if init not in ("bucket", "zero"):
            raise ValueError(f"IdMap init must be 'bucket' or 'zero', got {init!r}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"IdMap ttl_s must be > 0 or None, got {ttl_s}")
        if bucket_half_life_s is not None and bucket_half_life_s <= 0:
            raise ValueError(f"IdMap bucket_half_life_s must be > 0 or None, got {bucket_half_life_s}")
        self.capacity, self.num_buckets = int(capacity), int(num_buckets)
        self.admit_after = max(1, int(admit_after))
        self.ttl_s, self.init = ttl_s, init
        # A bucket row untouched for a while still holds what its last occupants taught it, which says
        # nothing about the next id to land there: with a half-life, it shrinks towards zero by
        # 0.5 ** (idle time / half-life) when next touched (event time).
        self.bucket_half_life_s = bucket_half_life_s
        self.buckets = BucketDecay(self.num_buckets, bucket_half_life_s)
        self.candidates = int(candidates) if candidates is not None else max(1, self.capacity // 2)
        if self.candidates < 1:
            raise ValueError(f"IdMap candidates must be >= 1, got {self.candidates}")
        self.sweep_interval_s = ttl_s / 8 if ttl_s is not None else float("inf")
        self.evict_chunk = max(1, self.capacity // 32)
        self._main = _Table(int(self.capacity / MAX_LOAD))
        self._row_key = np.full(self.capacity, EMPTY, dtype=np.int64)
        self._seen_ext = np.zeros(self.capacity + 1, dtype=np.float64)  # + a sink at [-1] for row -1
        self._row_seen = self._seen_ext[:self.capacity]  # last time each own row was looked up
        self._row_slot = np.zeros(self.capacity, dtype=np.int64)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack; pops row 0 first
        self._free_top = self.capacity
        self._chunk = max(1, self.candidates // 4)  # keys per counting step: bounds the candidate load
        self.lookups_only = lookups_only  # no candidates kept: lookup(train=False) only (module docstring)
        slots = 1 if lookups_only else int((self.candidates + self._chunk) / MAX_LOAD)
        self._cur, self._prev = _Candidates(slots), _Candidates(slots)
        self._scratch = np.empty(0 if lookups_only else max(self._main.size, self._cur.size), dtype=np.int32)
        self._last_sweep = -float("inf")
        self.counters = _Counters()
        self._rng = np.random.default_rng(0)  # LRU threshold samples only: rows evicted do not depend on it

    # ---- lookups -------------------------------------------------------------------------------------
    def lookup(self, keys: np.ndarray, now: float, train: bool = True) -> LookupResult:
        """Rows for ``keys`` (int64 >= 0, any shape). ``train=False`` (serving) only reads the map."""
        keys = np.asarray(keys)
        shape = keys.shape
        flat = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)  # (N,)
        if flat.size and flat.min() < 0:
            raise ValueError("IdMap keys must be hashed ids >= 0 (stream.ids.stable_hash / stream.features.hash_ids); "
                             f"got {int(flat.min())}")
        if train and self.lookups_only:
            raise ValueError("IdMap built with lookups_only=True keeps no candidates and cannot train: look up with "
                             "train=False, or build the map without lookups_only")
        evicted: list[np.ndarray] = []
        if train and now - self._last_sweep >= self.sweep_interval_s:
            evicted.append(self._evict_expired(now))
            self._last_sweep = now
        _, row = self._main.find(flat)  # (N,) own row, -1 where not admitted
        admitted = np.empty(0, dtype=np.int64)
        admitted_keys = np.empty(0, dtype=np.int64)
        delays = np.empty(0, dtype=np.float64)
        if train:
            # keys without a row write the sink; event time that steps back never makes a row look older
            self._seen_ext[row] = np.maximum(self._seen_ext.take(row), now)
            miss = np.flatnonzero(row < 0)
            parts = []
            for start in range(0, miss.size, self._chunk):  # chunks bound the candidate table's load
                m = miss[start:start + self._chunk]
                if start:  # keys admitted by an earlier chunk of this call
                    _, r = self._main.find(flat[m])
                    got = r >= 0
                    row[m[got]] = r[got]
                    m = m[~got]
                inst_rows, a, ak, d = self._count_and_admit(flat[m], now, evicted)
                row[m] = inst_rows
                parts.append((a, ak, d))
            if parts:
                admitted, admitted_keys, delays = (np.concatenate(p) for p in zip(*parts, strict=True))
        own = row >= 0
        out = row + self.num_buckets
        bucket = np.flatnonzero(~own)
        out[bucket] = flat[bucket] % self.num_buckets
        n_bucket = int(bucket.size)
        if train:
            self.counters.lookups += flat.size
            self.counters.bucket_lookups += n_bucket
        ev = np.concatenate(evicted) if evicted else np.empty(0, dtype=np.int64)
        res = LookupResult(rows=out.reshape(shape), admitted_rows=admitted + self.num_buckets,
                           admitted_from_bucket=admitted_keys % self.num_buckets, admitted_delay_s=delays,
                           evicted_rows=ev + self.num_buckets, bucket_lookups=n_bucket,
                           own_lookups=flat.size - n_bucket)
        if train and self.buckets.active:
            res.decayed_buckets, res.decay = self.buckets.touch(
                np.concatenate([out[bucket], res.admitted_from_bucket]), now)
        return res

    def decay_idle_buckets(self, now: float) -> LookupResult:
        """Bring every bucket's decay up to ``now`` (before a checkpoint, so the serving artifact built from
        it holds what the learner would serve). Exact: the decay is memoryless. Apply with ``decay_buckets``."""
        res = LookupResult()
        res.decayed_buckets, res.decay = self.buckets.idle(now)
        return res

    def _count_and_admit(self, keys: np.ndarray, now: float, evicted: list[np.ndarray],
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Count not-yet-admitted keys (N,); admit those reaching the threshold.

        Returns (own row per key or -1 (N,), admitted rows (A,), admitted keys (A,), their time to admission (A,)).
        """
        if self._cur.live >= self.candidates:  # generation full: live stays < candidates + chunk
            self._rotate()
        table = self._cur
        slots, new = table.find_or_insert(keys, self._scratch)
        if new.size and self._prev.live:  # first sight in this generation: carry the previous count and first time
            prev_slot, prev_count = self._prev.find(table.keys_at(new))
            hit = prev_count > 0
            table.set_vals(new[hit], prev_count[hit])
            table.first_seen[new[hit]] = self._prev.first_seen[prev_slot[hit]]
        starting = slots[table.vals_at(slots) == 0]  # new here, or admitted, evicted and counting again
        table.first_seen[starting] = now
        table.add_one(slots)
        inst_rows = np.full(keys.size, -1, dtype=np.int64)
        ready = np.flatnonzero(table.vals_at(slots) >= self.admit_after)
        if not ready.size:
            return inst_rows, _no_rows(), _no_rows(), np.empty(0, dtype=np.float64)
        ready_slots = slots[ready]
        uniq = ready_slots[_first_of_each(self._scratch, ready_slots)]  # (U,) one slot per key
        rows = self._allocate(uniq.size, now, evicted)  # may be fewer when every row was seen now
        uniq = uniq[:rows.size]
        ukeys = table.keys_at(uniq)
        if self._main.live + self._main.dead + ukeys.size > self._main.size // 2:
            self._rebuild_main()
        mslots = self._main.insert(ukeys)
        self._main.set_vals(mslots, rows)
        self._row_key[rows], self._row_slot[rows], self._row_seen[rows] = ukeys, mslots, now
        delays = np.maximum(now - table.first_seen[uniq], 0.0)  # NaN (unknown) stays NaN
        table.set_vals(uniq, 0)  # an evicted key starts counting again
        self.counters.admissions += rows.size
        scratch = self._scratch
        scratch[ready_slots] = -1
        scratch[uniq] = rows
        inst_rows[ready] = scratch.take(ready_slots)
        return inst_rows, rows, ukeys, delays

    def _rotate(self) -> None:
        self._cur, self._prev = self._prev, self._cur
        self._cur.clear()
        self.counters.rotations += 1

    # ---- rows and eviction ---------------------------------------------------------------------------
    def _allocate(self, n: int, now: float, evicted: list[np.ndarray]) -> np.ndarray:
        """Pop up to n free rows, evicting least recently seen rows (not seen at ``now``) if short."""
        if self._free_top < n:
            self._evict_lru(max(n - self._free_top, self.evict_chunk), now, evicted)
        take = min(n, self._free_top)
        rows = self._free[self._free_top - take:self._free_top][::-1].copy()
        self._free_top -= take
        return rows

    def _evict_lru(self, k: int, now: float, evicted: list[np.ndarray]) -> None:
        """Free the k least recently seen rows (rows seen at ``now``, i.e. in this call, stay).

        Exact, without sorting the table: a threshold from a sample of last-seen times selects a little
        more than k candidates in one pass; the k oldest of those are the k oldest of all (else: full sort).
        Among rows last seen at the same time the lowest rows go first: the same rows whatever the sample.
        """
        eligible = self._row_key >= 0
        eligible &= self._row_seen < now
        n = int(np.count_nonzero(eligible))
        k = min(k, n)
        if k <= 0:
            return
        pool = None
        if k < n // 4 and self.capacity > 4 * _LRU_SAMPLE:
            probe = self._rng.integers(0, self.capacity, _LRU_SAMPLE)
            s = self._row_seen[probe][eligible[probe]]
            q = int(np.ceil(1.25 * k / n * s.size)) + 8  # aim a little over k
            if s.size and q < s.size:
                threshold = np.partition(s, q)[q]
                pool = np.flatnonzero(eligible & (self._row_seen <= threshold))
                if pool.size < k:
                    pool = None  # the sample was unlucky: sort everything
        if pool is None:
            pool = np.flatnonzero(eligible)
        if k < pool.size:  # the pool holds every row up to the k-th oldest's time: ties go to the lowest rows, so
            seen = self._row_seen[pool]  # the victims do not depend on the sample (nor on a restored generator)
            kth = np.partition(seen, k - 1)[k - 1]
            older = pool[seen < kth]
            victims = np.concatenate([older, pool[seen == kth][:k - older.size]])
        else:
            victims = pool
        self._release(victims)
        self.counters.evictions_lru += k
        evicted.append(victims)

    def _evict_expired(self, now: float) -> np.ndarray:
        if self.ttl_s is None:
            return np.empty(0, dtype=np.int64)
        victims = np.flatnonzero((self._row_key >= 0) & (self._row_seen < now - self.ttl_s))
        self._release(victims)
        self.counters.evictions_ttl += victims.size
        return victims

    def evict_expired(self, now: float) -> np.ndarray:
        """Free own rows unseen for ``ttl_s``; returns them (local rows). ``lookup`` also sweeps by itself."""
        self._last_sweep = now
        return self._evict_expired(now) + self.num_buckets

    def _release(self, rows: np.ndarray) -> None:
        self._main.set_keys(self._row_slot[rows], TOMBSTONE)
        self._main.live -= rows.size
        self._main.dead += rows.size
        self._row_key[rows] = EMPTY
        self._free[self._free_top:self._free_top + rows.size] = rows
        self._free_top += rows.size

    def _rebuild_main(self) -> None:
        """Purge tombstones: re-insert the live keys into a cleared table."""
        live = np.flatnonzero(self._row_key >= 0)
        self._main.clear()
        slots = self._main.insert(self._row_key[live])
        self._main.set_vals(slots, live)
        self._row_slot[live] = slots
        self.counters.rebuilds += 1

    # ---- embedding rows --------------------------------------------------------------------------------
    @torch.no_grad()
    def decay_buckets(self, weight: torch.Tensor, result: LookupResult, first_row: int = 0) -> None:
        """Scale the bucket rows ``result`` says went idle (bucket_half_life_s) towards zero. Call before
        ``init_admitted``, so an admitted row starts from the vector its bucket serves now."""
        if result.decayed_buckets.size:
            rows = to_global(first_row, result.decayed_buckets).to(weight.device)
            weight[rows] *= torch.from_numpy(result.decay).to(weight.device, weight.dtype).unsqueeze(1)

    @torch.no_grad()
    def init_admitted(self, weight: torch.Tensor, result: LookupResult, first_row: int = 0) -> None:
        """Initialise the rows admitted in ``result`` in ``weight`` (the fused table; the field starts at
        ``first_row``): the bucket's vector (init="bucket") or zeros. Reset their optimizer state apart."""
        if not result.admitted_rows.size:
            return
        dst = to_global(first_row, result.admitted_rows).to(weight.device)
        if self.init == "bucket":
            weight[dst] = weight[to_global(first_row, result.admitted_from_bucket).to(weight.device)]
        else:
            weight[dst] = 0

    # ---- metrics and persistence -------------------------------------------------------------------------
    @property
    def max_candidates(self) -> int:
        """The most not-yet-admitted keys a generation holds (it rotates once it has ``candidates``, and a counting
        step adds up to a chunk)."""
        return self.candidates + self._chunk

    @property
    def size(self) -> int:
        """Local rows of the field: buckets + own rows."""
        return self.num_buckets + self.capacity

    def owned_rows(self) -> np.ndarray:
        """(K,) int64 local rows (``lookup``'s numbering) of the admitted ids: the rows a restart sends again."""
        return np.flatnonzero(self._row_key >= 0) + self.num_buckets

    def stats(self) -> dict[str, float]:
        c = self.counters
        live = self.capacity - self._free_top
        return {"occupancy": live / self.capacity, "live_rows": float(live),
                "candidates": float(self._cur.live + self._prev.live), "lookups": float(c.lookups),
                "bucket_share": c.bucket_lookups / c.lookups if c.lookups else 0.0,
                "admissions": float(c.admissions), "evictions": float(c.evictions_ttl + c.evictions_lru),
                "evictions_ttl": float(c.evictions_ttl), "evictions_lru": float(c.evictions_lru)}

    def config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "num_buckets": self.num_buckets, "admit_after": self.admit_after,
                "ttl_s": self.ttl_s, "init": self.init, "candidates": self.candidates,
                "bucket_half_life_s": self.bucket_half_life_s}

    def nbytes(self) -> int:
        """Bytes held by the map's arrays (constant after construction)."""
        arrays = (self._main.kv, self._row_key, self._seen_ext, self._row_slot, self._free, self._cur.kv,
                  self._cur.first_seen, self._prev.kv, self._prev.first_seen, self._scratch, *self.buckets.arrays())
        return sum(a.nbytes for a in arrays)

    def state_dict(self) -> dict[str, Any]:
        """Config, own rows, free list and live candidates (key, count, first-seen event time) as CPU tensors
        (torch.save, weights_only ok). The first-seen times are optional keys of the same version (a reader
        without them ignores them; :meth:`load_state_dict` reads a state without them as unknown times)."""
        if self.lookups_only:
            raise ValueError("IdMap built with lookups_only=True dropped its candidates: its state would lose them; "
                             "save the map it was loaded from instead")
        def live(t: _Candidates) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            s = t.live_slots()
            return torch.from_numpy(t.keys_at(s)), torch.from_numpy(t.vals_at(s)), torch.from_numpy(t.first_seen[s])

        cur_keys, cur_counts, cur_first = live(self._cur)
        prev_keys, prev_counts, prev_first = live(self._prev)
        return {"version": _STATE_VERSION, "config": self.config(),
                "row_key": torch.from_numpy(self._row_key.copy()),
                "row_seen": torch.from_numpy(self._row_seen.copy()),
                "free": torch.from_numpy(self._free[:self._free_top].copy()),
                "cur_keys": cur_keys, "cur_counts": cur_counts, "prev_keys": prev_keys, "prev_counts": prev_counts,
                "cur_first_seen": cur_first, "prev_first_seen": prev_first,
                "bucket_seen": torch.from_numpy(self.buckets.seen.copy()),
                "last_sweep": self._last_sweep, "counters": dict(vars(self.counters))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"IdMap state version {state.get('version')!r}, this code reads {_STATE_VERSION}")
        # states written before bucket_half_life_s existed had none
        if {"bucket_half_life_s": None, **dict(state["config"])} != self.config():
            raise ValueError(f"IdMap state was written with config {dict(state['config'])}, this map has "
                             f"{self.config()}: build the map from the checkpoint's config")
        # Exactly one entry per own row (per bucket): numpy's assignment would spread a state of length 1 over every
        # row (a malformed delta's id map then remapped every admitted id in silence; the audit of serving's swap).
        for name, have in (("row_key", self._row_key), ("row_seen", self._row_seen),
                           ("bucket_seen", self.buckets.seen)):
            if name in state and tuple(state[name].shape) != have.shape:
                raise ValueError(f"IdMap state {name!r} has shape {tuple(state[name].shape)}, this map's is "
                                 f"{have.shape}: the state is malformed")
        live = state["row_key"].numpy()[state["row_key"].numpy() >= 0]  # one row per key: a key on two rows leaked
        if np.unique(live).size != live.size:  # one (the table finds one of them) and miscounted the live keys
            raise ValueError("IdMap state 'row_key' gives a key more than one row: the state is malformed")
        free = state["free"].numpy()  # the rows handed out next: exactly the rows no key owns (a live one went to
        if not np.array_equal(np.sort(free), np.flatnonzero(state["row_key"].numpy() < 0)):  # two keys at once)
            raise ValueError(f"IdMap state 'free' lists {free.size} rows that are not exactly the "
                             f"{int((state['row_key'] < 0).sum())} rows without a key: the state is malformed")
        self._row_key[:] = state["row_key"].numpy()
        self._row_seen[:] = state["row_seen"].numpy()
        self.buckets.seen[:] = state["bucket_seen"].numpy() if "bucket_seen" in state else -np.inf
        self._load_rest(free, state, float(state["last_sweep"]), state["counters"])

    def _load_rest(self, free: np.ndarray, candidates: Mapping[str, Any], last_sweep: float,
                   counters: Mapping[str, int]) -> None:
        """What both loads share once the own rows are set: the free stack (top last), the main table rebuilt from
        the rows, the candidates' two generations (their first-seen times NaN, unknown, where the state has none:
        written before they existed), the sweep clock and the counters."""
        self._free_top = free.size
        self._free[:free.size] = free
        self._rebuild_main()
        for table, gen in ((self._cur, "cur"), (self._prev, "prev")):
            table.clear()
            keys = np.asarray(candidates[f"{gen}_keys"], dtype=np.int64)
            counts = np.asarray(candidates[f"{gen}_counts"], dtype=np.int64)
            # More keys than a generation holds filled its table, and the insert probed for a free slot for ever
            if (keys.ndim != 1 or keys.size > self.max_candidates or counts.shape != keys.shape
                    or (keys.size and (keys.min() < 0 or np.unique(keys).size != keys.size))):
                raise ValueError(f"IdMap state {gen}_keys {keys.shape} / {gen}_counts {counts.shape}: a generation "
                                 f"holds at most {self.max_candidates} distinct keys >= 0, one count each: the state "
                                 "is malformed")
            if keys.size:
                first = first_seen_of(candidates, gen)
                if first.shape != keys.shape:
                    raise ValueError(f"IdMap state {gen}_first_seen has shape {first.shape}, its {gen}_keys "
                                     f"{keys.shape}: the state is malformed")
                if self.lookups_only:  # checked like any state (a malformed one is refused alike), not kept
                    continue
                slots = table.insert(keys)
                table.set_vals(slots, counts)
                table.first_seen[slots] = first
        self._last_sweep = last_sweep
        self.counters = _Counters(**counters)

    def load_entries(self, keys: np.ndarray, rows: np.ndarray, seen: np.ndarray, candidates: Mapping[str, Any],
                     last_sweep: float, counters: Mapping[str, int] | None = None,
                     free: np.ndarray | None = None) -> None:
        """Fill an empty map from its parts: admitted ``keys`` (K,) on own ``rows`` (K,) (local, 0-based, distinct,
        < capacity) last seen at ``seen`` (K,); the candidates' ``cur_keys``/``cur_counts``/``prev_keys``/
        ``prev_counts`` (at most ``candidates`` keys each, none of them admitted) and optionally ``cur_first_seen``/
        ``prev_first_seen`` (absent: unknown). The distributed mode builds its
        shards' maps from a checkpoint of another world size with it, and one whole map from the shards'
        (``learner/sharded_ids.py``). The buckets' decay clock is not a part: set ``buckets.seen``. ``free``: the
        free stack the map had (``state_dict()["free"]``; top last) when it holds exactly the rows left free, so the
        rows go out in the order they would have; else the lowest free row first."""
        rows = np.asarray(rows, dtype=np.int64)
        keys, seen = np.asarray(keys, dtype=np.int64), np.asarray(seen, dtype=np.float64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.capacity or np.unique(rows).size != rows.size):
            raise ValueError(f"IdMap.load_entries: rows must be distinct and in [0, {self.capacity})")
        if keys.shape != rows.shape or seen.shape != rows.shape:
            raise ValueError(f"IdMap.load_entries: {keys.shape} keys and {seen.shape} times for {rows.shape} rows: "
                             "one key and one time per row")
        # as load_state_dict: a key on two rows leaked one (the table finds one of them) and miscounted the live keys
        if keys.size and (keys.min() < 0 or np.unique(keys).size != keys.size):
            why = "a key on more than one row" if keys.min() >= 0 else f"key {int(keys.min())}"
            raise ValueError(f"IdMap.load_entries: the admitted keys must be distinct hashed ids >= 0, got {why}: the "
                             "state is malformed")
        self._row_key[:] = EMPTY
        self._row_seen[:] = 0.0
        self._row_key[rows] = keys
        self._row_seen[rows] = seen
        lowest = np.flatnonzero(self._row_key < 0)[::-1]  # a stack: the lowest free row is handed out first
        if free is not None and not np.array_equal(np.sort(free := np.asarray(free, np.int64)), lowest[::-1]):
            free = None  # not the rows this map has free
        self._load_rest(lowest if free is None else free, candidates, float(last_sweep), counters or {})


@dataclass
class FieldIdMaps:
    """The id maps of several fields, by field name."""

    maps: dict[str, IdMap] = field(default_factory=dict)

    def lookup(self, keys: Mapping[str, np.ndarray], now: float, train: bool = True) -> dict[str, LookupResult]:
        return {name: self.maps[name].lookup(k, now, train) for name, k in keys.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: m.stats() for name, m in self.maps.items()}

    def state_dict(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in self.maps.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = set(self.maps) ^ set(state)
        if missing:
            raise ValueError(f"id map state has fields {sorted(state)}, expected {sorted(self.maps)}")
        for name, m in self.maps.items():
            m.load_state_dict(state[name])
