"""Settings of the nightly hot-embedding cache refresh (``streamrec refresh``), section ``[refresh]``.

Built once at the process edge with ``Sources.build(RefreshSettings, "refresh", ...)``: defaults <
``--config`` TOML ``[refresh]`` < ``STREAMREC_REFRESH_<KEY>`` < flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from learner.config import ArtifactFormat
from serving.settings import EmbeddingStore, RowDtype
from stream.config import Choice, check_counts, check_durations, check_ports, check_topic
from stream.errors import ConfigError


class CountEvent(Choice):
    """Which Redis day counts rank the hot set (``cache_refresh/hot_set.py``)."""

    LOOKUP = "lookup"  # serving's own row reads (serving/lookup_counts.py)
    IMPRESSION = "impression"  # the joiner's
    CLICK = "click"  # the joiner's


class LogLevel(Choice):
    """``[refresh] log_level``: the level of the refresh's log lines (``--log-level`` overrides it); any case."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        lower = str(value).strip().lower()
        return cls(lower) if lower in cls._value2member_map_ else None


MAX_MISFIRE_GRACE_S = 366 * 86400


@dataclass(frozen=True)
class RefreshSettings:
    # Settings the learner's section owns, used when [refresh] does not give its own (stream.setting_values.inherited):
    # the README's one-file example set [learner] checkpoint_dir only, and the refresh read .streamrec/checkpoints
    INHERITS: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {
        "checkpoint_dir": (("learner", "checkpoint_dir"),), "signing_key_file": (("learner", "signing_key_file"),)}
    checkpoint_dir: Path = Path(".streamrec/checkpoints")  # the learner's (LearnerSettings.checkpoint_dir)
    publish_root: Path = Path(".streamrec/serving")  # versions/, CURRENT, last_run.json
    # hot set: top-K of the Redis per-day counts summed over the last `days` days
    days: int = 7  # at most 3,650 (10 years)
    hot_items: int = 100_000  # at most 1,000,000,000 (as hot_users and small_field_rows)
    hot_users: int = 100_000
    # lookup | impression | click: which counts rank the hot set. lookup (default): serving's own row reads, what
    # the hot cache serves (a request reads ~100 candidates per impression); fallback_event's top ids fill the budget
    # that count_event leaves empty (no lookup counts yet: the impression-ranked hot set). fallback = count: no fill.
    count_event: CountEvent = CountEvent.LOOKUP
    fallback_event: CountEvent = CountEvent.IMPRESSION
    # every row of a field with at most this many buckets is hot too (context fields: few rows, every
    # request reads them); 0 = only the counted items and users
    small_field_rows: int = 100_000
    # schedule: a crontab expression as crontab reads it (weekday 0 and 7: Sunday; a day of the month and a weekday both
    # restricted is refused: APScheduler 3 would need both to match); a run missed while the process was down runs on
    # start within the grace
    schedule: str = "0 3 * * *"
    timezone: str = "UTC"
    misfire_grace_s: int = 3600  # at most MAX_MISFIRE_GRACE_S (366 days)
    # artifact and publishing
    keep_versions: int = 5
    format: ArtifactFormat = ArtifactFormat.TORCHSCRIPT  # torchscript | export | eager (learner/scorer.py)
    # validation before publish
    validate_tolerance: float = 1e-5  # max |artifact - learner fp32 eager| probability on the probe set
    probe_samples: int = 512
    holdout_messages: int = 50  # last N messages of the samples topic; 0 = no quality check (an onnx_int8 or
    # safetensors_bf16 artifact is then published with a refresh_degraded warning: its AUC cost is not measured;
    # onnx_int8_static is refused: it is calibrated on the oldest quarter of these messages, gated on the rest)
    holdout_timeout_s: float = 10.0
    max_auc_drop: float = 0.01  # fail when holdout AUC < live artifact's AUC - this
    # reduced-precision formats (onnx_int8, onnx_int8_static, safetensors_bf16): fail when the holdout AUC < the
    # same artifact's fp32 AUC - this
    # (cache_refresh/validate.py; bench/onnx_int8.py measures the cost: ~1e-5 on its synthetic holdout)
    max_int8_auc_drop: float = 0.002
    # Redis
    redis_attempts: int = 5
    redis_backoff_s: float = 0.5  # first retry waits this long, then doubles
    redis_timeout_s: float = 5.0
    notify_channel: str = ""  # PUBLISH the new version here; "" = "<redis prefix>:model-updates"
    alerts_topic: str = "alerts"  # Kafka topic of firing alerts ("" = log only)
    # HMAC-SHA256 key file (>= 16 bytes; the same file as serving's): the manifest of every artifact built is
    # signed with it (``signature``), and a rollback or the live artifact read for comparison must verify. None:
    # artifacts are unsigned.
    signing_key_file: Path | None = None
    # The layered deployment (serving/embedding_store.py): "layered" also writes every row outside the hot set to
    # Redis ([redis] url) under <prefix>:emb:<version>: before publishing, as embedding_store_dtype values, and
    # deletes the rows of versions pruned from the publish root; in_process writes nothing there.
    embedding_store: EmbeddingStore = EmbeddingStore.IN_PROCESS
    embedding_store_dtype: RowDtype = RowDtype.FLOAT32
    embedding_store_cluster: bool = False  # [redis] url is a Redis Cluster node
    log_level: LogLevel = LogLevel.INFO
    # The scheduler serves Prometheus /metrics (cache_refresh/metrics.py: runs by outcome, last success, duration,
    # hot set) on this port while it runs; None: none. A one-shot --now reports through its summary and exit code.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # loopback; 0.0.0.0 exposes it to the network

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", ArtifactFormat.of(self.format, "[refresh] format"))
        object.__setattr__(self, "count_event", CountEvent.of(self.count_event, "[refresh] count_event"))
        object.__setattr__(self, "fallback_event", CountEvent.of(self.fallback_event, "[refresh] fallback_event"))
        object.__setattr__(self, "embedding_store",
                           EmbeddingStore.of(self.embedding_store, "[refresh] embedding_store"))
        object.__setattr__(self, "embedding_store_dtype",
                           RowDtype.of(self.embedding_store_dtype, "[refresh] embedding_store_dtype"))
        # a level logging does not know was a ValueError traceback from logging.basicConfig once the command ran
        object.__setattr__(self, "log_level", LogLevel.of(self.log_level, "[refresh] log_level"))
        # holdout_timeout_s, redis_timeout_s, misfire_grace_s > 0; redis_backoff_s >= 0 (0: retry at once);
        # validate_tolerance finite and >= 0 (0: exact; NaN passed every probe). The AUC drops only finite: a negative
        # one demands a gain (tests use it to force a refusal), but NaN passed every holdout (``drop > nan`` is
        # False: an INT8 artifact of any AUC cost was published) and inf is no bound at all
        check_durations("refresh", self, zero_ok=("redis_backoff_s", "validate_tolerance"),
                        extra=("validate_tolerance",))
        for name in ("max_auc_drop", "max_int8_auc_drop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"[refresh] {name} must be a finite number (a negative one demands a gain), "
                                  f"got {value!r}")
        if self.format is ArtifactFormat.ONNX_INT8_STATIC and self.holdout_messages <= 0:
            raise ConfigError(f"[refresh] format = onnx_int8_static is calibrated on the holdout's older samples, but "
                              f"holdout_messages = {self.holdout_messages} reads none: set holdout_messages (e.g. "
                              f"{RefreshSettings.holdout_messages}), or use format = onnx_int8 (dynamic quantization: "
                              "no calibration)")
        if self.misfire_grace_s > MAX_MISFIRE_GRACE_S:  # (a finite number > 0: check_durations above)
            raise ConfigError(f"[refresh] misfire_grace_s must be at most {MAX_MISFIRE_GRACE_S} seconds (366 days), "
                              f"got {self.misfire_grace_s!r}: a run is not caught up later than that (APScheduler's "
                              "own misfire check overflows on much larger ones)")
        check_ports("refresh", self)
        if self.alerts_topic:  # "" = log only
            check_topic("[refresh] alerts_topic", self.alerts_topic)
        # days, keep_versions, probe_samples, redis_attempts >= 1; 0 means: hot_items / hot_users none of that kind
        # hot (top_ids(k=0) is empty), small_field_rows only the counted ids, holdout_messages no quality check
        # hot set sizes past a billion rows and days past 10 years are typos (the rest: stream.config.MAX_COUNT)
        check_counts("refresh", self, zero_ok=("hot_items", "hot_users", "small_field_rows", "holdout_messages"),
                     at_most={"days": 3_650, "hot_items": 1_000_000_000, "hot_users": 1_000_000_000,
                              "small_field_rows": 1_000_000_000})
