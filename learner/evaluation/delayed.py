"""The ``delayed`` protocol: what users of the daemon get, simulated in event time in one process.

Replay + joiner + learner, deterministic: the ratings in event-time order are impressions; a rating >= 4
gets a click a delay later, drawn from the replay's click-delay model (``stream.replay.table.
draw_click_delays_ms``, the same draws ``streamrec replay`` makes for the same seed); the joiner's own
join (``stream.joiner.engine.PartitionJoin``, with its window, lateness, watermark quorum and emission
policy) turns the events into samples in the order and at the event time it would emit them; a learner
(``learner.trainer.Trainer``, with ``learner/delayed.py``'s weights) trains on them in steps of
``batch_size`` rows as they come.

Served quality, the measure: every impression is scored by the model as it stands when the impression
arrives (event time), before any sample of its own is trained. Its true label is the joined one (a click
inside the attribution window). Reported over the whole stream, its last 20% and cold users (a user's first
``cold_k`` impressions): AUC, logloss and normalized entropy (NE: logloss over the entropy of the base rate,
He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook", ADKDD 2014; NE >= 1 is no better
than always predicting the base rate). Also reported: the progressive AUC the learner measures on what it is
fed (test-then-train on the emitted samples, as the daemon's ``streamrec_learner_auc``: biased by the
emission order), the freshness of a click in the model (event time from the click to the step that trains
its positive) and the throughput of the simulation.

Approximations (each small next to what is measured): one partition fed in event-time order in batches of
``feed_events`` events; a sample's features are the impression's, with the history as of the impression
minus ``history_delay_s`` (``learner/evaluation/samples.py``), whichever emission carries it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from learner.batch import TensorBatch, to_tensors
from learner.delayed import BaseRateBias
from learner.evaluation.config import EvalConfig
from learner.evaluation.ratings import Ratings, cold_mask, online_labels
from learner.evaluation.samples import build_samples, columns_feature_config, feature_config
from learner.features import FeatureConfig
from learner.progressive import auc, logloss, normalized_entropy
from learner.trainer import Trainer
from stream.events import Click, Impression
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.replay.config import ClickDelay, DelayKind
from stream.replay.table import draw_click_delays_ms
from stream.samples import DELAYED_POSITIVE, SampleBatch

LAST_SHARE = 0.2
Log = Callable[[str], None]


def served_metrics(probs: np.ndarray, y: np.ndarray) -> dict[str, float]:
    return {"auc": auc(probs, y), "logloss": logloss(probs, y), "ne": normalized_entropy(probs, y),
            "n": int(len(y)), "positive_rate": float(y.mean()) if len(y) else float("nan"),
            "mean_prediction": float(probs.mean()) if len(y) else float("nan")}  # calibration: vs positive_rate


def _relabel(sb: SampleBatch, rows: np.ndarray, labels: np.ndarray, kinds: np.ndarray,
             label_delay_ms: np.ndarray) -> SampleBatch:
    """``sb``'s ``rows`` with the emitted labels, kinds and label delays."""
    b = sb.batch.take(pa.array(rows, pa.int64()))
    for name, values in (("label", labels.astype(np.int8)), ("kind", kinds.astype(np.int8)),
                         ("label_delay_ms", label_delay_ms.astype(np.int64))):
        b = b.set_column(b.schema.get_field_index(name), name, pa.array(values))
    return SampleBatch(b)


class Ids(Protocol):
    """How a run treats ids (``learner/cold_start.py``'s variants): its feature config, and what it does to
    every batch before the model sees it (``train``: a training step, else serving's lookup) and after each
    training step."""

    def feature_config(self, sb: SampleBatch) -> FeatureConfig: ...

    def trainer(self, fcfg: FeatureConfig) -> Trainer: ...

    def prepare(self, tb: TensorBatch, now_s: float, train: bool) -> None: ...

    def after_step(self) -> None: ...


def run_delayed(r: Ratings, features: str, seed: int, cfg: EvalConfig, log: Log,
                make_trainer: Callable[[Any, EvalConfig, int], Trainer], ids: Ids | None = None) -> dict[str, Any]:
    """The ``delayed`` protocol on ``r`` (module docstring); ``ids`` None: hashed ids (the feature set's)."""
    n = len(r)
    clicked_rows = np.flatnonzero(online_labels(r.rating))
    rng = np.random.Generator(np.random.PCG64(cfg.delay_seed))
    delay = ClickDelay(DelayKind.LOGNORMAL, cfg.click_delay_median_s, cfg.click_delay_sigma)
    click_ts = r.ts_ms[clicked_rows] + draw_click_delays_ms(delay, len(clicked_rows), rng)
    window_ms = int(cfg.window_s * 1000)
    y = np.zeros(n, np.float64)  # the joined label: a click inside the window
    y[clicked_rows[click_ts - r.ts_ms[clicked_rows] <= window_ms]] = 1.0
    click_at = np.full(n, -1, np.int64)
    click_at[clicked_rows] = click_ts

    t0 = time.perf_counter()
    sb = build_samples(r, np.arange(n), y.astype(np.int8), features, cfg)
    build_s = time.perf_counter() - t0
    if ids is not None:
        fcfg = ids.feature_config(sb)
        trainer = ids.trainer(fcfg)
    else:
        fcfg = columns_feature_config(sb, cfg) if r.dataset == "synthetic" else feature_config(features, cfg)
        trainer = make_trainer(fcfg, cfg, seed)

    jcfg = JoinConfig(window_ms=window_ms, lateness_ms=int(cfg.lateness_s * 1000), policy=cfg.emission,
                      elapsed_ms=int(cfg.elapsed_s * 1000), max_pending=10 * n + 1, max_waiting=10 * n + 1)
    join = PartitionJoin(0, jcfg)
    ev_ts = np.concatenate([r.ts_ms, click_ts])
    ev_kind = np.concatenate([np.zeros(n, np.int8), np.ones(len(click_ts), np.int8)])
    ev_row = np.concatenate([np.arange(n), clicked_rows])
    order = np.lexsort((ev_kind, ev_ts))  # event time; impressions first at equal times

    served = np.full(n, np.nan)
    to_score: list[np.ndarray] = []
    buf_rows: list[int] = []
    buf_labels: list[int] = []
    buf_kinds: list[int] = []
    buf_delays: list[int] = []
    freshness_ms: list[np.ndarray] = []
    offsets = [-1, -1]
    n_delayed = 0
    step = cfg.batch_size
    bias = BaseRateBias(prior_rate=cfg.prior_click_rate) if cfg.init_bias else None
    if bias is not None:
        bias.start(trainer.model)
    t_train = time.perf_counter()
    next_log = n // 10

    def score() -> None:
        if to_score:
            rows = np.concatenate(to_score)
            to_score.clear()
            probs = []
            for i in range(0, len(rows), cfg.eval_batch):
                tb = to_tensors(SampleBatch(sb.batch.take(pa.array(rows[i:i + cfg.eval_batch]))), fcfg)
                if ids is not None:
                    ids.prepare(tb, float(r.ts_ms[rows[i]]) / 1000.0, False)
                probs.append(trainer.predict(tb))
            served[rows] = np.concatenate(probs)

    def train(now_ms: int, final: bool = False) -> None:
        nonlocal buf_rows, buf_labels, buf_kinds, buf_delays
        while len(buf_rows) >= step or (final and buf_rows):
            score()  # the impressions so far are scored by the model before this step
            rows, labels = np.array(buf_rows[:step]), np.array(buf_labels[:step])
            kinds, delays = np.array(buf_kinds[:step], np.int8), np.array(buf_delays[:step], np.int64)
            buf_rows, buf_labels, buf_kinds = buf_rows[step:], buf_labels[step:], buf_kinds[step:]
            buf_delays = buf_delays[step:]
            tb = to_tensors(_relabel(sb, rows, labels, kinds, delays), fcfg)
            if ids is not None:
                ids.prepare(tb, now_ms / 1000.0, True)
            trainer.test_then_train(tb)
            if ids is not None:
                ids.after_step()
            if bias is not None:
                bias.update(trainer.model, labels, kinds, tb.ts, tb.label_delay_ms)
            pos = rows[labels == 1]
            freshness_ms.append(now_ms - click_at[pos])

    feed = cfg.feed_events
    for start in range(0, len(order), feed):
        idx = order[start:start + feed]
        imps, clicks = [], []
        for k in idx:
            row = int(ev_row[k])
            if ev_kind[k] == 0:
                offsets[0] += 1
                imps.append((offsets[0], Impression(str(row), int(ev_ts[k]), "u", "i", {}, {})))
            else:
                offsets[1] += 1
                clicks.append((offsets[1], Click(str(row), int(ev_ts[k]))))
        new_rows = ev_row[idx[ev_kind[idx] == 0]]
        if len(new_rows):
            to_score.append(new_rows)
        last = start + feed >= len(order)
        res = join.apply(imps, clicks, drain=last)
        now = int(ev_ts[idx[-1]])
        for s in res.samples:
            n_delayed += s.kind == DELAYED_POSITIVE
            buf_rows.append(int(s.pending.impression_id))
            buf_labels.append(s.label)
            buf_kinds.append(s.kind)
            buf_delays.append(s.label_delay_ms)
        train(now, final=last)
        if start >= next_log:
            log(f"{min(start + feed, len(order)):,} / {len(order):,} events  emitted-order progressive auc "
                f"{trainer.metrics.auc:.4f}  ({time.perf_counter() - t_train:.0f}s)")
            next_log += len(order) // 10
    score()
    train_s = time.perf_counter() - t_train

    cut = n - int(round(n * LAST_SHARE))
    cold = cold_mask(r.user, cfg.cold_k)
    fresh = np.concatenate(freshness_ms) / 1000.0 if freshness_ms else np.zeros(0)
    return {
        "fields": [f.name for f in fcfg.fields], "n_samples": n, "emission": cfg.emission,
        "es_dfm_elapsed_s": cfg.elapsed_s if cfg.emission == "es_dfm" else None,
        "window_s": cfg.window_s, "positive_rate": float(y.mean()),
        "served": served_metrics(served, y), "served_last": served_metrics(served[cut:], y[cut:]),
        "served_cold": served_metrics(served[cold], y[cold]), "served_warm": served_metrics(served[~cold], y[~cold]),
        "emitted_samples": trainer.samples, "delayed_positives": n_delayed,
        "emitted_order_auc": trainer.metrics.auc, "emitted_order_logloss": trainer.metrics.logloss,
        "click_to_model_s": {"p50": float(np.median(fresh)) if len(fresh) else None,
                             "p90": float(np.quantile(fresh, 0.9)) if len(fresh) else None},
        "late_share_estimate": trainer.delayed.late_share if cfg.emission in ("fake_negative", "es_dfm") else None,
        "steps": trainer.steps, "build_s": build_s, "train_s": train_s,
        "samples_per_s": trainer.samples / train_s if train_s > 0 else None,
    }
