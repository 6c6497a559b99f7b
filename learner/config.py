"""The training daemon's settings (``[learner]``, ``STREAMREC_LEARNER_*``), the model's own config, and
the choices among them (devices, sparse optimizers, id initialisation), each parsed once, here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream.config import Choice, check_counts, check_durations, check_group_id, check_ports, check_redis_url
from stream.errors import ConfigError
from stream.secrets import redacted_repr


class Device(Choice):
    """Where tensors live: ``auto`` is CUDA when there is one, else the CPU."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"

    def resolve(self, cuda_available: bool) -> str:
        """The torch device name this choice means on this machine."""
        if self is Device.AUTO:
            return "cuda" if cuda_available else "cpu"
        return self.value


class AutoOnOff(Choice):
    """A choice of ``auto`` / ``on`` / ``off`` (the subclass defines the members); TOML ``true``/``false`` (and
    ``1``/``0``, ``yes``/``no``) mean ``on``/``off``."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        word = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}.get(
            str(value).strip().lower())
        return None if word is None else cls(word)


class Amp(AutoOnOff):
    """Mixed precision of the dense part (FM, MLP; lookups stay fp32). ``auto``: fp16 with loss scaling on
    CUDA; on a CPU, bf16 only where the CPU computes it natively (AVX512-BF16 or AMX, which oneDNN reports),
    else fp32. An AVX2-only CPU emulates bf16 matmuls: 256x400 @ 400x400 took 38 ms in bf16 against 1.3 ms in
    fp32 on this project's 2-core AMD EPYC (bench/README.md, "Precision"), so ``on`` there is 5x slower per step.
    ``on`` forces autocast (bf16 on CPU, fp16 on CUDA), ``off`` forces fp32. TOML ``true``/``false`` (the
    setting's earlier form) mean ``on``/``off``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def dtype_name(self, device_type: str, native_cpu_bf16: bool) -> str | None:
        """The autocast dtype this choice means (``"float16"``, ``"bfloat16"``), None for fp32."""
        if self is Amp.OFF:
            return None
        if device_type == "cuda":
            return "float16"
        return "bfloat16" if self is Amp.ON or native_cpu_bf16 else None


class PinMemory(AutoOnOff):
    """Whether the DataLoader copies batches into page-locked memory (faster host-to-GPU copies). ``auto``: on CUDA
    only; ``on`` needs CUDA (a :class:`ConfigError` at start without it), ``off`` never. TOML ``true``/``false`` mean
    ``on``/``off``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def resolve(self, device_type: str) -> bool:
        """Whether to pin on ``device_type`` (``cpu`` / ``cuda``)."""
        if self is PinMemory.ON and device_type != "cuda":
            raise ConfigError(f"[learner] pin_memory = on needs CUDA, and this learner trains on {device_type}: use "
                              "auto (pins on CUDA only) or off")
        return self is PinMemory.ON or (self is PinMemory.AUTO and device_type == "cuda")


class FusedSparseUpdate(AutoOnOff):
    """Where the table's row-wise Adagrad runs (``learner/fused_update.py``). ``auto``: inside the backward of the
    lookup (fbgemm's fused ``EXACT_ROWWISE_ADAGRAD``: no sparse gradient, no ``coalesce``) wherever that is the
    same update, i.e. ``sparse_optimizer = rowwise_adagrad``, ``accumulation = 1`` and no fp16 loss scaling (fp16
    autocast on CUDA), on the CPU; elsewhere, and on CUDA (where it measured slower in wall time), the
    optimizer's own step. ``on`` requires the fused update (a setting that rules it
    out is a :class:`ConfigError`), ``off`` never uses it. TOML ``true``/``false`` mean ``on``/``off``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class SparseOptimizer(Choice):
    """The embedding table's optimizer (``learner/optim.py``)."""

    ROWWISE_ADAGRAD = "rowwise_adagrad"
    SPARSE_ADAM = "sparse_adam"


class ArtifactFormat(Choice):
    """How a serving artifact stores its scorer (``learner/scorer.py``)."""

    TORCHSCRIPT = "torchscript"
    EXPORT = "export"
    EAGER = "eager"
    SAFETENSORS = "safetensors"  # tensors only, rebuilt from the manifest's ScorerSpec: nothing is unpickled
    ONNX = "onnx"  # the dense part (FM + MLP) run by ONNX Runtime, tensors as safetensors (learner/onnx_scorer.py)
    ONNX_INT8 = "onnx_int8"  # the same with the MLP dynamically quantized to INT8 (CPU serving; not exact)
    # the same statically quantized (fixed activation scales calibrated on samples: the refresh's holdout; not exact)
    ONNX_INT8_STATIC = "onnx_int8_static"
    SAFETENSORS_BF16 = "safetensors_bf16"  # safetensors, the MLP run in bf16 (CPUs with native bf16; not exact)


class IdInit(Choice):
    """The first vector of an admitted id's own row: its hash bucket's vector, or zeros."""

    BUCKET = "bucket"
    ZERO = "zero"


def _layer_width(x: Any) -> int:
    """One layer's width: an integer (its text, or a float that is one), never a bool or a fraction."""
    if isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()):
        raise ValueError(x)
    return int(x)


# Bounds of the MLP no model reaches (a 16,384-wide layer after another holds 1 GiB of fp32 weights): past them, widths
# were a traceback once the model was built after the first samples (2**64: torch's "Overflow when unpacking long
# long"; 2**40: a 440 TB allocation)
MAX_MLP_WIDTH, MAX_MLP_LAYERS = 16_384, 64


def parse_mlp(value: Any) -> tuple[int, ...]:
    """The MLP's hidden layer sizes from ``"400,400,400"`` (a setting, an older checkpoint's meta), a
    list or a tuple: the one parser of the ``mlp`` setting. ValueError unless at most 64 sizes in 1..16,384."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, str):
        parts = [x.strip() for x in re.split(r"[,\s()\[\]]+", value) if x.strip()]
    else:
        raise ValueError(f"mlp: expected comma-separated layer widths like 400,400,400, got {value!r}")
    try:
        sizes = tuple(_layer_width(x) for x in parts)
    except (ValueError, TypeError):
        raise ValueError(f"mlp: expected comma-separated layer widths like 400,400,400, got {value!r}") from None
    if any(x < 1 for x in sizes):
        raise ValueError(f"mlp: layer sizes must be >= 1, got {value!r}")
    if len(sizes) > MAX_MLP_LAYERS or any(x > MAX_MLP_WIDTH for x in sizes):
        raise ValueError(f"mlp: at most {MAX_MLP_LAYERS} layers of at most {MAX_MLP_WIDTH} units each, got "
                         f"{len(sizes)} layers, the widest {max(sizes)}")
    return sizes


@dataclass(frozen=True)
class ModelConfig:
    """The model's own settings, typed: what DeepFM is built from and a checkpoint's ``meta["model"]`` records
    (with plain values: ``mlp`` as ``"400,400,400"``, choices as strings, so a safe load reads it)."""

    mlp: tuple[int, ...] = (400, 400, 400)
    dropout: float = 0.0
    sparse_optimizer: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp", parse_mlp(self.mlp))
        object.__setattr__(self, "sparse_optimizer", SparseOptimizer.of(self.sparse_optimizer, "sparse_optimizer"))

    @property
    def mlp_text(self) -> str:
        return ",".join(str(x) for x in self.mlp)

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> ModelConfig:
        """From a checkpoint's ``meta["model"]`` (any streamrec version's: ``mlp`` a string or a list)."""
        return cls(parse_mlp(d["mlp"]), float(d.get("dropout", 0.0)),
                   SparseOptimizer.of(d.get("sparse_optimizer", "rowwise_adagrad"), "sparse_optimizer"))


@dataclass(frozen=True)
class LearnerSettings:
    """The continuous training daemon (``streamrec train``)."""

    group_id: str = "streamrec-learner"  # offsets committed here after each durable checkpoint (for lag)
    checkpoint_dir: Path = Path(".streamrec/checkpoints")
    checkpoint_every_s: float = 30.0
    checkpoint_every_samples: int = 1_000_000
    keep_checkpoints: int = 3
    batch_rows: int = 4096  # rows read per batch (whole samples messages are never split); at most 10,000,000
    # Rows per optimizer step: a batch is trained as consecutive chunks of this many rows, each predicted
    # before it is learned. Smaller is fresher (ML-1M online AUC: 0.75 at 4096, 0.78 at 64) and slower.
    step_rows: int = 256
    accumulation: int = 1  # micro-batches per optimizer step
    embedding_dim: int = 16  # at most 4,096 (serving loads artifacts of at most 65,536)
    buckets: int = 200_000  # hash-bucket rows per id field (user, item; history shares item's); at most 1,000,000,000
    # Dynamic ids (cold start, learner/row_mapper.py): own rows per id field for admitted ids (0 = ids
    # only ever use their hash bucket); an id seen admit_after times gets one, starting as its bucket's
    # vector (id_init = bucket) or zero; rows unseen for id_ttl_s of event time are evicted, and the least
    # recently seen ones when the table is full.
    id_capacity: int = 500_000  # at most 1,000,000,000
    admit_after: int = 2
    id_ttl_s: float | None = None
    id_init: IdInit = IdInit.BUCKET
    # A user bucket idle this long (event time) has shrunk halfway to zero when the next not-yet-admitted
    # user lands in it: what earlier occupants taught it says nothing about a new user (README, cold start).
    user_bucket_half_life_s: float | None = 60.0
    # Young rows learn up to 1 + boost times faster; the boost halves every boost_half_life updates.
    boost: float = 0.0
    boost_half_life: float = 8.0
    cold_k: int = 10  # a user's first cold_k impressions count as cold (streamrec_learner_cold_auc)
    # Users the cold tracker remembers as warm (learner/row_mapper.py ColdTracker: ~217 bytes each, 170-250 as its
    # hash tables round up to powers of two; 207 MiB at 1 M, allocated at start). Full, it forgets the least recently
    # seen warm users, each counted cold again for its next cold_k impressions
    # (streamrec_learner_cold_tracker_evictions_total, and a warning the first time). May change across a restart
    # (the most recently seen warm users are kept).
    cold_tracker_capacity: int = 1_000_000
    # The cold, warm and served window metrics (streamrec_learner_cold_auc, ..._warm_auc, their logloss; the
    # cold_user_auc_gap rule; ..._served_auc, ..._served_cold_auc) cover their window's samples of the last
    # quality_recent_s of event time (served ones: whose label became known then), and are NaN (no data: a rule
    # neither fires nor resolves) while fewer than quality_min_samples (at most the window) are that recent: old
    # samples are no reading of today's model (learner/quality.py TrainingQuality)
    quality_recent_s: float = 3600.0
    quality_min_samples: int = 500
    # Delayed feedback (learner/delayed.py, learner/served.py): the joiner's attribution window (served quality
    # waits this long of event time for an observed negative's delayed positive), and a fresh model's bias
    # following the click rate until it is known, from prior_click_rate before any label (BaseRateBias). At least
    # the joiner's: a samples message with a longer label_delay_ms is dead-lettered (learner/kafka_dataset.py).
    attribution_window_s: float = 1800.0
    init_bias: bool = True
    prior_click_rate: float = 0.05  # your stream's click rate, roughly: what a fresh model serves first
    # Platt scaling of the served logit, fitted online on the held-out predictions (learner/calibration.py)
    online_calibration: bool = True
    ctx_buckets: int = 10_000  # rows per context field; at most 1,000,000,000
    mlp: tuple[int, ...] = (400, 400, 400)  # hidden layer sizes; "400,400,400" in a file or the environment (MAX_MLP_*)
    dropout: float = 0.0
    lr_sparse: float = 0.05
    lr_dense: float = 0.001
    # The dense gradient's total norm clipped to this many times the median of the last 1,000 steps' norms
    # (learner/grad_clip.py): one batch with an out-of-scale dense value (1e18) cannot freeze Adam. 0: off
    dense_grad_clip: float = 10.0
    # Row-wise Adagrad's starting sum of squares: with 0 a row's first step is lr in size whatever its gradient
    # (a negative at p = 0.1 moves an id as far as a click), the noise behind served NE > 1 on a stream of rare ids
    # (README "Delayed feedback"). Gradients are of a mean loss, so the value belongs with step_rows (256).
    initial_accumulator: float = 1e-5
    sparse_optimizer: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD  # or sparse_adam
    # auto | on | off: row-wise Adagrad applied inside the lookup's backward where it is the same update
    # (learner/fused_update.py; FusedSparseUpdate says where that is)
    fused_sparse_update: FusedSparseUpdate = FusedSparseUpdate.AUTO
    amp: Amp = Amp.AUTO  # auto | on | off: the dense part's autocast (Amp: bf16 only on a CPU that has it natively)
    device: Device = Device.AUTO  # auto | cpu | cuda
    dedup_window: int = 200_000  # recent impression ids remembered to drop duplicate samples
    metrics_window: int = 100_000  # samples in the sliding-window AUC/logloss
    # DataLoader workers: each reads its share of the samples partitions (learner.distributed.partitions_of) and
    # merges them in event time, the main process trains. 0 (the default) reads in the training process: on 2 cores
    # a worker competes with the 2 torch threads (bench/README.md, learner: Kafka-fed at 1 worker, 0.32x); workers
    # pay off with cores to spare. Across workers batches come as each worker has one, not in event time.
    num_workers: int = 0
    prefetch_factor: int = 4  # batches each worker prepares ahead (only with num_workers > 0)
    persistent_workers: bool = False  # keep workers between iterations (the daemon iterates once per run)
    pin_memory: PinMemory = PinMemory.AUTO  # auto | on | off: page-locked batches for the copy to the GPU
    # With workers: a worker that hands over no batch for this long while the learner waits for it is hung (a live
    # one hands over its rows, or a heartbeat every second while idle) and stops the learner, naming it
    # (learner/worker_stall.py); it was otherwise waited for in silence for good. Keep it well above 10 s (one broker
    # call of a start: a starting worker hands a heartbeat over between them).
    worker_stall_s: float = 300.0
    # Hand the samples partitions on in event-time order (learner/kafka_dataset.py, EventTimeMerge): a backlog is
    # otherwise read a partition chunk at a time. False: as fetched.
    merge_partitions: bool = True
    max_samples: int | None = None  # stop after training this many samples
    exit_when_idle_s: float | None = None  # stop after this long without new samples
    seed: int = 0
    metrics_port: int | None = None  # serve Prometheus /metrics on this port
    metrics_host: str = "127.0.0.1"  # ... bound to this address (loopback; 0.0.0.0 exposes it to the network)
    # Serving freshness (learner/deltas.py): every deltas_every_s (0 = off) write the rows touched since the
    # last delta plus the dense weights to deltas_dir, keep the last deltas_keep, and PUBLISH the seq on
    # deltas_channel ("" = the [redis] prefix's channel, RedisSettings.deltas_channel) on the [redis] Redis, with
    # its credentials and TLS (`streamrec train` hands the learner its [redis] settings; serving also polls).
    deltas_every_s: float = 0.0
    deltas_dir: Path = Path(".streamrec/deltas")
    deltas_keep: int = 100
    # Deprecated: announce on this url instead of the [redis] url (credentials in it replace [redis]'s). Remove
    # it and set [redis] url / username / password_file instead; a warning says so while it is set.
    deltas_redis_url: str | None = None
    deltas_channel: str = ""
    deltas_id_maps_every_s: float = 60.0  # dynamic ids: a delta carries the id maps at most this often
    # HMAC-SHA256 key file (>= 16 bytes, read once at start): every delta is signed with it; serving with the
    # same file refuses deltas that are not. None: deltas are unsigned.
    signing_key_file: Path | None = None
    # A fresh learner infers its fields from the first probe_rows rows: a context or dense column becomes a
    # field only if it is present in at least min_field_share of them, at most max_fields of each kind (one
    # hostile message with thousands of keys must not fix the model's shape for good).
    probe_rows: int = 4096
    min_field_share: float = 0.01
    max_fields: int = 64  # at most 4,096
    # A samples message in poison_after failed training batches in a row is dead-lettered (stream/strikes.py).
    poison_after: int = 3
    # A samples message with a row whose ts leads this machine's wall clock by more than this is dead-lettered
    # (future_ts; keep it >= the joiner's [limits] future_ts_s); the learner's clocks never lead the wall clock.
    future_ts_s: float = 3600.0
    # On N ranks: how long a rank waits in one collective for the others (a hung rank stalls the job this long;
    # keep it well above 5 s, the rounds in which the ranks wait together for the first samples).
    collective_timeout_s: float = 600.0
    __repr__ = redacted_repr  # deltas_redis_url's user-info: never shown

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mlp", parse_mlp(self.mlp))
        except ValueError as exc:
            raise ConfigError(f"[learner] {exc}") from None
        for name, kind in (("id_init", IdInit), ("sparse_optimizer", SparseOptimizer), ("device", Device),
                           ("amp", Amp), ("fused_sparse_update", FusedSparseUpdate), ("pin_memory", PinMemory)):
            object.__setattr__(self, name, kind.of(getattr(self, name), f"[learner] {name}"))
        # every count >= 1 (step_rows 0 trained a whole batch as one step, keep_checkpoints 0 never pruned); 0 means:
        # id_capacity no own rows (hash buckets only), cold_k no sample is cold, dedup_window no memory across
        # batches (duplicates within one are still dropped), num_workers reading in the training process, max_fields
        # no context or dense field (ids and history only), seed a seed like any other (numpy refuses negatives;
        # torch takes at most 2**64 - 1). max_samples None: no bound. The counts that size the model's memory have
        # bounds no deployment reaches (the rest: stream.config.MAX_COUNT)
        check_counts("learner", self, zero_ok=("id_capacity", "cold_k", "dedup_window", "num_workers", "max_fields",
                                               "seed"),
                     at_most={"seed": 2**64 - 1, "embedding_dim": 4_096, "buckets": 1_000_000_000,
                              "ctx_buckets": 1_000_000_000, "id_capacity": 1_000_000_000, "batch_rows": 10_000_000,
                              "max_fields": 4_096})
        check_group_id("[learner] group_id", self.group_id)
        if self.deltas_redis_url:  # None or "": unset (learner.delta_writer); checked as [redis] url is, by its rule
            object.__setattr__(self, "deltas_redis_url", self.deltas_redis_url.strip())
            check_redis_url("[learner] deltas_redis_url", self.deltas_redis_url)
        # every period, ttl and window finite and > 0; 0 means off for deltas_every_s, every delta for
        # deltas_id_maps_every_s, none for future_ts_s. The optimizers' knobs too (checked here, not when the model is
        # built once the first samples arrived: a negative lr_dense ended the daemon in torch's ValueError then, a
        # negative lr_sparse or initial_accumulator trained away from the data or into NaN rows in silence): the
        # learning rates >= 0 (0: that part does not learn, what the model_not_learning alert is tested with),
        # boost_half_life > 0; 0 means off for dense_grad_clip and boost, Adagrad's plain start for initial_accumulator
        check_durations("learner", self, zero_ok=("deltas_every_s", "deltas_id_maps_every_s", "future_ts_s",
                                                  "dense_grad_clip", "boost", "initial_accumulator", "lr_sparse",
                                                  "lr_dense"),
                        extra=("dense_grad_clip", "lr_sparse", "lr_dense", "boost", "boost_half_life",
                               "initial_accumulator"))
        check_ports("learner", self)
        if not 0 <= self.dropout < 1:  # torch's Dropout refused it only when the model was built
            raise ConfigError(f"[learner] dropout must be a share >= 0 and < 1, got {self.dropout!r}")
        if not 0 <= self.min_field_share <= 1:  # above 1 no column would ever become a field
            raise ConfigError(f"[learner] min_field_share must be a share between 0 and 1, got "
                              f"{self.min_field_share!r}")
        if not 0 < self.prior_click_rate < 1:
            raise ConfigError(f"[learner] prior_click_rate must be between 0 and 1 (exclusive), got "
                              f"{self.prior_click_rate!r}: set it to your stream's click rate, roughly (0.05 "
                              f"when unknown)")

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(self.mlp, self.dropout, self.sparse_optimizer)


# Settings that shape the model a checkpoint holds: a learner restored from a checkpoint must have the same
# ones, or it would silently train another model (or fail to load). Everything else may change across a
# restart and is taken from the settings: learning rates, amp, dropout, the boost, step and batch sizes,
# cadences, deltas, device and workers.
SHAPE_SETTINGS = ("mlp", "sparse_optimizer", "embedding_dim", "buckets", "ctx_buckets", "id_capacity",
                  "admit_after", "id_ttl_s", "id_init", "user_bucket_half_life_s")


class CheckpointMismatch(ConfigError):
    """The settings would change the shape of the model a checkpoint holds. ``fields``: name ->
    (checkpoint's value, settings' value)."""

    def __init__(self, path: object, fields: dict[str, tuple[Any, Any]]) -> None:
        self.fields = fields
        listed = ", ".join(f"{k}: checkpoint {a!r}, settings {b!r}" for k, (a, b) in sorted(fields.items()))
        super().__init__(f"checkpoint {path} was trained with other model-shaping settings ({listed}); a model "
                         "cannot change shape in place: set them back, or train into a new checkpoint_dir")


class CheckpointTopicMismatch(ConfigError):
    """A checkpoint's offsets are of another samples topic than the one the settings read: resuming would apply them to
    this topic (skipping its messages up to those offsets, or waiting past its end) and report the other topic's
    samples as trained (a recreated topic, a restarted in-memory broker, a copied checkpoint_dir)."""

    def __init__(self, path: object, recorded: str, topic: str) -> None:
        super().__init__(f"checkpoint {path} was trained from samples topic {recorded!r}, and these settings read "
                         f"{topic!r}: its offsets belong to {recorded!r}. Set [kafka] samples_topic back to "
                         f"{recorded!r}, or train {topic!r} into a new checkpoint_dir")


def check_topic(path: object, meta: Mapping[str, Any], topic: str) -> None:
    """:class:`CheckpointTopicMismatch` unless the checkpoint (``meta``) was trained from ``topic`` (a checkpoint that
    records no topic passes)."""
    recorded = meta.get("topic")
    if isinstance(recorded, str) and recorded and recorded != topic:
        raise CheckpointTopicMismatch(path, recorded, topic)


def shape_of(ls: LearnerSettings) -> dict[str, Any]:
    """The model-shaping settings of ``ls`` as plain values (what a checkpoint records)."""
    out = {k: getattr(ls, k) for k in SHAPE_SETTINGS}
    out = {k: v.value if isinstance(v, Choice) else v for k, v in out.items()}
    out["mlp"] = ls.model.mlp_text
    return out
