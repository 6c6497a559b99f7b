"""The ``[evaluate]`` knobs (``EvalOverrides``: ``--config``, ``STREAMREC_EVALUATE_*``, flags; and ``EvalConfig``,
what ``evaluate()`` takes directly) are range-checked where they are set, like the learner's own: a nonsense value is a
ConfigError naming the key (exit 2 at the CLI), not a whole evaluation run on it or torch's ValueError once the data
had loaded."""

from __future__ import annotations

import math
from typing import Any

import pytest

from learner.evaluation.config import EvalConfig, EvalOverrides, resolve_config
from stream.errors import ConfigError
from streamrec.settings import SettingsError, build

BAD: list[tuple[str, Any]] = [
    *[(k, v) for k in ("lr_dense", "lr_sparse", "initial_accumulator", "boost", "weight_decay", "history_delay_s",
                       "elapsed_s") for v in (-0.001, math.nan, math.inf, "0.1")],
    *[(k, v) for k in ("boost_half_life", "window_s") for v in (0.0, -1.0, math.nan, math.inf)],
    *[("lr_decay", v) for v in (0.0, -0.5, 1.5, math.nan)],
    *[("dropout", v) for v in (-0.1, 1.0, 2.0, math.nan, True)],
    *[(k, v) for k in ("prior_click_rate", "syn_base_ctr") for v in (0.0, 1.0, -0.2, 1.2, math.nan)],
    *[(k, v) for k in ("calibrate", "init_bias", "online_calibration") for v in ("yes", 1)],
    ("sparse_optimizer", "sgd"), ("request_time", "day"), ("emission", "never"), ("mlp", "400,0"), ("mlp", "-3"),
    ("embedding_dim", 0), ("batch_size", -1), ("threads", 2.5),
]


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_a_nonsense_evaluate_value_is_a_config_error_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^\[evaluate\] {key}\b"):
        EvalOverrides(**{key: value})
    with pytest.raises(ConfigError, match=rf"^\[evaluate\] {key}\b"):  # the same in evaluate()'s own config
        EvalConfig(**{key: value})


@pytest.mark.parametrize("env", [{"STREAMREC_EVALUATE_DROPOUT": "1.5"}, {"STREAMREC_EVALUATE_LR_DECAY": "2"},
                                 {"STREAMREC_EVALUATE_WINDOW_S": "-60"}, {"STREAMREC_EVALUATE_LR_SPARSE": "-1"}])
def test_a_bad_evaluate_setting_from_the_environment_is_one_settings_error_line(env: dict[str, str]) -> None:
    key = next(iter(env)).removeprefix("STREAMREC_EVALUATE_").lower()
    with pytest.raises(SettingsError, match=rf"^\[evaluate\] {key} must be"):
        build(EvalOverrides, "evaluate", environ=env)


def test_sensible_values_and_the_tuned_defaults_pass() -> None:
    over = EvalOverrides(dropout=0.0, lr_dense=0.0, lr_decay=1.0, boost=0.0, history_delay_s=0.0, elapsed_s=0.0,
                         window_s=60.0, prior_click_rate=0.01, syn_base_ctr=0.2, calibrate=False, mlp="64,32",
                         sparse_optimizer="sparse_adam", request_time="hour", emission="window", history_len=0)
    cfg = resolve_config("autoint", "paper", over.to_config())
    assert (cfg.mlp, cfg.lr_decay, cfg.history_len) == ((64, 32), 1.0, 0)
    for protocol, features in (("autoint", "default"), ("online", "paper"), ("delayed", "default")):
        resolve_config(protocol, features)
