"""Samples' histories as one list column: ``UserHistory.as_of_flat``'s (flat, offsets) goes into the samples messages
as it is, with no Python list per sample, and the messages are the ones each row's own history list makes."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.history import _as_of_flat, _parse
from stream.joiner.engine import Pending, Sample
from stream.joiner.sample_rows import to_batches
from stream.samples import OBSERVED, SampleBatch


def _rows(histories: list[list[int]], odd_row: bool = False) -> list[Sample]:
    rows = []
    for i, hist in enumerate(histories):
        context: dict[str, int | list[int]] = {"device": 7, "tags": [i, i + 1]}
        if odd_row and i == 1:
            context = {"device": 8}  # other columns: the messages take the union over their rows
        p = Pending(f"imp-{i}", 1000 + i, 11 + i, 21 + i, context, {"price": 1.5}, 0)
        p.history = hist
        rows.append(Sample(p, 0, 0, OBSERVED))
    return rows


def _decoded(values: list[bytes]) -> list[dict]:
    return [SampleBatch.decode(v).batch.to_pydict() for v in values]


def _flat(histories: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(histories) + 1, np.int32)
    np.cumsum([len(h) for h in histories], out=offsets[1:])
    return np.array([x for h in histories for x in h], np.int64), offsets


HISTORIES = [[5, 6], [], [7], [1, 2, 3, 4]]


def test_a_history_column_gives_the_messages_each_rows_own_list_gives() -> None:
    want = _decoded(to_batches(_rows(HISTORIES), max_rows=3))  # each row's pending.history
    rows = _rows([[] for _ in HISTORIES])  # the rows' own lists left empty: the column must be what counts
    got = _decoded(to_batches(rows, max_rows=3, histories=_flat(HISTORIES)))
    assert got == want and [m["history"] for m in got] == [[[5, 6], [], [7]], [[1, 2, 3, 4]]]


def test_rows_with_different_columns_still_get_their_history_from_the_column() -> None:
    want = _decoded(to_batches(_rows(HISTORIES, odd_row=True), max_rows=2))
    rows = _rows([[] for _ in HISTORIES], odd_row=True)
    assert _decoded(to_batches(rows, max_rows=2, histories=_flat(HISTORIES))) == want


@given(st.lists(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=6, unique=True), min_size=1,
                max_size=4),
       st.data(), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_the_flat_read_is_the_per_sample_read_as_one_list_column(stored: list, data: st.DataObject,
                                                                 max_len: int) -> None:
    lists = [[f"{t}:{i}".encode() for t, i in entries] for entries in stored]
    distinct = list(range(100, 100 + len(lists)))
    n = data.draw(st.integers(0, 12))
    users = data.draw(st.lists(st.sampled_from(distinct), min_size=n, max_size=n))
    times = data.draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    flat_read = _as_of_flat(users, times, distinct, lists, max_len)
    assert flat_read is not None  # well-formed, distinct entries: the column path takes them
    parsed = {u: _parse(e) for u, e in zip(distinct, lists, strict=True)}
    per_sample = []
    for u, ts in zip(users, times, strict=True):  # the definition: the newest max_len clicks before ts
        click_times, items = parsed[u]
        k = bisect_left(click_times, ts)
        per_sample.append(items[max(0, k - max_len):k])
    flat, offsets = flat_read
    assert flat.dtype == np.int64 and offsets.dtype == np.int32 and offsets.shape == (n + 1,)
    assert [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == per_sample


@given(st.lists(st.integers(0, 60), unique=True, max_size=8).map(sorted), st.lists(st.integers(0, 9), min_size=8,
                                                                                  max_size=8),
       st.lists(st.integers(0, 70), max_size=6), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_one_users_clicks_appended_in_time_order_read_as_the_batch_path_reads_them(
        click_times: list[int], items: list[int], times: list[int], max_len: int) -> None:
    lists = [[f"{t}:{i}".encode() for t, i in zip(click_times, items, strict=False)][::-1]]  # newest appended first
    users = [100] * len(times)
    one = _as_of_flat(users, times, [100], lists, max_len)  # one user, strictly increasing: no sort, no copy search
    batch = _as_of_flat(users, times, [100, 101], [*lists, [b"1:1"]], max_len)  # beside another user: the batch path
    assert one is not None and batch is not None
    assert one[0].tolist() == batch[0].tolist() and one[1].tolist() == batch[1].tolist()
    assert one[0].dtype == np.int64 and one[1].dtype == np.int32
