"""stream/features.py: a column hashed at once (``hash_column``) gives exactly the per-value
``hash_value`` numbers (BLAKE2b feature hashing must give identical rows whichever way it runs)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.features import MISSING, hash_column, hash_value

SCALARS = st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63 - 1), st.booleans(),
                    st.floats(allow_nan=False, allow_infinity=False))


def _each(values: list) -> list[int]:
    return [MISSING if v is None else hash_value(v) for v in values]


@given(st.lists(SCALARS, max_size=40))
@settings(max_examples=300, deadline=None)
def test_a_mixed_column_hashes_as_each_value_does(values: list) -> None:
    assert hash_column(values).tolist() == _each(values)


@given(st.sampled_from([st.text(max_size=6), st.integers(0, 30), st.booleans(), st.floats(-2, 2)]).flatmap(
    lambda s: st.lists(s, max_size=60)))
@settings(max_examples=200, deadline=None)
def test_a_column_of_one_type_with_repeats_hashes_as_each_value_does(values: list) -> None:
    assert hash_column(values).tolist() == _each(values)


def test_edge_cases() -> None:
    # empty strings, unicode, None (absent: MISSING), values equal across types (1, True, 1.0), signed zeros
    values = ["", "", "é", "\u00e9", "e\u0301", "日本", "\U0001f600", None, 1, True, 1.0, 0.0, -0.0, 0, False, "1",
              "True"]
    assert hash_column(values).tolist() == _each(values)
    assert len(set(hash_column([1, True, 1.0, "1"]).tolist())) == 3  # "1" and 1 are one id (stream/ids.py)
    for single_typed in ([True, False, True], [0, 0, 1, 0], ["", "a", ""], [0.0, -0.0, 0.0]):
        assert hash_column(single_typed).tolist() == _each(single_typed)
    assert hash_column([]).dtype == np.int64 and hash_column([]).shape == (0,)
    assert hash_column([None, None]).tolist() == [MISSING, MISSING]


def test_hash_ids_equals_hash_value_cold_warm_and_after_the_cache_empties(monkeypatch) -> None:
    import stream.features as sf

    ids = [0, 1, 7, 2**63 - 1, "1", "i7", "u42", 7, "i7"]  # ints and strings, 1 beside "1", repeats
    want = np.array([sf.hash_value(v) for v in ids], np.int64)
    monkeypatch.setattr(sf, "_ID_CACHE", {})
    assert np.array_equal(sf.hash_ids(ids), want)  # every id a miss
    assert np.array_equal(sf.hash_ids(ids), want)  # every id a hit
    assert np.array_equal(sf.hash_ids(ids[:3] + ["new"]), np.array([*want[:3], sf.hash_value("new")], np.int64))
    monkeypatch.setattr(sf, "_ID_CACHE_MAX", 2)  # full: emptied, then filled again
    assert np.array_equal(sf.hash_ids(ids + ["other"]), np.array([*want, sf.hash_value("other")], np.int64))
    assert sf.hash_ids([]).shape == (0,)


def test_ids_hashed_into_hash_ids_cache_do_not_also_fill_hash_values_lru_cache(monkeypatch) -> None:
    # one cache per id: a million distinct ids in both took 3.2x the memory (stream/features.py: _fill_id_cache)
    import stream.features as sf

    monkeypatch.setattr(sf, "_ID_CACHE", {})
    ids = [f"never-seen-{i}" for i in range(50)] + list(range(10**15, 10**15 + 50))
    before = sf.hash_value.cache_info().currsize
    got = sf.hash_ids(ids)
    assert sf.hash_value.cache_info().currsize == before
    assert len(sf._ID_CACHE) == len(ids)
    assert got.tolist() == [sf.stable_hash(v) for v in ids]


def test_hash_ids_cache_is_bounded_by_bytes_when_clients_send_long_distinct_ids(monkeypatch) -> None:
    # serving hashes client-chosen ids: distinct 256-character ones filled the 2**20-entry cache to ~430 MB
    import sys

    import stream.features as sf

    monkeypatch.setattr(sf, "_ID_CACHE", {})
    monkeypatch.setattr(sf, "_id_cache_bytes", 0)
    monkeypatch.setattr(sf, "_ID_CACHE_MAX_BYTES", 1 << 20)
    largest = 0
    for r in range(40):  # 40 requests of 500 distinct 256-character ids: ~8 MB of keys in all
        ids = [f"{r:04d}-{i:05d}-" + "x" * 244 for i in range(500)]
        assert sf.hash_ids(ids).tolist() == [sf.stable_hash(v) for v in ids]
        held = sys.getsizeof(sf._ID_CACHE) + sum(map(sys.getsizeof, sf._ID_CACHE))
        largest = max(largest, held)
    one_call = 500 * (sys.getsizeof("x" * 256) + sf._ENTRY_BYTES)
    assert largest <= (1 << 20) + one_call  # emptied once past the bound: at most one call's ids beyond it
    assert 0 < len(sf._ID_CACHE) < 40 * 500


def test_hash_values_lru_cache_holds_at_most_65536_distinct_client_values() -> None:
    from stream.features import hash_value, stable_hash

    values = [f"ctx-{i}-" + "y" * 240 for i in range(70_000)]  # long distinct strings: ~720 B each while cached
    assert [hash_value(v) for v in values[-3:]] == [stable_hash(v) for v in values[-3:]]
    for v in values:
        hash_value(v)
    assert hash_value.cache_info().currsize <= 1 << 16


def test_both_float_zeros_hash_alike_whichever_the_cache_saw_first() -> None:
    # -0.0 == 0.0, so hash_value's lru_cache answers one with the other's entry: a process that met -0.0 first (the
    # joiner) and one that met 0.0 first (serving) must still agree, and so must stable_hash uncached
    from stream.ids import stable_hash

    answers = []
    for first in (-0.0, 0.0):
        hash_value.cache_clear()
        answers.append([hash_value(first), hash_value(-first), *hash_column([0.0, -0.0, 1.5]).tolist()])
    hash_value.cache_clear()
    assert answers[0] == answers[1]
    assert stable_hash(-0.0) == stable_hash(0.0) == answers[0][0]
    assert stable_hash(0) != stable_hash(0.0) and stable_hash(False) != stable_hash(0.0)  # types still apart
