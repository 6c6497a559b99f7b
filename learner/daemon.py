"""``streamrec train``: the continuous training daemon.

    samples topic --KafkaSampleDataset--> TensorBatch --dedup--> Trainer.test_then_train
                                                                   |
                        checkpoint (model, optimizers, offsets) <--+ every N s / N samples, at exit
                        then commit the group offsets (for lag monitoring only)

Exactly once: the checkpoint records, per partition, the offset of the next message to train; on
start the learner loads the newest checkpoint and reads from exactly those offsets. Whatever was
trained after the last checkpoint is lost with the crashed process's memory and trained again, so
every sample changes the persisted model exactly once. The group's committed offsets trail the
checkpoint and are never read back by the learner.

The feature config is inferred from the first ``probe_rows`` samples on a fresh start (which context
columns are present in enough of them, which are lists) and then lives in the checkpoint: a
restarted learner uses the checkpoint's config, and refuses settings that would change the model's
shape. Columns outside the config are ignored.

A periodic checkpoint that cannot be written (disk full, read-only) is retried at the next interval;
the one at exit is not optional: if it fails the daemon exits non-zero (what was trained since the
last durable checkpoint is trained again on restart, nothing is lost).

Failures: a training batch that raises an unexpected exception gives each of its messages a strike
(``stream/strikes.py``, stored in ``<checkpoint_dir>/strikes.json``) and stops the daemon without a
checkpoint; on restart those messages are trained one per batch, and one that fails
``poison_after`` times in a row goes to ``samples.dlq``. A failure of the infrastructure, or a DataLoader worker that
died on its own (OOM-killed, killed by a signal, a segfault; torch raises it in the training process wherever that
is), gives no strikes (:func:`strike_failed_batch`). A message with strikes that trains after all loses them;
when the strikes file cannot be written then (a full disk), training goes on (``_clear_strikes``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from confluent_kafka import KafkaException, TopicPartition
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

from learner import checkpoint
from learner.batch import TensorBatch
from learner.calibration import OnlineCalibration, identity
from learner.config import Amp, CheckpointMismatch, LearnerSettings, check_topic, parse_mlp, shape_of
from learner.delayed import BaseRateBias
from learner.delta_writer import DeltaWriter
from learner.distributed import partitions_of
from learner.event_clock import EventClock
from learner.features import FeatureConfig, FieldKind, default_config
from learner.health import FieldCoverage, MemoryMonitor, PositiveRate
from learner.kafka_dataset import KafkaSampleDataset, not_the_batch, read_samples, read_watermark, sample_loader
from learner.lag import publish_lag
from learner.model import DeepFM, autocast_dtype
from learner.optim import make_optimizers
from learner.progressive import ProgressiveMetrics
from learner.quality import IdMetrics, TrainingQuality
from learner.row_mapper import MapStats, RowMapper, user_keys
from learner.tensorpack import load_signing_key
from learner.trainer import Trainer
from learner.worker_counters import count_worker_counters
from learner.worker_stall import watched
from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError
from stream.features import MISSING
from stream.files import NotDurable, describe_os_error
from stream.idle_clock import IdleClock
from stream.joiner.partitions import ensure_samples
from stream.kafka import headers_of, new_consumer
from stream.kafka_topics import topic_identity
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.samples import CTX_PREFIX, DELAYED_POSITIVE, DENSE_PREFIX, SampleBatch
from stream.stop_signals import put_back_signals, take_stop_signals
from stream.strikes import FileStrikes, Strikes, settle_strikes

log = logging.getLogger("streamrec.train")

AUC = Gauge("streamrec_learner_progressive_auc", "Progressive (test-then-train) AUC since the first sample.")
LOGLOSS = Gauge("streamrec_learner_progressive_logloss", "Progressive logloss since the first sample.")
WINDOW_AUC = Gauge("streamrec_learner_window_auc", "Progressive AUC over the recent window.")
EVENT_TIME = Gauge("streamrec_learner_event_time_seconds", "Event time (Unix seconds) of the newest sample trained: "
                   "the time axis of what the learner saw (a replay's is years ago; live, wall time minus this is "
                   "how far training trails the stream).")
SAMPLES = PCounter("streamrec_learner_samples_total", "Samples trained.")
DUPLICATES = PCounter("streamrec_learner_duplicates_total", "Duplicate samples dropped.")
CALIBRATION_SCALE = Gauge("streamrec_learner_calibration_scale", "Platt scale a of the served logit a * z + b "
                          "(learner/calibration.py; 1 = served as the model says, below 1 = shrunk).")
CALIBRATION_SHIFT = Gauge("streamrec_learner_calibration_shift", "Platt shift b of the served logit a * z + b.")
NAN_LOSSES = PCounter("streamrec_learner_nan_losses_total", "Batches whose loss was not finite (update skipped).")
DENSE_CLIPPED = PCounter("streamrec_learner_dense_clipped_steps_total",
                         "Steps whose dense gradient was scaled down to [learner] dense_grad_clip x the recent median "
                         "norm (an outlier batch, e.g. an out-of-scale dense value).")
CHECKPOINT_S = Gauge("streamrec_learner_checkpoint_seconds", "Time the last checkpoint took.")
CHECKPOINT_FAILURES = PCounter("streamrec_learner_checkpoint_failures_total",
                               "Checkpoints that could not be written (disk full, read-only); retried.")
CHECKPOINT_NOT_DURABLE = PCounter("streamrec_learner_checkpoints_not_durable_total",
                                  "Checkpoints written into place whose directory fsync then failed: read at restart, "
                                  "not known to survive a power loss; none older is pruned until one is durable.")
TOPIC_CHANGED = PCounter("streamrec_learner_topic_changed_total",
                         "Restores whose checkpoint's samples topic had another topic id than the topic of its name "
                         "now (deleted and created again, another cluster): every partition trained from its first "
                         "record.")
# Health (learner/health.py): memory, gradients, feature coverage, label balance; published at most once a second.
RSS = Gauge("streamrec_learner_rss_bytes", "Resident set size of the learner process (bytes).")
CUDA_MEMORY = Gauge("streamrec_learner_cuda_memory_bytes", "Device memory of the learner's CUDA device (bytes): "
                    "kind=allocated (tensors) or reserved (held by the caching allocator); only on CUDA.", ["kind"])
MEMORY_GROWTH = Gauge("streamrec_learner_memory_growth_bytes_per_hour", "Growth of the learner's memory (bytes per "
                      "hour; least-squares slope over the last 10 minutes, NaN for the first 5): memory=rss, or "
                      "cuda_allocated on CUDA.", ["memory"])
_NORM_BUCKETS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0, float("inf"))
GRAD_NORM = Histogram("streamrec_learner_grad_norm", "L2 norm of each optimizer step's gradient: part=dense (MLP "
                      "and bias) or embedding (the table's rows the step touched).", ["part"], buckets=_NORM_BUCKETS)
FIELD_GRAD_NORM = Histogram("streamrec_learner_field_grad_norm", "L2 norm of a step's embedding gradient in one "
                            "field's rows (history counts under item_id, whose rows it shares); one step a second.",
                            ["field"], buckets=_NORM_BUCKETS)
UPDATE_NORM = Gauge("streamrec_learner_update_norm", "L2 norm of what one optimizer step changed, part=dense or "
                    "embedding; a step sampled once a second (0: nothing changes: zero learning rate, frozen table).",
                    ["part"])
COVERAGE = Gauge("streamrec_learner_field_coverage", "Share of recent samples (about metrics_window / 10) carrying "
                 "the field (not MISSING, a non-empty list, a non-zero dense value), per field that some sample "
                 "carried since the learner started.", ["field"])
POSITIVE_RATE = Gauge("streamrec_learner_window_positive_rate", "Share of positive labels among the last "
                      "metrics_window samples trained (NaN until 1000 arrived); compare streamrec_join_samples_total.")


def observe_grad_norms(steps: list[tuple[float, float]], blocks: list[dict[str, float]]) -> None:
    """``GradNorms.drain``'s (dense, embedding) norms of each step and per-field norms of each sampled step into
    their histograms (both daemons); a step the scaler skipped (inf) or one not measured (NaN) is not observed."""
    dense, table = GRAD_NORM.labels("dense"), GRAD_NORM.labels("embedding")
    for d, e in steps:
        if math.isfinite(d):  # an inf or a NaN would poison the sums
            dense.observe(d)
        if math.isfinite(e):
            table.observe(e)
    for per_field in blocks:
        for name, v in per_field.items():
            if math.isfinite(v):
                FIELD_GRAD_NORM.labels(name).observe(v)


def publish_coverage(coverage: FieldCoverage) -> None:
    """Each field's share of the recent samples carrying it (both daemons; on N ranks rank 0's, of every rank's)."""
    for name, share in coverage.shares().items():
        COVERAGE.labels(name).set(share)


def publish_memory(memory: MemoryMonitor) -> None:
    """The process's memory now and its growth (learner/health.py): both daemons, each rank its own, at most 1/s."""
    mem = memory.sample()
    RSS.set(mem["rss"])
    for kind in ("allocated", "reserved"):
        if f"cuda_{kind}" in mem:
            CUDA_MEMORY.labels(kind).set(mem[f"cuda_{kind}"])
    for name, rate in memory.growth_per_hour().items():
        MEMORY_GROWTH.labels(name).set(rate)


class RecentIds:
    """The last ``capacity`` samples seen: drops duplicate samples (joiner retries). A sample is its impression
    id and whether it is a delayed positive (``stream/samples.py``: an impression may have an ``OBSERVED`` 0
    and then a ``DELAYED_POSITIVE``, two samples). The key of a delayed positive is the 1-tuple ``(id,)``, of any
    other sample the id itself: no impression id can equal another's delayed positive (with ``id + suffix`` keys,
    an impression named ``X\\x00delayed`` shadowed the click of impression ``X``, dropped as a duplicate)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str | tuple[str], None] = OrderedDict()

    def filter(self, ids: np.ndarray, kinds: np.ndarray | None = None) -> np.ndarray:
        """Mask (B,) of first occurrences; remembers them."""
        keep = np.ones(len(ids), bool)
        seen = self._ids
        keys: list[str | tuple[str]] = ids.tolist()
        if kinds is not None:
            for j in np.flatnonzero(kinds == DELAYED_POSITIVE).tolist():
                keys[j] = (keys[j],)  # type: ignore[assignment]
        for i, imp in enumerate(keys):
            if imp in seen:
                keep[i] = False
            else:
                seen[imp] = None
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return keep

    def state(self) -> list[str | tuple[str]]:
        return list(self._ids)

    def load(self, ids: list[str | tuple[str] | list[str]]) -> None:
        self._ids = OrderedDict.fromkeys(_recent_key(i) for i in ids[-self.capacity:])

    def load_merged(self, lists: list[list[str | tuple[str] | list[str]]]) -> None:
        """Several learners' states (a sharded job restarted on another number of ranks): the newest equal share of
        each, so that every old rank's recent samples are still caught (the concatenation cut to ``capacity`` kept
        only the last rank's)."""
        share = self.capacity // max(len(lists), 1)
        self.load([i for ids in lists for i in (ids[-share:] if share else [])])


def _recent_key(key: str | tuple[str] | list[str]) -> str | tuple[str]:
    """A key of :class:`RecentIds` as a checkpoint holds it: a delayed positive's ``(id,)`` (a list once through
    some serialisers) or the id. A checkpoint from before these keys wrote a delayed positive as
    ``id + "\\x00delayed"``: read as the plain string it is, it matches no sample, so only a retry of such a click
    re-sent across the upgrade would be trained twice (reading it back as ``(id,)`` would let an id that ends so
    shadow a click again)."""
    return (str(key[0]),) if isinstance(key, tuple | list) else key


def _present(batch: SampleBatch, column: str) -> int:
    """Rows of ``batch`` that carry ``column`` (a missing categorical is MISSING, a list empty or ``[MISSING]``: the
    joiner's for a row without the key, ``stream/joiner/sample_rows.py``; a dense 0)."""
    col = batch.batch.column(column)
    if pa.types.is_list(col.type):  # a row with a value other than MISSING
        values, offsets = batch.lists(column)
        kept = np.concatenate([[0], np.cumsum(values != MISSING)])  # (N + 1,) values kept before each
        return int((kept[offsets[1:]] > kept[offsets[:-1]]).sum())
    return int((col.to_numpy(zero_copy_only=False) != (0.0 if column.startswith(DENSE_PREFIX) else MISSING)).sum())


def strike_failed_batch(strikes: Strikes, keys: list[tuple[str, int, int]], exc: BaseException) -> bool:
    """Each of ``keys`` (the messages of a batch whose training raised ``exc``) gets a strike, unless the failure is
    no message's fault (:func:`learner.kafka_dataset.not_the_batch`: the infrastructure, a DataLoader worker that
    died). Returns whether they got one."""
    if not keys or not_the_batch(exc):
        return False
    log.error("training a batch of %d message(s) failed (%s); each gets a strike, stopping without a checkpoint",
              len(keys), type(exc).__name__)
    strikes.failed(keys, exc)
    return True


def refuse_sharded(directory: Path) -> None:
    """A :class:`ConfigError` when ``directory`` holds checkpoints of the sharded learner (``dcp-*/``, written under
    torchrun: ``learner/sharded_checkpoint.py``). One process does not read them, and it started a fresh model there,
    silently: trained every retained sample again from offset 0 over that progress, while ``streamrec train --status``
    went on reporting the sharded one. The sharded learner refuses a directory of single-process checkpoints the same
    way (``learner/sharded_daemon.py``)."""
    from learner import sharded_checkpoint  # torch.distributed.checkpoint: only here, once at start

    found = sharded_checkpoint.describe_newest(directory)
    if found is None:
        return
    raise ConfigError(
        f"[learner] checkpoint_dir {directory} holds sharded checkpoints ({found}): one process does not resume "
        "from them, and a fresh model here would train every retained sample again over that progress. Go on under "
        "torchrun with the same world size, or convert the newest into a single-process checkpoint with "
        f"`streamrec train --checkpoint-dir {directory} --unshard NEW_DIR` and train one process with "
        "--checkpoint-dir NEW_DIR")


def infer_fields(batches: list[SampleBatch], min_share: float, max_fields: int,
                 ) -> tuple[dict[str, FieldKind], tuple[str, ...]]:
    """Context fields (name -> single/multi) and dense names present in at least ``min_share`` of the rows of
    ``batches``, at most ``max_fields`` of each (the most present first)."""
    rows = sum(len(b) for b in batches)
    present: Counter[str] = Counter()
    multi: set[str] = set()
    for b in batches:
        for f in b.batch.schema:
            if f.name.startswith((CTX_PREFIX, DENSE_PREFIX)):
                present[f.name] += _present(b, f.name)
                if pa.types.is_list(f.type):
                    multi.add(f.name)
    keep = [name for name, n in present.most_common() if rows and n / rows >= min_share and n > 0]
    ctx = [n for n in keep if n.startswith(CTX_PREFIX)][:max_fields]
    dense = [n for n in keep if n.startswith(DENSE_PREFIX)][:max_fields]
    return ({n[len(CTX_PREFIX):]: ("multi" if n in multi else "single") for n in sorted(ctx)},
            tuple(sorted(n[len(DENSE_PREFIX):] for n in dense)))


PROBE_S = 5.0  # one probe for the first samples (infer_feature_config) waits this long; a fresh learner probes again
PROBE_POLL_S = 0.5


def first_samples_clock() -> IdleClock:
    """How long a fresh learner has waited for its first samples (``exit_when_idle_s`` bounds it), one tick a probe.
    A stall is no waiting: it counted, and a learner stopped past its limit before any sample came woke to end its run
    "no samples arrived" with the samples of the stall unread (stream.idle_clock)."""
    return IdleClock(PROBE_S + 2.0, PROBE_S)


def infer_feature_config(kafka: KafkaSettings, ls: LearnerSettings, timeout_s: float,
                         limits: EventLimits = DEFAULT_LIMITS) -> FeatureConfig | None:
    """The config of a fresh learner, from the first ``probe_rows`` samples (None: no data yet).

    Waits for up to ``timeout_s`` for that many rows, then decides on what arrived (at least one message). Only
    messages the reader would train count (``KafkaSampleDataset``'s bounds): one it dead-letters, at the head of the
    topic, gave the model its fields for good."""
    c = new_consumer(kafka, f"{ls.group_id}-probe")
    batches: list[SampleBatch] = []
    try:
        md = c.list_topics(kafka.samples_topic, timeout=10).topics[kafka.samples_topic]
        c.assign([TopicPartition(kafka.samples_topic, p, 0) for p in md.partitions])
        waited = IdleClock(PROBE_POLL_S + 2.0, PROBE_POLL_S)  # a stall is no waiting: stream.idle_clock
        while waited.idle_s < timeout_s and sum(len(b) for b in batches) < ls.probe_rows:
            msgs = c.consume(16, PROBE_POLL_S)
            waited.tick()
            for m in msgs:
                if m.error() is None:
                    try:
                        read_watermark(headers_of(m), ls.future_ts_s, ls.attribution_window_s)
                        batches.append(read_samples(m.value(), ls.future_ts_s, ls.attribution_window_s, limits))
                    except Exception:  # noqa: BLE001 - a bad message: the dataset will dead-letter it
                        continue
            if batches and not msgs:
                break  # nothing more for now: decide on what is there
    finally:
        c.close()
    if not batches:
        return None
    ctx, dense = infer_fields(batches, ls.min_field_share, ls.max_fields)
    return default_config(ctx, buckets=ls.buckets, ctx_buckets=ls.ctx_buckets, embedding_dim=ls.embedding_dim,
                          dense=dense, id_capacity=ls.id_capacity, admit_after=ls.admit_after, id_ttl_s=ls.id_ttl_s,
                          id_init=ls.id_init.value, user_bucket_half_life_s=ls.user_bucket_half_life_s)


class Learner:
    def __init__(self, kafka: KafkaSettings, ls: LearnerSettings, redis: RedisSettings | None = None,
                 limits: EventLimits = DEFAULT_LIMITS) -> None:
        self.kafka, self.ls = kafka, ls
        self.limits = limits  # [limits], the joiner's: the longest impression id a samples message may hold
        self.redis_settings = redis  # where the deltas are announced ([redis]); None: not announced, serving polls
        self._signing_key = load_signing_key(ls.signing_key_file)  # read once; signs the deltas (never printed)
        self.device = torch.device(ls.device.resolve(torch.cuda.is_available()))
        self._stop = False
        self.trainer: Trainer | None = None
        self.cfg: FeatureConfig | None = None
        self.deltas: DeltaWriter | None = None  # serving freshness, built with the model (learner/deltas.py)
        self.mapper: RowMapper | None = None  # dynamic ids -> rows (built with the model)
        self._event_now: float | None = None  # event time (s) after the samples trained: learner/event_clock.py
        self._event_newest = 0.0  # event time of the newest sample trained (s)
        self._fresh_state()
        self._window_published = 0.0
        self._health_published = 0.0
        self.memory = MemoryMonitor(self.device)
        self.coverage: FieldCoverage | None = None  # built with the model (it needs the feature config)
        self.positive_rate = PositiveRate(ls.metrics_window)
        self._group = new_consumer(kafka, ls.group_id)  # commits only, for lag dashboards
        self._lock: int | None = None  # the checkpoint directory's LOCK while run() trains (checkpoint.hold_directory)
        self._handlers: dict[int, Any] = {}  # the signal handlers run() replaced, put back by close()
        self._shape = shape_of(ls)  # what a checkpoint records and a restore compares
        self.strikes = Strikes(FileStrikes(Path(ls.checkpoint_dir) / "strikes.json"), ls.poison_after)

    # -- model and state ---------------------------------------------------------------------------
    def _fresh_state(self) -> None:
        """The state a checkpoint restores besides the model (``_build``), as a learner without one has it. A restore
        starts every candidate checkpoint from here: a newest one refused after some parts loaded (``_load``) left
        its quality windows, read by the older one's ``load_state_dict`` as "absent: keep", in the resumed run."""
        ls = self.ls
        self.partition_rows: Counter[int] = Counter()  # rows trained (or dropped as duplicates) per partition
        self.duplicates = 0
        self.offsets: dict[int, int] = {}
        self.topic_ids: dict[str, str] = {}  # which samples topic the offsets are of (checkpoint.TOPIC_IDENTITY)
        self.recent = RecentIds(ls.dedup_window)
        self._clock = EventClock()
        self.quality = TrainingQuality(ls.cold_k, ls.metrics_window, ls.attribution_window_s, ls.quality_recent_s,
                                       ls.quality_min_samples, ls.cold_tracker_capacity)
        self.bias: BaseRateBias | None = None  # a model built without a checkpoint: learner/delayed.py
        self.id_metrics = IdMetrics(ls.metrics_window)  # dynamic ids: lookups, admissions, bucket share

    def _model_settings(self) -> dict[str, Any]:
        ls = self.ls
        return {"mlp": ls.model.mlp_text, "dropout": ls.dropout, "lr_sparse": ls.lr_sparse, "lr_dense": ls.lr_dense,
                "sparse_optimizer": ls.sparse_optimizer.value, "amp": ls.amp.value, "seed": ls.seed, "boost": ls.boost,
                "boost_half_life": ls.boost_half_life, "initial_accumulator": ls.initial_accumulator}

    def _build(self, cfg: FeatureConfig, model_settings: dict[str, Any]) -> None:
        self.cfg = cfg
        amp_dtype = autocast_dtype(Amp.of(model_settings["amp"], "amp"), self.device)
        model = DeepFM(cfg, mlp=parse_mlp(model_settings["mlp"]),
                       dropout=model_settings["dropout"], seed=model_settings["seed"], autocast_dtype=amp_dtype)
        model.to(self.device)
        sparse, dense = make_optimizers(model, model_settings["lr_sparse"], model_settings["lr_dense"],
                                        model_settings["sparse_optimizer"], boost=model_settings.get("boost", 0.0),
                                        boost_half_life=model_settings.get("boost_half_life", 0.0),
                                        initial_accumulator=model_settings.get("initial_accumulator", 0.0))
        self.mapper = RowMapper(cfg)
        self.trainer = Trainer(model, sparse, dense, accumulation=self.ls.accumulation, device=self.device,
                               metrics=ProgressiveMetrics(window=self.ls.metrics_window),
                               calibration=OnlineCalibration() if self.ls.online_calibration else None,
                               fused_sparse_update=self.ls.fused_sparse_update,
                               dense_grad_clip=self.ls.dense_grad_clip)
        if self.ls.deltas_every_s > 0:
            self.deltas = DeltaWriter.from_settings(self.ls, cfg.num_rows, key=self._signing_key,
                                                    redis_settings=self.redis_settings)
            if self.mapper.active:  # serving learns of ids admitted after its artifact
                self.deltas.id_maps_source = self.mapper.state_dict

    def _restore(self) -> bool:
        """Resume from the newest checkpoint. Its model-shaping settings (``learner.config.SHAPE_SETTINGS``)
        must equal ours (else :class:`CheckpointMismatch`, exit 2); the rest come from the settings. A directory of
        the sharded learner's checkpoints is refused (:func:`refuse_sharded`)."""
        refuse_sharded(Path(self.ls.checkpoint_dir))
        # weights-only (a foreign file runs nothing); one that does not fit its own model is skipped as damaged
        ckpt = checkpoint.restore_latest(self.ls.checkpoint_dir, check=self._load)
        if ckpt is None:  # a new model: never of a lineage an earlier training left here (its deltas' artifacts)
            checkpoint.begin_lineage(Path(self.ls.checkpoint_dir))
            return False
        listed = checkpoint.list_checkpoints(self.ls.checkpoint_dir)
        passed = listed[listed.index(ckpt.path) + 1:] if ckpt.path in listed else []  # (newest last)
        if passed and self.deltas is not None:  # (each was reported with why it did not load)
            self.deltas.resend_all(f"resumed from {ckpt.path.name}, behind "
                                   f"{', '.join(p.name for p in passed)}, which do not load")
            self.deltas.sync()  # the resend survives a restart that no longer falls back (pending list)
        checkpoint.set_aside(passed)
        if self.deltas is not None:
            self.deltas.abandon_after(ckpt.meta.get("delta_seq"), ckpt.samples_trained)
        log.info("resumed from %s: %d samples trained, offsets %s", ckpt.path, ckpt.samples_trained,
                 self.offsets)
        return True

    def _load(self, ckpt: checkpoint.Checkpoint) -> None:
        """The learner's state from ``ckpt``. A ConfigError when our shaping settings or topic differ from its; any
        other exception (a tensor of another shape, a missing key: a damaged file) has the restore try the previous
        checkpoint, and this runs again on it (every part below is built or reset anew first: ``_fresh_state``)."""
        meta, recorded = ckpt.meta, ckpt.shape
        mine = shape_of(self.ls)
        changed = {k: (recorded.get(k), v) for k, v in mine.items() if k in recorded and recorded[k] != v}
        if changed:
            raise CheckpointMismatch(ckpt.path, changed)
        check_topic(ckpt.path, meta, self.kafka.samples_topic)
        checkpoint.continue_lineage(self.ls.checkpoint_dir, ckpt.meta, ckpt.path)  # before the deltas read LINEAGE
        self._fresh_state()  # nothing of a newer checkpoint refused after some of it loaded
        self._build(ckpt.feature_config, self._model_settings())
        assert self.trainer is not None
        self.trainer.model.load_state_dict(ckpt["model"])
        self.trainer.sparse_opt.load_state_dict(ckpt["sparse_opt"])
        self.trainer.dense_opt.load_state_dict(ckpt["dense_opt"])
        for opt, lr in ((self.trainer.sparse_opt, self.ls.lr_sparse), (self.trainer.dense_opt, self.ls.lr_dense)):
            for group in opt.param_groups:  # a restored optimizer keeps its state but takes today's rate
                group["lr"] = lr
        self.trainer.metrics.load_state_dict(ckpt["metrics"])
        self.trainer.samples, self.trainer.steps = ckpt.samples_trained, ckpt.steps
        self.offsets, self.topic_ids = ckpt.offsets, checkpoint.topic_recorded(meta)
        self.bias = None
        self.partition_rows, self.duplicates = Counter(ckpt.partition_rows), ckpt.duplicates
        self.recent.load(ckpt["recent_ids"])
        self._clock.load(ckpt.get("event_clock"))  # id ages go on from where they were, not from one new row
        self.trainer.dense_clip.load_state_dict(ckpt.get("dense_clip"))  # the clip's norms: no fresh window to pass
        assert self.mapper is not None
        self.mapper.load_state_dict(ckpt.get("id_maps", {}))
        if self.deltas is not None:  # the first delta (with the maps) resends every admitted id's row: deltas.py
            self.deltas.mark(self.mapper.owned_rows())
        self.quality.load_state_dict(ckpt)
        self.id_metrics.load_state_dict(ckpt.get("id_metrics", {}))  # the bucket share, published before a batch
        if ckpt.get("base_rate_bias"):  # the model's bias followed the click rate (and may still: unless done)
            self.bias = BaseRateBias(prior_rate=self.ls.prior_click_rate)
            self.bias.load_state_dict(ckpt["base_rate_bias"])
        if "delayed_weights" in ckpt:
            self.trainer.delayed.load_state_dict(ckpt["delayed_weights"])
        if self.trainer.calibration is not None and ckpt.get("calibration"):
            self.trainer.calibration.load_state_dict(ckpt["calibration"])
        elif self.trainer.calibration is None:  # calibration turned off: serve the raw logits again
            self.trainer.model.get_buffer("calibration").copy_(identity())

    def save(self) -> None:
        assert self.trainer is not None and self.cfg is not None
        t0 = time.monotonic()
        self.trainer.step()  # no gradient left pending: the checkpoint is a clean step boundary
        tr = self.trainer
        if self.mapper is not None and self.mapper.active and self._event_now is not None:
            decayed = self.mapper.decay_idle_buckets(tr.model, self._event_now)  # the artifact gets today's buckets
            if self.deltas is not None:  # ... and serving with the next delta (listed as pending by the sync below)
                self.deltas.mark(decayed)
        meta = {
            "samples_trained": tr.samples, "steps": tr.steps, "offsets": {str(p): o for p, o in self.offsets.items()},
            "partition_rows": {str(p): n for p, n in self.partition_rows.items()}, "duplicates": self.duplicates,
            "feature_config": self.cfg.to_dict(), "model": self._model_settings(), "shape": self._shape,
            "metrics": tr.metrics.summary(), "topic": self.kafka.samples_topic, **self.topic_ids,
            "delta_seq": self.deltas.seq if self.deltas is not None else None,  # the deltas it includes
        }
        state = {"model": tr.model.state_dict(), "sparse_opt": tr.sparse_opt.state_dict(),
                 "dense_opt": tr.dense_opt.state_dict(), "metrics": tr.metrics.state_dict(),
                 "recent_ids": self.recent.state(), "id_maps": self.mapper.state_dict() if self.mapper else {},
                 "event_clock": self._clock.state(), "dense_clip": tr.dense_clip.state_dict(),
                 **self.quality.state_dict(), "id_metrics": self.id_metrics.state_dict(),
                 "delayed_weights": tr.delayed.state_dict(),
                 "calibration": tr.calibration.state_dict() if tr.calibration is not None else {},
                 "base_rate_bias": self.bias.state_dict() if self.bias is not None else {}}
        if self.deltas is not None:  # rows trained before this checkpoint and in no delta yet: durably listed
            self.deltas.sync()  # (learner/deltas.py "Pending rows"); what is trained after it is trained again
        try:
            checkpoint.save(self.ls.checkpoint_dir, state, meta, keep=self.ls.keep_checkpoints)
            durable = True
        except NotDurable as exc:  # written (and read at restart): not a failed checkpoint, retried and counted as one
            durable = False
            CHECKPOINT_NOT_DURABLE.inc()  # nothing pruned meanwhile: rising for long, the directory fills
            log.warning("checkpoint written, but not known durable: %s; a restart reads it, a power loss may undo it "
                        "(older checkpoints kept, group offsets not committed until one is durable)", exc)
        # Only now, after the checkpoint is durable: the group offsets, for lag dashboards only (the learner
        # never reads them back), so a broker that is away just delays them to the next checkpoint.
        if self.offsets and durable:
            topic = self.kafka.samples_topic
            try:
                self._group.commit(offsets=[TopicPartition(topic, p, o) for p, o in self.offsets.items()],
                                   asynchronous=False)
            except KafkaException as exc:
                log.warning("could not commit the group offsets (lag dashboards lag): %s", exc)
        CHECKPOINT_S.set(time.monotonic() - t0)
        self._update_lag()

    def _try_save(self) -> bool:
        """A periodic checkpoint; a full or read-only disk is survived: training goes on, the group offsets
        stay where the last durable checkpoint put them, and the next interval tries again."""
        try:
            self.save()
            return True
        except OSError as exc:
            CHECKPOINT_FAILURES.inc()
            log.error("checkpoint to %s failed (%s); training goes on from memory, next try in %.0f s",
                      self.ls.checkpoint_dir, describe_os_error(exc), self.ls.checkpoint_every_s)
            return False

    def _clear_strikes(self, keys: list[tuple[str, int, int]]) -> None:
        """Messages with strikes that trained after all lose them. A strikes file that cannot be written (a full
        disk) is survived like a checkpoint: they are cleared in memory, and written with the next change that can
        be (a restart before that trains them one per batch once more, which is harmless). Raised, it stopped the
        daemon after every such batch, a crash loop for as long as the disk was full."""
        try:
            self.strikes.succeeded(keys)
        except OSError as exc:
            log.warning("could not record that %d message(s) with strikes trained after all (%s); training goes on",
                        len(keys), describe_os_error(exc))

    def _update_lag(self) -> None:
        """Every partition's lag (learner/lag.py), those not trained from yet too."""
        publish_lag(self._group, self.kafka.samples_topic, self.offsets)

    # -- the loop ----------------------------------------------------------------------------------
    def _partitions(self) -> list[int]:
        ensure_samples(self.kafka)  # the inputs' partition count (stream/joiner/partitions.py)
        md = self._group.list_topics(self.kafka.samples_topic, timeout=10).topics[self.kafka.samples_topic]
        return sorted(md.partitions)

    def _check_topic_ids(self) -> None:
        """The checkpoint's offsets dropped (every partition read from its first record, ``KafkaSampleDataset``'s
        ``unsaved``) when they are of another topic of the samples topic's name (:func:`checkpoint.same_topic`); the
        ids the broker gives now are what the next checkpoints record. Asked once, at the start: a topic made again
        under the running learner would otherwise get its id recorded with the old topic's offsets, the silent skip
        this prevents (kept, the old id has a restart train the new topic again from its start: said, counted)."""
        now = topic_identity(self.kafka, self.kafka.samples_topic)
        if not checkpoint.same_topic(self.topic_ids, now, self.kafka.samples_topic):
            TOPIC_CHANGED.inc()
            self.offsets = {}
            # strikes name messages by offset too: the old topic's would send the new one's alone or dead-letter them
            self._clear_strikes([k for k in self.strikes.counts if k[0] == self.kafka.samples_topic])
        if "topic_id" in now:  # a broker that says none keeps the recorded id
            self.topic_ids = now

    def run(self) -> dict[str, Any]:
        take_stop_signals(self._handlers, self._on_signal)
        ls = self.ls
        self._lock = checkpoint.hold_directory(Path(ls.checkpoint_dir))  # one learner a directory; closed by close()
        if not self._restore():
            wait = ls.exit_when_idle_s if ls.exit_when_idle_s is not None else float("inf")
            cfg = None
            waited = first_samples_clock()
            while cfg is None and not self._stop and waited.idle_s < wait:
                cfg = infer_feature_config(self.kafka, ls, timeout_s=min(PROBE_S, wait), limits=self.limits)
                waited.tick()
            if cfg is None:
                return self.summary(reason="signal" if self._stop else "no samples arrived")
            self._build(cfg, self._model_settings())
            self.bias = BaseRateBias(prior_rate=ls.prior_click_rate) if ls.init_bias else None
            if self.bias is not None:
                assert self.trainer is not None
                self.bias.start(self.trainer.model)
        listed = self._partitions()
        self._check_topic_ids()
        unsaved = [p for p in listed if p not in self.offsets]  # no checkpoint offset: start at 0
        for p in unsaved:
            self.offsets[p] = 0
        assert self.trainer is not None and self.cfg is not None
        topic = self.kafka.samples_topic
        settle_strikes(self.strikes, {(topic, p): o for p, o in self.offsets.items()})
        suspects = {(p, o): self.strikes.poisoned(key) for key in self.strikes.counts
                    for t, p, o in [key] if t == topic}
        # Pinned by the DataLoader (in the main process: memory a worker pins does not survive the hand-over).
        dataset = KafkaSampleDataset(self.kafka, self.cfg, self.offsets, ls.batch_rows, ls.exit_when_idle_s,
                                     suspects=suspects, merge=ls.merge_partitions, future_ts_s=ls.future_ts_s,
                                     max_label_delay_s=ls.attribution_window_s, unsaved=unsaved,
                                     listed=listed, limits=self.limits)
        loader = sample_loader(dataset, ls.num_workers, ls.prefetch_factor, ls.pin_memory.resolve(self.device.type),
                               persistent_workers=ls.persistent_workers, stall_s=ls.worker_stall_s)
        last_ckpt, since_ckpt = time.monotonic(), 0
        reason = "input idle"
        for batch in watched(loader, ls.num_workers, ls.worker_stall_s,
                             partial(partitions_of, sorted(self.offsets), 0, 1, num_workers=ls.num_workers)):
            count_worker_counters(batch)  # a DataLoader worker's: its registry is not the one /metrics serves
            keys = [(topic, p, o) for p, o, _ in batch.positions]
            try:
                self._train(batch)
            except Exception as exc:
                strike_failed_batch(self.strikes, keys, exc)
                raise
            if self.strikes.counts:
                self._clear_strikes(keys)
            since_ckpt += len(batch)
            if ls.max_samples is not None and self.trainer.samples >= ls.max_samples:
                reason = "max samples"
                break
            if self._stop:
                reason = "signal"
                break
            if since_ckpt >= ls.checkpoint_every_samples or time.monotonic() - last_ckpt >= ls.checkpoint_every_s:
                if self._try_save():
                    since_ckpt = 0
                last_ckpt = time.monotonic()
        if self.deltas is not None:  # a clean exit: serving gets what was trained since the last delta now,
            # before the final checkpoint, so its delta_seq includes this delta (same samples_trained: its artifacts
            # skip it by name, and one that never saw it counts no gap when it is pruned unread)
            self.trainer.step()  # the rows written are the trained ones
            try:
                self.deltas.write(self.trainer.model, self.trainer.samples)
            except OSError as exc:  # the pending list keeps the rows: the first delta after a restart sends them
                log.warning("the last delta could not be written at exit (%s); it goes out after a restart", exc)
        try:  # not optional (module docstring): it fails the run, in one line naming the path and the errno
            self.save()
        except OSError as exc:
            raise checkpoint.exit_save_failed(Path(ls.checkpoint_dir), exc) from exc
        return self.summary(reason=reason)

    def _train(self, batch: TensorBatch) -> None:
        assert self.trainer is not None
        keep = self.recent.filter(batch.impression_ids, batch.kinds) if len(batch) else np.ones(0, bool)
        dups = int((~keep).sum())
        if dups:
            self.duplicates += dups
            DUPLICATES.inc(dups)
        kept = batch.select(keep)
        rows_per_message = [rows for _, _, rows in batch.positions]
        partitions = (np.repeat([p for p, _, _ in batch.positions], rows_per_message)[keep]
                      if sum(rows_per_message) == len(batch) else None)  # (B',) samples partition of each row
        if len(kept):
            if self.coverage is None and self.cfg is not None:
                self.coverage = FieldCoverage(self.cfg, max(1, self.ls.metrics_window // 10))
            if self.coverage is not None:
                self.coverage.observe(kept)  # before the ids are mapped to rows (it reads MISSING)
            now = self._clock.advance_s(kept.ts)
            # event time drives id ages, so replays are deterministic; a quorum of rows moves it, never one row
            self._event_now = now
            self._event_newest = max(self._event_newest, now)  # merged partitions interleave a little
            EVENT_TIME.set(self._event_newest)
            users = user_keys(kept, self.cfg) if self.cfg is not None else None
            impressions = None if kept.kinds is None else kept.kinds != DELAYED_POSITIVE  # a click is no sighting
            cold = self.quality.cold_of(users, now, impressions)
            if self.mapper is not None and self.mapper.active:
                ids = self.mapper.apply(kept, now, model=self.trainer.model, sparse_opt=self.trainer.sparse_opt)
                self._observe_ids(ids)
                if self.deltas is not None:  # rows given to other ids wait for the delta with the maps
                    self.deltas.hold(ids.reassigned)
                    self.deltas.mark(torch.from_numpy(ids.decayed))  # (decayed buckets no batch row names)
            nan_before, clipped_before = self.trainer.nan_losses, self.trainer.dense_clip.clipped
            labels = kept.labels.numpy()
            probs = np.concatenate([self.trainer.test_then_train(chunk)  # each chunk predicted, then learned
                                    for chunk in kept.chunks(self.ls.step_rows)])
            if self.bias is not None:  # a new model: its bias follows the click rate until that is known
                self.bias.update(self.trainer.model, labels, kept.kinds, kept.ts, kept.label_delay_ms)
            self.quality.record(kept.impression_ids, kept.ts, kept.kinds, labels, probs, cold, partitions,
                                kept.label_delay_ms, now, kept.watermarks)
            if self.trainer.dense_clip.clipped > clipped_before:
                DENSE_CLIPPED.inc(self.trainer.dense_clip.clipped - clipped_before)
                log.warning("clipped the dense gradient of %d step(s) to [learner] dense_grad_clip x its recent scale "
                            "(%d so far): a batch with out-of-scale dense values?",
                            self.trainer.dense_clip.clipped - clipped_before, self.trainer.dense_clip.clipped)
            if self.trainer.nan_losses > nan_before:
                NAN_LOSSES.inc(self.trainer.nan_losses - nan_before)
                log.warning("skipped %d batch(es) with a non-finite loss (%d so far)",
                            self.trainer.nan_losses - nan_before, self.trainer.nan_losses)
            if self.trainer.calibration is not None:
                CALIBRATION_SCALE.set(self.trainer.calibration.a)
                CALIBRATION_SHIFT.set(self.trainer.calibration.b)
            SAMPLES.inc(len(kept))
            self.positive_rate.observe(labels)
            m = self.trainer.metrics
            AUC.set(m.auc)
            LOGLOSS.set(m.logloss)
            if time.monotonic() - self._window_published >= 1.0:  # the window AUC sorts the window: at most 1/s
                WINDOW_AUC.set(m.window_metrics()[0])
                self._window_published = time.monotonic()
        if time.monotonic() - self._health_published >= 1.0:  # also on idle heartbeats (memory)
            self._publish_health()
            self._health_published = time.monotonic()
        if self.deltas is not None:  # also on idle heartbeats, so the last rows trained go out
            self.deltas.after_step(self.trainer, kept.values)
        for p, off, rows in batch.positions:
            self.offsets[p] = off + 1  # the last: a partition made again starts over
            self.partition_rows[p] += rows

    def _publish_health(self) -> None:
        """Memory, gradient and update norms, coverage and the positive rate (learner/health.py); at most 1/s."""
        publish_memory(self.memory)
        if self.trainer is not None:
            observe_grad_norms(*self.trainer.grad_norms.drain())
            for part, v in self.trainer.update_norms.drain().items():
                UPDATE_NORM.labels(part).set(v)
        if self.coverage is not None:
            publish_coverage(self.coverage)
        POSITIVE_RATE.set(self.positive_rate.rate)

    def _observe_ids(self, st: MapStats) -> None:
        assert self.mapper is not None
        self.id_metrics.observe(st, {name: s["occupancy"] for name, s in self.mapper.stats().items()})

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """End the run after its batch (asked before it, at its first): SIGTERM/SIGINT, or the caller's (``streamrec
        train``'s, for a stop that came before the run took the signals over)."""
        self._stop = True

    @property
    def stopped(self) -> bool:
        """Whether a stop ended the run (its summary's reason "signal"), or will."""
        return self._stop

    def summary(self, reason: str) -> dict[str, Any]:
        tr = self.trainer
        return {
            "reason": reason,
            "samples_trained": tr.samples if tr else 0,
            "steps": tr.steps if tr else 0,
            "duplicates_dropped": self.duplicates,
            "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
            "partition_rows": {str(p): n for p, n in sorted(self.partition_rows.items())},
            "metrics": tr.metrics.summary() if tr else {},
            **self.quality.summary(),
            "calibration": tr.calibration.summary() if tr and tr.calibration else None,
            "id_maps": self.mapper.stats() if self.mapper else {},
            "base_rate_bias": self.bias.summary() if self.bias is not None else None,
            "device": str(self.device),
            "precision": str(getattr(tr.model, "autocast_dtype", None) or torch.float32).removeprefix("torch.")
            if tr else None,
            "sparse_update": tr.sparse_update if tr else None,  # fused (learner/fused_update.py) or unfused
            "checkpoint_dir": str(self.ls.checkpoint_dir),
            "settings": {k: str(v) for k, v in asdict(self.ls).items()},
        }

    def close(self) -> None:
        """Put back the signal handlers run() replaced, close the group consumer and release the directory's LOCK, the
        release whatever the close raises (the process may go on: a test harness, an embedding application, and the
        next learner there was refused)."""
        lock, self._lock = self._lock, None
        try:
            put_back_signals(self._handlers)
            self._group.close()
        finally:
            checkpoint.release_directory(lock)
