"""What one evaluation is: its protocol, its feature set and the model, optimizer and hashing knobs.

:class:`EvalConfig` is the full configuration, :data:`DEFAULT_CONFIGS` the tuned one per (protocol,
feature set), :class:`EvalOverrides` the subset a user may set from the command line, ``[evaluate]`` in
``--config`` or ``STREAMREC_EVALUATE_*``, and :func:`resolve_config` the merge of the two. The names of
the feature sets' fields live here too, so the sample builder and the ratings loader agree on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from learner.config import LearnerSettings, SparseOptimizer, parse_mlp
from stream.config import check_counts
from stream.errors import ConfigError, shown
from stream.features import REQUEST_TIME, TIME_UNITS
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import POLICIES

PROTOCOLS = ("autoint", "online", "delayed")
EMISSIONS = POLICIES  # the joiner's emission policies (stream.joiner.config.EmissionPolicy)
FEATURE_SETS = ("paper", "default")
PAPER_FIELDS = ("gender", "age", "occupation", "zip", REQUEST_TIME, "year", "genres")  # AutoInt's 7 fields
MULTI_VALUED = frozenset({"genres"})


# The knobs [evaluate] may set (EvalOverrides), checked where they are set and again in EvalConfig (a config given to
# evaluate() directly): a finite number >= 0 (0: that part does not learn, no boost, no decay of the weights, no
# delay) or > 0, a share, one of a few words, a boolean. A nonsense value (a negative dropout, lr_decay 2, NaN) ran a
# whole evaluation and reported its AUC, or ended it in torch's ValueError once the data had loaded.
_AT_LEAST_ZERO = ("lr_dense", "lr_sparse", "initial_accumulator", "boost", "weight_decay", "history_delay_s",
                  "elapsed_s")
_ABOVE_ZERO = ("boost_half_life", "window_s")
_BOOLEANS = ("calibrate", "init_bias", "online_calibration")


def _check_knobs(cfg: EvalConfig | EvalOverrides) -> None:
    """A :class:`ConfigError` naming the ``[evaluate]`` key of the first value of ``cfg`` out of its range (``None``:
    unset, passes)."""
    def bad(name: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"[evaluate] {name} must be {what}, got {shown(value)}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def get(name: str) -> Any:
        return getattr(cfg, name)

    for name in _AT_LEAST_ZERO:
        if get(name) is not None and not (number(get(name)) and get(name) >= 0):
            raise bad(name, "a finite number >= 0", get(name))
    for name in _ABOVE_ZERO:
        if get(name) is not None and not (number(get(name)) and get(name) > 0):
            raise bad(name, "a finite number > 0", get(name))
    if get("lr_decay") is not None and not (number(get("lr_decay")) and 0 < get("lr_decay") <= 1):
        raise bad("lr_decay", "a factor > 0 and <= 1 (1: no decay)", get("lr_decay"))
    if get("dropout") is not None and not (number(get("dropout")) and 0 <= get("dropout") < 1):
        raise bad("dropout", "a share >= 0 and < 1", get("dropout"))
    for name in ("prior_click_rate", "syn_base_ctr"):
        if get(name) is not None and not (number(get(name)) and 0 < get(name) < 1):
            raise bad(name, "a rate between 0 and 1 (exclusive)", get(name))
    for name in _BOOLEANS:
        if get(name) is not None and not isinstance(get(name), bool):
            raise bad(name, "true or false", get(name))
    for name, words in (("sparse_optimizer", tuple(m.value for m in SparseOptimizer)),
                        ("request_time", tuple(sorted(TIME_UNITS))), ("emission", tuple(EMISSIONS))):
        if get(name) is not None and get(name) not in words:
            raise bad(name, "one of " + ", ".join(words), get(name))
    if get("mlp") is not None:
        try:
            parse_mlp(get("mlp"))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"[evaluate] {exc}") from None


# The upper bounds of the counts that size an evaluation's model (EvalConfig and EvalOverrides; every other count:
# stream.config.MAX_COUNT): a dim of at most 4,096, at most a billion rows per table, 10 M rows per batch, 1,024 threads
EVAL_BOUNDS = {"embedding_dim": 4_096, "id_buckets": 1_000_000_000, "ctx_buckets": 1_000_000_000,
               "zip_buckets": 1_000_000_000, "batch_size": 10_000_000, "eval_batch": 10_000_000, "threads": 1_024}


@dataclass(frozen=True)
class EvalConfig:
    """Model, optimizer and feature-hashing knobs of one evaluation (tuned on valid AUC, never on test)."""

    embedding_dim: int = 16  # at most 4,096; the bounds of every count: EVAL_BOUNDS
    mlp: tuple[int, ...] = (400, 400, 400)
    dropout: float = 0.0
    lr_dense: float = 1e-3
    lr_sparse: float = 0.05
    sparse_optimizer: str = "rowwise_adagrad"
    initial_accumulator: float = 0.0  # row-wise Adagrad: pseudo squared gradient every row starts with
    boost: float = 0.0  # row-wise Adagrad: young rows learn up to 1 + boost times faster
    boost_half_life: float = 8.0  # updates
    weight_decay: float = 0.0
    batch_size: int = 4096
    epochs: int = 5  # autoint: the most epochs; online: always one pass
    patience: int = 1  # autoint: stop after this many epochs without a better valid AUC
    lr_decay: float = 1.0  # autoint: both learning rates are multiplied by this after every epoch
    calibrate: bool = True  # autoint: Platt-scale the test probabilities with (a, b) fitted on the valid split
    id_buckets: int = 500_000  # user_id, item_id (history shares item_id's rows)
    ctx_buckets: int = 10_000  # small context fields (gender, age, occupation, request time, year, genres)
    zip_buckets: int = 200_000  # ctx.zip: 3,439 distinct zip codes
    history_len: int = 50
    # A positive enters its user's history this long after its rating (0: at once). The joiner adds an
    # item when its click arrives, a click delay after the impression; see learner/evaluation/samples.py.
    history_delay_s: float = 0.0
    request_time: str = "hour_of_week"  # the request-time field from the rating time: hour | weekday | hour_of_week
    autocast: str | None = None  # None: fp32; "bf16": the dense part under bfloat16 autocast
    eval_batch: int = 65_536
    threads: int = 2
    # delayed protocol (learner/evaluation/delayed.py): the joiner's policy and window, the replay's delays
    # the delayed protocol simulates the daemon at its defaults: the joiner's emission, the learner's bias rule
    emission: str = JoinerSettings().emission.value
    elapsed_s: float = 60.0  # es_dfm
    window_s: float = 1800.0
    lateness_s: float = 5.0
    click_delay_median_s: float = 30.0
    click_delay_sigma: float = 1.0
    delay_seed: int = 7  # the replay's default seed: the same click times as `streamrec replay`
    init_bias: bool = LearnerSettings().init_bias  # learner.delayed.BaseRateBias
    prior_click_rate: float = LearnerSettings().prior_click_rate  # what BaseRateBias starts from
    online_calibration: bool = LearnerSettings().online_calibration  # learner/calibration.py (fits delayed rows only)
    feed_events: int = 256  # events per joiner batch
    cold_k: int = 10  # a user's first cold_k impressions are cold
    # --dataset synthetic (stream/replay/synthetic.py): how many impressions, their click rate (None: the
    # feed's default) and the share of brand-new users
    syn_impressions: int = 300_000
    syn_base_ctr: float | None = None
    syn_new_user_share: float = 0.02

    def __post_init__(self) -> None:
        # as EvalOverrides: every count >= 1 (history_len 0: no history feature; cold_k 0: no impression is cold; the
        # seed any); then the other knobs
        check_counts("evaluate", self, zero_ok=("history_len", "cold_k", "delay_seed"),
                     at_most={**EVAL_BOUNDS, "delay_seed": 2**64 - 1})
        _check_knobs(self)
        if self.request_time not in TIME_UNITS:
            raise ValueError(f"request_time must be one of {sorted(TIME_UNITS)}, got {self.request_time!r}")
        if self.autocast not in (None, "bf16"):
            raise ValueError(f"autocast must be None or 'bf16', got {self.autocast!r}")
        if self.batch_size < 1 or self.epochs < 1 or self.patience < 1:
            raise ValueError("batch_size, epochs and patience must be >= 1")
        if self.emission not in EMISSIONS:
            raise ValueError(f"emission must be one of {EMISSIONS}, got {self.emission!r}")
        if self.emission == "es_dfm" and not 0 <= self.elapsed_s <= self.window_s:
            raise ValueError(f"elapsed_s must be between 0 and window_s ({self.window_s:g}), got {self.elapsed_s!r}")
        if not 0 < self.prior_click_rate < 1:
            raise ValueError(f"prior_click_rate must be between 0 and 1 (exclusive), got {self.prior_click_rate!r}")
        if not (math.isfinite(self.history_delay_s) and self.history_delay_s >= 0):
            raise ValueError(f"history_delay_s must be a finite number >= 0, got {self.history_delay_s!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mlp"] = list(self.mlp)
        return d


@dataclass(frozen=True)
class EvalOverrides:
    """Settings a user may override from the command line, ``[evaluate]`` in ``--config`` or
    ``STREAMREC_EVALUATE_*`` (``streamrec.settings.build`` fills it); ``None`` keeps the tuned default."""

    embedding_dim: int | None = None  # at most 4,096; the bounds of every count: EVAL_BOUNDS
    mlp: str | None = None  # "400,400,400"
    dropout: float | None = None
    lr_dense: float | None = None
    lr_sparse: float | None = None
    lr_decay: float | None = None
    sparse_optimizer: str | None = None
    initial_accumulator: float | None = None
    boost: float | None = None
    boost_half_life: float | None = None
    weight_decay: float | None = None
    batch_size: int | None = None
    epochs: int | None = None
    patience: int | None = None
    id_buckets: int | None = None
    ctx_buckets: int | None = None
    zip_buckets: int | None = None
    history_len: int | None = None
    history_delay_s: float | None = None
    request_time: str | None = None
    calibrate: bool | None = None
    eval_batch: int | None = None
    threads: int | None = None
    emission: str | None = None
    elapsed_s: float | None = None
    window_s: float | None = None
    init_bias: bool | None = None
    prior_click_rate: float | None = None
    online_calibration: bool | None = None
    syn_impressions: int | None = None
    syn_base_ctr: float | None = None

    def __post_init__(self) -> None:
        # every count set >= 1 (embedding_dim 0 trained and reported an AUC for a dim-0 model); history_len 0: no
        # history feature
        check_counts("evaluate", self, zero_ok=("history_len",), at_most=EVAL_BOUNDS)
        _check_knobs(self)

    def to_config(self) -> dict[str, Any]:
        """The set fields as :func:`resolve_config` overrides; raises ValueError on a malformed ``mlp``."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if "mlp" in out:
            out["mlp"] = parse_mlp(out["mlp"])
        return out


# Chosen by valid AUC (autoint) / by the progressive AUC of the first 80% of the stream (online).
DEFAULT_CONFIGS: dict[tuple[str, str], EvalConfig] = {
    ("autoint", "paper"): EvalConfig(embedding_dim=32, lr_sparse=0.1, lr_dense=2e-3, batch_size=2048, epochs=10,
                                     patience=2),
    ("autoint", "default"): EvalConfig(embedding_dim=32, lr_sparse=0.1, lr_dense=2e-3, batch_size=2048, epochs=10,
                                       patience=2, lr_decay=0.6),
    ("online", "paper"): EvalConfig(batch_size=8, mlp=(200, 200), lr_sparse=0.07, lr_dense=3e-4),
    ("online", "default"): EvalConfig(batch_size=8, mlp=(200, 200), lr_sparse=0.07, lr_dense=3e-4),
    # the daemon's step (LearnerSettings.step_rows) and model
    ("delayed", "paper"): EvalConfig(batch_size=256, mlp=(400, 400, 400), lr_sparse=0.05, lr_dense=1e-3,
                                     initial_accumulator=LearnerSettings().initial_accumulator),
    ("delayed", "default"): EvalConfig(batch_size=256, mlp=(400, 400, 400), lr_sparse=0.05, lr_dense=1e-3,
                                       initial_accumulator=LearnerSettings().initial_accumulator),
}


def resolve_config(protocol: str, features: str, config: EvalConfig | Mapping[str, Any] | None = None,
                   epochs: int | None = None) -> EvalConfig:
    """The protocol's default configuration, overridden by ``config`` (an EvalConfig or a dict of fields)."""
    base = DEFAULT_CONFIGS[(protocol, features)]
    if isinstance(config, EvalConfig):
        base = config
    elif config:
        known = {f.name for f in fields(EvalConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown evaluation settings {unknown}; known: {sorted(known)}")
        over = dict(config)
        if "mlp" in over:
            over["mlp"] = tuple(over["mlp"])
        base = replace(base, **over)
    if epochs is not None:
        base = replace(base, epochs=epochs)
    return base
