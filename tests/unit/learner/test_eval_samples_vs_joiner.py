"""Differential: the offline sample builder (``learner/evaluation/samples.py``) against the joiner, on one rating set.

The same MovieLens-shaped ratings go (a) through ``load_ratings`` + ``build_samples`` and (b) through the replay's
table (``load_movielens`` with a fixed click delay), the publisher's bytes, the event decoders, the join engine in
event-time batches, the history appends and as-of reads the pipeline makes (``UserHistory`` over an in-memory list
store with Redis' LPUSH + LTRIM semantics) and the sample batches the pipeline encodes. Column by column, every
impression's samples must carry what the offline row carries: ids, context, history (order and cap) and label.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import learner.evaluation.ratings as ratings_module
import stream.replay.movielens as movielens_module
from learner.evaluation.config import EvalConfig
from learner.evaluation.ratings import load_ratings, online_labels
from learner.evaluation.samples import build_samples, history_as_of
from stream.config import RedisSettings
from stream.events import decode_click, decode_impression
from stream.features import MISSING
from stream.history import UserHistory
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.sample_rows import to_batches
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.encoding import click_bytes, impression_bytes
from stream.replay.movielens import MovieLensTables, load_movielens
from stream.replay.publisher import replay_order
from stream.replay.table import CLICK
from stream.samples import SampleBatch

NAME = "ml-1m"
T0 = 978_300_000  # seconds


class MemoryHistory(UserHistory):
    """``UserHistory`` over in-memory lists: LPUSH of a batch's entries in order, then LTRIM to ``max_len``."""

    def __init__(self, max_len: int) -> None:
        super().__init__(client=None, max_len=max_len)  # type: ignore[arg-type]
        self.lists: dict[int, list[bytes]] = {}

    def append_many(self, user_hashes, item_hashes, click_ts) -> None:  # type: ignore[no-untyped-def]
        for u, i, t in zip(user_hashes, item_hashes, click_ts, strict=True):
            self.lists.setdefault(int(u), []).insert(0, f"{int(t)}:{int(i)}".encode())
        for lst in self.lists.values():
            del lst[self.max_len:]

    def _lrange(self, distinct: list[int]) -> list[list[bytes | str]]:
        return [list(self.lists.get(u, [])) for u in distinct]


def _rating_set() -> list[tuple[str, str, int, float]]:
    """(user, item, ts seconds, rating), in file order."""
    rows = [
        # u1: equal timestamps, positives and negatives, a repeated rating of one item
        ("u1", "m1", T0 + 10, 5), ("u1", "m2", T0 + 10, 4), ("u1", "m3", T0 + 10, 2),
        ("u1", "m4", T0 + 20, 3), ("u1", "m1", T0 + 40, 4), ("u1", "m5", T0 + 40, 1),
        ("u1", "m6", T0 + 5000, 4),
        # u2: no attributes; rates like u1 at the same seconds
        ("u2", "m2", T0 + 10, 4), ("u2", "m7", T0 + 11, 5), ("u2", "m3", T0 + 12, 4),
        ("u2", "m8", T0 + 13, 2),  # m8 has no genres
    ]
    # u3: a burst of 70 positives over 70 s, with negatives among them: the history cap of 50 matters
    for k in range(70):
        rows.append(("u3", f"m{10 + k}", T0 + 100 + k, 4 + k % 2))
        if k % 10 == 0:
            rows.append(("u3", f"m{200 + k}", T0 + 100 + k, 1))
    rows.append(("u3", "m1", T0 + 4000, 2))
    # u4: one item rated twice at the same second, both positives
    rows += [("u4", "m1", T0 + 10, 5), ("u4", "m1", T0 + 10, 4), ("u4", "m2", T0 + 20, 1)]
    # u5: a negative, then 260 positives inside its attribution window
    rows.append(("u5", "m9", T0 + 1000, 1))
    rows += [("u5", f"m{300 + k}", T0 + 1001 + k, 5) for k in range(260)]
    return rows


def _tables(rows: list[tuple[str, str, int, float]]) -> MovieLensTables:
    users, items, ts, rating = zip(*rows, strict=True)
    inter = pa.table({"user_id:token": pa.array(users), "item_id:token": pa.array(items),
                      "rating:float": pa.array([f"{x:g}" for x in rating]),
                      "timestamp:float": pa.array([str(t) for t in ts])})
    user_attrs: dict[str, dict[str, object]] = {"u1": {"gender": "F", "age": 25, "occupation": 4, "zip": "48067"},
                                                "u3": {"gender": "M", "age": 1, "occupation": 10, "zip": "02139"}}
    item_attrs: dict[str, dict[str, object]] = {
        i: {"year": 1990 + int(i[1:]) % 9, "genres": ["Drama"] if int(i[1:]) % 2 else ["Comedy", "Crime"]}
        for i in set(items) if i != "m8"}
    item_attrs["m8"] = {"year": 1999}
    return MovieLensTables(NAME, Path("/nowhere"), inter, user_attrs, item_attrs)


@pytest.fixture
def ratings_files(monkeypatch: pytest.MonkeyPatch) -> MovieLensTables:
    tables = _tables(_rating_set())
    monkeypatch.setattr(movielens_module, "read_movielens", lambda name: tables)
    monkeypatch.setattr(ratings_module, "read_movielens", lambda name: tables)
    return tables


def _joined(delay_s: float, batch_events: int, policy: str) -> dict[str, list[dict]]:
    """Impression id -> its samples as the joiner emits them (decoded rows, in emission order)."""
    table = load_movielens(NAME, ClickDelay(DelayKind.FIXED, delay_s), seed=7)
    imps = [decode_impression(b) for b in impression_bytes(table)]
    clicks = [decode_click(b) for b in click_bytes(table)]
    kinds, index = replay_order(table)
    js, rs = JoinerSettings(), RedisSettings()
    cfg = JoinConfig(window_ms=int(js.attribution_window_s * 1000), lateness_ms=int(js.allowed_lateness_s * 1000),
                     late_retention_ms=int(js.late_retention_s * 1000), history_len=rs.history_len,
                     watermark_quorum=js.watermark_quorum, policy=policy, elapsed_ms=int(js.elapsed_s * 1000))
    engine = PartitionJoin(0, cfg)
    history = MemoryHistory(4 * rs.history_len)  # as JoinPipeline keeps it
    offsets = [-1, -1]
    out: dict[str, list[dict]] = {}
    for start in range(0, len(kinds), batch_events):
        imp_batch, click_batch = [], []
        for kind, i in zip(kinds[start:start + batch_events], index[start:start + batch_events], strict=True):
            if kind == CLICK:
                offsets[1] += 1
                click_batch.append((offsets[1], clicks[i]))
            else:
                offsets[0] += 1
                imp_batch.append((offsets[0], imps[i]))
        res = engine.apply(imp_batch, click_batch, drain=start + batch_events >= len(kinds))
        if res.joined_clicks:  # JoinPipeline._record_redis, then _read_histories
            history.append_many([j.user for j in res.joined_clicks], [j.item for j in res.joined_clicks],
                                [j.click_ts for j in res.joined_clicks])
        if not res.samples:
            continue
        ps = [s.pending for s in res.samples]
        hist = history.as_of_flat([p.user for p in ps], [p.ts for p in ps], cfg.history_len)
        for value in to_batches(res.samples, 1_000, histories=hist):
            for row in SampleBatch.decode(value).batch.to_pylist():
                out.setdefault(row["impression_id"], []).append(row)
    return out


def _offline(delay_s: float) -> dict[str, dict]:
    r = load_ratings(NAME)
    sb = build_samples(r, np.arange(len(r)), online_labels(r.rating), "default", EvalConfig(history_delay_s=delay_s))
    return {row["impression_id"]: row for row in sb.batch.to_pylist()}


def _read(value: object, like: object) -> object:
    """A cell as the learner reads it (``learner/batch.py``): an absent column or a MISSING is absent, a list column's
    MISSING values are left out of its bag."""
    if isinstance(like, list):
        return [v for v in (value or []) if v != MISSING]  # type: ignore[attr-defined]
    return MISSING if value is None else value


def _compare(offline: dict[str, dict], joined: dict[str, list[dict]]) -> list[str]:
    diffs = []
    assert sorted(offline) == sorted(joined)
    for imp_id, want in offline.items():
        samples = joined[imp_id]
        if samples[-1]["label"] != want["label"]:
            diffs.append(f"{imp_id} label {samples[-1]['label']} != {want['label']}")
        for got in samples:
            for name, value in want.items():
                if name in ("label", "label_delay_ms", "kind"):
                    continue
                if _read(got.get(name), value) != _read(value, value):
                    diffs.append(f"{imp_id} {name}: joiner {got.get(name)} != offline {value}")
            extra = set(got) - set(want)
            if extra:
                diffs.append(f"{imp_id} joiner-only columns {sorted(extra)}")
    return diffs


@pytest.mark.parametrize("policy", ["wait", "fake_negative"])
@pytest.mark.parametrize("batch_events", [1, 16, 256])
@pytest.mark.parametrize(("click_delay_s", "history_delay_s"), [(0.001, 0.0), (30.0, 30.0)])
def test_offline_samples_are_the_joiners_samples(ratings_files: MovieLensTables, click_delay_s: float,
                                                 history_delay_s: float, batch_events: int, policy: str) -> None:
    """Clicks at the rating time (the replay's least delay, 1 ms: the ratings are whole seconds) against the default
    history, and a fixed click delay d against ``history_delay_s = d``."""
    diffs = _compare(_offline(history_delay_s), _joined(click_delay_s, batch_events, policy))
    assert diffs == []


@pytest.mark.parametrize("delay_ms", [0, 30_000])
def test_a_positive_repeated_at_the_same_time_is_one_history_entry_as_the_joiner_stores_it(delay_ms: int) -> None:
    """Two positives of one user on one item at one time are two clicks at one click time, which the joiner's history
    reads as one (``stream/history.py``: an entry is a click time and an item). The offline history listed it twice."""
    user = np.array([1, 1, 1, 1, 2])
    item = np.array([7, 7, 8, 9, 7])
    ts = np.array([10, 10, 10, 40_000, 50_000])
    flat, offsets = history_as_of(user, item, ts, np.array([1, 1, 1, 0, 1], bool), delay_ms=delay_ms)
    assert flat[offsets[3]:offsets[4]].tolist() == [7, 8]
