"""The two protocols of ``streamrec evaluate``, both on the learner's own code path.

Batches of ``learner.evaluation.samples.build_samples`` become tensors through
``learner.batch.to_tensors`` and a ``FeatureConfig``, and a ``learner.model.DeepFM`` learns through
``learner.trainer.Trainer.test_then_train`` with ``learner.optim.make_optimizers``.

``autoint``   the offline protocol of AutoInt (Song et al., CIKM 2019, arXiv 1810.11921): ratings > 3 are
              positives, < 3 negatives, = 3 dropped (739,012 samples); a random 8:1:1 train/valid/test
              split by seed; a few epochs with early stopping on valid AUC; test AUC and logloss (Platt-
              calibrated on the valid split, ``learner.evaluation.calibration``).
``online``    every rating in event-time order (rating >= 4 is a click, every rating an impression), one
              test-then-train pass: each prediction is made before the model learns from its sample;
              progressive AUC and logloss over the whole stream and over its last 20%.

The sample batch of the whole data set is built once and mini-batches are Arrow slices of it, so an
epoch costs the model's time, not feature building.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from learner.batch import to_tensors
from learner.calibration import OnlineCalibration
from learner.evaluation.calibration import apply_platt, fit_platt
from learner.evaluation.config import FEATURE_SETS, PROTOCOLS, EvalConfig, resolve_config
from learner.evaluation.delayed import run_delayed
from learner.evaluation.ratings import (
    Ratings,
    autoint_labels,
    load_ratings,
    online_labels,
    split_811,
    synthetic_ratings,
)
from learner.evaluation.samples import build_samples, feature_config
from learner.features import FeatureConfig
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.progressive import auc, logloss
from learner.trainer import Trainer
from stream.samples import SampleBatch

LAST_SHARE = 0.2  # online: the tail of the stream reported on its own

Log = Callable[[str], None]


def _make_trainer(fcfg: FeatureConfig, cfg: EvalConfig, seed: int) -> Trainer:
    model = DeepFM(fcfg, mlp=cfg.mlp, dropout=cfg.dropout, seed=seed,
                   autocast_dtype=torch.bfloat16 if cfg.autocast == "bf16" else None)
    sparse, dense = make_optimizers(model, cfg.lr_sparse, cfg.lr_dense, cfg.sparse_optimizer, cfg.weight_decay,
                                    initial_accumulator=cfg.initial_accumulator, boost=cfg.boost,
                                    boost_half_life=cfg.boost_half_life)
    return Trainer(model, sparse, dense, calibration=OnlineCalibration() if cfg.online_calibration else None)


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


def log_to(log: Log | bool | None) -> Log:
    """A progress sink from :func:`evaluate`'s ``log`` argument: ``True`` prints to stderr, a callable is
    used as is, ``None``/``False`` discards."""
    if log is True:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return log or (lambda msg: None)


def _run_autoint(r: Ratings, features: str, seed: int, cfg: EvalConfig, log: Log) -> dict[str, Any]:
    """The ``autoint`` protocol on ``r``: split, epochs with early stopping, calibrated test metrics."""
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
    if cfg.calibrate and ab == (1.0, 0.0):  # fit_platt's refusal: the test split is scored as the model says
        log("Platt: the valid split supports no increasing map (one class, or scores ranking backwards): identity")
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
    """The ``online`` protocol on ``r``: one test-then-train pass in event-time order."""
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
    """Run one evaluation and return its summary (see the module docstring for the protocols and
    ``learner.evaluation.samples`` for the feature sets).

    ``epochs`` overrides the configuration's (autoint only); ``config`` overrides any :class:`EvalConfig`
    field; ``limit`` keeps only the earliest N ratings (tests, quick looks); ``log`` receives progress
    lines (``True``: stderr).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if features not in FEATURE_SETS:
        raise ValueError(f"features must be one of {FEATURE_SETS}, got {features!r}")
    cfg = resolve_config(protocol, features, config, epochs)
    out_log = log_to(log)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        # Dropout draws from torch's global generator: it is seeded for a run that is the same given ``seed``,
        # and the caller's own stream is restored afterwards (an evaluation leaves no trace on it). The CPU's alone:
        # torch.manual_seed also reseeded every CUDA generator of the caller, which fork_rng(devices=[]) leaves out.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            if dataset == "synthetic":
                if protocol != "delayed":
                    raise ValueError("--dataset synthetic runs with --protocol delayed (and --cold-start)")
                r = synthetic_ratings(cfg.syn_impressions, cfg.syn_new_user_share, seed, limit,
                                      base_ctr=cfg.syn_base_ctr)
            else:
                r = load_ratings(dataset, limit)
            load_s = time.perf_counter() - t0
            out_log(f"{dataset}: {len(r):,} ratings loaded in {load_s:.1f}s; protocol {protocol}, features {features}")
            if protocol == "delayed":
                result = run_delayed(r, features, seed, cfg, out_log, _make_trainer)
            else:
                run = _run_autoint if protocol == "autoint" else _run_online
                result = run(r, features, seed, cfg, out_log)
    finally:
        torch.set_num_threads(threads)
    fields = result.pop("fields", None) or [f.name for f in feature_config(features, cfg).fields]
    summary: dict[str, Any] = {"dataset": dataset, "protocol": protocol, "features": features, "seed": seed,
                               "limit": limit, "fields": fields}
    summary.update(result)
    summary["config"] = cfg.to_dict()
    summary["load_s"] = load_s
    summary["elapsed_s"] = time.perf_counter() - t0
    return summary


def describe(d: dict[str, Any]) -> str:
    """A human-readable summary of :func:`evaluate`'s result."""
    c = d["config"]
    head = (f"{d['dataset']} protocol={d['protocol']} features={d['features']} seed={d['seed']}"
            + (f" limit={d['limit']:,}" if d.get("limit") else "")
            + (f" history_delay_s={c['history_delay_s']:g}" if c.get("history_delay_s") else ""))
    lines = [head, f"  fields: {', '.join(d['fields'])}"]
    if d["protocol"] == "autoint":
        lines += [
            f"  samples: train {d['n_train']:,}  valid {d['n_valid']:,}  test {d['n_test']:,}  "
            f"(positives {d['positive_rate']:.1%})",
            f"  test AUC {d['auc']:.4f}  logloss {d['logloss']:.4f} (uncalibrated {d['logloss_uncalibrated']:.4f}; "
            f"Platt a={d['calibration']['a']:.3f} b={d['calibration']['b']:.3f} fitted on valid)",
            f"  valid AUC {d['valid_auc']:.4f}; best epoch {d['best_epoch']} of {d['epochs_run']}",
        ]
    elif d["protocol"] == "delayed":
        sv, sl, sc = d["served"], d["served_last"], d["served_cold"]
        fr = d["click_to_model_s"]
        lines += [
            f"  {d['n_samples']:,} impressions (joined positives {d['positive_rate']:.1%}), emission {d['emission']}"
            + (f" (elapsed {d['es_dfm_elapsed_s']:g}s)" if d.get("es_dfm_elapsed_s") is not None else "")
            + f", window {d['window_s']:g}s; {d['emitted_samples']:,} samples trained "
            f"({d['delayed_positives']:,} delayed positives)",
            f"  served AUC {sv['auc']:.4f}  logloss {sv['logloss']:.4f}  NE {sv['ne']:.4f}",
            f"  served, last {LAST_SHARE:.0%}: AUC {sl['auc']:.4f}  NE {sl['ne']:.4f};  cold users "
            f"({sc['n']:,} impressions): AUC {sc['auc']:.4f}  NE {sc['ne']:.4f}",
            f"  progressive AUC on the emitted order (what the daemon's own metric sees): "
            f"{d['emitted_order_auc']:.4f}",
            f"  click to model: median {fr['p50']:.0f}s, p90 {fr['p90']:.0f}s event time; "
            f"{d['samples_per_s']:,.0f} samples/s",
        ]
    else:
        lines += [
            f"  samples: {d['n_samples']:,} in event-time order (positives {d['positive_rate']:.1%}), one pass",
            f"  progressive AUC {d['auc']:.4f}  logloss {d['logloss']:.4f}",
            f"  last {d['last_share']:.0%} ({d['n_last']:,} samples): AUC {d['last_auc']:.4f}  "
            f"logloss {d['last_logloss']:.4f}",
        ]
    lines.append(f"  model: DeepFM dim {c['embedding_dim']} mlp {c['mlp']} dropout {c['dropout']}  "
                 f"lr dense {c['lr_dense']} sparse {c['lr_sparse']} ({c['sparse_optimizer']})  "
                 f"batch {c['batch_size']}")
    lines.append(f"  elapsed {d['elapsed_s']:.1f}s (load {d['load_s']:.1f}s, features {d['build_s']:.1f}s, "
                 f"training {d['train_s']:.1f}s)")
    return "\n".join(lines)
