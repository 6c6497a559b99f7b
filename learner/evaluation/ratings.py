"""The ratings an evaluation learns from, their labels and the offline split.

:class:`Ratings` holds a data set in event-time order with users and items as dense codes into
per-entity hashed attributes, so building features is array indexing. :func:`load_ratings` reads a
packaged MovieLens data set through ``stream.replay.movielens.read_movielens``, the reader replay
uses, so the hashed values are the ones the joiner puts on the samples topic; ``learner/cold_start.py``
builds :class:`Ratings` from its synthetic feed with :meth:`Ratings.from_raw`.

Labels: :func:`online_labels` is the replay's click rule (rating >= 4), :func:`autoint_labels` the
AutoInt paper's (> 3 positive, < 3 negative, = 3 dropped); :func:`split_811` is its 8:1:1 split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from learner.evaluation.config import MULTI_VALUED
from learner.row_mapper import earlier_rows
from stream.errors import ConfigError
from stream.features import MISSING, hash_context, hash_value
from stream.replay.movielens import CLICK_MIN_RATING, read_movielens

RawIds: TypeAlias = np.ndarray | pa.Array | pa.ChunkedArray | list


def _columns(dicts: list[dict[str, int | list[int]]], names: list[str]) -> tuple[
        dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Hashed per-entity dicts -> single columns ``(K,)`` and list columns ``(flat, offsets (K+1,))``."""
    singles: dict[str, np.ndarray] = {}
    lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in names:
        values = [d.get(name) for d in dicts]
        if name in MULTI_VALUED or any(isinstance(v, list) for v in values):
            seqs = [v if isinstance(v, list) else ([] if v is None else [v]) for v in values]
            offsets = np.zeros(len(seqs) + 1, np.int64)
            np.cumsum([len(s) for s in seqs], out=offsets[1:])
            flat = np.fromiter((x for s in seqs for x in s), np.int64, int(offsets[-1]))
            lists[name] = (flat, offsets)
        else:
            singles[name] = np.array([MISSING if v is None else v for v in values], np.int64)
    return singles, lists


def _encode(values: RawIds, order: np.ndarray) -> tuple[list[Any], np.ndarray]:
    """``values[order]`` as ``(distinct values, codes (N,) int64)``; Arrow's dictionary encoding, in C++."""
    arr = values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(np.asarray(values, object))
    enc = pc.dictionary_encode(arr.take(pa.array(order, pa.int64())))
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass(frozen=True)
class Ratings:
    """Ratings in event-time order; users and items as dense codes into per-entity hashed attributes."""

    dataset: str
    user: np.ndarray  # (N,) int64 code
    item: np.ndarray  # (N,) int64 code
    rating: np.ndarray  # (N,) float64
    ts_ms: np.ndarray  # (N,) int64, event time
    user_hash: np.ndarray  # (U,) int64 hash_value(raw user id)
    item_hash: np.ndarray  # (I,) int64 hash_value(raw item id)
    user_ctx: dict[str, np.ndarray]  # name -> (U,) hashed value
    item_ctx: dict[str, np.ndarray]  # name -> (I,) hashed value
    item_lists: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (flat hashed values, offsets (I+1,))

    def __len__(self) -> int:
        return len(self.rating)

    @classmethod
    def from_raw(cls, users_raw: RawIds, items_raw: RawIds, rating: np.ndarray, ts_ms: np.ndarray,
                 user_attrs: Mapping[Any, dict[str, Any]], item_attrs: Mapping[Any, dict[str, Any]],
                 dataset: str = "custom", limit: int | None = None) -> Ratings:
        """Raw ids and attribute dicts (as replay publishes them) -> hashed codes, sorted by event time
        (stable: ties keep input order); ``limit`` keeps the earliest N."""
        ts_ms = np.asarray(ts_ms, np.int64)
        order = np.argsort(ts_ms, kind="stable")
        if limit is not None:
            if limit < 0:  # order[:-5] is "all but the last 5"
                raise ConfigError(f"--limit must be >= 0, got {limit}")
            order = order[:limit]
        user_keys, user = _encode(users_raw, order)
        item_keys, item = _encode(items_raw, order)
        user_dicts = [hash_context(dict(user_attrs.get(k, {}))) for k in user_keys]  # type: ignore[arg-type]
        item_dicts = [hash_context(dict(item_attrs.get(k, {}))) for k in item_keys]  # type: ignore[arg-type]
        user_names = sorted({n for d in user_dicts for n in d})
        item_names = sorted({n for d in item_dicts for n in d})
        user_ctx, user_lists = _columns(user_dicts, user_names)
        if user_lists:
            raise ValueError(f"multi-valued user attributes are not supported: {sorted(user_lists)}")
        item_ctx, item_lists = _columns(item_dicts, item_names)
        return cls(
            dataset=dataset, user=user, item=item,
            rating=np.asarray(rating, np.float64)[order], ts_ms=ts_ms[order],
            user_hash=np.fromiter((hash_value(k) for k in user_keys), np.int64, len(user_keys)),
            item_hash=np.fromiter((hash_value(k) for k in item_keys), np.int64, len(item_keys)),
            user_ctx=user_ctx, item_ctx=item_ctx, item_lists=item_lists,
        )


def load_ratings(dataset: str, limit: int | None = None) -> Ratings:
    """A packaged MovieLens data set, the earliest ``limit`` ratings in event time (default: all). Raises
    ValueError for an unknown name and ``stream.errors.DatasetMissing`` when it is not installed."""
    t = read_movielens(dataset)
    return Ratings.from_raw(t.user_ids, t.item_ids, t.ratings(), t.ts_ms(), t.user_attrs, t.item_attrs, dataset,
                            limit)


def autoint_labels(rating: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keep (N,) bool, label (N,) int8)``: > 3 -> 1, < 3 -> 0, = 3 dropped (keep False)."""
    rating = np.asarray(rating, np.float64)
    return rating != 3, (rating > 3).astype(np.int8)


def online_labels(rating: np.ndarray) -> np.ndarray:
    """A rating >= 4 is a click (the replay's rule)."""
    return (np.asarray(rating, np.float64) >= CLICK_MIN_RATING).astype(np.int8)


def split_811(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random 8:1:1 split of ``range(n)`` by its own generator: ``(train, valid, test)`` index arrays
    of sizes ``8n//10``, ``n//10`` and the rest."""
    perm = np.random.Generator(np.random.PCG64(seed)).permutation(n)
    n_train, n_valid = n * 8 // 10, n // 10
    return perm[:n_train], perm[n_train:n_train + n_valid], perm[n_train + n_valid:]


def synthetic_ratings(impressions: int, new_user_share: float, seed: int, limit: int | None = None,
                      new_user_impressions: int = 5, new_user_session_s: float = 0.0,
                      base_ctr: float | None = None) -> Ratings:
    """The synthetic feed (``stream.replay.synthetic``) as ratings: clicked impressions rate 5, the others 1
    (so rating >= 4 is a click). ``base_ctr`` None: the feed's default."""
    from stream.replay.config import ReplaySettings, SyntheticSettings
    from stream.replay.synthetic import build_synthetic

    s = SyntheticSettings(impressions=impressions, new_user_share=new_user_share, malformed_share=0.0,
                          new_user_impressions=new_user_impressions, new_user_session_s=new_user_session_s)
    if base_ctr is not None:
        s = dataclasses.replace(s, base_ctr=base_ctr)
    t = build_synthetic(s, ReplaySettings().click_delay, seed, limit=limit)
    clicked = np.isin(t.impression_id, t.click_impression_id)
    user_attrs: dict[Any, dict[str, Any]] = {}
    item_attrs: dict[Any, dict[str, Any]] = {}
    for part in t.context:  # device + hour (per impression), tags (per item): keep the per-entity ones
        for i in range(len(t.impression_id)):
            d = part.dicts[part.index[i]]
            if "device" in d:
                user_attrs.setdefault(int(t.user_id[i]), {"device": d["device"]})
            if "tags" in d:
                item_attrs.setdefault(int(t.item_id[i]), {"tags": d["tags"]})
    return Ratings.from_raw(t.user_id, t.item_id, np.where(clicked, 5.0, 1.0), t.ts, user_attrs, item_attrs,
                            dataset="synthetic")


def cold_mask(user: np.ndarray, k: int) -> np.ndarray:
    """(N,) True where the user had fewer than ``k`` earlier rows (rows in event-time order)."""
    return earlier_rows(user) < k
