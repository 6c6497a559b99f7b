"""``streamrec train`` on N ranks (``torchrun --nproc-per-node N``, ``WORLD_SIZE > 1``): one DeepFM whose table is
sharded row-wise over the ranks (``learner/sharded_model.py``), each rank reading its share of the samples
partitions (``learner/distributed.py``: partition p to rank p % N), all ranks stepping in lock-step.

    rank r: KafkaSampleDataset(partitions p % N == r, from the checkpoint's offsets) --dedup--> chunks
            LockStep.agree (rows, input ended, wants checkpoint, signal, samples, suspect) -- every rank, every round
            ShardedTrainer.test_then_train per step (chunks padded to the step's size) -- every rank, every step
            delta round:      learner/sharded_deltas.py (every rank's touched rows from their shards, one delta
                              written by rank 0 with learner/deltas.py's writer), when deltas_every_s > 0
            checkpoint round: learner/sharded_checkpoint.save (DCP + every partition's offset), then rank 0
                              commits the group offsets (lag dashboards only) and every rank sets the lag
                              of its own partitions (learner/lag.py) on its own /metrics

Before any of it, every rank checks with the others (``learner/rank_checks.py``) that they were started with the
same settings and read one Kafka cluster, and rank 0 holds the checkpoint directory; each refusal is the same
ConfigError on every rank.

Exactly once, as in the single-process daemon: a checkpoint holds the model and, for every samples partition,
the offset of the next message to train, written by all ranks at one step boundary; a restart (torchrun's
elastic restart after a rank died restarts every rank) loads the newest complete checkpoint and every rank reads
its partitions from exactly those offsets. What was trained after it is trained again; nothing is trained twice
into a persisted model. A dead rank is noticed by the others in their next collective (gloo: the peer closed
the connection), which raises; torchrun then stops and restarts the whole group.

The feature config is inferred by rank 0 from the first ``probe_rows`` samples and sent to the others; after
that it lives in the checkpoint, as in the single-process daemon.

Dynamic ids (``id_capacity > 0``: admission, eviction, the hash-bucket fallback) work: ``learner/sharded_ids.py``
shards each field's id map with its rows (each rank maps the keys that fall in its share of the own rows) and
applies the row changes in the shards.

Each round's rows of every rank are gathered once (:meth:`ShardedLearner._after_round`): rank 0 records the
cold/warm and served-quality metrics (``learner/quality.py``) over them, as one process would over the round as one
batch, and (``online_calibration``) fits the served logit's calibration (``learner/calibration.py``) on their raw
logits; the fitted ``(a, b)`` goes to every rank in one broadcast per round, so every rank records and returns the
served (calibrated) predictions and a delta or checkpoint carries what is served. While a fresh model's base-rate
bias (``learner/delayed.py``) follows the click rate, each step's rows of every rank are gathered too, and every
rank moves the bias with all of them, identically, so DDP's replicas stay equal (per step: moved once per round, it
let the first round's steps train against the prior's bias, and 2 ranks ended 0.023 below one process's progressive
AUC on the test stream).

``accumulation`` micro-batches are trained as one step of their rows (:func:`rows_per_step`: the same update).
What the distributed mode does not do (each refused at start with a ConfigError, ``rank_checks.check_settings``,
or turned off with a warning): ``sparse_adam``. The boost of young rows is applied around fbgemm's fused update
(``learner/sharded_boost.py``).

Poison messages (``stream/strikes.py``): a round's rows of every rank meet in its collective stages (the id
lookup by the key's owner rank, the base-rate bias, rank 0's quality metrics and calibration), so a fault one
rank's message triggers may raise on another rank. A failed round is therefore blamed as one process blames its
whole batch: every message of the round, on every rank, gets a strike (:meth:`ShardedLearner._strike_round`; one
strikes file per partition, so a partition's strikes follow it to whichever rank reads it after a restart on any
world size). The rank that failed for its data says so in the group's store before it exits
(:func:`learner.distributed.mark_round_failed`); the other ranks fail in their next collective
(:func:`learner.distributed.is_peer_failure`) and strike their messages of the round only if the store says so
(a killed or hung peer gives no strikes). torchrun restarts the group, and a suspect is trained alone in the whole
group (``Round.turn``: the other ranks hold their batches meanwhile), so an innocent one succeeds and loses its
strike while the guilty one fails alone again; one that failed ``poison_after`` times is dead-lettered with kind
``poison``. Serving deltas work
(``learner/sharded_deltas.py``); rank 0 announces them on the Redis of the ``redis`` settings :func:`run_ranks` is
given.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
import traceback
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from confluent_kafka import KafkaException, TopicPartition

from learner import checkpoint, sharded_checkpoint
from learner.batch import TensorBatch
from learner.calibration import OnlineCalibration, identity
from learner.config import CheckpointMismatch, LearnerSettings, check_topic, parse_mlp, shape_of
from learner.daemon import (
    AUC,
    CALIBRATION_SCALE,
    CALIBRATION_SHIFT,
    CHECKPOINT_FAILURES,
    CHECKPOINT_NOT_DURABLE,
    CHECKPOINT_S,
    DENSE_CLIPPED,
    DUPLICATES,
    EVENT_TIME,
    LOGLOSS,
    NAN_LOSSES,
    POSITIVE_RATE,
    PROBE_S,
    SAMPLES,
    TOPIC_CHANGED,
    UPDATE_NORM,
    WINDOW_AUC,
    RecentIds,
    first_samples_clock,
    infer_feature_config,
    observe_grad_norms,
    publish_coverage,
    publish_memory,
)
from learner.delayed import BaseRateBias, DelayedFeedbackWeights
from learner.distributed import (
    LockStep,
    RankContext,
    all_gather_objects,
    broadcast_object,
    gather_objects,
    is_peer_failure,
    mark_round_failed,
    partitions_of,
    peer_hung,
    round_failed_elsewhere,
)
from learner.event_clock import EventClock
from learner.features import FeatureConfig
from learner.health import (
    FieldCoverage,
    GradNorms,
    MemoryMonitor,
    PositiveRate,
    combine_rank_norms,
    combine_rank_updates,
)
from learner.kafka_dataset import KafkaSampleDataset, not_the_batch, sample_loader, to_tensors_empty
from learner.lag import publish_lag
from learner.model import autocast_dtype
from learner.progressive import ProgressiveMetrics
from learner.quality import IdMetrics, TrainingQuality
from learner.rank_checks import check_same_cluster, check_same_settings, check_settings, hold_checkpoint_dir
from learner.row_mapper import MapStats, user_keys
from learner.sharded_boost import ShardedBoost
from learner.sharded_checkpoint import aggregate_metrics, dense_opt_state, merged_metrics
from learner.sharded_deltas import ShardedDeltas
from learner.sharded_ids import ShardedRowMapper, merged_stats
from learner.sharded_model import ShardedDeepFM, feature_names, fused_state, shard, state_scale
from learner.sharded_trainer import ShardedTrainer
from learner.worker_counters import count_worker_counters
from learner.worker_stall import watched
from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError, close_after_error
from stream.files import NotDurable, describe_os_error
from stream.joiner.partitions import ensure_samples
from stream.kafka import new_consumer
from stream.kafka_topics import topic_identity
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.samples import DELAYED_POSITIVE
from stream.stop_signals import StopsTaken, put_back_signals, take_stop_signals
from stream.strikes import PartitionFileStrikes, Strikes, settle_strikes

log = logging.getLogger("streamrec.train")


class RoundFailed(RuntimeError):
    """The strike's error of a message whose round failed on another rank: that rank's error."""


def rows_per_step(ls: LearnerSettings) -> int:
    """Rows of one optimizer step on a rank: ``step_rows * accumulation``. The table's optimizer runs inside the
    backward (fbgemm's fused row-wise Adagrad), so no gradient waits for the next micro-batch: ``accumulation``
    micro-batches are trained as ONE step over their rows. It is the single process's update (the mean loss of k
    equal micro-batches is the mean over their rows) and the same predictions (the weights do not change between
    micro-batches); what it does not bound is the memory of activations, which is that of the k micro-batches at
    once."""
    return ls.step_rows * ls.accumulation  # each >= 1 (LearnerSettings)


class ShardedLearner:
    def __init__(self, kafka: KafkaSettings, ls: LearnerSettings, ctx: RankContext,
                 redis: RedisSettings | None = None, limits: EventLimits = DEFAULT_LIMITS) -> None:
        check_settings(ls)
        self.kafka, self.ls, self.ctx = kafka, ls, ctx
        self.limits = limits  # [limits], the joiner's: the longest impression id a samples message may hold
        self.redis_settings = redis  # where rank 0 announces deltas; None: not announced, serving polls
        self.deltas: ShardedDeltas | None = None  # serving freshness, built with the model
        self.model: ShardedDeepFM | None = None
        dev = ls.device.resolve(torch.cuda.is_available())
        self.device = torch.device(dev, ctx.local_rank) if dev == "cuda" else torch.device(dev)
        self._stop = False
        self.offsets: dict[int, int] = {}
        self.topic_ids: dict[str, str] = {}  # which samples topic the offsets are of (checkpoint.TOPIC_IDENTITY)
        self._topic_changed = False  # the checkpoint's offsets were another topic's (_partitions)
        self.partition_rows: Counter[int] = Counter()
        self.duplicates = 0
        self.recent = RecentIds(ls.dedup_window)
        self.cfg: FeatureConfig | None = None
        self.trainer: ShardedTrainer | None = None
        self.ids: ShardedRowMapper | None = None  # dynamic ids -> rows (built with the model)
        self.bias: BaseRateBias | None = None  # a fresh model's intercept at the click rate (learner/delayed.py)
        self.quality = TrainingQuality(ls.cold_k, ls.metrics_window, ls.attribution_window_s,  # rank 0's
                                       ls.quality_recent_s, ls.quality_min_samples, ls.cold_tracker_capacity)
        self.id_metrics = IdMetrics(ls.metrics_window)  # rank 0's, over every rank's lookups
        self._clock = EventClock()  # rank 0's: every rank's rows' event time (learner/event_clock.py), checkpointed
        self._event_newest = 0.0  # rank 0's: the newest event time (s) of every rank's rows trained
        self.positive_rate = PositiveRate(ls.metrics_window)  # rank 0's, over every rank's rows
        # rank 0's, over every rank's rows (_record_round): the window AUC and the coverage (built with the model)
        self.window: ProgressiveMetrics | None = None
        self.coverage: FieldCoverage | None = None  # every rank counts its rows with it; rank 0 adds them up
        self._coverage_counts = np.zeros(0, np.int64)  # (fields + dense,) this round's kept rows carrying each
        self._sampled_drained = 0  # the trainer's sampled steps when its gradient norms were last drained
        self._health_published = 0.0
        # no value on the others' /metrics (a 0 positive rate fired one_class_labels): NaN, as PositiveRate before its
        for rank0s in (EVENT_TIME, POSITIVE_RATE, WINDOW_AUC) if ctx.rank != 0 else ():  # window
            rank0s.set(float("nan"))
        self.memory = MemoryMonitor(self.device)  # this rank's
        self._memory_published = 0.0
        # the served logit's calibration: fitted on rank 0 only, its (a, b) sent to every rank each round
        self.calibration = OnlineCalibration() if ls.online_calibration and ctx.rank == 0 else None
        self.dmp: Any = None
        self._base_samples = 0  # samples trained by all ranks before this run (rank 0 counts them)
        self._base_steps = 0
        self._shape = shape_of(ls)
        # rank 0 commits the group offsets (lag dashboards); every rank asks its partitions' watermarks (learner/lag.py)
        self._group = new_consumer(kafka, ls.group_id)
        self._handlers: dict[int, Any] = {}  # the signal handlers run() replaced, put back by close()

    # -- model and state ---------------------------------------------------------------------------
    def _model_settings(self) -> dict[str, Any]:
        ls = self.ls
        return {"mlp": ls.model.mlp_text, "dropout": ls.dropout, "lr_sparse": ls.lr_sparse, "lr_dense": ls.lr_dense,
                "sparse_optimizer": ls.sparse_optimizer.value, "amp": ls.amp.value, "seed": ls.seed, "boost": ls.boost,
                "boost_half_life": ls.boost_half_life, "initial_accumulator": ls.initial_accumulator}

    def _build(self, cfg: FeatureConfig) -> None:
        ls = self.ls
        self.cfg = cfg
        model = ShardedDeepFM(cfg, parse_mlp(ls.mlp), ls.dropout, ls.seed, autocast_dtype(ls.amp, self.device),
                              table_device=torch.device("meta"))
        self.dmp = shard(model, self.ctx.world_size, self.device, ls.lr_sparse, 1e-8, ls.initial_accumulator, ls.seed)
        self.model = model
        self.ids = ShardedRowMapper.of(cfg, self.dmp, ls.initial_accumulator * state_scale(cfg.embedding_dim))
        self.deltas = ShardedDeltas.from_settings(ls, cfg.num_rows, cfg.embedding_dim, self.ctx.rank,
                                                  self.redis_settings)
        if self.deltas is not None and self.ids.active:  # serving maps ids admitted since its artifact
            self.deltas.id_maps = (cfg, self.ids.state_dict)
        self._dense = [(n, p) for n, p in model.named_parameters() if not n.startswith("sparse.")]
        try:
            dense_opt: torch.optim.Optimizer = torch.optim.Adam([p for _, p in self._dense], lr=ls.lr_dense,
                                                                fused=True)
        except (RuntimeError, TypeError):
            dense_opt = torch.optim.Adam([p for _, p in self._dense], lr=ls.lr_dense)
        self.trainer = ShardedTrainer(self.dmp, dense_opt, feature_names(cfg), self.device,
                                      ProgressiveMetrics(window=ls.metrics_window), ls.dense_grad_clip)
        self.trainer.grad_norms = GradNorms.of(model)  # the field blocks of the table's rows
        self.coverage = FieldCoverage(cfg, max(1, ls.metrics_window // 10))
        self.window = ProgressiveMetrics(window=ls.metrics_window)
        if ls.boost > 0:  # fbgemm has none: applied around its fused update (learner/sharded_boost.py)
            self.trainer.boost = ShardedBoost(self.dmp, ls.boost, ls.boost_half_life)
            self.ids.counts = self.trainer.boost.counts
        if ls.online_calibration:
            self.trainer.calibration = identity()

    def _app_state(self) -> dict[str, Any]:
        assert self.trainer is not None
        table_state = {"momentum1": fused_state(self.dmp)["momentum1"]}
        if self.trainer.boost is not None:
            table_state["updates"] = self.trainer.boost.counts
        return {"model": self.dmp.state_dict(), "table_state": table_state,
                "dense_opt": dense_opt_state(self.trainer.dense_opt, {id(p): n for n, p in self._dense})}

    def _restore(self) -> bool:
        found = sharded_checkpoint.latest(self.ls.checkpoint_dir, restore=True)
        if found is None:
            single = checkpoint.list_checkpoints(Path(self.ls.checkpoint_dir))
            if single:  # a fresh model would train again, from offset 0, what that one was trained on
                raise ConfigError(f"{self.ls.checkpoint_dir} holds single-process checkpoints (newest "
                                  f"{single[-1].name}) and no sharded one: N ranks do not resume from a single-process "
                                  "checkpoint (there is no reshard from one process to N ranks), and a fresh model "
                                  "here would train every retained sample again while `streamrec train --status` and "
                                  "`streamrec refresh` kept reading the old checkpoint. Run the ranks with another "
                                  "--checkpoint-dir to start a sharded model, or go on training in one process")
            if self.ctx.rank == 0:  # a new model: never of a lineage an earlier training left here
                checkpoint.begin_lineage(Path(self.ls.checkpoint_dir))
            return False
        path, meta = found
        recorded = meta.get("shape", {})
        changed = {k: (recorded.get(k), v) for k, v in self._shape.items() if k in recorded and recorded[k] != v}
        if changed:
            raise CheckpointMismatch(path, changed)
        check_topic(path, meta, self.kafka.samples_topic)
        if self.ctx.rank == 0:  # the only reader of LINEAGE (its delta writer, the checkpoints' metadata)
            checkpoint.continue_lineage(self.ls.checkpoint_dir, meta, path)  # before the delta writer reads it
        self._build(FeatureConfig.from_dict(meta["feature_config"]))
        if self.deltas is not None and self.deltas.writer is not None:  # (rank 0) a dead branch: learner/deltas.py
            self.deltas.writer.abandon_after(meta.get("delta_seq"), int(meta["samples_trained"]))
        assert self.trainer is not None
        app = self._app_state()
        if "updates" in app["table_state"] and not sharded_checkpoint.holds(path, "table_state.updates"):
            log.info("%s has no update counts (written without a boost): every row starts young", path)
            del app["table_state"]["updates"]
        sharded_checkpoint.load(path, app)  # in place: the table's local rows, its sums, the dense part
        self.dmp.load_state_dict(app["model"])
        opt = self.trainer.dense_opt
        for n, p in self._dense:
            st = app["dense_opt"][n]
            if float(st["step"]) > 0:
                opt.state[p] = {"step": st["step"].clone(), "exp_avg": st["exp_avg"].clone(),
                                "exp_avg_sq": st["exp_avg_sq"].clone()}
        states = sharded_checkpoint.rank_states(path, meta)
        # a value no training makes: this checkpoint refused, by every rank together whichever rank reads it
        moves = sharded_checkpoint.loaded_together(path, lambda: self._load_own_states(meta, states))
        with sharded_checkpoint.state_loaded(path):
            self._load_shared_states(moves)
        if self.ctx.rank == 0:
            self._base_samples = int(meta["samples_trained"])
        self._base_steps = int(meta["steps"])
        self.offsets = {int(p): int(o) for p, o in meta["offsets"].items()}
        self.topic_ids = checkpoint.topic_recorded(meta)
        self.partition_rows = Counter({int(p): int(n) for p, n in meta["partition_rows"].items()})
        log.info("rank %d resumed from %s (%d ranks wrote it): %d samples trained, offsets %s", self.ctx.rank, path,
                 meta["world_size"], meta["samples_trained"], self.offsets)
        return True

    def _load_shared_states(self, moves: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Collective: the id maps' rows that change rank (``moves``: :meth:`_load_own_states`; None: no maps) and
        rank 0's calibration, after :meth:`_load_own_states`."""
        assert self.ids is not None
        if moves is not None:
            self.ids.move_rows(moves, self.dmp)
            if self.deltas is not None:  # the first delta (with the maps) resends every admitted id's row: deltas.py
                self.deltas.mark(self.ids.owned_rows())
        self._share_calibration()

    def _load_own_states(self, meta: dict[str, Any],
                         states: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
        """The ranks' own states (``rank_states``) into this rank, no collective among them (so every rank refuses a
        checkpoint together: ``sharded_checkpoint.loaded_together``): a ValueError for a value no training makes.
        Returns the id maps' rows that change rank (``ShardedRowMapper.load_shares``; None: no maps)."""
        assert self.trainer is not None
        assert self.ids is not None
        moves = self.ids.load_shares(states) if self.ids.active else None  # (every rank's parts, whatever the world)
        if states[0].get("base_rate_bias"):  # rank 0's copy; every rank's is the same
            self.bias = BaseRateBias(prior_rate=self.ls.prior_click_rate)
            self.bias.load_state_dict(states[0]["base_rate_bias"])
        self.trainer.dense_clip.load_state_dict(states[0].get("dense_clip"))  # every rank's is the same
        if self.ctx.rank == 0:  # rank 0 tracks them, whatever the world size
            self.quality.load_state_dict(states[0])
            self._clock.load(states[0].get("event_clock"))  # (a checkpoint from before it: a fresh clock, as then)
            self.id_metrics.load_state_dict(states[0].get("id_metrics", {}))  # published before the first round
            self.window = merged_metrics(states, self.ls.metrics_window)  # every rank's window, whatever the world
            if self.calibration is not None and states[0].get("calibration"):
                self.calibration.load_state_dict(states[0]["calibration"])
        if int(meta["world_size"]) == self.ctx.world_size:
            mine = states[self.ctx.rank]
            self.trainer.metrics.load_state_dict(mine["metrics"])
            self.recent.load(mine.get("recent_ids", []))
            checkpoint.state_counts(f"rank-{self.ctx.rank}.pt", {"duplicates": mine.get("duplicates", 0)})  # (no bool)
            self.duplicates = mine.get("duplicates", 0)
            self.trainer.delayed.load_state_dict(mine.get("delayed_weights") or {})
        else:  # resharded: rank 0 carries everybody's metrics, every rank every recent id and its share of the counts
            self.trainer.delayed.load_state_dict(DelayedFeedbackWeights.share(
                [s.get("delayed_weights") or {} for s in states], self.ctx.rank, self.ctx.world_size))
            if self.ctx.rank == 0:
                self.trainer.metrics = merged_metrics(states, self.ls.metrics_window)
                self.duplicates = int(meta["duplicates"])
            self.recent.load_merged([s.get("recent_ids", []) for s in states])
        return moves

    def samples_trained(self) -> int:
        """This rank's share of the job's samples (rank 0 also counts those of earlier runs)."""
        return self._base_samples + (self.trainer.samples if self.trainer else 0)

    def save(self) -> Path:
        """Collective: a checkpoint of every rank's state at this step boundary."""
        assert self.trainer is not None and self.cfg is not None
        t0 = time.monotonic()
        world, rank = self.ctx.world_size, self.ctx.rank
        gathered = all_gather_objects((self.offsets, dict(self.partition_rows), self.samples_trained(),
                                       self.duplicates))
        offsets: dict[int, int] = dict(self.offsets)
        rows: dict[int, int] = dict(self.partition_rows)
        for r, (offs, prows, _, _) in enumerate(gathered):  # each partition from the rank that reads it
            for p in partitions_of(list(offs), r, world):
                offsets[p] = offs[p]
            for p in partitions_of(list(prows), r, world):
                rows[p] = prows[p]
        metrics = aggregate_metrics(self.trainer.metrics)
        meta = {"samples_trained": sum(g[2] for g in gathered), "steps": self._base_steps + self.trainer.steps,
                "offsets": {str(p): o for p, o in sorted(offsets.items())},
                "partition_rows": {str(p): n for p, n in sorted(rows.items())},
                "duplicates": sum(g[3] for g in gathered), "world_size": world,
                "feature_config": self.cfg.to_dict(), "model": self._model_settings(), "shape": self._shape,
                "metrics": metrics.summary(), "metrics_window": self.ls.metrics_window,
                "topic": self.kafka.samples_topic, **self.topic_ids,
                "delta_seq": self.deltas.writer.seq if self.deltas is not None and self.deltas.writer else None}
        rank_state = {"metrics": self.trainer.metrics.state_dict(), "recent_ids": self.recent.state(),
                      "duplicates": self.duplicates, "delayed_weights": self.trainer.delayed.state_dict(),
                      "dense_clip": self.trainer.dense_clip.state_dict()}
        if self.ids is not None and self.ids.active:
            decayed = self.ids.decay_idle(self.dmp)  # the artifact built from this checkpoint gets today's buckets
            if self.deltas is not None:  # ... and serving with the next delta (rank 0's pending list: the sync below)
                self.deltas.mark(torch.from_numpy(decayed))
            rank_state.update(self.ids.state_dict())  # each rank its shares of the maps
        if rank == 0:
            rank_state.update(self.quality.state_dict())
            rank_state["id_metrics"] = self.id_metrics.state_dict()  # every rank's lookups: whatever the world size
            rank_state["calibration"] = self.calibration.state_dict() if self.calibration is not None else {}
            rank_state["base_rate_bias"] = self.bias.state_dict() if self.bias is not None else {}
            rank_state["event_clock"] = self._clock.state()  # as one process's checkpoint holds its clock
        if self.deltas is not None:  # every rank's rows trained before this checkpoint and in no delta yet:
            self.deltas.sync()  # durably in rank 0's pending list (learner/deltas.py "Pending rows")
        try:
            path, durable = sharded_checkpoint.save(self.ls.checkpoint_dir, self._app_state(), rank_state, meta, rank,
                                                    keep=self.ls.keep_checkpoints), True
        except NotDurable as exc:  # in place (read at restart), on every rank alike: written, not a failed checkpoint
            path, durable = Path(str(exc.filename)), False
            if rank == 0:  # counted once, as one process's Learner.save counts it
                CHECKPOINT_NOT_DURABLE.inc()
                log.warning("checkpoint written, but not known durable: %s; a restart reads it, a power loss may undo "
                            "it (older checkpoints kept, group offsets not committed until one is durable)", exc)
        if rank == 0 and offsets and durable:  # after the checkpoint is durable; lag dashboards only
            try:
                self._group.commit(offsets=[TopicPartition(self.kafka.samples_topic, p, o)
                                            for p, o in offsets.items()], asynchronous=False)
            except KafkaException as exc:
                log.warning("could not commit the group offsets (lag dashboards lag): %s", exc)
        CHECKPOINT_S.set(time.monotonic() - t0)  # this rank's wait for the collective checkpoint, its part written
        publish_lag(self._group, self.kafka.samples_topic, self.offsets, (rank, world))  # its own partitions' lag
        return path

    def _try_save(self) -> bool:
        """Collective: a periodic checkpoint, as one process's ``Learner._try_save``: one that a full or read-only disk
        failed on any rank fails on every rank alike (``sharded_checkpoint.save``), so every rank goes on training,
        none commits offsets or sets the lag, and the next interval tries again; rank 0 counts it once."""
        try:
            self.save()
            return True
        except OSError as exc:
            if self.ctx.rank == 0:
                CHECKPOINT_FAILURES.inc()
                log.error("checkpoint to %s failed (%s); every rank trains on from memory, next try in %.0f s",
                          self.ls.checkpoint_dir, describe_os_error(exc), self.ls.checkpoint_every_s)
            return False

    # -- the loop ----------------------------------------------------------------------------------
    def _partitions(self) -> list[int]:
        """Collective: the samples topic's partitions as rank 0 lists them at the start. Every rank asks the topic's
        ids (``stream.kafka_topics.topic_identity``) of its own broker, and they must name one cluster
        (:func:`check_same_cluster`); rank 0 also asks whether the checkpoint's offsets are of this topic
        (:func:`checkpoint.same_topic`, said and counted once), and every rank takes its answer: on each, the offsets
        dropped for another topic's (``run``), the ids the next checkpoints record (the broker giving none: the
        checkpoint's kept). Asked once, as the single-process learner does (``Learner._check_topic_ids``)."""
        found = None
        if self.ctx.rank == 0:
            ensure_samples(self.kafka)  # the inputs' partition count (stream/joiner/partitions.py)
        now = topic_identity(self.kafka, self.kafka.samples_topic)  # every rank its own broker's answer
        check_same_cluster(self.kafka.bootstrap_servers, now)
        if self.ctx.rank == 0:
            md = self._group.list_topics(self.kafka.samples_topic, timeout=10).topics[self.kafka.samples_topic]
            same = checkpoint.same_topic(self.topic_ids, now, self.kafka.samples_topic)
            if not same:
                TOPIC_CHANGED.inc()
            found = (sorted(md.partitions), now, same)
        parts, now, same = broadcast_object(found)
        self._topic_changed = not same
        if "topic_id" in now:
            self.topic_ids = now
        return list(parts)

    def _fresh_config(self) -> FeatureConfig | None:
        """Rank 0 infers the config from the first samples and sends it; the others wait in rounds of about 5 s
        (one all-gather each, so no rank waits in one collective for longer than its timeout while no data
        arrives). None: nothing arrived within ``exit_when_idle_s``, or a stop signal on any rank."""
        wait = self.ls.exit_when_idle_s if self.ls.exit_when_idle_s is not None else float("inf")
        waited = first_samples_clock()
        while True:
            cfg, idle = None, False
            if self.ctx.rank == 0:
                cfg = infer_feature_config(self.kafka, self.ls, timeout_s=min(PROBE_S, wait), limits=self.limits)
                idle = cfg is None and waited.tick() >= wait
            everyone = all_gather_objects((None if cfg is None else cfg.to_dict(), idle, self._stop))
            found = everyone[0][0]
            if found is not None:
                return FeatureConfig.from_dict(found)
            if everyone[0][1] or any(stop for _, _, stop in everyone):
                return None

    def run(self) -> dict[str, Any]:
        take_stop_signals(self._handlers, self._on_signal)
        ls = self.ls
        if not self._restore():
            cfg = self._fresh_config()
            if cfg is None:
                return self.summary(reason="signal" if self._stop else "no samples arrived")
            self._build(cfg)
            if ls.init_bias:  # every rank the same value, after DDP copied rank 0's parameters
                self.bias = BaseRateBias(prior_rate=ls.prior_click_rate)
                assert self.model is not None
                self.bias.start(self.model)
        assert self.trainer is not None and self.cfg is not None
        listed = self._partitions()
        if self._topic_changed:  # every partition from its first record
            self.offsets = {}
        unsaved = [p for p in listed if p not in self.offsets]  # no checkpoint offset: start at 0
        for p in unsaved:
            self.offsets[p] = 0
        mine = partitions_of(list(self.offsets), self.ctx.rank, self.ctx.world_size)
        log.info("rank %d of %d reads samples partitions %s", self.ctx.rank, self.ctx.world_size, mine)
        topic = self.kafka.samples_topic
        # poison strikes: one file per partition, written by the rank reading it (stream/strikes.py)
        strikes = Strikes(store := PartitionFileStrikes(ls.checkpoint_dir, mine), ls.poison_after)
        if self._topic_changed:  # strikes name messages by offset too: the old topic's are none of the new one's
            strikes.succeeded([k for k in strikes.counts if k[0] == topic])
        settle_strikes(strikes, {(topic, p): self.offsets[p] for p in mine})
        suspects = {(p, o): strikes.poisoned(key) for key in strikes.counts for t, p, o in [key] if t == topic}
        step_rows = rows_per_step(ls)  # accumulation included
        dataset = KafkaSampleDataset(self.kafka, self.cfg, {p: self.offsets[p] for p in mine},
                                     max(ls.batch_rows, step_rows),
                                     ls.exit_when_idle_s, suspects=suspects, merge=ls.merge_partitions,
                                     future_ts_s=ls.future_ts_s, max_label_delay_s=ls.attribution_window_s,
                                     unsaved=unsaved, listed=listed, shard=(self.ctx.rank, self.ctx.world_size),
                                     limits=self.limits)
        loader = watched(sample_loader(dataset, ls.num_workers, ls.prefetch_factor,
                                       ls.pin_memory.resolve(self.device.type), stall_s=ls.worker_stall_s),
                         ls.num_workers, ls.worker_stall_s,
                         partial(partitions_of, mine, self.ctx.rank, self.ctx.world_size, num_workers=ls.num_workers))
        lock = LockStep(step_rows, ls.max_samples)
        empty = to_tensors_empty(self.cfg, None)
        ended = False
        # this rank's next batch, read and deduplicated, held while another rank's suspect trains alone:
        # (batch, kept rows, the samples partition of each kept row or None)
        held: tuple[TensorBatch, TensorBatch, np.ndarray | None] | None = None
        # the last round's messages: they lose their strikes once every rank is known to have finished that round
        # (the next collective that every rank enters after it: the next round's agree, a delta, a checkpoint);
        # until then a peer that failed in it may still blame them (_strike_round)
        settled: list[tuple[str, int, int]] = []
        last_ckpt, since_ckpt = time.monotonic(), 0
        while True:
            if held is None and not ended:
                batch = next(loader, None)
                ended = batch is None
                if batch is not None:
                    count_worker_counters(batch)  # a DataLoader worker's: its registry is not the one /metrics serves
                    store.hold(p for p, _, _ in batch.positions)  # a partition added while it reads: its strikes
                    held = self._admit(batch, empty)
            batch, kept = None, empty
            partitions: np.ndarray | None = np.zeros(0, np.int64)  # (B',) samples partition of each kept row
            keys: list[tuple[str, int, int]] = []
            try:
                held_keys = [] if held is None else [(topic, p, o) for p, o, _ in held[0].positions]
                wants = (since_ckpt >= ls.checkpoint_every_samples
                         or time.monotonic() - last_ckpt >= ls.checkpoint_every_s)
                rnd = lock.agree(len(held[1]) if held is not None else 0, held is None, wants, self._stop,
                                 self.samples_trained(), wants_delta=self.deltas is not None and self.deltas.due(),
                                 suspect=any(strikes.suspect(k) for k in held_keys))
                settled = self._settle(strikes, settled)
                if held is not None and rnd.turn in (None, self.ctx.rank):  # else: held for a later round
                    (batch, kept, partitions), held, keys = held, None, held_keys
                assert self.coverage is not None
                self._coverage_counts = self.coverage.counts(kept)  # before the ids are mapped (it reads MISSING)
                if self.ids is not None and self.ids.active:  # collective: every rank, every round
                    self._map_ids(kept)
                chunks = kept.chunks(step_rows) if len(kept) else []
                if self.deltas is not None and len(kept):
                    self.deltas.mark(kept.values)
                probs, logits = [], []
                counts = self.trainer.nan_losses, self.trainer.dense_clip.clipped
                for i, rows in enumerate(rnd.steps):  # every rank runs every step, padded to its size
                    chunk = chunks[i] if i < len(chunks) else empty
                    probs.append(self.trainer.test_then_train(chunk, rows))  # (len(chunk),) as served
                    logits.append(self.trainer.last_logits)  # (len(chunk),) raw
                    if self.bias is not None and not self.bias.done:  # (the same on every rank)
                        self._follow_base_rate(chunk)
                self._count_steps(*counts)
                self._after_round(kept, np.concatenate(probs) if probs else np.zeros(0),
                                  np.concatenate(logits) if logits else np.zeros(0), partitions)
            except Exception as exc:
                self._strike_round(strikes, settled + keys, exc)
                raise
            settled = keys
            if batch is not None:
                for p, off, n in batch.positions:
                    self.offsets[p] = off + 1  # the last: a partition made again starts over
                    self.partition_rows[p] += n
                since_ckpt += len(batch)
            if len(kept):
                SAMPLES.inc(len(kept))
                AUC.set(self.trainer.metrics.auc)
                LOGLOSS.set(self.trainer.metrics.logloss)
            if time.monotonic() - self._memory_published >= 1.0:  # this rank's, at most 1/s, idle rounds too
                publish_memory(self.memory)
                self._memory_published = time.monotonic()
            if time.monotonic() - self._health_published >= 1.0:  # rank 0's, at most 1/s (it sorts the window)
                self._publish_health()
            if rnd.stop is not None:
                reason = rnd.stop
                self._publish_health()  # the last round's
                break
            try:
                if rnd.delta:
                    self._write_delta()
                    settled = self._settle(strikes, settled)
                if rnd.checkpoint:
                    if self._try_save():
                        since_ckpt = 0
                    settled = self._settle(strikes, settled)
                    last_ckpt = time.monotonic()
            except Exception as exc:
                self._strike_round(strikes, settled, exc, own=False)
                raise
        if self.deltas is not None:  # a clean exit: serving gets what was trained since the last delta now, before
            # the final checkpoint, so its delta_seq includes this delta (as learner/daemon.py: same samples_trained)
            try:
                self._write_delta()
            except OSError as exc:  # rank 0's pending list keeps the rows: the first delta after a restart sends them
                log.warning("the last delta could not be written at exit (%s); it goes out after a restart", exc)
        try:
            self.save()
        except Exception as exc:
            self._strike_round(strikes, settled, exc, own=False)
            if isinstance(exc, OSError):  # every rank alike (sharded_checkpoint.save): one line each, as one process's
                raise checkpoint.exit_save_failed(Path(self.ls.checkpoint_dir), exc) from exc
            raise
        self._settle(strikes, settled)
        return self.summary(reason=reason)

    def _admit(self, batch: TensorBatch, empty: TensorBatch) -> tuple[TensorBatch, TensorBatch, np.ndarray | None]:
        """A batch as read, its rows that are no duplicates, and each kept row's samples partition (None if the
        positions do not cover the rows)."""
        if not len(batch):
            return batch, empty, np.zeros(0, np.int64)
        keep = self.recent.filter(batch.impression_ids, batch.kinds)
        dups = int((~keep).sum())
        self.duplicates += dups
        DUPLICATES.inc(dups)  # this rank's: summed over the ranks, the job's (as the summary's duplicates_dropped)
        per_message = [rows for _, _, rows in batch.positions]
        partitions = (np.repeat([p for p, _, _ in batch.positions], per_message)[keep]
                      if sum(per_message) == len(batch) else None)
        return batch, batch.select(keep), partitions

    @staticmethod
    def _settle(strikes: Strikes, keys: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """``keys``' round is finished on every rank: they are no suspects any more. Returns the keys still
        unsettled (none)."""
        if strikes.counts and keys:
            strikes.succeeded(keys)
        return []

    def _strike_round(self, strikes: Strikes, keys: list[tuple[str, int, int]], exc: Exception,
                      own: bool = True) -> None:
        """A failed round's strikes (module docstring, "Poison messages"): its rows of every rank met in its
        collective stages, so every rank's messages of the round are suspects, as one process's whole batch. A
        rank whose round failed for its data (not a peer's failure, not the infrastructure's) says so in the
        group's store and strikes its messages; a rank that saw a peer fail strikes its messages only if the store
        says that the peer's round failed for its data (a killed or hung peer is no message's fault). ``keys``:
        this rank's messages of the round that may have failed (the current one, and the last one while no
        collective since has shown that every rank finished it). ``own=False``: this rank's own error is no
        training failure (a delta, a checkpoint) and blames nothing."""
        if not_the_batch(exc):  # the infrastructure's, or this rank's DataLoader worker died: no message's fault
            return
        if not is_peer_failure(exc):
            if not own:
                return
            mark_round_failed(self.ctx.rank, exc)
            if keys:
                log.error("rank %d: training a batch of %d message(s) failed (%s); each gets a strike, stopping "
                          "every rank without a checkpoint", self.ctx.rank, len(keys), type(exc).__name__)
                strikes.failed(keys, exc)
            return
        elsewhere = round_failed_elsewhere()
        if elsewhere is not None and keys:
            log.error("rank %d: the round failed on another rank (%s) with this rank's %d message(s) in it; each "
                      "gets a strike", self.ctx.rank, elsewhere, len(keys))
            strikes.failed(keys, RoundFailed(elsewhere))

    def _count_steps(self, nan_before: int, clipped_before: int) -> None:
        """The round's steps skipped for a non-finite loss and dense gradients clipped, counted by rank 0 only: every
        rank decides both alike (learner/sharded_trainer.py), so each is one step of the job, as one process counts."""
        assert self.trainer is not None
        nan, clipped = self.trainer.nan_losses - nan_before, self.trainer.dense_clip.clipped - clipped_before
        if self.ctx.rank != 0:
            return
        if clipped:
            DENSE_CLIPPED.inc(clipped)
            log.warning("clipped the dense gradient of %d step(s) to [learner] dense_grad_clip x its recent scale "
                        "(%d so far): a batch with out-of-scale dense values?", clipped,
                        self.trainer.dense_clip.clipped)
        if nan:
            NAN_LOSSES.inc(nan)
            log.warning("skipped %d step(s) with a non-finite loss on some rank (%d so far)", nan,
                        self.trainer.nan_losses)

    def _write_delta(self) -> None:
        """Collective: one serving delta of the rows every rank touched since the last one."""
        assert self.deltas is not None and self.model is not None
        path = self.deltas.write(self.dmp, self.model, self.samples_trained(),
                                 self.trainer.calibration if self.trainer is not None else None)
        if path is not None:
            log.debug("delta %s written", path.name)

    def _follow_base_rate(self, chunk: TensorBatch) -> None:
        """Collective, every rank after every step while a fresh model's bias follows the click rate: the step's
        rows of every rank (in rank order) move it the same way on every rank (``BaseRateBias.update``)."""
        assert self.bias is not None and self.model is not None
        n = len(chunk)
        parts = all_gather_objects((chunk.labels.numpy(), chunk.kinds if chunk.kinds is not None
                                    else np.zeros(n, np.int8), chunk.ts, chunk.label_delay_ms))
        if not sum(len(p[0]) for p in parts):
            return
        kinds = np.concatenate([p[1] for p in parts])
        delays = [p[3] for p in parts]
        self.bias.update(self.model, np.concatenate([p[0] for p in parts]), kinds if kinds.any() else None,
                         np.concatenate([p[2] for p in parts]),
                         None if any(d is None for d in delays) else np.concatenate(delays))

    def _after_round(self, kept: TensorBatch, probs: np.ndarray, logits: np.ndarray,
                     partitions: np.ndarray | None) -> None:
        """Collective, every rank every round: the round's kept rows of every rank (in rank order) go into rank
        0's quality metrics and calibration, whose (a, b) then goes to every rank (module docstring). ``probs``
        (B',): the predictions made before learning, as served; ``logits`` (B',): raw."""
        self._record_round(kept, probs, logits, partitions)
        self._share_calibration()

    def _share_calibration(self) -> None:
        """Collective with ``online_calibration``: rank 0's fitted (a, b) becomes every rank's served calibration."""
        if self.trainer is None or self.trainer.calibration is None:
            return
        mine = self.calibration.params if self.calibration is not None else None
        params = broadcast_object(mine)
        self.trainer.calibration = params
        if self.ctx.rank == 0 and self.calibration is not None:
            CALIBRATION_SCALE.set(self.calibration.a)
            CALIBRATION_SHIFT.set(self.calibration.b)

    def _record_round(self, kept: TensorBatch, probs: np.ndarray, logits: np.ndarray,
                      partitions: np.ndarray | None) -> None:
        """Collective: the round's rows of every rank to rank 0, into its quality metrics and calibration."""
        cfg = self.cfg
        assert cfg is not None
        n = len(kept)
        mine: dict[str, Any] = {"ids": kept.impression_ids, "ts": kept.ts, "labels": kept.labels.numpy(),
                "probs": probs, "logits": logits,
                "kinds": kept.kinds if kept.kinds is not None else np.zeros(n, np.int8),  # None: all FINAL
                "delay": kept.label_delay_ms, "partitions": partitions, "watermarks": kept.watermarks,
                "users": user_keys(kept, cfg) if n else np.zeros(0, np.int64)}
        assert self.trainer is not None and self.coverage is not None
        # counted by run() before the ids were mapped (it reads MISSING); else (a round given directly) now
        mine["coverage"] = self._coverage_counts if len(self._coverage_counts) else self.coverage.counts(kept)
        self._coverage_counts = np.zeros(0, np.int64)  # this round's, used once
        if self.trainer.sampled_steps != self._sampled_drained:  # a sampled step this round: on every rank alike
            self._sampled_drained = self.trainer.sampled_steps
            mine["grad_norms"] = self.trainer.grad_norms.drain()  # every step's since the last drain
            mine["update_norms"] = self.trainer.update_norms.drain()  # the last sampled step's change
        parts = gather_objects(mine)  # on rank 0; None on the others
        if parts is None:
            return
        if "grad_norms" in parts[0]:  # the whole model's steps: rank 0's dense part, the ranks' shards combined
            observe_grad_norms(*combine_rank_norms([p["grad_norms"] for p in parts]))
            for part, v in combine_rank_updates([p["update_norms"] for p in parts]).items():
                UPDATE_NORM.labels(part).set(v)
        if not sum(len(p["labels"]) for p in parts):
            return

        def cat(key: str) -> np.ndarray | None:  # (sum B'_r,) in rank order; None if any rank lacks it
            got = [p[key] for p in parts]
            return None if any(g is None for g in got) else np.concatenate(got)

        labels, kinds, ts, delay = cat("labels"), cat("kinds"), cat("ts"), cat("delay")
        assert labels is not None and kinds is not None and ts is not None
        kinds_or_none = kinds if kinds.any() else None  # as TensorBatch: None when every row is FINAL
        probs_all, ids = cat("probs"), cat("ids")
        assert probs_all is not None and ids is not None
        users = cat("users")
        now = self._clock.advance_s(ts)
        self._event_newest = max(self._event_newest, now)  # the single process's gauges, over every rank's rows
        EVENT_TIME.set(self._event_newest)
        self.positive_rate.observe(labels)
        POSITIVE_RATE.set(self.positive_rate.rate)
        assert self.window is not None and self.coverage is not None
        self.window.update(probs_all, labels)
        self.coverage.add(len(labels), sum(p["coverage"] for p in parts))
        cold = self.quality.cold_of(users, now, None if kinds_or_none is None else kinds != DELAYED_POSITIVE)
        self.quality.record(ids, ts, kinds_or_none, labels, probs_all, cold, cat("partitions"), delay, now,
                            {k: v for p in parts for k, v in p.get("watermarks", {}).items()})  # one rank a partition
        if self.calibration is not None:  # fitted on held-out raw logits as their labels become final
            raw = cat("logits")
            assert raw is not None
            self.calibration.observe(ids, kinds_or_none, labels, raw, ts, delay)

    def _publish_health(self) -> None:
        """Rank 0: the window AUC and the field coverage of every rank's rows (kept by :meth:`_record_round`)."""
        self._health_published = time.monotonic()
        if self.ctx.rank != 0 or self.window is None or self.coverage is None:
            return
        WINDOW_AUC.set(self.window.window_metrics()[0])
        publish_coverage(self.coverage)

    def _map_ids(self, kept: TensorBatch) -> None:
        """Collective, every rank every round: ``kept``'s ids mapped to rows (``ShardedRowMapper.apply``); the rows
        given to other ids wait in rank 0's writer for the delta that carries the id maps (``ShardedDeltas.hold``)."""
        assert self.ids is not None
        st = self.ids.apply(kept, self.dmp)
        self._observe_ids(st)
        if self.deltas is not None:
            self.deltas.hold(st.reassigned)
            self.deltas.mark(torch.from_numpy(st.decayed))  # (decayed buckets no batch row names)

    def _observe_ids(self, st: MapStats) -> None:
        """The id maps' metrics (rank 0: ``st`` counts every rank's keys, ``ids.occupancy`` every rank's maps), as
        the single-process daemon publishes them (``learner.quality.IdMetrics``: the bucket share of the
        cold_start_share rule too)."""
        if self.ctx.rank != 0 or self.ids is None:
            return
        self.id_metrics.observe(st, self.ids.occupancy)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """End the run at its next round's agreement (asked before it, at its first): SIGTERM/SIGINT, or the
        caller's (``streamrec train``'s, for a stop that came before the run took the signals over)."""
        self._stop = True

    @property
    def stopped(self) -> bool:
        """Whether a stop on this rank ended the run (its summary's reason "signal"), or will."""
        return self._stop

    def summary(self, reason: str) -> dict[str, Any]:
        """Collective: the job's summary (every rank returns it; the metrics aggregated over the ranks)."""
        tr = self.trainer
        gathered = all_gather_objects((self.samples_trained(), dict(self.partition_rows), self.duplicates,
                                       self.offsets, self.ids.stats_part() if self.ids is not None else {}))
        metrics = aggregate_metrics(tr.metrics) if tr else ProgressiveMetrics()
        world = self.ctx.world_size
        offsets = {p: o for r, g in enumerate(gathered) for p, o in g[3].items()
                   if p in partitions_of(list(g[3]), r, world)}
        rows = {p: n for r, g in enumerate(gathered) for p, n in g[1].items()
                if p in partitions_of(list(g[1]), r, world)}
        return {
            "reason": reason, "world_size": world, "rank": self.ctx.rank,
            "samples_trained": sum(g[0] for g in gathered),
            "samples_per_rank": [g[0] for g in gathered],
            "steps": (self._base_steps + tr.steps) if tr else 0,
            "duplicates_dropped": sum(g[2] for g in gathered),
            "offsets": {str(p): o for p, o in sorted(offsets.items())},
            "partition_rows": {str(p): n for p, n in sorted(rows.items())},
            "metrics": metrics.summary() if tr else {},
            "id_maps": merged_stats([g[4] for g in gathered], self.ids.capacities()) if self.ids is not None else {},
            "base_rate_bias": self.bias.summary() if self.bias is not None else None,
            "calibration": self.calibration.summary() if self.calibration is not None else None,
            **(self.quality.summary() if self.ctx.rank == 0 else {}),
            "device": str(self.device), "sharding": "row-wise (TorchRec DMP), dense part DDP",
            "checkpoint_dir": str(self.ls.checkpoint_dir),
        }

    def close(self) -> None:
        # the handlers are bound methods: left installed they would keep this learner, its model and so the
        # process group alive past destroy_process_group (run_ranks)
        put_back_signals(self._handlers)
        self._group.close()



def run_ranks(kafka: KafkaSettings, ls: LearnerSettings, ctx: RankContext, *, stops: StopsTaken,
              redis: RedisSettings | None = None, limits: EventLimits = DEFAULT_LIMITS) -> dict[str, Any] | None:
    """This rank's part of ``streamrec train`` under torchrun: join the group, train, leave. The job's summary on
    rank 0 (None on the others). ``redis``: the [redis] settings rank 0 announces deltas on (as the
    single-process ``Learner``'s). ``stops`` (the caller's, entered): SIGTERM/SIGINT from the learner's build to the
    caller's summary, the learner's run nested in it, as the single-process ``streamrec train`` takes them: the run
    put the process's own back in its close, and a stop in the rest of the leave (the directory's LOCK, the group's
    destroy) killed the rank, no summary, where one in the run ends with it.

    Leaving: the learner (its DMP, DDP, sharded tensors, each holding the gloo process group) is dropped and
    collected BEFORE ``destroy_process_group``, so the group's last reference goes there and its C++ destructor
    joins gloo's worker threads while the interpreter is alive. Left to the interpreter's exit (as before), those
    threads outlived ``destroy_process_group``; one still releasing a finished collective's tensors needs the GIL
    to free their Python objects, and a thread that asks for the GIL once the interpreter is finalizing is ended
    with pthread_exit, whose unwinding through the (noexcept) tensor destructor calls std::terminate: SIGABRT,
    "terminate called without an active exception", now and then at the exit of a rank that had finished."""
    ctx.init(timeout_s=ls.collective_timeout_s)
    try:
        summary = _train(kafka, ls, ctx, redis, limits, stops)
    except BaseException as exc:  # its traceback's frames hold the learner: clear them before the group goes
        if (hung := peer_hung(exc, ctx.rank, ls.collective_timeout_s)) is not None:
            log.error("%s", hung)
        clear_chained_frames(exc)
        raise
    finally:
        gc.collect()  # the model's reference cycles (modules, hooks) hold the group too
        ctx.close()
    return summary if ctx.rank == 0 else None


def clear_chained_frames(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback and of every exception chained to it (``__context__``,
    ``__cause__``): when ``learner.run()`` raises and ``close()`` raises too, the learner's frames sit in the
    first exception, reached only through the second's ``__context__``. Each exception once (a chain may loop)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo.extend(c for c in (e.__context__, e.__cause__) if c is not None)


def _train(kafka: KafkaSettings, ls: LearnerSettings, ctx: RankContext,
           redis: RedisSettings | None, limits: EventLimits, stops: StopsTaken) -> dict[str, Any]:
    """The learner's run; nothing of the learner outlives this call (run_ranks), nor rank 0's directory lock (nor
    does ``stops`` keep it: StopsTaken.run keeps its stopped() as a value)."""
    lock = hold_checkpoint_dir(ls, ctx.rank)
    try:
        check_same_settings(kafka, ls, ctx.rank, limits)
        learner = ShardedLearner(kafka, ls, ctx, redis=redis, limits=limits)
        if ctx.rank == 0:
            print(f"training on {kafka.samples_topic} at {kafka.bootstrap_servers} on {ctx.world_size} ranks "
                  f"({ctx.backend}), checkpoints in {ls.checkpoint_dir}", file=sys.stderr)
        stops.take(learner.stop, lambda: learner.stopped)
        try:
            summary = stops.run(learner.run)
        except BaseException:  # a close that fails too is logged, not raised in the place of what ended the run
            close_after_error(learner.close, "closing the learner", log)
            raise
        learner.close()
        return summary
    finally:
        checkpoint.release_directory(lock)
