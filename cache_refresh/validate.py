"""Validation before publish: the artifact scores what the learner scores, and not worse than the live one.

1. **Probe** (exactness): random field-major bags over the whole table (hot rows and cold rows, empty
   bags, multi-valued fields) scored by the staged artifact and by the learner's DeepFM rebuilt from
   the same checkpoint in fp32 eager mode; the largest absolute difference of the probabilities must
   not exceed the tolerance. A mismatch means the export is broken (wrong weights, wrong rows, wrong
   pooling), never that the model got worse.
2. **Holdout** (quality): the last ``holdout_messages`` messages of the samples topic scored by the
   new artifact and by the live one; the new AUC may not fall more than ``max_auc_drop`` below the
   live AUC. These samples are recent, not unseen: the learner trains on everything, so both models
   may have learned from them; the check catches a broken or regressed model, not overfitting.
   Skipped (and said so in the summary) when there is no live artifact, no samples, a single class, fewer than
   :data:`MIN_CLASS_SAMPLES` of either class, or the live artifact has another feature config.

An INT8 artifact (``onnx_int8``, learner/onnx_scorer.py) is not exact: the probe checks its fp32 path (the same
stored tensors scored in torch) against the learner within the tolerance and only records the INT8 scores'
difference (bounded by :data:`INT8_PROBE_BOUND`, which catches a graph of other weights); the holdout then refuses
it when its AUC falls more than ``max_int8_auc_drop`` below its own fp32 path's on the same samples (a cost
measured on every refresh instead of a tolerance), whether or not there is a live artifact. Where it cannot be
measured (no samples, one class) the summary says so (``unmeasured``) and the publish alerts (refresh_degraded,
cache_refresh/job.py): its only other check is the probe's loose :data:`INT8_PROBE_BOUND`.

A statically quantized artifact (``onnx_int8_static``) is calibrated when it is built, on samples: the holdout's
older messages (:func:`calibration_split`: the oldest :data:`CALIBRATION_SHARE` of the messages read, by their newest
sample's time), and its gate (the same as ``onnx_int8``'s) is measured on the newer rest only, so no sample both sets
its activation scales and judges them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from confluent_kafka import Message

from cache_refresh.settings import RefreshSettings
from learner.artifact import eager_model
from learner.batch import to_tensors
from learner.features import FeatureConfig
from learner.progressive import auc, logloss
from learner.scorer import REDUCED_PRECISION_FORMATS
from serving.model import ScoringModel
from stream.config import KafkaSettings
from stream.errors import StreamrecError
from stream.kafka import read_to_end, watermarks
from stream.samples import SampleBatch, final_view

log = logging.getLogger("streamrec.refresh")

# max |INT8 - fp32| probability on the (random, off-distribution) probe: bench/onnx_int8.py's trained 400-400-400 model
# measured 0.024; a graph of other weights than the artifact's tensors is off by more
INT8_PROBE_BOUND = 0.1
DEFAULT_MAX_INT8_AUC_DROP = RefreshSettings.max_int8_auc_drop
# holdout samples of each class (clicked, not clicked) below which the AUCs of the new and the live artifact are not
# compared: a handful of pairs decide the AUC (one of each: 0 or 1), and a young samples topic refused every refresh
# as "a worse model" on one swapped pair. Unchecked instead, as for one class (a refresh_degraded warning)
MIN_CLASS_SAMPLES = 30
# onnx_int8_static: the share of the holdout's messages (the oldest) that calibrates the artifact instead of judging
# it, and the fewest samples it may be calibrated on (its activation ranges from fewer are a guess)
CALIBRATION_SHARE = 0.25
MIN_CALIBRATION_SAMPLES = 100


class ValidationFailed(StreamrecError):
    """The staged artifact failed a check; the message says which and by how much."""


def probe_inputs(cfg: FeatureConfig, b: int, seed: int = 0, hot_rows: np.ndarray | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values (N,), offsets (F*B + 1,), dense (B, Dd)): random bags, a third of the values hot rows."""
    rng = np.random.default_rng(seed)
    hot = np.asarray(hot_rows if hot_rows is not None else [], np.int64)
    values, lengths = [], []
    for spec, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True):
        n = np.ones(b, np.int64) if spec.kind == "single" else rng.integers(0, 6, b)
        v = first + rng.integers(0, rows, int(n.sum()))
        in_block = hot[(hot >= first) & (hot < first + rows)]
        if len(in_block) and len(v):
            pick = rng.random(len(v)) < 1 / 3
            v[pick] = rng.choice(in_block, int(pick.sum()))
        lengths.append(n)
        values.append(v)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    dense = rng.normal(size=(b, len(cfg.dense))).astype(np.float32)
    return torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets), torch.from_numpy(dense)


def probe(model: ScoringModel, checkpoint: Mapping[str, Any], samples: int, tolerance: float,
          hot_rows: np.ndarray | None = None, seed: int = 0, between: Callable[[], object] | None = None,
          on: list[SampleBatch] | None = None) -> dict[str, Any]:
    """Compare the artifact's probabilities with the learner's fp32 eager ones; raise beyond ``tolerance``.
    ``between`` (the run's stop check) is called after each unit: the learner's model rebuilt, each scoring (an
    INT8 artifact's own last: the run loads the live artifact next). ``on``: samples on which a statically quantized
    artifact's INT8 scores are bounded (:data:`INT8_PROBE_BOUND`) against its fp32 path (itself checked against the
    learner here) instead of on the random probe: its fixed activation ranges (calibrated on samples) clip the
    probe's off-distribution activations, ~0.13 off on tests/integration/test_refresh.py's model, 0.24 on
    bench/ort_call.py's; the probe's figure is still recorded."""
    between = between or (lambda: None)
    values, offsets, dense = probe_inputs(model.feature_config, samples, seed, hot_rows)
    reference = eager_model(checkpoint)
    between()
    with torch.no_grad():
        want = torch.sigmoid(reference(values, offsets, dense))  # (B,)
        between()
        # For the record: how far the learner's own bf16-autocast forward is from fp32 serving.
        reference.autocast_dtype = torch.bfloat16
        bf16 = torch.sigmoid(reference(values, offsets, dense).float())  # (B,)
        between()
    int8 = model.format in REDUCED_PRECISION_FORMATS
    got = model.score(values, offsets, dense, fp32=int8).cpu()  # (B,); INT8: its fp32 path must be exact
    between()
    diff = float((got - want).abs().max()) if samples else 0.0
    result = {"samples": samples, "max_abs_diff": diff, "tolerance": tolerance,
              "learner_bf16_max_abs_diff": float((bf16 - want).abs().max()) if samples else 0.0}
    if int8:
        q = model.score(values, offsets, dense).cpu()
        between()
        result["int8_max_abs_diff"] = q_diff = float((q - want).abs().max()) if samples else 0.0
        where = f"{samples} probe samples"
        if on is not None:
            result["int8_max_abs_diff_on_samples"] = q_diff = _int8_diff(model, on, between)
            where = f"{sum(len(b) for b in on)} holdout samples (against its fp32 path)"
        if on is not None and diff <= tolerance and not q_diff <= INT8_PROBE_BOUND:
            # its graph is the checkpoint's (its fp32 path matched the learner above): its calibration does not fit
            raise ValidationFailed(f"probe: the {model.format} scorer's INT8 scores differ from its own fp32 path "
                                   f"(the learner's scores within {tolerance:g}) by {q_diff:.3g} (INT8 rounding "
                                   f"stays below {INT8_PROBE_BOUND:g}) on {sum(len(b) for b in on)} newer holdout "
                                   "samples: the activation ranges it was calibrated on (the holdout's oldest "
                                   "messages) do not fit them, e.g. an extreme dense feature value among the "
                                   "calibration samples widened a range until ordinary values round to zero; scale "
                                   "or clip the dense features, or publish --format onnx_int8 (dynamic "
                                   "quantization: no calibration)")
        if not q_diff <= INT8_PROBE_BOUND:
            raise ValidationFailed(f"probe: the {model.format} scorer's scores differ from the learner's eager "
                                   f"scores by {q_diff:.3g} (its rounding stays below {INT8_PROBE_BOUND:g}) on "
                                   f"{where}; the {model.format} scorer is not the checkpoint's model")
    if not diff <= tolerance:  # also catches NaN
        raise ValidationFailed(f"probe: artifact scores differ from the learner's eager scores by {diff:.3g} "
                               f"(tolerance {tolerance:g}) on {samples} probe samples; the artifact is not the "
                               "checkpoint's model (export or row placement is broken)")
    return result


def _int8_diff(model: ScoringModel, batches: list[SampleBatch], between: Callable[[], object]) -> float:
    """max |INT8 - its fp32 path| of ``model``'s probabilities on the samples of ``batches``."""
    diff = 0.0
    for batch in batches:
        tb = to_tensors(batch, model.feature_config)
        model.map_batch(tb)
        if len(tb):
            q = model.score(tb.values, tb.offsets, tb.dense)
            diff = max(diff, float((q - model.score(tb.values, tb.offsets, tb.dense, fp32=True)).abs().max()))
        between()
    return diff


def read_holdout(kafka: KafkaSettings, messages: int, timeout_s: float,
                 between: Callable[[], object] | None = None) -> list[SampleBatch]:
    """The last ~``messages`` messages of the samples topic, spread over its partitions (oldest first).
    ``between`` (the run's stop check, ``job.StopSignals.check``) is called between the tries of the watermarks'
    requests, after them and after each poll.

    The end of a partition is found from partition-EOF events, not the high watermark, which the local
    broker under-reports by up to one record batch (environment.md); so a little more may be read.
    """
    if messages <= 0:
        return []
    marks = watermarks(kafka, kafka.samples_topic, timeout_s, between)
    if not marks:
        return []
    if between is not None:
        between()
    # shared among the partitions that hold messages: by every partition's count, samples on one of four read a quarter
    filled = {p: (low, high) for p, (low, high) in marks.items() if high > low}
    per = max(1, math.ceil(messages / max(1, len(filled))))
    start = {p: max(low, high - per) for p, (low, high) in filled.items()}
    got: dict[int, list[SampleBatch]] = {p: [] for p in start}
    bad: list[str] = []  # the first message that is no sample and why, then one entry a message: said below

    def keep(m: Message) -> None:
        try:
            got[int(m.partition() or 0)].append(SampleBatch.decode(m.value() or b""))
        except Exception as exc:  # noqa: BLE001 - a malformed message is not a sample
            bad.append("" if bad else f"partition {m.partition()} offset {m.offset()}: {str(exc)[:200]}")

    try:
        read_to_end(kafka, kafka.samples_topic, keep, start=start, timeout_s=timeout_s, between=between)
    except TimeoutError as exc:  # a holdout is a sample: validate on what arrived in time
        log.warning("holdout: %s; validating on the %d messages read", exc, sum(map(len, got.values())))
    if bad:
        log.warning("holdout: %d of the %d holdout messages read from %s are no samples batch and are left out of the "
                    "quality check (first: %s)", len(bad), len(bad) + sum(map(len, got.values())),
                    kafka.samples_topic, bad[0])
    return [b for p in sorted(got) for b in got[p][-per:]]


def calibration_split(batches: list[SampleBatch], fmt: str, messages: int,
                      ) -> tuple[list[SampleBatch], list[SampleBatch]]:
    """(calibration, measured): ``batches`` (the holdout, ``messages`` the ``[refresh] holdout_messages`` it was
    read with) split by time for a calibrated format ``fmt``: the oldest :data:`CALIBRATION_SHARE` of the messages
    (ordered by their newest sample's ``ts``; at least one, and one left) calibrate it, the newer rest measure its
    gate. ValidationFailed naming the setting and the fix when there are too few to calibrate on."""
    fix = (f"raise [refresh] holdout_messages (now {messages}) so that its oldest {CALIBRATION_SHARE:.0%} holds at "
           f"least {MIN_CALIBRATION_SAMPLES} samples, or publish --format onnx_int8 (dynamic quantization: no "
           "calibration)")
    if messages <= 0:
        raise ValidationFailed(f"format {fmt} is calibrated on the holdout's older samples, but [refresh] "
                               f"holdout_messages = {messages} reads none: {fix}")
    order = sorted(batches, key=lambda b: int(b.column("ts").max()) if len(b) else -1)
    k = min(max(1, int(len(order) * CALIBRATION_SHARE)), len(order) - 1)
    calib, measured = order[:max(k, 0)], order[max(k, 0):]
    got = sum(len(b) for b in calib)
    if got < MIN_CALIBRATION_SAMPLES:
        raise ValidationFailed(f"format {fmt} is calibrated on the holdout's older samples: {len(batches)} messages "
                               f"were read from the samples topic, {got} samples in the {len(calib)} calibrating "
                               f"ones (at least {MIN_CALIBRATION_SAMPLES}, and a newer message left to measure it "
                               f"on): {fix}")
    return calib, measured


def quality(model: ScoringModel, batches: list[SampleBatch], fp32: bool = False,
            between: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """AUC and logloss of ``model`` on the samples of ``batches`` (``fp32``: an INT8 artifact's fp32 path);
    ``between`` (the run's stop check) is called after each batch scored."""
    probs, labels, ids, kinds = [], [], [], []
    for batch in batches:
        tb = to_tensors(batch, model.feature_config)
        model.map_batch(tb)  # dynamic ids: the rows the artifact's id maps give them
        if len(tb):
            probs.append(model.score(tb.values, tb.offsets, tb.dense, fp32=fp32).cpu().numpy())
            labels.append(tb.labels.numpy())
            ids.append(tb.impression_ids)
            kinds.append(batch.kinds)
        between()
    if not probs:
        return {"samples": 0, "auc": float("nan"), "logloss": float("nan")}
    # one row per impression with the label it ends with (fake_negative / es_dfm emit a clicked one twice)
    keep, final = final_view(np.concatenate(ids), np.concatenate(labels), np.concatenate(kinds))
    p, y = np.concatenate(probs)[keep], final[keep].astype(np.float64)
    return {"samples": int(len(y)), "positives": int(y.sum()), "auc": auc(p, y), "logloss": logloss(p, y)}


def _unmeasured(fmt: str, why: str) -> str:
    """The summary's (and the refresh_degraded warning's) words for a reduced-precision artifact whose AUC cost
    could not be measured: ``max_int8_auc_drop`` did not apply to it."""
    return (f"the {fmt} artifact's AUC cost against its fp32 path was not measured ({why}): max_int8_auc_drop "
            "did not apply")


def holdout(new: ScoringModel, live: ScoringModel | None, batches: list[SampleBatch],
            max_auc_drop: float, max_int8_auc_drop: float = DEFAULT_MAX_INT8_AUC_DROP,
            between: Callable[[], object] = lambda: None, switched_off: bool = False) -> dict[str, Any]:
    """Quality of the new artifact vs the live one on recent samples; raise if worse beyond the bound. An INT8
    artifact also against its own fp32 path: raise when INT8 costs more than ``max_int8_auc_drop`` of AUC.
    ``between`` (the run's stop check) is called after each batch each model scores. ``switched_off``: the operator
    set ``holdout_messages = 0`` (no quality check): said so, and no ``unchecked`` (only a reduced-precision artifact's
    ``unmeasured``, as the setting documents); before, every publish over a live artifact sent a refresh_degraded
    warning blaming an empty or misnamed samples topic."""
    reduced = new.format in REDUCED_PRECISION_FORMATS
    if switched_off:
        why = "holdout_messages = 0: the quality check is switched off"
        return {"skipped": why, **({"unmeasured": _unmeasured(new.format, why)} if reduced else {})}
    if not batches:
        # With a live artifact that is a publish the gate did not check ("unchecked": a refresh_degraded warning,
        # job._published_warnings): a samples topic that is empty, misnamed, or holds nothing that decodes had
        # switched the quality gate off for every run, without a word but the summary's "skipped"
        return {"skipped": "no samples in the topic",
                **({"unchecked": "no holdout samples were read from the samples topic (empty, another "
                                 "[kafka] samples_topic, or no message of it decodes as samples)"}
                   if live is not None else {}),
                **({"unmeasured": _unmeasured(new.format, "no samples in the topic")} if reduced else {})}
    mine = quality(new, batches, between=between)
    out: dict[str, Any] = {"new": mine, "max_auc_drop": max_auc_drop}
    if reduced:
        ref = quality(new, batches, fp32=True, between=between)
        cost = ref["auc"] - mine["auc"]
        out["int8"] = {"fp32": ref, "auc_cost": cost, "logloss_cost": mine["logloss"] - ref["logloss"],
                       "max_int8_auc_drop": max_int8_auc_drop}
        if math.isnan(cost):  # one class (or no sample scored): not comparable, not refused, but said
            out["unmeasured"] = _unmeasured(new.format, f"AUC undefined on the {mine['samples']} holdout samples: "
                                                        "one class only")
        elif cost > max_int8_auc_drop:
            raise ValidationFailed(f"holdout: {new.format} AUC {mine['auc']:.4f} is {cost:.4f} below the same "
                                   f"artifact's fp32 AUC {ref['auc']:.4f} on {mine['samples']} recent samples (bound "
                                   f"max_int8_auc_drop {max_int8_auc_drop:g}); not publishing it: publish "
                                   "an exact format (e.g. --format onnx), or raise the bound")
    if live is None:
        out["skipped"] = "no live artifact to compare with"
        return out
    if live.feature_config != new.feature_config:
        # a live model this run cannot compare with: published, but alerted (job._published_warnings)
        out["skipped"] = out["unchecked"] = f"live artifact {live.version} has another feature config"
        return out
    theirs = quality(live, batches, between=between)
    out["live"] = {**theirs, "version": live.version}
    if math.isnan(mine["auc"]) or math.isnan(theirs["auc"]):
        out["skipped"] = out["unchecked"] = (f"AUC undefined on the {mine['samples']} holdout samples (one class "
                                             "only, or none scored)")
        return out
    rarer = min(mine["positives"], mine["samples"] - mine["positives"])
    if rarer < MIN_CLASS_SAMPLES:
        out["skipped"] = out["unchecked"] = (f"too few holdout samples to compare AUCs: {rarer} of the rarer class "
                                             f"among {mine['samples']} (at least {MIN_CLASS_SAMPLES} of each)")
        return out
    drop = theirs["auc"] - mine["auc"]
    out["auc_drop"] = drop
    if drop > max_auc_drop:
        raise ValidationFailed(f"holdout: AUC {mine['auc']:.4f} is {drop:.4f} below the live artifact "
                               f"{live.version}'s {theirs['auc']:.4f} on {mine['samples']} recent samples "
                               f"(bound {max_auc_drop:g}); not publishing a worse model")
    return out
