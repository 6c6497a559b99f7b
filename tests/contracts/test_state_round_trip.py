"""Contract: a stateful part of the learner, restored from its saved state, continues exactly as the part it
was saved from. A checkpoint (``learner/checkpoint.py``) promises "everything needed to continue exactly
where training stopped"; this checks it part by part.

For every part: drive it with some input, save its state, restore a fresh copy from that state, feed the SAME
next inputs to the original and to the copy, and compare their outputs, bitwise (arrays, tensors and floats
compared by value and dtype; the code is deterministic on CPU). The state travels three ways: handed over in
memory, and through a real checkpoint file read back with ``load_latest(safe=False)`` (the learner's resume)
and ``load_latest(safe=True)`` (``torch.load(weights_only=True)``, what the refresh job reads).

Parts with a state dict: ``IdMap`` and ``FieldIdMaps`` (learner/id_map.py), ``RowMapper`` (learner/row_mapper.py,
restored with ``from_state``), ``ColdTracker``, ``ProgressiveMetrics`` (learner/progressive.py), the model with
each sparse optimizer (learner/optim.py: rowwise_adagrad, rowwise_adagrad with boost, sparse_adam; the dense
Adam comes along), ``RecentIds`` (the duplicate filter, learner/daemon.py), ``BaseRateBias``,
``DelayedFeedbackWeights`` (the late share), ``OnlineCalibration``, ``ServedQuality`` (learner/served.py: its
pending impressions and clocks too), ``AdaptiveClip`` (the dense gradient clip, learner/grad_clip.py) and
``IdMetrics`` (the bucket share, learner/quality.py). Parts whose state is their store:
``DeltaWriter`` (learner/deltas.py: its directory), ``Strikes`` over ``FileStrikes`` and ``RedisStrikes``.

Each part's driven outputs must also differ from a fresh part's (``test_..._depend_on_the_state``): otherwise
the round trip would pass without any state at all.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from learner import checkpoint
from learner.batch import to_tensors
from learner.calibration import OnlineCalibration
from learner.daemon import RecentIds
from learner.delayed import BaseRateBias, DelayedFeedbackWeights
from learner.delta_writer import DeltaWriter
from learner.deltas import load_delta
from learner.features import FeatureConfig, FieldSpec
from learner.grad_clip import AdaptiveClip
from learner.id_map import FieldIdMaps, IdMap
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.progressive import ProgressiveMetrics
from learner.quality import IdMetrics
from learner.row_mapper import ColdTracker, MapStats, RowMapper, user_keys
from learner.served import ServedQuality
from learner.trainer import Trainer
from stream.samples import SampleBatch
from stream.strikes import FileStrikes, RedisStrikes, Strikes

DRIVE_STEPS = 6  # inputs before the state is saved
NEXT_STEPS = 4  # inputs fed to both the original and the restored copy


# -- comparing outputs bitwise ----------------------------------------------------------------------
def assert_same(a: Any, b: Any, where: str = "output") -> None:
    """``a`` and ``b`` are equal all the way down: arrays and tensors in dtype, shape and every bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            diff = np.flatnonzero(a.view(np.uint8).reshape(-1) != b.view(np.uint8).reshape(-1)) if a.size else []
            first = np.unravel_index(int(diff[0]) // a.itemsize, a.shape) if len(diff) else ()
            raise AssertionError(f"{where}: arrays differ, first at {tuple(int(i) for i in first)}: "
                                 f"{a[first]!r} != {b[first]!r} ({len(set(int(d) // a.itemsize for d in diff))} "
                                 f"element(s) differ)")
    elif isinstance(a, torch.Tensor):
        assert_same(a.detach().cpu().numpy(), b.detach().cpu().numpy(), where)
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif is_dataclass(a):
        for f in fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def differs(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False


# -- inputs -----------------------------------------------------------------------------------------
def keys_at(step: int, n: int = 64, distinct: int = 120) -> np.ndarray:
    """Hashed-id-like keys (int64 >= 0), skewed so some repeat and some are new, different per step."""
    rng = np.random.default_rng(1000 + step)
    ranks = np.minimum(rng.zipf(1.3, n), distinct)
    return (ranks * 7_919 + 13).astype(np.int64)


def now_at(step: int) -> float:
    return 100.0 + 15.0 * step  # event time, seconds: TTLs and bucket half-lives below are a few steps


ID_CFG = FeatureConfig((FieldSpec("user_id", "single", 8, capacity=24, admit_after=2, ttl_s=60.0,
                                  bucket_half_life_s=20.0),
                        FieldSpec("item_id", "single", 6, capacity=16, admit_after=1, init="zero"),
                        FieldSpec("history", "sequence", 1, shares="item_id"),
                        FieldSpec("ctx.device", "single", 5)), embedding_dim=4)
STATIC_CFG = FeatureConfig((FieldSpec("user_id", "single", 40), FieldSpec("item_id", "single", 30),
                            FieldSpec("history", "sequence", 1, shares="item_id"),
                            FieldSpec("ctx.device", "single", 5)), embedding_dim=4)


def samples_at(step: int, n: int = 24) -> SampleBatch:
    rng = np.random.default_rng(2000 + step)
    users = keys_at(step, n, distinct=60)
    items = np.minimum(rng.zipf(1.5, n), 40) * 31 + 5
    return SampleBatch.from_columns(
        impression_id=[f"imp-{step}-{k}" for k in range(n)], ts=np.full(n, int(now_at(step) * 1000)),
        label=(rng.random(n) < 0.4).astype(np.int8), label_delay_ms=np.zeros(n), user_id=users, item_id=items,
        history=[[int(x) for x in rng.integers(0, 200, int(rng.integers(0, 4)))] for _ in range(n)],
        context={"device": rng.integers(0, 3, n)})


def impression_ids_at(step: int) -> np.ndarray:
    """Ids with repeats within a batch and across batches (joiner retries)."""
    rng = np.random.default_rng(3000 + step)
    return np.array([f"imp-{int(k)}" for k in rng.integers(0, 90, 40)], dtype=object)


# -- the parts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    make: Callable[[], Any]  # a fresh part
    step: Callable[[Any, int], Any]  # feed input number ``step``; returns what the part put out
    save: Callable[[Any], Any]  # its state (what the checkpoint holds)
    load: Callable[[Any], Any]  # a fresh part restored from a state


def _id_map() -> IdMap:
    # small capacity: admissions, LRU and TTL evictions, candidate rotations and bucket decay all happen
    return IdMap(capacity=24, num_buckets=8, admit_after=2, ttl_s=60.0, candidates=10, bucket_half_life_s=20.0)


def _load_id_map(state: Any) -> IdMap:
    m = _id_map()
    m.load_state_dict(state)
    return m


def _id_map_step(m: IdMap, step: int) -> Any:
    trained = m.lookup(keys_at(step), now_at(step))
    return trained, m.lookup(keys_at(step + 50), now_at(step), train=False).rows, m.stats()


def _field_maps() -> FieldIdMaps:
    return FieldIdMaps({"user_id": _id_map(), "item_id": IdMap(16, 6, admit_after=1, init="zero")})


def _load_field_maps(state: Any) -> FieldIdMaps:
    m = _field_maps()
    m.load_state_dict(state)
    return m


def _mapper_step(m: RowMapper, step: int) -> Any:
    tb = to_tensors(samples_at(step), ID_CFG)
    stats = m.apply(tb, now_at(step))
    return tb.values, stats, m.stats(), m.rows(3, keys_at(step + 70)), m.rows(0, keys_at(step + 70))


def _cold() -> ColdTracker:
    return ColdTracker(3, capacity=40)


def _load_cold(state: Any) -> ColdTracker:
    c = _cold()
    c.load_state_dict(state)
    return c


def _metrics() -> ProgressiveMetrics:
    return ProgressiveMetrics(window=100, bins=64)


def _load_metrics(state: Any) -> ProgressiveMetrics:
    m = _metrics()
    m.load_state_dict(state)
    return m


def _metrics_update(m: ProgressiveMetrics, step: int) -> None:
    rng = np.random.default_rng(4000 + step)
    labels = (rng.random(37) < 0.3).astype(np.float64)
    m.update(np.clip(0.3 * labels + 0.7 * rng.random(37), 0.0, 1.0), labels)


def _cumulative_step(m: ProgressiveMetrics, step: int) -> Any:
    _metrics_update(m, step)
    return m.count, m.auc, m.logloss


def _window_step(m: ProgressiveMetrics, step: int) -> Any:
    _metrics_update(m, step)
    return m.window_metrics()


def seeded_model(seed: int) -> DeepFM:
    """DeepFM's ``seed`` draws the embedding table only; the MLP takes torch's global generator, seeded here
    (without moving the global generator of the rest of the session)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DeepFM(STATIC_CFG, mlp=(8,), seed=seed, autocast_dtype=None)


@dataclass
class Training:
    model: DeepFM
    trainer: Trainer


def _training(sparse_optimizer: str, boost: float = 0.0) -> Callable[[], Training]:
    def make() -> Training:
        model = seeded_model(0)
        sparse, dense = make_optimizers(model, 0.05, 0.01, sparse_optimizer, boost=boost,
                                        boost_half_life=2.0 if boost else 0.0)
        return Training(model, Trainer(model, sparse, dense))

    return make


def _training_save(t: Training) -> Any:
    return {"model": t.model.state_dict(), "sparse_opt": t.trainer.sparse_opt.state_dict(),
            "dense_opt": t.trainer.dense_opt.state_dict()}


def _training_load(make: Callable[[], Training]) -> Callable[[Any], Training]:
    def load(state: Any) -> Training:  # what Learner._restore does
        t = make()
        t.model.load_state_dict(state["model"])
        t.trainer.sparse_opt.load_state_dict(state["sparse_opt"])
        t.trainer.dense_opt.load_state_dict(state["dense_opt"])
        return t

    return load


def _training_step(t: Training, step: int) -> Any:
    probs = t.trainer.test_then_train(to_tensors(samples_at(step), STATIC_CFG))
    w = t.model.sparse.bag.weight
    opt_state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.trainer.sparse_opt.state[w].items()}
    return probs, w.detach().clone(), opt_state, {k: v.clone() for k, v in t.model.state_dict().items()}


def _recent() -> RecentIds:
    return RecentIds(50)


def _load_recent(state: Any) -> RecentIds:
    r = _recent()
    r.load(state)
    return r


def _delayed_rows(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step ``s`` of a fake_negative stream: 64 impressions in second ``s`` as OBSERVED 0s, and the clicks of 1 in 5
    of second ``s - 1``'s as DELAYED_POSITIVEs (delay 1-2 s). (ids, kinds, labels, ts ms, label_delay_ms)."""
    from stream.samples import DELAYED_POSITIVE, OBSERVED

    rng = np.random.default_rng(s)
    ts = s * 1000 + np.arange(64) * 15
    clicked = np.flatnonzero(np.random.default_rng(s - 1).random(64) < 0.2) if s > 0 else np.zeros(0, np.int64)
    ids = np.array([f"i{s}_{j}" for j in range(64)] + [f"i{s - 1}_{j}" for j in clicked], object)
    kinds = np.array([OBSERVED] * 64 + [DELAYED_POSITIVE] * len(clicked), np.int8)
    labels = np.array([0.0] * 64 + [1.0] * len(clicked), np.float32)
    shown = (s - 1) * 1000 + clicked * 15  # the clicked impressions' own times: a delayed positive's ts
    delay = s * 1000 + 500 + rng.integers(0, 500, len(clicked)) - shown
    return (ids, kinds, labels, np.concatenate([ts, shown]).astype(np.int64),
            np.concatenate([np.zeros(64), delay]).astype(np.int64))


def _bias_step(b: BaseRateBias, s: int) -> tuple[float, float, bool]:
    _, kinds, labels, ts, delays = _delayed_rows(s)
    b.observe(labels, kinds, ts, delays)
    return b.rate, b.delay_rate, b.done


def _load_bias(state: Any) -> BaseRateBias:
    b = BaseRateBias(min_positives=5, mature_delays=2.0)
    b.load_state_dict(state)
    return b


def _es_dfm_rows(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step ``s`` of an es_dfm stream (elapsed 3 s): 64 OBSERVED rows, 15% clicked in time (label 1, waited < 3 s),
    the rest 0s that waited the 3 s, and the late clicks of 5% of step ``s - 1``'s as DELAYED_POSITIVEs: a late share
    of ~0.25, away from the prior's 0.5 (under fake_negative it is 1 whatever the state). (kinds, labels, delays)"""
    from stream.samples import DELAYED_POSITIVE, OBSERVED

    rng = np.random.default_rng(500 + s)
    on_time, late = rng.random(64) < 0.15, int((np.random.default_rng(499 + s).random(64) < 0.05).sum()) if s else 0
    kinds = np.array([OBSERVED] * 64 + [DELAYED_POSITIVE] * late, np.int8)
    labels = np.concatenate([on_time.astype(np.float32), np.ones(late, np.float32)])
    delays = np.concatenate([np.where(on_time, rng.integers(0, 3000, 64), 3000), rng.integers(3000, 9000, late)])
    return kinds, labels, delays.astype(np.int64)


def _weights_step(w: DelayedFeedbackWeights, s: int) -> tuple[float, Any]:
    kinds, labels, delays = _es_dfm_rows(s)
    w.observe(kinds, labels, delays)
    probs = torch.as_tensor(np.random.default_rng(200 + s).random(len(kinds)), dtype=torch.float32)
    weights = w.weights(kinds, torch.as_tensor(labels), probs)
    return w.late_share, None if weights is None else weights.numpy()


def _load_weights(state: Any) -> DelayedFeedbackWeights:
    w = DelayedFeedbackWeights()
    w.load_state_dict(state)
    return w


def _calibration_step(c: OnlineCalibration, s: int) -> tuple[float, float, int, int]:
    ids, kinds, labels, ts, delays = _delayed_rows(s)
    logits = np.random.default_rng(100 + s).normal(-1.0, 2.0, len(ids))
    c.observe(ids, kinds, labels, logits, ts, delays)
    return c.a, c.b, c.rows, c.pending


def _load_calibration(state: Any) -> OnlineCalibration:
    c = OnlineCalibration(maturity_s=2.0, prior_rows=10.0)
    c.load_state_dict(state)
    return c


def _served() -> ServedQuality:
    return ServedQuality(window_ms=3000, max_pending=150)


def _served_step(q: ServedQuality, s: int) -> Any:
    """Step ``s`` of :func:`_delayed_rows` served from two partitions: partition 0 closes windows by the joiner's
    watermark, partition 1 by its click clock; 150 pending at most (some forced). Impressions wait 3 s, their clicks
    come a step later: a state that lost the pending ones counts those clicks unmatched."""
    ids, kinds, labels, ts, delays = _delayed_rows(s)
    probs = np.random.default_rng(300 + s).random(len(ids))
    parts = np.array([int(i.rsplit("_", 1)[1]) % 2 for i in ids.tolist()], np.int64)
    cold = np.arange(len(ids)) % 3 == 0
    q.record(ids, ts, kinds, labels, probs, cold, parts, delays, watermarks={0: s * 1000 - 2500})
    return q.summary(), q.state_dict()


def _load_served(state: Any) -> ServedQuality:
    q = _served()
    q.load_state_dict(state)
    return q


def _clip() -> AdaptiveClip:
    return AdaptiveClip(factor=2.0, history=4, min_history=3)  # a short ring: it wraps before the save


def _clip_step(c: AdaptiveClip, s: int) -> Any:
    """A gradient of norm 1 to 5 (one of 40 now and then): the factor applied, the threshold, the steps clipped."""
    norm = 40.0 if s % 4 == 3 else 1.0 + np.random.default_rng(600 + s).random() * 4.0
    grad = torch.full((4,), norm / 2.0)  # (4,) of L2 norm ``norm``
    scale = c.clip_([grad], norm)
    return scale, c.threshold, c.clipped, grad


def _load_clip(state: Any) -> AdaptiveClip:
    c = _clip()
    c.load_state_dict(state)
    return c


def _id_metrics_step(m: IdMetrics, s: int) -> Any:
    """A batch of 10 to 90 user lookups, some answered by a bucket; the share published after it."""
    n = 10 + 20 * (s % 5)
    m.observe(MapStats(lookups={"user_id": n}, bucket_lookups={"user_id": (7 * s) % n}), {})
    return dict(m.bucket_share)


def _load_id_metrics(state: Any) -> IdMetrics:
    m = IdMetrics(500)
    m.load_state_dict(state)
    return m


def _training_part(name: str, boost: float = 0.0) -> Part:
    make = _training(name, boost)
    return Part(make, _training_step, _training_save, _training_load(make))


PARTS: dict[str, Part] = {
    "id_map": Part(_id_map, _id_map_step, IdMap.state_dict, _load_id_map),
    "field_id_maps": Part(_field_maps, lambda m, s: (m.lookup({"user_id": keys_at(s), "item_id": keys_at(s + 9)},
                                                              now_at(s)), m.stats()),
                          FieldIdMaps.state_dict, _load_field_maps),
    "row_mapper": Part(lambda: RowMapper(ID_CFG), _mapper_step, RowMapper.state_dict,
                       lambda state: RowMapper.from_state(ID_CFG, state)),
    "cold_tracker": Part(_cold, lambda c, s: c.cold(user_keys(to_tensors(samples_at(s), ID_CFG), ID_CFG), now_at(s)),
                         ColdTracker.state_dict, _load_cold),
    "progressive_metrics": Part(_metrics, _cumulative_step, ProgressiveMetrics.state_dict, _load_metrics),
    "model+rowwise_adagrad": _training_part("rowwise_adagrad"),
    "model+rowwise_adagrad_boost": _training_part("rowwise_adagrad", boost=2.0),
    "model+sparse_adam": _training_part("sparse_adam"),
    "recent_ids": Part(_recent, lambda r, s: r.filter(impression_ids_at(s)), RecentIds.state, _load_recent),
    "base_rate_bias": Part(lambda: BaseRateBias(min_positives=5, mature_delays=2.0), _bias_step,
                           BaseRateBias.state_dict, _load_bias),
    "delayed_feedback_weights": Part(DelayedFeedbackWeights, _weights_step, DelayedFeedbackWeights.state_dict,
                                     _load_weights),
    "online_calibration": Part(lambda: OnlineCalibration(maturity_s=2.0, prior_rows=10.0), _calibration_step,
                               OnlineCalibration.state_dict, _load_calibration),
    "served_quality": Part(_served, _served_step, ServedQuality.state_dict, _load_served),
    "dense_gradient_clip": Part(_clip, _clip_step, AdaptiveClip.state_dict, _load_clip),
    "id_metrics": Part(lambda: IdMetrics(500), _id_metrics_step, IdMetrics.state_dict, _load_id_metrics),
}
# Parts that break the contract today (bugs found by it; the owners of those files have the reproduction).
KNOWN_BREAKS: dict[str, str] = {}


def _names() -> list[Any]:
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BREAKS[n])) if n in KNOWN_BREAKS else n
            for n in sorted(PARTS)]


WINDOW = Part(_metrics, _window_step, ProgressiveMetrics.state_dict, _load_metrics)


def _via(state: Any, via: str, tmp: Path) -> Any:
    """``state`` after the trip: in memory, or through a checkpoint file and load_latest (safe or not)."""
    if via == "memory":
        # torch's state_dict() holds the live tensors and Optimizer.load_state_dict keeps tensors that need no
        # cast, so a state handed over as is would be SHARED by the two models; a checkpoint never does that
        return copy.deepcopy(state)
    directory = tmp / "ckpt"
    checkpoint.save(directory, {"part": state}, {"samples_trained": DRIVE_STEPS})
    loaded = checkpoint.load_latest(directory, safe=via == "checkpoint-safe")
    assert loaded is not None
    return loaded["part"]


VIAS = ("memory", "checkpoint", "checkpoint-safe")


def run_round_trip(part: Part, via: str, tmp: Path) -> tuple[list[Any], list[Any]]:
    """Outputs of the original and of the restored copy for the NEXT_STEPS inputs after the save."""
    original = part.make()
    for s in range(DRIVE_STEPS):
        part.step(original, s)
    restored = part.load(_via(part.save(original), via, tmp))
    nxt = range(DRIVE_STEPS, DRIVE_STEPS + NEXT_STEPS)
    a = [part.step(original, s) for s in nxt]
    b = [part.step(restored, s) for s in nxt]
    return a, b


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("name", _names())
def test_a_restored_part_continues_exactly_like_the_original(name: str, via: str, tmp_path: Path) -> None:
    a, b = run_round_trip(PARTS[name], via, tmp_path)
    assert_same(a, b, name)


@pytest.mark.parametrize("name", sorted(PARTS))
def test_the_outputs_compared_depend_on_the_state(name: str) -> None:
    """A fresh part fed the same next inputs answers differently from the driven one: the contract above
    would fail for a state that lost anything that matters."""
    part = PARTS[name]
    driven, fresh = part.make(), part.make()
    for s in range(DRIVE_STEPS):
        part.step(driven, s)
    nxt = range(DRIVE_STEPS, DRIVE_STEPS + NEXT_STEPS)
    assert differs([part.step(driven, s) for s in nxt], [part.step(fresh, s) for s in nxt])


@pytest.mark.parametrize("name", _names())
def test_a_saved_state_is_a_snapshot_not_a_view_of_the_live_part(name: str, tmp_path: Path) -> None:
    """A state taken, then the part driven on, then the state loaded: the copy continues from the moment
    of the save (a state that aliased live arrays would have moved on with the original)."""
    part = PARTS[name]
    original, twin = part.make(), part.make()
    for s in range(DRIVE_STEPS):
        part.step(original, s)
        part.step(twin, s)
    state = part.save(original)
    if name.startswith("model+"):  # torch's state_dict() holds the live tensors by design; the checkpoint
        state = _via(state, "checkpoint", tmp_path)  # writes it at once, which is the snapshot this checks
    for s in range(DRIVE_STEPS, DRIVE_STEPS + 2):
        part.step(original, s)  # the original moves on ...
    restored = part.load(state)
    nxt = range(DRIVE_STEPS, DRIVE_STEPS + NEXT_STEPS)
    assert_same([part.step(twin, s) for s in nxt], [part.step(restored, s) for s in nxt], name)  # ... the state not


@pytest.mark.parametrize("via", VIAS)
def test_progressive_window_metrics_continue_after_a_restore(via: str, tmp_path: Path) -> None:
    a, b = run_round_trip(WINDOW, via, tmp_path)
    assert_same(a, b, "window_metrics")


# -- parts whose state lives in their store --------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


DELTA_LINEAGE = "0123456789abcdef0123456789abcdef"


def _delta_writer(directory: Path) -> tuple[DeltaWriter, Clock]:
    clock = Clock()
    return DeltaWriter(directory, STATIC_CFG.num_rows, every_s=10.0, keep=50, clock=clock,
                       lineage=DELTA_LINEAGE), clock


def _trainer(step: int) -> Trainer:
    model = seeded_model(step)  # weights change from step to step
    sparse, dense = make_optimizers(model, 0.05, 0.01)
    t = Trainer(model, sparse, dense)
    t.samples = 100 * (step + 1)
    return t


def _delta_round_trip(tmp_path: Path, pending: bool) -> tuple[list[Any], list[Any]]:
    """A writer driven DRIVE_STEPS batches (the last one only marked when ``pending``), restarted from a copy
    of its directory; both then take the same next batches."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    original, clock_a = _delta_writer(a_dir)
    for s in range(DRIVE_STEPS):
        clock_a.t += 10.0 if not (pending and s == DRIVE_STEPS - 1) else 1.0
        original.after_step(_trainer(s), to_tensors(samples_at(s), STATIC_CFG).values)
    shutil.copytree(a_dir, b_dir)  # the restart: a new process finds the directory as it is
    restored, clock_b = _delta_writer(b_dir)
    clock_b.t = clock_a.t

    def step(w: DeltaWriter, clock: Clock, s: int) -> Any:
        clock.t += 10.0
        path = w.after_step(_trainer(s), to_tensors(samples_at(s), STATIC_CFG).values)
        assert path is not None
        d = load_delta(path)
        return path.name, d.seq, d.samples_trained, d.lineage, d.rows, d.vectors, d.dense_state

    nxt = range(DRIVE_STEPS, DRIVE_STEPS + NEXT_STEPS)
    return [step(original, clock_a, s) for s in nxt], [step(restored, clock_b, s) for s in nxt]


def test_a_restarted_delta_writer_continues_the_sequence_with_the_same_deltas(tmp_path: Path) -> None:
    a, b = _delta_round_trip(tmp_path, pending=False)
    assert [x[1] for x in a] == list(range(DRIVE_STEPS + 1, DRIVE_STEPS + NEXT_STEPS + 1))
    assert_same(a, b, "deltas")


def test_a_restarted_delta_writer_still_sends_the_rows_marked_before_the_restart(tmp_path: Path) -> None:
    a, b = _delta_round_trip(tmp_path, pending=True)
    assert_same(a, b, "deltas")


def test_delta_round_trip_outputs_depend_on_the_directory(tmp_path: Path) -> None:
    """A writer on an empty directory starts at seq 1: the comparison above sees the restored sequence."""
    a, _ = _delta_round_trip(tmp_path / "x", pending=False)
    fresh, clock = _delta_writer(tmp_path / "empty")
    clock.t = 10.0
    path = fresh.after_step(_trainer(DRIVE_STEPS), to_tensors(samples_at(DRIVE_STEPS), STATIC_CFG).values)
    assert path is not None and load_delta(path).seq == 1 != a[0][1]


KEYS = [("samples", p, o) for p in range(3) for o in range(4)]


def _strike_steps(strikes: Strikes, step: int) -> Any:
    """A failed batch (every key of it struck), then some of them succeeding; returns what the consumer asks."""
    rng = np.random.default_rng(5000 + step)
    batch = [KEYS[int(i)] for i in rng.choice(len(KEYS), 4, replace=False)]
    strikes.failed(batch, RuntimeError(f"boom {step}"))
    strikes.succeeded(batch[:1])
    return [(strikes.suspect(k), strikes.poisoned(k)) for k in KEYS], dict(sorted(strikes.counts.items()))


@pytest.fixture(params=["file", "redis"])
def strike_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    if request.param == "file":
        yield lambda: FileStrikes(tmp_path / "strikes.json")
        return
    client: redis.Redis = request.getfixturevalue("redis_client")
    key = f"strikes-contract-{tmp_path.name}"
    client.delete(key)
    try:
        yield lambda: RedisStrikes(client, key)
    finally:
        client.delete(key)


def test_strikes_restarted_on_their_store_continue_exactly(strike_store: Callable[[], Any]) -> None:
    original = Strikes(strike_store(), limit=3)
    for s in range(DRIVE_STEPS):
        _strike_steps(original, s)
    restored = Strikes(strike_store(), limit=3)  # a fresh process on the same store
    nxt = range(DRIVE_STEPS, DRIVE_STEPS + NEXT_STEPS)
    a = [_strike_steps(original, s) for s in nxt]
    b = [_strike_steps(restored, s) for s in nxt]
    assert any(p is not None for p in (x for out in a for _, x in out[0])), "some key must be poisoned"
    assert_same(a, b, "strikes")
