"""``streamrec evaluate``: how accurate the streaming learner is on MovieLens-1M, offline and online.

Two protocols, both on the learner's own code path: raw values are hashed with
``stream.features.hash_value``/``hash_context`` into a ``stream.samples.SampleBatch`` (columns
``user_id``, ``item_id``, ``history``, ``ctx.<name>``), batches become tensors through
``learner.batch.to_tensors`` and a ``FeatureConfig``, and a ``learner.model.DeepFM`` learns through
``learner.trainer.Trainer.test_then_train`` with ``learner.optim.make_optimizers``.

``autoint``   the offline protocol of AutoInt (Song et al., CIKM 2019, arXiv 1810.11921): ratings > 3 are
              positives, < 3 negatives, = 3 dropped (739,012 samples); a random 8:1:1 train/valid/test
              split by seed; a few epochs with early stopping on valid AUC; test AUC and logloss.
``online``    every rating in event-time order (rating >= 4 is a click, every rating an impression), one
              test-then-train pass: each prediction is made before the model learns from its sample;
              progressive AUC and logloss over the whole stream and over its last 20%.

Feature sets:

``paper``     AutoInt's seven MovieLens-1M fields, none of them an id (the fields of the paper's Figure 5:
              Gender, Age, Occupation, Zipcode, RequestTime, ReleaseTime, Genre): the user's gender, age,
              occupation and zip code, the request time (the hour of the week of the rating, UTC; the
              paper does not say how fine, hour of the week beat hour of day and weekday on valid AUC),
              the movie's release year and its genres (multi-valued, mean-pooled).
``default``   those plus user id, item id and the user's history: the items the user rated >= 4
              strictly before this rating's timestamp, newest last, at most 50 (as of time: a rating
              never sees itself, a rating of the same second, or the future). The history shares the
              item id rows of the embedding table.

The sample batch of the whole data set is built once (numpy; Python only hashes distinct values) and
mini-batches are Arrow slices of it, so an epoch costs the model's time, not feature building.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from learner.batch import to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.progressive import auc, logloss
from learner.trainer import Trainer
from stream.features import MISSING, hash_context, hash_value
from stream.replay.movielens import CLICK_MIN_RATING, DATASETS, _attribute_dicts, _read_tsv
from stream.samples import CTX_PREFIX, SampleBatch

PROTOCOLS = ("autoint", "online")
FEATURE_SETS = ("paper", "default")
REQUEST_TIME = "request_time"  # the context name of the request-time field
PAPER_FIELDS = ("gender", "age", "occupation", "zip", REQUEST_TIME, "year", "genres")  # AutoInt's 7 fields
MULTI_VALUED = frozenset({"genres"})
LAST_SHARE = 0.2  # online: the tail of the stream reported on its own

Log = Callable[[str], None]
# request-time granularity: (ms per unit, units per period)
_TIME_UNITS = {"hour": (3_600_000, 24), "weekday": (86_400_000, 7), "hour_of_week": (3_600_000, 168)}


# -- configuration --------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalConfig:
    """Model, optimizer and feature-hashing knobs of one evaluation (tuned on valid AUC, never on test)."""

    embedding_dim: int = 16
    mlp: tuple[int, ...] = (400, 400, 400)
    dropout: float = 0.0
    lr_dense: float = 1e-3
    lr_sparse: float = 0.05
    sparse_optimizer: str = "rowwise_adagrad"
    initial_accumulator: float = 0.0  # row-wise Adagrad: pseudo squared gradient every row starts with
    boost: float = 0.0  # row-wise Adagrad: young rows learn up to 1 + boost times faster
    boost_half_life: float = 8.0  # updates
    weight_decay: float = 0.0
    batch_size: int = 4096
    epochs: int = 5  # autoint: the most epochs; online: always one pass
    patience: int = 1  # autoint: stop after this many epochs without a better valid AUC
    lr_decay: float = 1.0  # autoint: both learning rates are multiplied by this after every epoch
    calibrate: bool = True  # autoint: Platt-scale the test probabilities with (a, b) fitted on the valid split
    id_buckets: int = 500_000  # user_id, item_id (history shares item_id's rows)
    ctx_buckets: int = 10_000  # small context fields (gender, age, occupation, request time, year, genres)
    zip_buckets: int = 200_000  # ctx.zip: 3,439 distinct zip codes
    history_len: int = 50
    request_time: str = "hour_of_week"  # the request-time field from the rating time: hour | weekday | hour_of_week
    autocast: str | None = None  # None: fp32; "bf16": the dense part under bfloat16 autocast
    eval_batch: int = 65_536
    threads: int = 2

    def __post_init__(self) -> None:
        if self.request_time not in _TIME_UNITS:
            raise ValueError(f"request_time must be one of {sorted(_TIME_UNITS)}, got {self.request_time!r}")
        if self.autocast not in (None, "bf16"):
            raise ValueError(f"autocast must be None or 'bf16', got {self.autocast!r}")
        if self.batch_size < 1 or self.epochs < 1 or self.patience < 1:
            raise ValueError("batch_size, epochs and patience must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mlp"] = list(self.mlp)
        return d


@dataclass(frozen=True)
class EvalOverrides:
    """Settings a user may override from the command line, ``[evaluate]`` in ``--config`` or
    ``STREAMREC_EVALUATE_*`` (``streamrec.settings.build`` fills it); ``None`` keeps the tuned default."""

    embedding_dim: int | None = None
    mlp: str | None = None  # "400,400,400"
    dropout: float | None = None
    lr_dense: float | None = None
    lr_sparse: float | None = None
    lr_decay: float | None = None
    sparse_optimizer: str | None = None
    initial_accumulator: float | None = None
    boost: float | None = None
    boost_half_life: float | None = None
    weight_decay: float | None = None
    batch_size: int | None = None
    epochs: int | None = None
    patience: int | None = None
    id_buckets: int | None = None
    ctx_buckets: int | None = None
    zip_buckets: int | None = None
    history_len: int | None = None
    request_time: str | None = None
    calibrate: bool | None = None
    eval_batch: int | None = None
    threads: int | None = None

    def to_config(self) -> dict[str, Any]:
        """The set fields as :func:`resolve_config` overrides; raises ValueError on a malformed ``mlp``."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if "mlp" in out:
            try:
                out["mlp"] = tuple(int(x) for x in str(out["mlp"]).replace(" ", "").split(",") if x)
            except ValueError:
                raise ValueError(f"mlp: expected comma-separated layer widths like 400,400,400, "
                                 f"got {self.mlp!r}") from None
        return out


# Chosen by valid AUC (autoint) / by the progressive AUC of the first 80% of the stream (online).
DEFAULT_CONFIGS: dict[tuple[str, str], EvalConfig] = {
    ("autoint", "paper"): EvalConfig(embedding_dim=32, lr_sparse=0.1, lr_dense=2e-3, batch_size=2048, epochs=10,
                                     patience=2),
    ("autoint", "default"): EvalConfig(embedding_dim=32, lr_sparse=0.1, lr_dense=2e-3, batch_size=2048, epochs=10,
                                       patience=2, lr_decay=0.6),
    ("online", "paper"): EvalConfig(batch_size=8, mlp=(200, 200), lr_sparse=0.07, lr_dense=3e-4),
    ("online", "default"): EvalConfig(batch_size=8, mlp=(200, 200), lr_sparse=0.07, lr_dense=3e-4),
}


def resolve_config(protocol: str, features: str, config: EvalConfig | Mapping[str, Any] | None = None,
                   epochs: int | None = None) -> EvalConfig:
    """The protocol's default configuration, overridden by ``config`` (an EvalConfig or a dict of fields)."""
    base = DEFAULT_CONFIGS[(protocol, features)]
    if isinstance(config, EvalConfig):
        base = config
    elif config:
        known = {f.name for f in fields(EvalConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown evaluation settings {unknown}; known: {sorted(known)}")
        over = dict(config)
        if "mlp" in over:
            over["mlp"] = tuple(over["mlp"])
        base = replace(base, **over)
    if epochs is not None:
        base = replace(base, epochs=epochs)
    return base


# -- the ratings ----------------------------------------------------------------------------
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


RawIds = np.ndarray | pa.Array | pa.ChunkedArray | list


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
    """A packaged MovieLens data set (``stream/replay/movielens.py`` locates it and parses attributes
    exactly as replay does, so the hashed values are the ones the joiner puts on the samples topic)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown data set {dataset!r}; known: {', '.join(sorted(DATASETS))}")
    ds = DATASETS[dataset]
    folder = ds.locate()
    inter = _read_tsv(folder / f"{dataset}.inter")
    users_raw, items_raw = inter.column("user_id:token"), inter.column("item_id:token")
    rating = np.asarray(inter.column("rating:float").cast(pa.float64()).to_numpy(), np.float64)
    ts_ms = np.rint(inter.column("timestamp:float").cast(pa.float64()).to_numpy() * 1000).astype(np.int64)
    user_attrs = _attribute_dicts(_read_tsv(folder / f"{dataset}.user"), "user_id:token", ds.user_fields,
                                  ds.multi_valued)
    item_attrs = _attribute_dicts(_read_tsv(folder / f"{dataset}.item"), "item_id:token", ds.item_fields,
                                  ds.multi_valued)
    return Ratings.from_raw(users_raw, items_raw, rating, ts_ms, user_attrs, item_attrs, dataset, limit)


# -- protocol pieces (pure numpy, tested on their own) ---------------------------------------
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


def gather_lists(flat: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` of a list column ``(flat, offsets)`` -> a new ``(flat, offsets)``, no Python loop."""
    starts, lengths = offsets[idx], offsets[np.asarray(idx) + 1] - offsets[idx]
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    pos = np.repeat(starts - out[:-1], lengths) + np.arange(out[-1])
    return flat[pos], out


def history_as_of(user: np.ndarray, item: np.ndarray, ts: np.ndarray, positive: np.ndarray,
                  max_len: int = 50, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's history: the items of the same user's positive rows with a timestamp strictly before
    the row's, oldest first, the last ``max_len`` of them. Returns ``(flat items, offsets)`` for
    ``rows`` (default: every row, in input order). One sort by (user, ts); the rest is vectorized."""
    user, item, ts = np.asarray(user), np.asarray(item), np.asarray(ts)
    positive = np.asarray(positive, bool)
    n = len(user)
    order = np.lexsort((np.arange(n), ts, user))  # by user, then time, then input order
    u, t, pos = user[order], ts[order], positive[order]
    cum = np.zeros(n + 1, np.int64)  # cum[i]: positives among the first i sorted rows
    np.cumsum(pos, out=cum[1:])
    idx = np.arange(n)
    first = np.ones(n, bool)
    first[1:] = u[1:] != u[:-1]
    user_start = np.maximum.accumulate(np.where(first, idx, 0))
    first[1:] |= t[1:] != t[:-1]  # first row of each (user, ts) group
    group_start = np.maximum.accumulate(np.where(first, idx, 0))
    end = cum[group_start]  # positives of this user strictly before this timestamp: [cum[user_start], end)
    begin = np.maximum(end - max_len, cum[user_start])
    pos_items = item[order][pos]  # the k-th positive in sorted order is pos_items[k]
    b, e = np.empty(n, np.int64), np.empty(n, np.int64)
    b[order], e[order] = begin, end
    if rows is not None:
        b, e = b[rows], e[rows]
    lengths = e - b
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    take = np.repeat(b - offsets[:-1], lengths) + np.arange(offsets[-1])
    return pos_items[take], offsets


def request_time(ts_ms: np.ndarray, kind: str = "hour_of_week") -> np.ndarray:
    """The raw request-time value of each rating (UTC): hour of day, weekday (0 = Thursday, the epoch's
    weekday) or hour of the week."""
    unit, period = _TIME_UNITS[kind]
    return (np.asarray(ts_ms, np.int64) // unit) % period


def _hash_many(values: np.ndarray) -> np.ndarray:
    """hash_value of every element, hashing each distinct value once."""
    uniq, inv = np.unique(values, return_inverse=True)
    lut = np.fromiter((hash_value(v.item() if hasattr(v, "item") else v) for v in uniq), np.int64, len(uniq))
    return lut[inv.ravel()]


def build_samples(r: Ratings, rows: np.ndarray, label: np.ndarray, features: str, cfg: EvalConfig) -> SampleBatch:
    """The sample batch of ``rows`` (indices into ``r``), in that order, as the joiner would emit them.
    ``paper`` features leave ``history`` empty (the feature config does not read it)."""
    rows = np.asarray(rows, np.int64)
    u, i = r.user[rows], r.item[rows]
    context: dict[str, Any] = {name: col[u] for name, col in r.user_ctx.items()}
    context.update({name: col[i] for name, col in r.item_ctx.items()})
    context.update({name: gather_lists(flat, off, i) for name, (flat, off) in r.item_lists.items()})
    context[REQUEST_TIME] = _hash_many(request_time(r.ts_ms[rows], cfg.request_time))
    if features == "default":
        history = history_as_of(r.user, r.item_hash[r.item], r.ts_ms, online_labels(r.rating), cfg.history_len, rows)
    else:
        history = (np.zeros(0, np.int64), np.zeros(len(rows) + 1, np.int64))
    imp = np.char.add(f"{r.dataset}-", np.char.zfill(rows.astype(str), 9))  # replay's impression ids
    return SampleBatch.from_columns(
        impression_id=imp, ts=r.ts_ms[rows], label=np.asarray(label, np.int8),
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


# -- training -------------------------------------------------------------------------------
def _make_trainer(fcfg: FeatureConfig, cfg: EvalConfig, seed: int) -> Trainer:
    model = DeepFM(fcfg, mlp=cfg.mlp, dropout=cfg.dropout, seed=seed,
                   autocast_dtype=torch.bfloat16 if cfg.autocast == "bf16" else None)
    sparse, dense = make_optimizers(model, cfg.lr_sparse, cfg.lr_dense, cfg.sparse_optimizer, cfg.weight_decay,
                                    initial_accumulator=cfg.initial_accumulator, boost=cfg.boost,
                                    boost_half_life=cfg.boost_half_life)
    return Trainer(model, sparse, dense)


def _slices(sb: SampleBatch, size: int):
    for start in range(0, len(sb), size):
        yield SampleBatch(sb.batch.slice(start, size))


def predict(trainer: Trainer, sb: SampleBatch, fcfg: FeatureConfig, size: int) -> np.ndarray:
    """Click probabilities of every row of ``sb`` (eval mode, no learning)."""
    if len(sb) == 0:
        return np.zeros(0, np.float32)
    return np.concatenate([trainer.predict(to_tensors(part, fcfg)) for part in _slices(sb, size)])


def _labels(sb: SampleBatch) -> np.ndarray:
    return sb.column("label").astype(np.float64)


def _log_to(log: Log | bool | None) -> Log:
    if log is True:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return log or (lambda msg: None)


def fit_platt(probs: np.ndarray, labels: np.ndarray, iters: int = 50) -> tuple[float, float]:
    """(a, b) minimising the logloss of sigmoid(a * logit(p) + b) on (probs, labels): Newton's method.

    A monotone map: AUC is unchanged; an over-confident model (late epochs) gets its logloss back.
    """
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    z = np.log(p / (1 - p))  # (N,) logits
    y = labels.astype(np.float64)
    def loss(a: float, b: float) -> float:  # mean logloss of sigmoid(a z + b), computed stably
        t = a * z + b
        return float(np.mean(np.logaddexp(0.0, t) - y * t))

    a, b, cur = 1.0, 0.0, loss(1.0, 0.0)
    for _ in range(iters):
        q = 1.0 / (1.0 + np.exp(-(a * z + b)))
        r, w = q - y, q * (1 - q)
        grad = np.array([(r * z).sum(), r.sum()])
        hess = np.array([[(w * z * z).sum(), (w * z).sum()], [(w * z).sum(), w.sum()]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6 and loss(a - t * step[0], b - t * step[1]) > cur:  # damped: never increase the loss
            t *= 0.5
        a, b = a - t * step[0], b - t * step[1]
        new = loss(a, b)
        if cur - new < 1e-12:
            break
        cur = new
    return float(a), float(b)


def apply_platt(probs: np.ndarray, ab: tuple[float, float]) -> np.ndarray:
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    return 1.0 / (1.0 + np.exp(-(ab[0] * np.log(p / (1 - p)) + ab[1])))


def _run_autoint(r: Ratings, features: str, seed: int, cfg: EvalConfig, log: Log) -> dict[str, Any]:
    keep, label = autoint_labels(r.rating)
    kept = np.flatnonzero(keep)
    tr, va, te = split_811(len(kept), seed)
    n_tr, n_va = len(tr), len(va)
    t0 = time.perf_counter()
    rows = kept[np.concatenate([tr, va, te])]
    sb = build_samples(r, rows, label[rows], features, cfg)
    train = SampleBatch(sb.batch.slice(0, n_tr))
    valid = SampleBatch(sb.batch.slice(n_tr, n_va))
    test = SampleBatch(sb.batch.slice(n_tr + n_va))
    build_s = time.perf_counter() - t0
    fcfg = feature_config(features, cfg)
    trainer = _make_trainer(fcfg, cfg, seed)
    shuffle = np.random.Generator(np.random.PCG64([seed, 1]))  # epoch order; independent of the split's
    y_va, y_te = _labels(valid), _labels(test)
    best_auc, best_epoch, best_state, bad = -1.0, 0, None, 0
    history: list[dict[str, float]] = []
    t_train = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        t_ep = time.perf_counter()
        epoch_batch = SampleBatch(train.batch.take(pa.array(shuffle.permutation(n_tr))))
        losses = []
        for part in _slices(epoch_batch, cfg.batch_size):
            trainer.test_then_train(to_tensors(part, fcfg))
            losses.append(trainer.last_loss)
        p_va = predict(trainer, valid, fcfg, cfg.eval_batch)
        v_auc, v_loss = auc(p_va, y_va), logloss(p_va, y_va)
        history.append({"epoch": epoch, "train_loss": float(np.mean(losses)), "valid_auc": v_auc,
                        "valid_logloss": v_loss, "seconds": time.perf_counter() - t_ep})
        for opt in (trainer.sparse_opt, trainer.dense_opt):
            for group in opt.param_groups:
                group["lr"] *= cfg.lr_decay
        log(f"epoch {epoch}: train loss {np.mean(losses):.4f}  valid auc {v_auc:.4f}  logloss {v_loss:.4f}  "
            f"({time.perf_counter() - t_ep:.1f}s)")
        if v_auc > best_auc:
            best_auc, best_epoch, bad = v_auc, epoch, 0
            best_state = copy.deepcopy(trainer.model.state_dict())
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    train_s = time.perf_counter() - t_train
    if best_state is not None:
        trainer.model.load_state_dict(best_state)
    p_va = predict(trainer, valid, fcfg, cfg.eval_batch)
    p_te = predict(trainer, test, fcfg, cfg.eval_batch)
    # Calibration is fitted on the valid split only; the test split is touched once, here.
    ab = fit_platt(p_va, y_va) if cfg.calibrate and len(p_va) else (1.0, 0.0)
    return {
        "n_train": n_tr, "n_valid": n_va, "n_test": len(te),
        "positive_rate": float(label[kept].mean()) if len(kept) else float("nan"),
        "auc": auc(p_te, y_te), "logloss": logloss(apply_platt(p_te, ab), y_te),
        "logloss_uncalibrated": logloss(p_te, y_te), "calibration": {"a": ab[0], "b": ab[1]},
        "valid_auc": auc(p_va, y_va), "valid_logloss": logloss(p_va, y_va),
        "best_epoch": best_epoch, "epochs_run": len(history), "epoch_log": history,
        "build_s": build_s, "train_s": train_s,
    }


def _run_online(r: Ratings, features: str, seed: int, cfg: EvalConfig, log: Log) -> dict[str, Any]:
    label = online_labels(r.rating)
    n = len(r)
    t0 = time.perf_counter()
    sb = build_samples(r, np.arange(n), label, features, cfg)
    build_s = time.perf_counter() - t0
    fcfg = feature_config(features, cfg)
    trainer = _make_trainer(fcfg, cfg, seed)
    probs = np.empty(n, np.float64)
    t_train = time.perf_counter()
    done, next_log = 0, n // 10
    for part in _slices(sb, cfg.batch_size):
        probs[done:done + len(part)] = trainer.test_then_train(to_tensors(part, fcfg))
        done += len(part)
        if done >= next_log:
            log(f"{done:,} / {n:,} samples  progressive auc {trainer.metrics.auc:.4f}  "
                f"logloss {trainer.metrics.logloss:.4f}  ({time.perf_counter() - t_train:.0f}s)")
            next_log += n // 10
    train_s = time.perf_counter() - t_train
    y = label.astype(np.float64)
    cut = n - int(round(n * LAST_SHARE))
    return {
        "n_samples": n, "positive_rate": float(y.mean()) if n else float("nan"),
        "auc": auc(probs, y), "logloss": logloss(probs, y),
        "last_share": LAST_SHARE, "n_last": n - cut,
        "last_auc": auc(probs[cut:], y[cut:]), "last_logloss": logloss(probs[cut:], y[cut:]),
        "first_auc": auc(probs[:cut], y[:cut]), "first_logloss": logloss(probs[:cut], y[:cut]),
        "steps": trainer.steps, "build_s": build_s, "train_s": train_s,
    }


def evaluate(dataset: str = "ml-1m", protocol: str = "autoint", features: str = "default", seed: int = 42, *,
             epochs: int | None = None, config: EvalConfig | Mapping[str, Any] | None = None,
             limit: int | None = None, log: Log | bool | None = None) -> dict[str, Any]:
    """Run one evaluation and return its summary (see the module docstring for the protocols).

    ``epochs`` overrides the configuration's (autoint only); ``config`` overrides any :class:`EvalConfig`
    field; ``limit`` keeps only the earliest N ratings (tests, quick looks); ``log`` receives progress
    lines (``True``: stderr).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if features not in FEATURE_SETS:
        raise ValueError(f"features must be one of {FEATURE_SETS}, got {features!r}")
    cfg = resolve_config(protocol, features, config, epochs)
    out_log = _log_to(log)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        torch.manual_seed(seed)
        r = load_ratings(dataset, limit)
        load_s = time.perf_counter() - t0
        out_log(f"{dataset}: {len(r):,} ratings loaded in {load_s:.1f}s; protocol {protocol}, features {features}")
        run = _run_autoint if protocol == "autoint" else _run_online
        result = run(r, features, seed, cfg, out_log)
    finally:
        torch.set_num_threads(threads)
    fcfg = feature_config(features, cfg)
    summary: dict[str, Any] = {"dataset": dataset, "protocol": protocol, "features": features, "seed": seed,
                               "limit": limit, "fields": [f.name for f in fcfg.fields]}
    summary.update(result)
    summary["config"] = cfg.to_dict()
    summary["load_s"] = load_s
    summary["elapsed_s"] = time.perf_counter() - t0
    return summary


def describe(d: dict[str, Any]) -> str:
    """A human-readable summary of :func:`evaluate`'s result."""
    head = (f"{d['dataset']} protocol={d['protocol']} features={d['features']} seed={d['seed']}"
            + (f" limit={d['limit']:,}" if d.get("limit") else ""))
    lines = [head, f"  fields: {', '.join(d['fields'])}"]
    if d["protocol"] == "autoint":
        lines += [
            f"  samples: train {d['n_train']:,}  valid {d['n_valid']:,}  test {d['n_test']:,}  "
            f"(positives {d['positive_rate']:.1%})",
            f"  test AUC {d['auc']:.4f}  logloss {d['logloss']:.4f} (uncalibrated {d['logloss_uncalibrated']:.4f}; "
            f"Platt a={d['calibration']['a']:.3f} b={d['calibration']['b']:.3f} fitted on valid)",
            f"  valid AUC {d['valid_auc']:.4f}; best epoch {d['best_epoch']} of {d['epochs_run']}",
        ]
    else:
        lines += [
            f"  samples: {d['n_samples']:,} in event-time order (positives {d['positive_rate']:.1%}), one pass",
            f"  progressive AUC {d['auc']:.4f}  logloss {d['logloss']:.4f}",
            f"  last {d['last_share']:.0%} ({d['n_last']:,} samples): AUC {d['last_auc']:.4f}  "
            f"logloss {d['last_logloss']:.4f}",
        ]
    c = d["config"]
    lines.append(f"  model: DeepFM dim {c['embedding_dim']} mlp {c['mlp']} dropout {c['dropout']}  "
                 f"lr dense {c['lr_dense']} sparse {c['lr_sparse']} ({c['sparse_optimizer']})  "
                 f"batch {c['batch_size']}")
    lines.append(f"  elapsed {d['elapsed_s']:.1f}s (load {d['load_s']:.1f}s, features {d['build_s']:.1f}s, "
                 f"training {d['train_s']:.1f}s)")
    return "\n".join(lines)
