"""``streamrec evaluate --cold-start``: how well brand-new users are served, three ways, on one stream.

Every rating (or synthetic impression) goes once through test-then-train in event-time order, as in the
``online`` protocol; a sample is *cold* when its user had fewer than ``cold_k`` earlier impressions. The
same model and settings run with three treatments of ids the model has not learned yet:

``zero``       an id seen ``admit_after`` times gets its own row (starting at zero); until then it is
               served one shared, fixed zero vector (a default vector, as TorchRec's managed-collision
               modules and HugeCTR give unknown ids);
``buckets``    hash buckets only: ``id mod rows`` with as many rows as the other two variants' own rows
               plus buckets, so every variant has the same table size;
``admission``  the same admission, but ids not yet admitted share ``buckets`` learned hash-bucket rows
               (a learned vector from the first request) and idle user buckets forget their earlier
               occupants (``user_bucket_half_life_s``); an admitted id's row starts as its bucket's
               vector (``init``), and young rows can learn faster (row-wise Adagrad with ``boost``).

Reported per variant: progressive AUC and logloss over cold samples, warm samples and all samples.
``--dataset synthetic`` uses the planted-click-model feed (``stream/replay/synthetic.py``) with a steady
arrival of new users; ``ml-1m`` is MovieLens-1M in time order (a user's first ratings are cold).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from learner.batch import TensorBatch, to_tensors
from learner.calibration import OnlineCalibration
from learner.evaluation.config import EvalConfig
from learner.evaluation.delayed import run_delayed
from learner.evaluation.protocols import Log, log_to
from learner.evaluation.ratings import Ratings, cold_mask, load_ratings, online_labels, synthetic_ratings
from learner.evaluation.samples import build_samples
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.progressive import auc, logloss
from learner.row_mapper import RowMapper
from learner.trainer import Trainer
from stream.config import check_counts
from stream.errors import ConfigError, shown
from stream.samples import CTX_PREFIX, SampleBatch

VARIANTS = ("zero", "buckets", "admission")


@dataclass(frozen=True)
class ColdStartConfig:
    cold_k: int = 10  # a user's first K impressions are cold
    # The defaults bound memory below the id count (ML-1M: 6,040 users, 3,706 items), the regime the id
    # maps exist for; --capacity 200000 shows the unbounded one.
    capacity: int = 1000  # own rows per id field (zero, admission); buckets uses capacity + buckets rows
    buckets: int = 2000  # shared fallback rows per id field (admission)
    admit_after: int = 5  # sightings before an id gets its own row (zero, admission)
    init: str = "bucket"  # an admitted row starts as its bucket's vector, or "zero" (admission)
    # idle user buckets shrink halfway to zero per this many seconds of event time (admission); None = never
    user_bucket_half_life_s: float | None = 60.0
    boost: float = 0.0  # young rows learn up to 1 + boost times faster (admission; measured: it hurts)
    boost_half_life: float = 8.0  # updates
    batch_size: int = 64
    synthetic_impressions: int = 300_000
    synthetic_new_user_share: float = 0.1
    synthetic_new_user_impressions: int = 5  # 1..N impressions per brand-new user
    synthetic_new_user_session_s: float = 0.0  # 0: each new user's impressions in one burst; > 0: a session

    def __post_init__(self) -> None:
        """Every setting checked here, before any data loads: a bucket count of 0 or a negative capacity failed as a
        traceback from deep in the feature config, after the data set loaded; a negative ``cold_k`` (no sample cold:
        NaN cold AUC) or a NaN ``boost`` (silently no boost) ran and reported as if they were settings."""
        check_counts("evaluate --cold-start", self, zero_ok=("admit_after",))
        if self.init not in ("bucket", "zero"):
            raise ConfigError(f"[evaluate --cold-start] init must be bucket or zero, got {shown(self.init)}")
        for name, low, open_low, optional in (("boost", 0.0, False, False), ("boost_half_life", 0.0, True, False),
                                              ("user_bucket_half_life_s", 0.0, True, True),
                                              ("synthetic_new_user_session_s", 0.0, False, False),
                                              ("synthetic_new_user_share", 0.0, False, False)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                    or (v <= low if open_low else v < low) or (name.endswith("_share") and v > 1)):
                bound = ("in [0, 1]" if name.endswith("_share") else f"{'>' if open_low else '>='} {low:g}")
                never = " (None: never)" if optional else ""
                raise ConfigError(f"[evaluate --cold-start] {name} must be a finite number {bound}{never}, "
                                  f"got {shown(v)}")


def _feature_config(sb: SampleBatch, cfg: EvalConfig, cs: ColdStartConfig, variant: str) -> FeatureConfig:
    ids: dict[str, Any]
    if variant == "zero":  # the single "bucket" row is the shared zero vector (kept at zero)
        ids = {"num_buckets": 1, "capacity": cs.capacity, "admit_after": cs.admit_after, "init": "zero"}
    elif variant == "buckets":
        ids = {"num_buckets": cs.capacity + cs.buckets}
    else:
        ids = {"num_buckets": cs.buckets, "capacity": cs.capacity, "admit_after": cs.admit_after, "init": cs.init}
    decay = cs.user_bucket_half_life_s if variant == "admission" else None
    specs = [FieldSpec("user_id", "single", **ids, bucket_half_life_s=decay), FieldSpec("item_id", "single", **ids),
             FieldSpec("history", "sequence", 1, shares="item_id")]
    for f in sb.batch.schema:
        if f.name.startswith(CTX_PREFIX):
            specs.append(FieldSpec(f.name, "multi" if pa.types.is_list(f.type) else "single", cfg.ctx_buckets))
    return FeatureConfig(tuple(specs), embedding_dim=cfg.embedding_dim)


def _trainer(fcfg: FeatureConfig, cfg: EvalConfig, cs: ColdStartConfig, variant: str, seed: int) -> Trainer:
    model = DeepFM(fcfg, mlp=cfg.mlp, dropout=cfg.dropout, seed=seed, autocast_dtype=None)
    boost = (cs.boost, cs.boost_half_life) if variant == "admission" and cs.boost > 0 else (0.0, 0.0)
    sparse, dense = make_optimizers(model, cfg.lr_sparse, cfg.lr_dense, cfg.sparse_optimizer, boost=boost[0],
                                    boost_half_life=boost[1], initial_accumulator=cfg.initial_accumulator)
    return Trainer(model, sparse, dense, calibration=OnlineCalibration() if cfg.online_calibration else None)


class VariantIds:
    """One variant's ids for ``learner.evaluation.delayed.run_delayed`` (its ``Ids``): the feature config, the
    RowMapper on every batch (serving's lookups do not count towards admission) and the zero default vector."""

    def __init__(self, cfg: EvalConfig, cs: ColdStartConfig, variant: str, seed: int) -> None:
        self.cfg, self.cs, self.variant, self.seed = cfg, cs, variant, seed
        self.mapper: RowMapper | None = None
        self._trainer: Trainer | None = None
        self._zero_rows: torch.Tensor | None = None

    def feature_config(self, sb: SampleBatch) -> FeatureConfig:
        return _feature_config(sb, self.cfg, self.cs, self.variant)

    def trainer(self, fcfg: FeatureConfig) -> Trainer:
        self.mapper = RowMapper(fcfg)
        self._trainer = _trainer(fcfg, self.cfg, self.cs, self.variant, self.seed)
        if self.variant == "zero":
            self._zero_rows = torch.tensor([fcfg.blocks[i][0] for i in (0, 1)])
            self.after_step()
        return self._trainer

    def prepare(self, tb: TensorBatch, now_s: float, train: bool) -> None:
        assert self.mapper is not None and self._trainer is not None
        self.mapper.apply(tb, now=now_s, train=train, model=self._trainer.model, sparse_opt=self._trainer.sparse_opt)

    def after_step(self) -> None:
        if self._zero_rows is not None and self._trainer is not None:  # the default vector stays zero
            with torch.no_grad():
                self._trainer.model.get_parameter("sparse.bag.weight")[self._zero_rows] = 0.0


def _run_variant(sb: SampleBatch, cold: np.ndarray, cfg: EvalConfig, cs: ColdStartConfig, variant: str,
                 seed: int, log: Log) -> dict[str, Any]:
    ids = VariantIds(cfg, cs, variant, seed)
    fcfg = ids.feature_config(sb)
    trainer = ids.trainer(fcfg)
    n = len(sb)
    probs = np.empty(n, np.float64)
    ts = sb.column("ts")
    t0 = time.perf_counter()
    for start in range(0, n, cs.batch_size):
        tb = to_tensors(SampleBatch(sb.batch.slice(start, cs.batch_size)), fcfg)
        ids.prepare(tb, float(ts[start]) / 1000.0, True)
        probs[start:start + len(tb)] = trainer.test_then_train(tb)
        ids.after_step()
    y = sb.column("label").astype(np.float64)
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0}
    for name, m in (("cold", cold), ("warm", ~cold), ("all", np.ones(n, bool))):
        out[name] = {"samples": int(m.sum()), "auc": auc(probs[m], y[m]), "logloss": logloss(probs[m], y[m])}
    assert ids.mapper is not None
    out["id_maps"] = {k: {s: v[s] for s in ("occupancy", "bucket_share", "admissions", "evictions")}
                      for k, v in ids.mapper.stats().items()}
    log(f"{variant}: cold auc {out['cold']['auc']:.4f} logloss {out['cold']['logloss']:.4f}  "
        f"warm auc {out['warm']['auc']:.4f}  ({out['seconds']:.0f}s)")
    return out


def _served_variant(r: Ratings, cfg: EvalConfig, cs: ColdStartConfig, variant: str, seed: int,
                    log: Log) -> dict[str, Any]:
    """One variant through the delayed protocol, reported like :func:`_run_variant` (cold / warm / all)."""
    ids = VariantIds(replace(cfg, batch_size=cs.batch_size), cs, variant, seed)
    d = run_delayed(r, "default", seed, replace(cfg, batch_size=cs.batch_size, cold_k=cs.cold_k), log,
                    lambda f, c, s: _trainer(f, c, cs, variant, s), ids=ids)
    out: dict[str, Any] = {"seconds": d["train_s"]}
    for name, key in (("cold", "served_cold"), ("warm", "served_warm"), ("all", "served")):
        out[name] = {"samples": d[key]["n"], "auc": d[key]["auc"], "logloss": d[key]["logloss"], "ne": d[key]["ne"]}
    assert ids.mapper is not None
    out["id_maps"] = {k: {s: v[s] for s in ("occupancy", "bucket_share", "admissions", "evictions")}
                      for k, v in ids.mapper.stats().items()}
    log(f"{variant} (served, {cfg.emission}): cold auc {out['cold']['auc']:.4f}  warm auc {out['warm']['auc']:.4f}")
    return out


def evaluate_cold_start(dataset: str = "synthetic", seed: int = 42, *, config: dict[str, Any] | None = None,
                        cold: ColdStartConfig | None = None, limit: int | None = None,
                        variants: tuple[str, ...] = VARIANTS, log: Log | bool | None = None,
                        protocol: str = "online") -> dict[str, Any]:
    """The variants on one stream. ``protocol`` "online": test-then-train in event-time order with immediate
    labels (the module docstring); "delayed": served quality through the joiner's emission policy
    (``learner/evaluation/delayed.py``, ``config["emission"]``), with the variant's ids."""
    cs = cold or ColdStartConfig()
    cfg = replace(EvalConfig(mlp=(200, 200)), **(config or {}))
    out_log = log_to(log)
    t0 = time.perf_counter()
    if dataset == "synthetic":
        r = synthetic_ratings(cs.synthetic_impressions, cs.synthetic_new_user_share, seed, limit,
                              cs.synthetic_new_user_impressions, cs.synthetic_new_user_session_s)
    else:
        r = load_ratings(dataset, limit)
    label = online_labels(r.rating)
    sb = build_samples(r, np.arange(len(r)), label, "default", cfg)
    cold_rows = cold_mask(r.user, cs.cold_k)
    out_log(f"{dataset}: {len(r):,} samples, {int(cold_rows.sum()):,} cold (a user's first {cs.cold_k}), "
            f"{len(np.unique(r.user)):,} users")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        if protocol == "delayed":
            results = {v: _served_variant(r, cfg, cs, v, seed, out_log) for v in variants}
        else:
            results = {v: _run_variant(sb, cold_rows, cfg, cs, v, seed, out_log) for v in variants}
    finally:
        torch.set_num_threads(threads)
    summary: dict[str, Any] = {
        "dataset": dataset, "protocol": "cold-start" if protocol == "online" else "cold-start/delayed",
        "emission": cfg.emission if protocol == "delayed" else None, "seed": seed, "limit": limit, "samples": len(r),
        "cold_samples": int(cold_rows.sum()), "users": int(len(np.unique(r.user))),
        "variants": results, "cold_start": vars(cs), "config": cfg.to_dict(),
        "elapsed_s": time.perf_counter() - t0,
    }
    if {"admission", "zero", "buckets"} <= set(results):
        c = {v: results[v]["cold"] for v in results}
        summary["admission_vs"] = {
            other: {"cold_auc_gain": c["admission"]["auc"] - c[other]["auc"],
                    "cold_logloss_gain": c[other]["logloss"] - c["admission"]["logloss"]}
            for other in ("zero", "buckets")}
    return summary


def describe(d: dict[str, Any]) -> str:
    how = f" (served through the joiner's {d['emission']} policy)" if d.get("emission") else ""
    lines = [f"{d['dataset']} cold start{how}: {d['samples']:,} samples in event-time order, {d['cold_samples']:,} "
             f"cold (a user's first {d['cold_start']['cold_k']} impressions), {d['users']:,} users",
             f"  {'variant':<10} {'cold AUC':>9} {'cold logloss':>13} {'warm AUC':>9} {'all AUC':>8} {'seconds':>8}"]
    for v, r in d["variants"].items():
        lines.append(f"  {v:<10} {r['cold']['auc']:>9.4f} {r['cold']['logloss']:>13.4f} {r['warm']['auc']:>9.4f} "
                     f"{r['all']['auc']:>8.4f} {r['seconds']:>8.0f}")
    for other, g in d.get("admission_vs", {}).items():
        lines.append(f"  admission vs {other}: cold AUC {g['cold_auc_gain']:+.4f}, "
                     f"cold logloss {-g['cold_logloss_gain']:+.4f}")
    return "\n".join(lines)
