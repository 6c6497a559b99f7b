"""Typed settings, built once at the process edge.

Every component gets one frozen dataclass. Values come from, in increasing precedence:

1. the defaults written here (the embedded defaults: a local stack on loopback);
2. a TOML file given with ``--config FILE``, one table per section (``[kafka]``, ``[redis]``, ...);
3. environment variables ``STREAMREC_<SECTION>_<FIELD>`` (``STREAMREC_KAFKA_BOOTSTRAP_SERVERS``);
4. command-line flags.

Nothing below the CLI reads ``os.environ``; components receive the dataclass they need.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stream.errors import shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "STREAMREC_"


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names the source, key and fix."""


@dataclass(frozen=True)
class KafkaSettings:
    """How every streamrec process talks to Kafka (or the local Kafka-protocol broker)."""

    bootstrap_servers: str = "127.0.0.1:19092"
    # The local Tansu broker takes about half the session timeout to complete a group join, so the
    # local default is short. Real Kafka deployments may raise it (compose/ uses 10000).
    session_timeout_ms: int = 6000
    impressions_topic: str = "impressions"
    clicks_topic: str = "clicks"
    samples_topic: str = "samples"
    dlq_suffix: str = ".dlq"
    partitions: int = 4
    replication_factor: int = 1
    client_id: str = "streamrec"

    def dlq_topic(self, topic: str) -> str:
        return topic + self.dlq_suffix


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:16379/0"
    prefix: str = "streamrec"  # every key streamrec writes starts with this
    counts_ttl_days: int = 8  # per-day count keys live this long
    history_len: int = 50  # recent clicked items kept per user


@dataclass(frozen=True)
class JoinerSettings:
    """The impression-click joiner (``streamrec join``)."""

    app_id: str = "streamrec-joiner"  # faust app id = consumer group; names the state topic
    driver: str = "faust"  # faust | kafka (plain confluent-kafka loop, same semantics, faster)
    attribution_window_s: float = 1800.0  # a click within this event time of its impression labels it 1
    allowed_lateness_s: float = 5.0  # watermark = max event time seen - allowed lateness
    late_retention_s: float = 3600.0  # how long after expiry a click is still recognised as late
    # A partition without clicks for this long (wall clock) lets impressions alone advance event time.
    click_idle_s: float = 30.0
    counts_flush_s: float = 2.0  # Redis day counts are aggregated in memory this long between writes
    late_clicks_topic: str = "late_clicks"
    # Samples are flushed once per batch: a batch closes at batch_max events or after batch_within_s,
    # and its samples go out as messages of at most sample_flush_rows rows per partition.
    batch_max: int = 5000
    batch_within_s: float = 0.5
    sample_flush_rows: int = 4096
    exit_when_idle_s: float | None = None  # bounded runs: exit after this long without input
    drain_at_exit: bool = False  # at exit, treat input as complete: expire every pending impression
    metrics_port: int | None = None  # serve Prometheus /metrics on this port
    # Hostile input (stream/joiner/engine.py, stream/strikes.py): event time per input is its
    # watermark_quorum-th largest event time, so no single event steers it; memory caps per partition;
    # a message in poison_after failed batches in a row (processed alone after the first) is dead-lettered.
    watermark_quorum: int = 16
    max_pending_per_partition: int = 500_000
    max_waiting_per_partition: int = 100_000
    poison_after: int = 3
    max_sample_bytes: int = 900_000  # a samples message; Kafka's default message.max.bytes is 1 MB


@dataclass(frozen=True)
class LearnerSettings:
    """The continuous training daemon (``streamrec train``)."""

    group_id: str = "streamrec-learner"  # offsets committed here after each durable checkpoint (for lag)
    checkpoint_dir: Path = Path(".streamrec/checkpoints")
    checkpoint_every_s: float = 30.0
    checkpoint_every_samples: int = 1_000_000
    keep_checkpoints: int = 3
    batch_rows: int = 4096  # rows read per batch (whole samples messages are never split)
    # Rows per optimizer step: a batch is trained as consecutive chunks of this many rows, each predicted
    # before it is learned. Smaller is fresher (ML-1M online AUC: 0.75 at 4096, 0.78 at 64) and slower.
    step_rows: int = 256
    accumulation: int = 1  # micro-batches per optimizer step
    embedding_dim: int = 16
    buckets: int = 200_000  # hash-bucket rows per id field (user, item; history shares item's)
    # Dynamic ids (cold start, learner/row_mapper.py): own rows per id field for admitted ids (0 = ids
    # only ever use their hash bucket); an id seen admit_after times gets one, starting as its bucket's
    # vector (id_init = bucket) or zero; rows unseen for id_ttl_s of event time are evicted, and the least
    # recently seen ones when the table is full.
    id_capacity: int = 500_000
    admit_after: int = 2
    id_ttl_s: float | None = None
    id_init: str = "bucket"
    # A user bucket idle this long (event time) has shrunk halfway to zero when the next not-yet-admitted
    # user lands in it: what earlier occupants taught it says nothing about a new user (README, cold start).
    user_bucket_half_life_s: float | None = 60.0
    # Young rows learn up to 1 + boost times faster; the boost halves every boost_half_life updates.
    boost: float = 0.0
    boost_half_life: float = 8.0
    cold_k: int = 10  # a user's first cold_k impressions count as cold (streamrec_learner_cold_auc)
    ctx_buckets: int = 10_000  # rows per context field
    mlp: str = "400,400,400"
    dropout: float = 0.0
    lr_sparse: float = 0.05
    lr_dense: float = 0.001
    sparse_optimizer: str = "rowwise_adagrad"  # or sparse_adam
    amp: bool = True  # bf16 autocast of the dense part on CPU (fp16 + GradScaler on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    dedup_window: int = 200_000  # recent impression ids remembered to drop duplicate samples
    metrics_window: int = 100_000  # samples in the sliding-window AUC/logloss
    num_workers: int = 0  # DataLoader workers (they split the partitions)
    max_samples: int | None = None  # stop after training this many samples
    exit_when_idle_s: float | None = None  # stop after this long without new samples
    seed: int = 0
    metrics_port: int | None = None
    # Serving freshness (learner/deltas.py): every deltas_every_s (0 = off) write the rows touched since the
    # last delta plus the dense weights to deltas_dir, keep the last deltas_keep, and PUBLISH the seq on
    # deltas_channel ("<redis prefix>:model-deltas") at deltas_redis_url when set (serving also polls).
    deltas_every_s: float = 0.0
    deltas_dir: Path = Path(".streamrec/deltas")
    deltas_keep: int = 100
    deltas_redis_url: str | None = None
    deltas_channel: str = "streamrec:model-deltas"
    deltas_id_maps_every_s: float = 60.0  # dynamic ids: a delta carries the id maps at most this often
    # A fresh learner infers its fields from the first probe_rows rows: a context or dense column becomes a
    # field only if it is present in at least min_field_share of them, at most max_fields of each kind (one
    # hostile message with thousands of keys must not fix the model's shape for good).
    probe_rows: int = 4096
    min_field_share: float = 0.01
    max_fields: int = 64
    # A samples message in poison_after failed training batches in a row is dead-lettered (stream/strikes.py).
    poison_after: int = 3


@dataclass(frozen=True)
class StackSettings:
    """The local development stack: a Tansu broker and a Redis server on loopback."""

    state_dir: Path = Path(".streamrec/stack")
    host: str = "127.0.0.1"
    kafka_port: int = 19092
    redis_port: int = 16379
    start_timeout_s: float = 20.0


class DelayKind(str, enum.Enum):
    FIXED = "fixed"
    EXPONENTIAL = "exponential"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class ClickDelay:
    """Distribution of the time from an impression to its click (event time)."""

    kind: DelayKind = DelayKind.LOGNORMAL
    median_s: float = 30.0
    # lognormal: sigma of log(delay); exponential and fixed ignore it.
    sigma: float = 1.0


@dataclass(frozen=True)
class ReplaySettings:
    dataset: str = "ml-1m"
    limit: int | None = None
    rate: float | None = None  # events per second (wall clock); None = as fast as possible
    speed: float | None = None  # event-time speed-up factor; None = as fast as possible
    seed: int = 7
    click_delay_kind: DelayKind = DelayKind.LOGNORMAL
    click_delay_median_s: float = 30.0
    click_delay_sigma: float = 1.0
    linger_ms: int = 20
    progress: bool = True

    @property
    def click_delay(self) -> ClickDelay:
        return ClickDelay(self.click_delay_kind, self.click_delay_median_s, self.click_delay_sigma)


@dataclass(frozen=True)
class SyntheticSettings:
    """A deterministic synthetic feed with a planted click model (``--dataset synthetic``)."""

    impressions: int = 200_000
    users: int = 1_000_000  # distinct-id cardinality of returning users (up to 100 M)
    items: int = 100_000
    zipf_exponent: float = 1.1
    new_user_share: float = 0.02  # share of impressions from brand-new users
    new_user_impressions: int = 5  # a brand-new user has 1..this many impressions (uniform)
    # 0: a new user's impressions are consecutive rows (a burst); > 0: spread uniformly over this many
    # seconds of event time from the user's first, interleaved with everyone else's (a session)
    new_user_session_s: float = 0.0
    impressions_per_s: float = 200.0  # event-time arrival rate
    start_ts_ms: int = 1_700_000_000_000
    base_ctr: float = 0.1
    latent_dim: int = 8
    signal: float = 1.5  # strength of the planted user x item interaction
    attribution_window_s: float = 1800.0
    late_click_share: float = 0.02  # share of clicks arriving after the attribution window
    duplicate_click_share: float = 0.03
    orphan_click_share: float = 0.01  # clicks for impression ids that were never shown
    malformed_share: float = 0.0  # share of all messages that are extra malformed ones (valid counts stay exact)


T = TypeVar("T")


def read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"config file {p} does not exist (given with --config)") from None
    except OSError as exc:  # a directory, no permission
        raise SettingsError(f"config file {p} cannot be read: {exc.strerror or exc} (given with --config)") from None
    # TOMLDecodeError, and the ValueErrors tomllib lets through: not UTF-8, an integer of over 4300 digits
    except ValueError as exc:
        raise SettingsError(f"config file {p} is not valid TOML: {exc}") from None
    except RecursionError:
        raise SettingsError(f"config file {p} is not valid TOML: arrays or tables nested too deeply") from None
    return data


def build(
    cls: type[T],
    section: str,
    file_data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build settings ``cls`` for ``section`` from defaults < file < environment < overrides.

    ``overrides`` entries whose value is ``None`` are ignored (an unset CLI flag).
    Unknown keys in the file's section or in ``STREAMREC_<SECTION>_*`` are errors, so a typo
    never silently falls back to a default.
    """
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}

    table = (file_data or {}).get(section, {})
    if not isinstance(table, Mapping):
        raise SettingsError(f"config file: [{section}] must be a table, got {shown(table)}")
    for key, raw in table.items():
        if key not in names:
            raise SettingsError(
                f"config file: unknown key {key!r} in [{section}]; known keys: {', '.join(sorted(names))}"
            )
        values[key] = _coerce(hints[key], raw, f"config file [{section}].{key}")

    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for env_key, raw in (environ if environ is not None else os.environ).items():
        if not env_key.startswith(prefix):
            continue
        key = env_key[len(prefix) :].lower()
        if key not in names:
            raise SettingsError(
                f"environment: {env_key} does not name a [{section}] setting; "
                f"known: {', '.join(prefix + n.upper() for n in sorted(names))}"
            )
        values[key] = _coerce(hints[key], raw, f"environment {env_key}")

    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in names:
            raise SettingsError(f"internal: {key!r} is not a [{section}] setting")
        values[key] = _coerce(hints[key], raw, f"--{key.replace('_', '-')}")
    return cls(**values)


def _coerce(tp: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        return _coerce(inner[0], raw, where)
    if isinstance(raw, Mapping | list):  # a table or an array where one value belongs
        raise SettingsError(f"{where}: cannot use {shown(raw)}: expected one value, "
                            f"got {'a table' if isinstance(raw, Mapping) else 'an array'}")
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected one of true/false/1/0/yes/no/on/off")
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(str(raw).replace("_", "")) if isinstance(raw, str) else int(raw)
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError("expected a number")
            return float(raw)
        if tp is str:
            return str(raw)
        if tp is Path:
            return Path(str(raw))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(raw)
            except ValueError:
                raise ValueError(f"expected one of {', '.join(m.value for m in tp)}") from None
    # TypeError: a date for a number; OverflowError: an integer too large for a float
    except (ValueError, TypeError, OverflowError) as exc:
        raise SettingsError(f"{where}: cannot use {shown(raw)}: {exc}") from None
    raise SettingsError(f"{where}: unsupported setting type {tp!r}")


@dataclass(frozen=True)
class Sources:
    """Where settings come from in this process: the parsed ``--config`` file and the environment."""

    file_data: dict[str, Any] = field(default_factory=dict)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def build(self, cls: type[T], section: str, **overrides: Any) -> T:
        return build(cls, section, self.file_data, self.environ, overrides)
