"""The layered store's pure logic (serving/embedding_store.py, row_codec.py, stored_versions.py): row codec, LRU,
bucket fallback, retry-after window.

The Redis behaviour itself (one MGET per request, scores, Redis stopped) is tested against real Redis in
tests/integration/test_layered_serving.py; the fake client here only raises or answers, to drive the logic.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import example, given, settings
from hypothesis import strategies as st

from serving.embedding_store import LayeredRows, RedisEmbeddingStore, RowCache, StoreUnavailable
from serving.row_codec import decode_answer, decode_rows, encode_rows, row_keys, tag_key
from serving.settings import RowDtype, ServeSettings


def test_rows_round_trip_exactly_as_float32_and_within_half_precision_as_float16() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 0.3, (7, 5)).astype(np.float32)
    assert np.array_equal(decode_rows(encode_rows(rows, RowDtype.FLOAT32), 5, RowDtype.FLOAT32), rows)
    half = decode_rows(encode_rows(rows, RowDtype.FLOAT16), 5, RowDtype.FLOAT16)
    assert np.allclose(half, rows, rtol=2 ** -11, atol=1e-7) and not np.array_equal(half, rows)
    assert len(encode_rows(rows, RowDtype.FLOAT16)[0]) == 10  # 5 values x 2 bytes, no header


def test_a_value_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 20"):
        decode_rows([b"\0" * 20, b"\0" * 16], 5, RowDtype.FLOAT32)


def test_an_answer_is_decoded_row_by_row_so_one_bad_value_costs_only_its_own_row() -> None:
    rows = np.arange(15, dtype=np.float32).reshape(3, 5)
    good = encode_rows(rows, RowDtype.FLOAT32)
    nan = np.full(5, np.nan, np.float32).tobytes()
    out, missing, malformed = decode_answer([good[0], None, b"\0" * 8, nan, good[2]], 5, RowDtype.FLOAT32)
    assert missing.tolist() == [False, True, False, False, False]
    assert malformed.tolist() == [False, False, True, True, False]
    assert np.array_equal(out[[0, 4]], rows[[0, 2]]) and not out[1:4].any()
    out, missing, malformed = decode_answer(good, 5, RowDtype.FLOAT32)  # every value good: the fast path
    assert np.array_equal(out, rows) and not missing.any() and not malformed.any()


def test_a_tagged_value_decodes_only_as_its_own_version_dtype_and_row() -> None:
    rows = np.random.default_rng(2).normal(size=(4, 5)).astype(np.float32)
    ids = np.array([7, 8, 9, 10])
    key = tag_key("v1", RowDtype.FLOAT32)
    values = encode_rows(rows, RowDtype.FLOAT32, ids, key)
    assert len(values[0]) == 5 * 4 + 4  # the values, then a 4-byte tag
    out, missing, malformed = decode_answer(values, 5, RowDtype.FLOAT32, ids, key)
    assert np.array_equal(out, rows) and not missing.any() and not malformed.any()
    for wrong_rows, wrong_key in ((ids[::-1], key), (ids, tag_key("v2", RowDtype.FLOAT32)),
                                  (ids, tag_key("v1", RowDtype.FLOAT16))):
        _, _, malformed = decode_answer(values, 5, RowDtype.FLOAT32, wrong_rows, wrong_key)
        assert malformed.all()
    flipped = [values[0][:2] + bytes([values[0][2] ^ 0x80]) + values[0][3:], *values[1:]]
    _, _, malformed = decode_answer(flipped, 5, RowDtype.FLOAT32, ids, key)
    assert malformed.tolist() == [True, False, False, False]


def test_values_of_wrong_lengths_that_add_up_to_the_right_total_are_each_refused() -> None:
    """The answer's total length is not each value's: a short value next to a long one (untagged), or one key
    holding two rows' values next to an empty one (each tag then matches its own row), must not be read across."""
    out, missing, malformed = decode_answer([b"\1" * 16, b"\1" * 24], 5, RowDtype.FLOAT32)
    assert malformed.tolist() == [True, True] and not missing.any() and not out.any()
    ids = np.array([7, 8])
    key = tag_key("v1", RowDtype.FLOAT32)
    values = encode_rows(np.ones((2, 5), np.float32), RowDtype.FLOAT32, ids, key)
    out, missing, malformed = decode_answer([values[0] + values[1], b""], 5, RowDtype.FLOAT32, ids, key)
    assert malformed.tolist() == [True, True] and not out.any()
    with pytest.raises(ValueError, match="expected 20"):
        decode_rows([b"\0" * 16, b"\0" * 24], 5, RowDtype.FLOAT32)


def test_keys_carry_the_version_so_versions_never_mix() -> None:
    assert row_keys("p", "v1", np.array([3, 10])) == ["p:emb:v1:r:3", "p:emb:v1:r:10"]
    assert set(row_keys("p", "v1", np.arange(5))).isdisjoint(row_keys("p", "v2", np.arange(5)))


def test_the_lru_keeps_the_most_recently_used_rows_within_its_capacity() -> None:
    cache = RowCache(3)
    cache.put_many(np.array([1, 2, 3]), np.eye(3, dtype=np.float32))
    out = np.zeros((1, 3), np.float32)
    assert cache.get_many(np.array([1]), out).tolist() == [True]  # 1 is now the most recent
    cache.put_many(np.array([4]), np.ones((1, 3), np.float32))  # evicts 2, the least recent
    hit = cache.get_many(np.array([1, 2, 3, 4]), np.zeros((4, 3), np.float32))
    assert hit.tolist() == [True, False, True, True] and len(cache) == 3
    cache.discard_many(np.array([3]))
    assert cache.get_many(np.array([3]), out).tolist() == [False]
    assert len(RowCache(0).get_many(np.array([1]), out)) == 1 and not RowCache(0).get_many(np.array([1]), out).any()


def test_the_lru_returns_the_vectors_it_was_given_through_evictions_and_reused_slots() -> None:
    rng = np.random.default_rng(1)
    cache = RowCache(50)
    truth: dict[int, np.ndarray] = {}
    for _ in range(200):  # random batches of unique rows: puts, gets and discards in any order
        rows = rng.choice(400, size=int(rng.integers(1, 80)), replace=False)
        vecs = rng.normal(size=(len(rows), 4)).astype(np.float32)
        cache.put_many(rows, vecs)
        truth.update(zip(rows.tolist(), vecs, strict=True))
        cache.discard_many(rng.choice(400, size=5, replace=False))
        probe = rng.choice(400, size=60, replace=False)
        out = np.zeros((60, 4), np.float32)
        hit = cache.get_many(probe, out)
        assert len(cache) <= 50
        for r, h, v in zip(probe.tolist(), hit, out, strict=True):
            if h:
                assert np.array_equal(v, truth[r])
    assert cache._data is not None and cache._data.shape == (50, 4)  # memory: one array of the capacity


class FakeClient:
    """Answers MGET/GET from a dict, or raises ConnectionError while ``down``; counts calls."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values, self.down, self.calls = values, False, 0

    def get(self, key: str) -> bytes | None:
        self.calls += 1
        if self.down:
            raise redis.ConnectionError("refused")
        return self.values.get(key)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        self.calls += 1
        if self.down:
            raise redis.ConnectionError("refused")
        return [self.values.get(k) for k in keys]


class SlowOnLargeMgets(FakeClient):
    """An MGET of more than ``max_keys`` keys times out, as real Redis did past a 50 ms timeout for the 262,144 rows
    a request may look up; pipelined MGETs are answered (in one round trip: ``round_trips``)."""

    def __init__(self, values: dict[str, bytes], max_keys: int) -> None:
        super().__init__(values)
        self.max_keys, self.round_trips = max_keys, 0

    def mget(self, keys: list[str]) -> list[bytes | None]:
        if len(keys) > self.max_keys:
            raise redis.TimeoutError("Timeout reading from socket")
        return super().mget(keys)

    def pipeline(self, transaction: bool = True) -> Any:
        client, queued = self, []

        class Pipe:
            def mget(self, keys: list[str]) -> None:
                queued.append(keys)

            def execute(self) -> list[list[bytes | None]]:
                client.round_trips += 1
                return [client.mget(k) for k in queued]

        return Pipe()


def _store(table: np.ndarray, clock: Any) -> tuple[RedisEmbeddingStore, FakeClient]:
    import json
    values = dict(zip(row_keys("p", "v", np.arange(len(table))), encode_rows(table, RowDtype.FLOAT32), strict=True))
    values["p:emb:v:meta"] = json.dumps({"rows": len(table), "dim": table.shape[1], "dtype": "float32"}).encode()
    client = FakeClient(values)
    return RedisEmbeddingStore(client, "p", cache_rows=100, retry_after_s=1.0, clock=clock), client


def test_an_admitted_ids_own_row_falls_back_to_its_bucket_row_and_other_rows_to_nothing() -> None:
    # one dynamic field at rows [4, 4 + 3 buckets + 5 own rows); rows 0..3 belong to a static field
    table = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    store, _ = _store(table, lambda: 0.0)
    row_key = np.array([10, 11, -1, 14, 3])  # own row i holds the id with this hashed key (-1: free)
    rows = LayeredRows(store, "v", table, [(4, 3, 5, "user_id")], {"user_id": {"row_key": row_key}})
    got = rows.fallback_rows(np.array([7, 8, 9, 10, 11, 5, 2]))
    # own rows 7..11 = local 0..4 -> keys 10, 11, -1, 14, 3 -> buckets 1, 2, none, 2, 0; bucket row 5 is itself
    assert got.tolist() == [4 + 1, 4 + 2, -1, 4 + 2, 4 + 0, 5, -1]
    have, vec = rows.local(np.array([4, 6, 7, 0]))  # the bucket rows are local, copied from the artifact
    assert have.tolist() == [True, True, False, False] and np.array_equal(vec[:2], table[[4, 6]])


def test_a_failed_round_trip_is_counted_once_and_redis_is_skipped_for_the_retry_after_window() -> None:
    now = [0.0]
    table = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    store, client = _store(table, lambda: now[0])
    rows = LayeredRows(store, "v", table, [], None)
    vec, failed = rows.gather(np.array([1, 2]))
    assert np.array_equal(vec, table[[1, 2]]) and not failed.any()
    client.down = True
    calls = client.calls
    vec, failed = rows.gather(np.array([3, 4]))
    assert failed.all() and not vec.any() and client.calls == calls + 1
    vec, failed = rows.gather(np.array([5]))  # inside the window: Redis is not asked
    assert failed.all() and client.calls == calls + 1
    cached, failed = rows.gather(np.array([1]))  # the LRU still serves what it holds
    assert np.array_equal(cached, table[[1]]) and not failed.any()
    client.down = False
    now[0] = 1.5
    vec, failed = rows.gather(np.array([3, 4]))
    assert np.array_equal(vec, table[[3, 4]]) and not failed.any()
    with pytest.raises(StoreUnavailable):
        client.down = True
        store.fetch("v", np.array([6]), 3, RowDtype.FLOAT32)


def test_an_lru_sized_beyond_the_table_holds_at_most_the_tables_rows() -> None:
    # embedding_cache_rows far beyond the table (a typo, 10**13): the LRU's one array was allocated at the size asked
    # on the first miss (MemoryError: every request with a miss failed); it never needs more rows than the table has.
    now = [0.0]
    table = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    store, _ = _store(table, lambda: now[0])
    store.cache_rows = 10 ** 13
    rows = LayeredRows(store, "v", table, [], None)
    vec, failed = rows.gather(np.array([1, 2]))
    assert np.array_equal(vec, table[[1, 2]]) and not failed.any()
    assert rows.cache.capacity == len(table)


def test_values_beyond_float16_are_refused_rather_than_stored_as_inf() -> None:
    # float16 tops out at 65504: a larger value became inf in Redis, and every MGET touching the row then failed
    # (non-finite rows are a failed round trip), so the refresh refuses the table instead of publishing it.
    rows = np.array([[1.0, 7e4], [0.5, -0.5]], np.float32)
    with pytest.raises(ValueError, match="float16"):
        encode_rows(rows, RowDtype.FLOAT16)
    assert len(encode_rows(rows, RowDtype.FLOAT32)) == 2


def test_by_default_a_delta_only_drops_its_rows_from_the_lru_and_writes_nothing_to_redis() -> None:
    """``embedding_store_write_deltas`` is off by default (nothing in streamrec reads the overlay, which can grow to
    a version's size): a delta's rows leave the LRU and Redis sees no write (FakeClient has no ``mset``: a write
    would be attempted through a pipeline or MSET and fail loudly here)."""
    table = np.random.default_rng(1).normal(size=(10, 3)).astype(np.float32)
    store, client = _store(table, lambda: 0.0)
    assert store.write_deltas is False and ServeSettings().embedding_store_write_deltas is False
    rows = LayeredRows(store, "v", table, [], None)
    rows.gather(np.array([1, 2]))
    assert 1 in rows.cache
    calls, keys = client.calls, set(client.values)
    rows.on_delta(np.array([1, 2]), np.ones((2, 3), np.float32), np.array([False, False]))
    assert 1 not in rows.cache and 2 not in rows.cache
    assert client.calls == calls and set(client.values) == keys


def test_a_request_of_more_rows_than_one_mget_may_carry_is_read_in_pipelined_chunks_and_served() -> None:
    """One huge MGET (a request may look up 262,144 rows) outlasted the timeout: counted as Redis down, so EVERY
    request's misses fell back for retry_after_s. Chunks of a pipeline: the rows are served, Redis stays in use."""
    import json
    table = np.random.default_rng(3).normal(size=(40, 3)).astype(np.float32)
    values = dict(zip(row_keys("p", "v", np.arange(40)), encode_rows(table, RowDtype.FLOAT32), strict=True))
    values["p:emb:v:meta"] = json.dumps({"rows": 40, "dim": 3, "dtype": "float32"}).encode()
    client = SlowOnLargeMgets(values, max_keys=8)
    store = RedisEmbeddingStore(client, "p", cache_rows=0, clock=lambda: 0.0, fetch_chunk=8)
    rows = LayeredRows(store, "v", table, [], None)
    vec, failed = rows.gather(np.arange(3, 40))  # 37 rows: 5 MGETs of at most 8 keys, one round trip
    assert not failed.any() and np.array_equal(vec, table[3:]) and store.available and client.round_trips == 1
    vec, failed = rows.gather(np.arange(3))  # a small request: one plain MGET, as before
    assert not failed.any() and np.array_equal(vec, table[:3]) and client.round_trips == 1


@pytest.mark.parametrize("meta", [b"{not json", b"\xff\xfe", b'{"rows": 10'])
def test_a_meta_that_is_not_json_is_refused_like_one_that_does_not_fit_not_taken_for_redis_down(meta: bytes) -> None:
    """Redis answered: the version's meta is damaged. It was read as a Redis failure, so the version loaded (and was
    swapped in) with Redis skipped, serving every non-hot row from fallback rows, where a meta that does not fit is
    refused and the live model kept."""
    table = np.zeros((10, 3), np.float32)
    store, client = _store(table, lambda: 0.0)
    client.values["p:emb:v:meta"] = meta
    with pytest.raises(ValueError, match="p:emb:v:meta is not a meta"):
        LayeredRows(store, "v", table, [], None)
    assert store.available


class MarkerClient(FakeClient):
    """GET/SET NX over a dict; a key in ``hashes`` is a Redis hash (GET: WRONGTYPE, as Redis answers)."""

    def __init__(self, values: dict[str, bytes], hashes: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(values)
        self.hashes = hashes

    def get(self, key: str) -> bytes | None:
        if key in self.hashes:
            raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
        return super().get(key)

    def set(self, key: str, value: Any, nx: bool = False) -> bool:
        if nx and (key in self.values or key in self.hashes):
            return False
        self.values[key] = value
        return True

    def type(self, key: str) -> bytes:
        return b"hash" if key in self.hashes else b"string"


@pytest.mark.parametrize("meta", [b"null", b"[]", b"3", b'"rows"', b"true"])
def test_a_meta_key_holding_json_that_is_no_object_is_damaged_not_absent(meta: bytes) -> None:
    """A meta key of JSON ``null`` read as no meta: ``write_version`` wrote over the key as if the version were free,
    and ``open()`` said the version was not stored although its key exists. Any non-object is refused alike."""
    from serving.embedding_store import VersionNotStored
    from serving.stored_versions import VersionTaken, write_version

    table = np.zeros((10, 3), np.float32)
    store, client = _store(table, lambda: 0.0)
    client.values["p:emb:v:meta"] = meta
    with pytest.raises(ValueError, match="p:emb:v:meta is not a meta") as exc:
        LayeredRows(store, "v", table, [], None)
    assert not isinstance(exc.value, VersionNotStored) and store.available
    marker = MarkerClient({"p:emb:v:meta": meta})
    with pytest.raises(VersionTaken, match="its meta not one a refresh writes"):
        write_version(marker, "p", "v", np.zeros((2, 4), np.float32), np.arange(2), RowDtype.FLOAT32, owner="o")
    assert marker.values == {"p:emb:v:meta": meta}  # nothing written


@pytest.mark.parametrize(("values", "hashes", "said"), [
    ({"p:emb:v:writer": b"{not json"}, set(), r"its writer marker b'\{not json'"),
    ({}, {"p:emb:v:writer"}, "p:emb:v:writer is a Redis hash")])
def test_a_writer_marker_a_refresh_never_writes_is_refused_naming_what_it_holds(
        values: dict[str, bytes], hashes: set[str], said: str) -> None:
    """A version's writer marker that is not JSON, or a key of another type, was said to be "its writer marker None":
    the error named neither the value nor the key's type."""
    from serving.stored_versions import VersionTaken, write_version

    client = MarkerClient(dict(values), hashes)
    with pytest.raises(VersionTaken, match=said):
        write_version(client, "p", "v", np.zeros((2, 4), np.float32), np.arange(2), RowDtype.FLOAT32, owner="o")
    assert set(client.values) == set(values)  # nothing written


# Any bytes in a version's meta or writer marker (Redis answered with them): the meta opens the version or is a
# ValueError, the marker is a VersionTaken; never another exception. Structured: each field of a good meta replaced
# by every JSON type.
_GOOD_META = {"rows": 10, "dim": 3, "dtype": "float32"}
_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                      max_size=3), max_leaves=6)
_meta_bytes = st.one_of(
    st.binary(max_size=100),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda k, v: json.dumps({**_GOOD_META, k: v}).encode(), st.sampled_from([*_GOOD_META, "row_check"]),
              _json_values))


@example(b"[" * 100_000)  # deeper than the json module recurses: RecursionError escaped the ValueError promise
@example(b'{"rows":' * 100_000)
@given(_meta_bytes)
@settings(max_examples=100, deadline=None)
def test_any_meta_bytes_open_the_version_or_are_a_value_error(meta: bytes) -> None:
    table = np.zeros((10, 3), np.float32)
    store, client = _store(table, lambda: 0.0)
    client.values["p:emb:v:meta"] = meta
    try:
        LayeredRows(store, "v", table, [], None)
    except ValueError as exc:
        assert str(exc).strip()
    assert store.available


@example(b"[" * 100_000)
@given(_meta_bytes)
@settings(max_examples=50, deadline=None)
def test_any_meta_or_writer_marker_bytes_of_another_writer_are_version_taken(value: bytes) -> None:
    from serving.stored_versions import VersionTaken, write_version

    for key in ["p:emb:v:writer", "p:emb:v:meta"]:  # a meta of JSON null too: the key exists, so it is damaged
        client = MarkerClient({key: value})
        with pytest.raises(VersionTaken):
            write_version(client, "p", "v", np.zeros((2, 4), np.float32), np.arange(2), RowDtype.FLOAT32, owner="o")


class ScanClient(MarkerClient):
    """MarkerClient with SCAN (every key: the glob is the caller's concern) and EXISTS."""

    def scan_iter(self, match: str, count: int) -> list[str]:
        return list(self.values)

    def exists(self, key: str) -> int:
        return int(key in self.values)


@example(b"[" * 100_000)  # deeper than json recurses: RecursionError escaped the refresh's cleanup
@given(_meta_bytes)
@settings(max_examples=50, deadline=None)
def test_any_writer_marker_bytes_are_an_unfinished_version_only_when_they_name_the_owner(value: bytes) -> None:
    from serving.stored_versions import unfinished_versions

    client = ScanClient({"p:emb:v:writer": value, "p:emb:w:writer": json.dumps({"owner": "o"}).encode()})
    try:
        ours = json.loads(value or b"null")
    except (ValueError, RecursionError):
        ours = None
    mine = isinstance(ours, dict) and ours.get("owner") == "o"
    assert unfinished_versions(client, "p", "o") == {"w"} | ({"v"} if mine else set())


def test_a_row_count_no_table_has_is_not_deleted_by_name() -> None:
    """On a cluster a version's keys are deleted by name, rows 0 .. rows - 1 of its meta (else its writer marker): a
    meta another client wrote with ``rows`` 10**12 had the delete name keys for days. Past the bound the keys are found
    by SCAN instead; a count a table can have is taken."""
    from serving.row_codec import meta_key, writer_key
    from serving.stored_versions import _stored_rows

    huge = FakeClient({meta_key("p", "v1"): json.dumps({"rows": 10**12}).encode()})
    assert _stored_rows(huge, "p", "v1") is None
    fine = FakeClient({meta_key("p", "v1"): b"[]", writer_key("p", "v1"): json.dumps({"rows": 5_000_000}).encode()})
    assert _stored_rows(fine, "p", "v1") == 5_000_000
