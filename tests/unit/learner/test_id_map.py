"""learner.id_map: the vectorized id -> row map against a plain Python model (pure logic, no Kafka)."""

from __future__ import annotations

import io
from hashlib import blake2b

import numpy as np
import pytest
import torch

from learner.id_map import FieldIdMaps, IdMap, to_global
from stream.features import hash_column, hash_ids


def zipf_stream(seed: int, n: int, universe: int, a: float = 1.2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = (rng.zipf(a, n) - 1) % universe
    return rng.integers(0, 2**63 - 1, universe, dtype=np.int64)[ranks]  # rank -> random 63-bit key


class RefMap:
    """The IdMap semantics, one key at a time, in dicts: admission counts in two generations of at most
    ``candidates`` keys, own rows from a free stack, exact LRU and TTL eviction."""

    def __init__(self, m: IdMap) -> None:
        self.c, self.b, self.admit = m.capacity, m.num_buckets, m.admit_after
        self.ttl, self.cand, self.sweep = m.ttl_s, m.candidates, m.sweep_interval_s
        self.rows: dict[int, int] = {}
        self.seen: dict[int, float] = {}  # row -> last seen
        self.key_of: dict[int, int] = {}  # row -> key
        self.free = list(range(self.c - 1, -1, -1))
        self.cur: dict[int, int] = {}
        self.prev: dict[int, int] = {}
        self.last_sweep = -float("inf")

    def _release(self, rows: list[int]) -> None:
        for r in rows:
            del self.rows[self.key_of.pop(r)]
            del self.seen[r]
            self.free.append(r)

    def lookup(self, key: int, now: float) -> int:
        if self.ttl is not None and now - self.last_sweep >= self.sweep:
            self._release(sorted(r for r, t in self.seen.items() if t < now - self.ttl))
            self.last_sweep = now
        if key in self.rows:
            self.seen[self.rows[key]] = now
            return self.b + self.rows[key]
        if len(self.cur) >= self.cand:
            self.prev, self.cur = self.cur, {}
        if key not in self.cur:
            self.cur[key] = self.prev.get(key, 0)
        self.cur[key] += 1
        if self.cur[key] >= self.admit:
            if not self.free:
                old = [r for r, t in self.seen.items() if t < now]
                if old:
                    self._release([min(old, key=self.seen.__getitem__)])
            if self.free:
                r = self.free.pop()
                self.rows[key], self.key_of[r], self.seen[r] = r, key, now
                self.cur[key] = 0
                return self.b + r
        return key % self.b


@pytest.mark.parametrize(("admit_after", "ttl_s"), [(1, None), (3, None), (2, 40.0)])
def test_matches_the_reference_model_one_key_at_a_time(admit_after: int, ttl_s: float | None) -> None:
    """Exact rows, admissions, LRU and TTL evictions, free-list reuse and candidate rotation."""
    m = IdMap(capacity=16, num_buckets=7, admit_after=admit_after, ttl_s=ttl_s, candidates=12)
    ref = RefMap(m)
    keys = zipf_stream(1, 3000, 60)
    own = 0
    for t, k in enumerate(keys.tolist()):
        res = m.lookup(np.array([k]), now=float(t))
        expected = ref.lookup(k, float(t))
        assert int(res.rows[0]) == expected, f"step {t}, key {k}"
        own += expected >= 7
    st = m.stats()
    assert st["live_rows"] == len(ref.rows) and st["admissions"] > 16 and st["evictions"] > 0
    assert 0 < own and (own < len(keys)) == (admit_after > 1)  # admit_after=1: every key gets a row
    if ttl_s is not None:
        assert st["evictions_ttl"] > 0


def _check_batch(m: IdMap, keys: np.ndarray, res, owner: dict[int, int]) -> None:  # noqa: ANN001
    """Invariants of one batch: buckets for unadmitted keys, one live key per own row."""
    b = m.num_buckets
    rows = res.rows
    assert rows.shape == keys.shape and rows.dtype == np.int64
    bucket = rows < b
    np.testing.assert_array_equal(rows[bucket], keys[bucket] % b)
    assert (rows[~bucket] < b + m.capacity).all()
    row_key = m.state_dict()["row_key"].numpy()
    np.testing.assert_array_equal(row_key[rows[~bucket] - b], keys[~bucket])  # the row is this key's
    for r in res.evicted_rows.tolist():
        owner.pop(r, None)
    for k, r in zip(keys[~bucket].tolist(), rows[~bucket].tolist(), strict=True):
        assert owner.setdefault(r, k) == k, "two live keys share an own row"


def test_batched_zipf_stream_admits_exactly_like_the_reference() -> None:
    """No eviction, no rotation: every occurrence of a key in the batch where its count reaches the
    threshold gets the new row; stable rows afterwards; unadmitted keys on their bucket."""
    m = IdMap(capacity=5000, num_buckets=101, admit_after=3, candidates=50_000)
    keys = zipf_stream(2, 40 * 997, 20_000).reshape(40, 997)
    counts: dict[int, int] = {}
    row_of: dict[int, int] = {}
    owner: dict[int, int] = {}
    for t, batch in enumerate(keys):
        res = m.lookup(batch, now=float(t))
        _check_batch(m, batch, res, owner)
        before = set(row_of)
        for k in batch.tolist():
            counts[k] = counts.get(k, 0) + 1
        admitted_now = {k for k in set(batch.tolist()) if counts[k] >= 3} - before
        own = res.rows >= 101
        for k, r, o in zip(batch.tolist(), res.rows.tolist(), own.tolist(), strict=True):
            assert o == (counts[k] >= 3), f"batch {t}: key {k} seen {counts[k]} times"
            if o:
                assert row_of.setdefault(k, r) == r, "an admitted key changed rows without eviction"
        assert set(res.admitted_rows.tolist()) == {row_of[k] for k in admitted_now}
        assert sorted(res.admitted_from_bucket.tolist()) == sorted(k % 101 for k in admitted_now)
        assert res.own_lookups == int(own.sum()) and res.bucket_lookups == batch.size - int(own.sum())
        assert res.evicted_rows.size == 0
    assert 0 < m.stats()["occupancy"] < 1


def test_lru_eviction_when_full_frees_the_least_recently_seen_rows() -> None:
    m = IdMap(capacity=64, num_buckets=5, admit_after=1)
    first = np.arange(1000, 1064, dtype=np.int64)
    m.lookup(first[:32], now=1.0)
    m.lookup(first[32:], now=2.0)  # full
    m.lookup(first[40:], now=3.0)  # refresh 24 of the later ones
    res = m.lookup(np.arange(5000, 5010, dtype=np.int64), now=4.0)  # 10 new keys need rows
    assert res.admitted_rows.size == 10 and (res.rows >= 5).all()
    # evicted in a chunk of max(need, capacity // 32) = 10, all from the 32 rows last seen at t=1
    assert res.evicted_rows.size == 10
    assert set(res.evicted_rows.tolist()) == set(res.admitted_rows.tolist())  # free-list reuse
    again = m.lookup(first, now=5.0, train=False).rows
    old_bucket = again < 5
    assert old_bucket.sum() == 10 and (first[old_bucket] < 1032).all()  # evicted keys back on buckets
    np.testing.assert_array_equal(again[old_bucket], first[old_bucket] % 5)


def test_rows_seen_in_the_same_call_are_never_evicted() -> None:
    m = IdMap(capacity=8, num_buckets=3, admit_after=1)
    m.lookup(np.arange(8, dtype=np.int64), now=1.0)
    res = m.lookup(np.arange(16, dtype=np.int64), now=2.0)  # 8 live rows all seen now, 8 new keys
    np.testing.assert_array_equal(res.rows[:8] - 3, np.arange(8))  # the old keys keep their rows
    np.testing.assert_array_equal(res.rows[8:], np.arange(8, 16) % 3)  # the new ones wait on buckets
    assert res.evicted_rows.size == 0
    res = m.lookup(np.arange(8, 16, dtype=np.int64), now=3.0)  # now the old rows are evictable
    assert (res.rows >= 3).all() and res.evicted_rows.size == 8


def test_admission_threshold_and_serving_lookups_change_nothing() -> None:
    m = IdMap(capacity=10, num_buckets=4, admit_after=3)
    k = np.array([77], dtype=np.int64)
    for t in range(3):
        assert int(m.lookup(k, now=0.5, train=False).rows[0]) == 77 % 4  # serving: no counting
        res = m.lookup(k, now=float(t))
        assert (int(res.rows[0]) >= 4) == (t == 2), t
    assert res.admitted_rows.tolist() == [4] and res.admitted_from_bucket.tolist() == [77 % 4]
    state = m.state_dict()
    assert int(m.lookup(np.array([77, 78, 78, 78]), now=9.0, train=False).rows[0]) == 4
    after = m.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state if isinstance(state[k], torch.Tensor))
    assert after["counters"] == state["counters"]
    m0 = IdMap(capacity=10, num_buckets=4, admit_after=0)
    assert int(m0.lookup(k, now=0.0).rows[0]) == 4  # 0 means admit on first sight


def test_ttl_eviction_and_refresh() -> None:
    m = IdMap(capacity=100, num_buckets=10, admit_after=1, ttl_s=10.0)
    m.lookup(np.arange(20, dtype=np.int64), now=0.0)
    m.lookup(np.arange(10, dtype=np.int64), now=8.0)  # keys 0..9 seen again
    assert m.evict_expired(now=9.0).size == 0
    ev = m.evict_expired(now=10.5)
    assert sorted(ev.tolist()) == list(range(20, 30))  # rows of keys 10..19 (local rows = 10 + row)
    rows = m.lookup(np.arange(20, dtype=np.int64), now=10.6, train=False).rows
    assert (rows[:10] >= 10).all() and (rows[10:] == np.arange(10, 20) % 10).all()
    res = m.lookup(np.array([10**12], dtype=np.int64), now=30.0)  # the sweep runs inside lookup too
    assert sorted(res.evicted_rows.tolist()) == list(range(10, 20))
    assert m.stats()["evictions_ttl"] == 20 and m.stats()["live_rows"] == 1


def test_state_dict_round_trip_continues_identically() -> None:
    keys = zipf_stream(3, 30 * 500, 3000).reshape(30, 500)
    a = IdMap(capacity=400, num_buckets=31, admit_after=2, ttl_s=12.0, candidates=600)
    for t in range(15):
        a.lookup(keys[t], now=float(t))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = IdMap(capacity=400, num_buckets=31, admit_after=2, ttl_s=12.0, candidates=600)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.stats() == a.stats()
    for t in range(15, 30):
        ra, rb = a.lookup(keys[t], now=float(t)), b.lookup(keys[t], now=float(t))
        np.testing.assert_array_equal(ra.rows, rb.rows)
        np.testing.assert_array_equal(np.sort(ra.evicted_rows), np.sort(rb.evicted_rows))
    assert a.stats() == b.stats() and a.stats()["evictions"] > 0
    with pytest.raises(ValueError, match="config"):
        IdMap(capacity=401, num_buckets=31, admit_after=2, ttl_s=12.0, candidates=600).load_state_dict(
            a.state_dict())


@pytest.mark.parametrize("name", ["row_key", "row_seen", "bucket_seen"])
def test_a_state_whose_rows_are_not_one_per_row_is_refused_not_spread_over_every_row(name: str) -> None:
    """numpy's assignment spread a state array of length 1 over every row: a malformed delta's id map (a ``row_key``
    of one key) loaded and remapped every admitted id in silence. A state array of another shape is a ValueError."""
    a = IdMap(capacity=40, num_buckets=7, admit_after=1)
    a.lookup(np.arange(30, dtype=np.int64), now=1.0)
    state = a.state_dict()
    state[name] = state[name][:1]
    b = IdMap(capacity=40, num_buckets=7, admit_after=1)
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        b.load_state_dict(state)


@pytest.mark.parametrize("free", [[3, 0], [3, 3], [3], [3, 2, 9]])
def test_a_state_whose_free_rows_are_not_exactly_its_unowned_rows_is_refused(free: list[int]) -> None:
    """The free stack is what the map hands out next: a malformed state's stack naming a live row (key 10's) gave
    that row to a new key while the table still sent key 10 there, two ids on one row in silence; one naming a row
    twice, or missing a free row, or past the table, is as malformed. A ValueError, the state not loaded."""
    m = IdMap(capacity=4, num_buckets=2)
    m.lookup(np.array([10, 11]), 1.0)  # rows 0 and 1
    state = m.state_dict()
    state["free"] = torch.tensor(free)
    with pytest.raises(ValueError, match="free"):
        IdMap(capacity=4, num_buckets=2).load_state_dict(state)


@pytest.mark.parametrize("lookups_only", [False, True])
@pytest.mark.parametrize("gen", ["cur", "prev"])
def test_a_state_with_more_candidates_than_a_generation_holds_is_refused_not_loaded_for_ever(
        gen: str, lookups_only: bool) -> None:
    """A candidate generation's table has room for ``max_candidates`` keys: a state (a malformed delta's or
    checkpoint's id map) listing more filled it, and the insert probed for a free slot for ever (serving's delta
    thread, a learner's restore hung). Too many keys, repeated or negative keys, or counts not one per key are a
    ValueError naming the generation; also for a map that drops its candidates (serving's: a delta it refused
    before it still refuses)."""
    m = IdMap(capacity=4, num_buckets=2)
    n = m.max_candidates + 1
    for keys, counts in ((np.arange(n), np.ones(n)), (np.arange(100), np.ones(100)),  # (100 > its 16 slots: hung)
                         (np.array([5, 5]), np.ones(2)), (np.array([-3]), np.ones(1)),
                         (np.arange(2), np.ones(1))):
        state = m.state_dict()
        state[f"{gen}_keys"] = torch.from_numpy(keys.astype(np.int64))
        state[f"{gen}_counts"] = torch.from_numpy(counts.astype(np.int64))
        state[f"{gen}_first_seen"] = torch.zeros(len(keys), dtype=torch.float64)
        with pytest.raises(ValueError, match=f"{gen}_"):
            IdMap(capacity=4, num_buckets=2, lookups_only=lookups_only).load_state_dict(state)


def test_a_lookups_only_map_maps_every_key_like_the_full_map_in_under_half_its_memory() -> None:
    """Serving built a full map (207 MiB at capacity 1 M: candidates, scratch) for every delta carrying the maps, beside
    the live one, and only ever looked keys up. Its lookups-only map gives every key the same row and counts."""
    full = IdMap(capacity=4096, num_buckets=101, admit_after=2, ttl_s=50.0)
    stream = zipf_stream(3, 60_000, 20_000)
    for t, keys in enumerate(np.split(stream, 6)):
        full.lookup(keys, now=float(t))
    state = full.state_dict()
    lite = IdMap(capacity=4096, num_buckets=101, admit_after=2, ttl_s=50.0, lookups_only=True)
    lite.load_state_dict(state)
    probe = np.append(np.unique(stream), np.int64(2**62))  # admitted, candidates (seen once), never seen
    want, got = full.lookup(probe, 0.0, train=False), lite.lookup(probe, 0.0, train=False)
    assert np.array_equal(got.rows, want.rows)
    assert (got.bucket_lookups, got.own_lookups) == (want.bucket_lookups, want.own_lookups)
    assert 0 < want.own_lookups < probe.size
    assert lite.nbytes() < 0.5 * full.nbytes()


def test_a_lookups_only_map_refuses_to_train_or_to_save_the_candidates_it_dropped() -> None:
    """Trained, it would admit nothing it had counted; saved, its state would lose every candidate's count."""
    m = IdMap(capacity=40, num_buckets=7, lookups_only=True)
    with pytest.raises(ValueError, match="lookups_only.*train=False"):
        m.lookup(np.arange(3, dtype=np.int64), now=1.0)
    with pytest.raises(ValueError, match="lookups_only.*candidates"):
        m.state_dict()


def test_memory_is_bounded_whatever_the_churn() -> None:
    m = IdMap(capacity=1000, num_buckets=50, admit_after=2)
    nbytes = m.nbytes()
    rng = np.random.default_rng(4)
    for t in range(100):  # 400 k ids, 380 k of them distinct, plus a hot set
        new = rng.integers(0, 2**62, 3800, dtype=np.int64)
        hot = rng.integers(0, 200, 200).astype(np.int64)
        m.lookup(np.concatenate([new, hot]), now=float(t))
    assert m.nbytes() == nbytes
    st = m.stats()
    assert st["live_rows"] <= 1000 and st["candidates"] <= 2 * (m.candidates + m.candidates // 4)
    assert m.lookup(np.arange(200, dtype=np.int64), now=100.0, train=False).rows.min() >= 50  # hot ids stay
    sd = m.state_dict()
    assert sd["cur_keys"].numel() + sd["prev_keys"].numel() <= 2 * (m.candidates + m.candidates // 4)


def test_string_and_int_ids_hash_stably() -> None:
    h = hash_ids([123, "123", "user-42"])
    assert h.dtype == np.int64 and h[0] == h[1] and (h >= 0).all()
    want = int.from_bytes(blake2b(b"user-42", digest_size=8).digest(), "little") & ((1 << 63) - 1)
    assert int(h[2]) == want
    np.testing.assert_array_equal(hash_ids(["123", "user-42"]), h[1:])
    m = IdMap(capacity=4, num_buckets=3)
    assert int(m.lookup(h[:1], now=0.0, train=False).rows[0]) == want_bucket(h[0], 3)
    with pytest.raises(ValueError, match=">= 0"):
        m.lookup(np.array([-5]), now=0.0)


def want_bucket(key: np.int64, b: int) -> int:
    return int(key) % b


def test_init_admitted_copies_the_bucket_or_zeroes() -> None:
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)  # field block at rows 2..9: 3 buckets + 5 own
    for init, want in (("bucket", w[2 + 11 % 3]), ("zero", torch.zeros(4))):
        m = IdMap(capacity=5, num_buckets=3, init=init)
        ww = w.clone()
        res = m.lookup(np.array([11]), now=0.0)
        m.init_admitted(ww, res, first_row=2)
        assert torch.equal(ww[2 + int(res.rows[0])], want)
        assert torch.equal(to_global(2, res.rows), torch.tensor([2 + 3]))


def test_field_id_maps() -> None:
    maps = FieldIdMaps({"user_id": IdMap(10, 3), "item_id": IdMap(20, 5, admit_after=2)})
    out = maps.lookup({"user_id": np.array([[1, 2]]), "item_id": np.array([7, 7])}, now=0.0)
    assert out["user_id"].rows.tolist() == [[3, 4]] and out["item_id"].rows.tolist() == [5, 5]
    state = maps.state_dict()
    other = FieldIdMaps({"user_id": IdMap(10, 3), "item_id": IdMap(20, 5, admit_after=2)})
    other.load_state_dict(state)
    assert other.stats() == maps.stats()
    with pytest.raises(ValueError, match="fields"):
        FieldIdMaps({"user_id": IdMap(10, 3)}).load_state_dict(state)


def test_a_batch_larger_than_the_candidate_chunk_admits_each_key_once() -> None:
    """Misses are counted in chunks of candidates // 4; a key admitted in an early chunk keeps its row."""
    m = IdMap(capacity=50, num_buckets=3, admit_after=1, candidates=8)  # chunks of 2 keys
    keys = np.random.default_rng(5).permutation(np.repeat(np.arange(100, 110, dtype=np.int64), 3))
    res = m.lookup(keys, now=0.0)
    assert (res.rows >= 3).all() and res.admitted_rows.size == 10
    row_of = {}
    for k, r in zip(keys.tolist(), res.rows.tolist(), strict=True):
        assert row_of.setdefault(k, r) == r
    assert len(set(row_of.values())) == 10 and m.stats()["live_rows"] == 10


def test_lru_on_a_large_table_evicts_exactly_the_oldest() -> None:
    """capacity > 4 x the LRU sample: the sampled-threshold path must still pick the k oldest rows."""
    m = IdMap(capacity=40_000, num_buckets=11, admit_after=1)
    old = np.arange(40_000, dtype=np.int64)
    for t in range(40):  # 1000 keys per time step
        m.lookup(old[t * 1000:(t + 1) * 1000], now=float(t))
    res = m.lookup(np.arange(10**9, 10**9 + 1500, dtype=np.int64), now=100.0)  # chunk = max(1500, 1250)
    assert res.evicted_rows.size == 1500 and (res.rows >= 11).all()
    back = m.lookup(old, now=101.0, train=False).rows < 11
    assert back.sum() == 1500 and back[:1000].all() and back[2000:].sum() == 0


def test_idle_buckets_shrink_towards_zero_by_their_half_life() -> None:
    first = 2  # the field's block starts at row 2 of the fused table
    m = IdMap(capacity=4, num_buckets=3, admit_after=3, bucket_half_life_s=10.0)
    w = torch.ones(first + 3 + 4, 2)
    def touch(keys: list[int], now: float):
        res = m.lookup(np.array(keys), now=now)
        m.decay_buckets(w, res, first_row=first)
        m.init_admitted(w, res, first_row=first)
        return res
    touch([3], 0.0)  # bucket 0: first use, nothing to forget
    assert torch.equal(w, torch.ones_like(w))
    touch([6], 10.0)  # bucket 0 again after one half-life (another id, still below admission)
    assert torch.allclose(w[first + 0], torch.full((2,), 0.5)) and torch.equal(w[first + 1], torch.ones(2))
    touch([6, 4], 10.0)  # no time passed: no decay; bucket 1 (key 4) first use
    assert torch.allclose(w[first + 0], torch.full((2,), 0.5)) and torch.equal(w[first + 1], torch.ones(2))
    res = touch([6], 40.0)  # third sighting of key 6: admitted after bucket 0 idled 3 half-lives
    own = int(res.rows[0])
    assert own >= 3 and torch.allclose(w[first + own], torch.full((2,), 0.5 / 8))  # starts as the decayed bucket
    assert torch.allclose(w[first + 0], torch.full((2,), 0.5 / 8))
    w[first + own] = 7.0
    touch([6], 1000.0)  # own rows never decay
    assert torch.equal(w[first + own], torch.full((2,), 7.0))
    assert m.lookup(np.array([9]), now=5000.0, train=False).decayed_buckets.size == 0  # serving reads only


def test_bucket_clock_survives_a_checkpoint_and_old_states_still_load() -> None:
    a = IdMap(capacity=4, num_buckets=3, admit_after=5, bucket_half_life_s=10.0)
    a.lookup(np.array([3]), now=0.0)
    b = IdMap(capacity=4, num_buckets=3, admit_after=5, bucket_half_life_s=10.0)
    b.load_state_dict(a.state_dict())
    res = b.lookup(np.array([6]), now=20.0)  # bucket 0 last touched at 0 in a: two half-lives
    assert res.decayed_buckets.tolist() == [0] and np.allclose(res.decay, [0.25])
    old = IdMap(capacity=4, num_buckets=3, admit_after=5).state_dict()
    del old["bucket_seen"]
    old["config"].pop("bucket_half_life_s")  # written before the setting existed
    IdMap(capacity=4, num_buckets=3, admit_after=5).load_state_dict(old)
    with pytest.raises(ValueError, match="bucket_half_life_s"):
        IdMap(capacity=4, num_buckets=3, bucket_half_life_s=0.0)


def test_decaying_every_idle_bucket_at_once_equals_decaying_each_when_next_used() -> None:
    lazy = IdMap(capacity=4, num_buckets=3, admit_after=9, bucket_half_life_s=10.0)
    eager = IdMap(capacity=4, num_buckets=3, admit_after=9, bucket_half_life_s=10.0)
    w_lazy, w_eager = torch.ones(3, 2), torch.ones(3, 2)
    for m, w in ((lazy, w_lazy), (eager, w_eager)):
        m.decay_buckets(w, m.lookup(np.array([3, 4]), now=0.0))  # buckets 0 and 1 in use; 2 never
    eager.decay_buckets(w_eager, eager.decay_idle_buckets(now=15.0))  # e.g. at a checkpoint
    assert torch.allclose(w_eager[:2], torch.full((2, 2), 0.5 ** 1.5)) and torch.equal(w_eager[2], torch.ones(2))
    for m, w in ((lazy, w_lazy), (eager, w_eager)):
        m.decay_buckets(w, m.lookup(np.array([6]), now=30.0))  # bucket 0 used again
    assert torch.allclose(w_lazy[0], w_eager[0]) and torch.allclose(w_lazy[0], torch.full((2,), 0.125))


def admitted_delays(res) -> dict[int, float]:  # noqa: ANN001
    """{own row: time to admission} of one lookup's admissions."""
    return dict(zip(res.admitted_rows.tolist(), res.admitted_delay_s.tolist(), strict=True))


def test_time_to_admission_is_the_event_time_from_first_sight_to_admission_across_batches() -> None:
    m = IdMap(capacity=64, num_buckets=5, admit_after=3)
    assert not m.lookup(np.array([7, 8]), now=100.0).admitted_rows.size  # 7 and 8 first seen at 100
    assert not m.lookup(np.array([7, 9]), now=150.0).admitted_rows.size  # 9 at 150
    res = m.lookup(np.array([7, 9, 9, 10, 10, 10]), now=400.0)  # 7: 3rd sight; 9: 3rd; 10: 3 at once
    row = {k: int(r) - 5 for k, r in zip([7, 9, 10], m.lookup(np.array([7, 9, 10]), 400.0, train=False).rows,
                                          strict=True)}
    assert admitted_delays(res) == {row[7] + 5: 300.0, row[9] + 5: 250.0, row[10] + 5: 0.0}
    assert not m.lookup(np.array([8]), now=900.0).admitted_rows.size  # 8's second sight: not yet


def test_time_to_admission_carries_over_to_the_next_candidate_generation() -> None:
    m = IdMap(capacity=2, num_buckets=3, admit_after=2, candidates=4)
    m.lookup(np.array([1]), now=10.0)  # 1 first seen at 10
    m.lookup(np.arange(100, 104), now=20.0)  # the generation fills and rotates: 1 is in the previous one
    assert m.counters.rotations > 0
    res = m.lookup(np.array([1]), now=30.0)  # carried over with its count and its first sight
    assert res.admitted_delay_s.tolist() == [20.0]


def test_an_evicted_id_counting_again_measures_from_its_new_first_sight() -> None:
    m = IdMap(capacity=2, num_buckets=3, admit_after=2, candidates=64)
    assert m.lookup(np.array([1, 1]), now=10.0).admitted_delay_s.tolist() == [0.0]
    m.lookup(np.array([200, 200, 201, 201]), now=40.0)  # two more ids take the 2 rows: 1 (oldest) is evicted
    assert int(m.lookup(np.array([1]), 40.0, train=False).rows[0]) < 3 and m.counters.rotations == 0
    m.lookup(np.array([1]), now=500.0)  # counts again from 500, not from 10
    assert m.lookup(np.array([1]), now=560.0).admitted_delay_s.tolist() == [60.0]


def test_first_seen_times_survive_a_checkpoint_round_trip() -> None:
    a = IdMap(capacity=16, num_buckets=3, admit_after=2)
    a.lookup(np.array([5, 6]), now=1000.0)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = IdMap(capacity=16, num_buckets=3, admit_after=2)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert sorted(b.lookup(np.array([5, 6]), now=1600.0).admitted_delay_s.tolist()) == [600.0, 600.0]


def test_a_state_without_first_seen_times_loads_and_reports_no_delay_for_its_candidates() -> None:
    a = IdMap(capacity=16, num_buckets=3, admit_after=2)
    a.lookup(np.array([5]), now=1000.0)
    old = {k: v for k, v in a.state_dict().items() if not k.endswith("_first_seen")}  # as written before
    b = IdMap(capacity=16, num_buckets=3, admit_after=2)
    b.load_state_dict(old)
    res = b.lookup(np.array([5, 6]), now=1600.0)  # 5 admitted: counted before the restore, first sight unknown
    assert res.admitted_rows.size == 1 and np.isnan(res.admitted_delay_s).all()
    assert b.lookup(np.array([6]), now=1700.0).admitted_delay_s.tolist() == [100.0]  # counted since: known


def test_a_lookup_at_an_earlier_event_time_never_makes_an_id_or_a_bucket_older_than_it_is() -> None:
    """Event time may step back (merged partitions, a wall-clock bound moved back): an id seen at 1000 and again at
    500 was still last seen at 1000, so a TTL of 100 keeps it at 1050; a bucket touched at 100, then at 50, has been
    idle for 0 s at 100."""
    m = IdMap(8, 4, admit_after=1, ttl_s=100.0, bucket_half_life_s=10.0)
    keys = np.array([11, 12], np.int64)
    rows = m.lookup(keys, 1000.0).rows
    m.lookup(keys[:1], 500.0)
    res = m.lookup(np.array([13], np.int64), 1050.0)
    assert res.evicted_rows.size == 0
    assert m.lookup(keys, 1050.0, train=False).rows.tolist() == rows.tolist()
    b = IdMap(8, 4, admit_after=5, bucket_half_life_s=10.0)
    b.lookup(np.array([1], np.int64), 100.0)
    b.lookup(np.array([1], np.int64), 50.0)
    assert b.lookup(np.array([1], np.int64), 100.0).decayed_buckets.size == 0  # no idle time to decay for


def test_the_learner_keeps_no_id_hashing_of_its_own() -> None:
    # learner.id_map.hash_ids was a second definition: np.array([1, 2.5]) made 1 the float 1.0 before hashing, so
    # its key was hash_value(1.0), not id 1's (training/serving skew). Ids are hashed in stream.features only.
    import learner.id_map

    assert not hasattr(learner.id_map, "hash_ids")


@pytest.mark.parametrize("ids", [[1, 42, 123456789], ["user-42", "a", "\u00e9t\u00e9"], [0, 2**63 - 1, "42", 42],
                                 [7, "7", "seven", 0]])
def test_the_learners_id_hashing_equals_servings(ids: list[int | str]) -> None:
    # the learner's keys: the joiner's hash_column over the events' ids (the samples' user_id / item_id columns);
    # serving's: stream.features.hash_ids over a request's candidates (serving/features.py)
    learner_keys = hash_column(ids)
    serving_keys = hash_ids(ids)
    assert learner_keys.dtype == serving_keys.dtype == np.int64
    assert learner_keys.tolist() == serving_keys.tolist()
    assert (learner_keys >= 0).all()
    assert hash_ids(["42"])[0] == hash_ids([42])[0] == hash_column([42])[0]  # "42" and 42 are one id


def test_a_restored_map_evicts_the_same_tied_least_recently_seen_rows_as_an_uninterrupted_one() -> None:
    """Above 4 x 8,192 rows the LRU pool comes from a sample of last-seen times drawn with the map's own generator,
    which the state does not carry; among rows seen at the same time the victims depended on that pool, so a map
    restored from a checkpoint (generator back at its seed) freed other rows than the map that went on."""
    def filled() -> IdMap:
        m = IdMap(40_000, 8, admit_after=1)
        for t in range(100):  # 400 ids seen at each of 100 times: the k-th oldest ties with hundreds
            m.lookup(np.arange(t * 400, (t + 1) * 400, dtype=np.int64), now=float(t))
        return m

    going = filled()
    going.lookup(np.arange(10**6, 10**6 + 10, dtype=np.int64), now=200.0)  # full: frees evict_chunk LRU rows
    restored = IdMap(40_000, 8, admit_after=1)
    restored.load_state_dict(going.state_dict())
    new = np.arange(2 * 10**6, 2 * 10**6 + going.evict_chunk, dtype=np.int64)  # more than the rows left free
    want = going.lookup(new, now=201.0)
    got = restored.lookup(new, now=201.0)
    assert want.evicted_rows.size == going.evict_chunk
    assert sorted(got.evicted_rows.tolist()) == sorted(want.evicted_rows.tolist())
    assert got.rows.tolist() == want.rows.tolist()


def test_a_state_that_gives_one_key_two_rows_is_refused() -> None:
    """A malformed state with key 10 on rows 0 and 1 loaded: the table found one of them, the other was leaked (never
    freed, never looked up) and the map counted more live keys than it held. A ValueError, the state not loaded."""
    m = IdMap(capacity=4, num_buckets=2)
    m.lookup(np.array([10, 11]), 1.0)  # rows 0 and 1
    state = m.state_dict()
    state["row_key"] = torch.tensor([10, 10, -1, -1])
    with pytest.raises(ValueError, match="row_key"):
        IdMap(capacity=4, num_buckets=2).load_state_dict(state)
