"""The offline sample builder: :class:`Ratings` rows -> the ``SampleBatch`` the joiner would emit for them.

Raw values are hashed with ``stream.features.hash_value``/``hash_context`` into a
``stream.samples.SampleBatch`` (columns ``user_id``, ``item_id``, ``history``, ``ctx.<name>``), and
:func:`feature_config` says which of those columns the model reads. The whole data set is built once
(numpy; Python only hashes distinct values).

Feature sets:

``paper``     AutoInt's seven MovieLens-1M fields, none of them an id (the fields of the paper's Figure 5:
              Gender, Age, Occupation, Zipcode, RequestTime, ReleaseTime, Genre): the user's gender, age,
              occupation and zip code, the request time (the hour of the week of the rating, UTC; the
              paper does not say how fine, hour of the week beat hour of day and weekday on valid AUC),
              the movie's release year and its genres (multi-valued, mean-pooled).
``default``   those plus user id, item id and the user's history: the items the user rated >= 4
              strictly before this rating's timestamp, newest last, at most 50 (as of time: a rating
              never sees itself, a rating of the same second, or the future; an item rated >= 4 twice at one
              time is there once, as in the joiner's history). The history shares the
              item id rows of the embedding table.

History, offline and in the joiner. The joiner (``stream/joiner/pipeline.py``, ``stream/history.py``)
appends an item to its user's history when the item's *click* joins, stamped with the click time, and
gives an impression at time T the user's clicks with click time < T, ordered by click time. Replaying
MovieLens, a rating >= 4 at t becomes a click at t + delay (``stream/replay/movielens.py``; the default
delay is lognormal with a median of 30 s), and a click more than the attribution window (1800 s) after
its impression is late and never enters the history. This builder, by default, stamps the item with the
rating time itself: a positive rated at t is in the history of the same user's ratings at T > t, as if
every click arrived at once. So the offline history also holds the user's positives whose click is still
in flight (t < T <= t + delay); MovieLens users rate in bursts, so this touches many samples.
``EvalConfig.history_delay_s`` (d) measures it: a positive rated at t enters the history only at t + d
(in the history of ratings at T > t + d). It is one fixed delay for every positive, where the joiner's
is drawn per click, so with d > 0 the history keeps the rating order (the joiner's follows click order)
and no positive is dropped as late. Measured on ml-1m, online protocol (``streamrec evaluate --protocol
online --history-delay-s D``): d = 30 s changes the history of 31% of the samples yet moves progressive
AUC by 0.00002 (0.79790 -> 0.79788); d = 1800 s, an upper bound (the attribution window), empties 38% of
the histories and costs 0.0009 (0.79701). The default, d = 0, is the figure the README reports.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from learner.evaluation.config import FEATURE_SETS, MULTI_VALUED, PAPER_FIELDS, EvalConfig
from learner.evaluation.ratings import Ratings, online_labels
from learner.features import FeatureConfig, FieldSpec
from stream.features import REQUEST_TIME, hash_value, request_time
from stream.samples import CTX_PREFIX, SampleBatch


def gather_lists(flat: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` of a list column ``(flat, offsets)`` -> a new ``(flat, offsets)``, no Python loop."""
    starts, lengths = offsets[idx], offsets[np.asarray(idx) + 1] - offsets[idx]
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    pos = np.repeat(starts - out[:-1], lengths) + np.arange(out[-1])
    return flat[pos], out


def history_as_of(user: np.ndarray, item: np.ndarray, ts: np.ndarray, positive: np.ndarray,
                  max_len: int = 50, rows: np.ndarray | None = None,
                  delay_ms: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Each row's history: the items of the same user's positive rows that entered the history strictly
    before the row's timestamp, oldest first, the last ``max_len`` of them; positives of one user on one item at
    one time are one entry (the joiner's history is a click time and an item, ``stream/history.py``, so it reads
    such clicks as one). A positive at ``ts`` enters
    at ``ts + delay_ms`` (0: at once; > 0: the way a click delay makes it enter the joiner's history
    later). Returns ``(flat items, offsets)`` for ``rows`` (default: every row, in input order).

    One sort merges the positives' entries (user, ts + delay_ms) with every row's look-up (user, ts);
    at equal times a look-up sorts first, so an entry counts only strictly before. The rest is vectorized.
    """
    user, item, ts = np.asarray(user), np.asarray(item), np.asarray(ts, np.int64)
    positive = np.asarray(positive, bool)
    n = len(user)
    users, code = np.unique(user, return_inverse=True)
    code = code.reshape(-1)  # (N,) dense user codes into users (U,)
    pos_rows = np.flatnonzero(positive)  # (P,)
    if len(pos_rows) > 1:  # one entry per (user, time, item), the first: the joiner's history keeps one such click
        _, item_code = np.unique(item[pos_rows], return_inverse=True)
        keys = (item_code.reshape(-1), ts[pos_rows], code[pos_rows])
        by = np.lexsort((pos_rows, *keys))
        repeat = np.zeros(len(by), bool)
        repeat[1:] = np.logical_and.reduce([k[by][1:] == k[by][:-1] for k in keys])
        pos_rows = np.sort(pos_rows[by][~repeat])
    n_pos = len(pos_rows)
    # Merged events: [0, P) entries, [P, P + N) look-ups; by user, time, look-up before entry, input order.
    is_entry = np.concatenate([np.ones(n_pos, bool), np.zeros(n, bool)])  # (P + N,)
    order = np.lexsort((np.concatenate([pos_rows, np.arange(n)]), is_entry,
                        np.concatenate([ts[pos_rows] + delay_ms, ts]), np.concatenate([code[pos_rows], code])))
    entry_sorted = is_entry[order]
    entries_before = np.cumsum(entry_sorted) - entry_sorted  # (P + N,) entries strictly before each event
    # Entries in merged order are sorted by (user, entry time, input order): the k-th is pos_items[k].
    pos_items = item[pos_rows[order[entry_sorted]]]
    end = np.empty(n, np.int64)  # row's history is pos_items[begin:end]
    end[order[~entry_sorted] - n_pos] = entries_before[~entry_sorted]
    user_first = np.zeros(len(users) + 1, np.int64)  # user_first[c]: entries of the users before code c
    np.cumsum(np.bincount(code[pos_rows], minlength=len(users)), out=user_first[1:])
    begin = np.maximum(end - max_len, user_first[code])
    if rows is not None:
        begin, end = begin[rows], end[rows]
    lengths = end - begin
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    take = np.repeat(begin - offsets[:-1], lengths) + np.arange(offsets[-1])
    return pos_items[take], offsets


def _hash_many(values: np.ndarray) -> np.ndarray:
    """hash_value of every element, hashing each distinct value once."""
    uniq, inv = np.unique(values, return_inverse=True)
    lut = np.fromiter((hash_value(v.item() if hasattr(v, "item") else v) for v in uniq), np.int64, len(uniq))
    return lut[inv.ravel()]


def build_samples(r: Ratings, rows: np.ndarray, label: np.ndarray, features: str, cfg: EvalConfig) -> SampleBatch:
    """The sample batch of ``rows`` (indices into ``r``), in that order, as the joiner would emit them
    (the history up to the difference the module docstring describes). ``paper`` features leave
    ``history`` empty (the feature config does not read it)."""
    rows = np.asarray(rows, np.int64)
    u, i = r.user[rows], r.item[rows]
    context: dict[str, Any] = {name: col[u] for name, col in r.user_ctx.items()}
    context.update({name: col[i] for name, col in r.item_ctx.items()})
    context.update({name: gather_lists(flat, off, i) for name, (flat, off) in r.item_lists.items()})
    context[REQUEST_TIME] = _hash_many(request_time(r.ts_ms[rows], cfg.request_time))
    if features == "default":
        history = history_as_of(r.user, r.item_hash[r.item], r.ts_ms, online_labels(r.rating), cfg.history_len, rows,
                                delay_ms=round(cfg.history_delay_s * 1000))
    else:
        history = (np.zeros(0, np.int64), np.zeros(len(rows) + 1, np.int64))
    imp = np.char.add(f"{r.dataset}-", np.char.zfill(rows.astype(str), 9))  # replay's impression ids
    return SampleBatch.from_columns(
        impression_id=imp.tolist(), ts=r.ts_ms[rows], label=np.asarray(label, np.int8),
        label_delay_ms=np.zeros(len(rows), np.int64), user_id=r.user_hash[u], item_id=r.item_hash[i],
        history=history, context=context,
    )


def feature_config(features: str, cfg: EvalConfig) -> FeatureConfig:
    """The fields the model reads: the paper's seven context fields, plus ids and history for ``default``."""
    if features not in FEATURE_SETS:
        raise ValueError(f"features must be one of {FEATURE_SETS}, got {features!r}")
    specs: list[FieldSpec] = []
    if features == "default":
        specs += [FieldSpec("user_id", "single", cfg.id_buckets), FieldSpec("item_id", "single", cfg.id_buckets),
                  FieldSpec("history", "sequence", cfg.id_buckets, shares="item_id")]
    for name in PAPER_FIELDS:
        specs.append(FieldSpec(CTX_PREFIX + name, "multi" if name in MULTI_VALUED else "single",
                               cfg.zip_buckets if name == "zip" else cfg.ctx_buckets))
    return FeatureConfig(tuple(specs), embedding_dim=cfg.embedding_dim)


def columns_feature_config(sb: SampleBatch, cfg: EvalConfig) -> FeatureConfig:
    """For a data set without MovieLens' fields (the synthetic feed): ids, history and every ``ctx.`` column
    ``sb`` has, in name order (single or multi-valued as stored)."""
    specs = [FieldSpec("user_id", "single", cfg.id_buckets), FieldSpec("item_id", "single", cfg.id_buckets),
             FieldSpec("history", "sequence", cfg.id_buckets, shares="item_id")]
    for f in sorted(sb.batch.schema, key=lambda f: f.name):
        if f.name.startswith(CTX_PREFIX):
            specs.append(FieldSpec(f.name, "multi" if pa.types.is_list(f.type) else "single", cfg.ctx_buckets))
    return FeatureConfig(tuple(specs), embedding_dim=cfg.embedding_dim)
