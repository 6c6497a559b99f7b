"""Every interval, period, timeout and rate setting is finite and > 0 (>= 0 where 0 means off), checked once per
settings class with a ConfigError (exit 2): 0 or a negative period pins a core, NaN compares False with
everything, inf overflows a wait."""

from __future__ import annotations

import math
from typing import Any

import pytest

from learner.config import LearnerSettings
from serving.settings import MAX_DURATION_S, ServeSettings
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.replay.config import ReplaySettings, SyntheticSettings
from streamrec.cli import build_parser
from streamrec.settings import build
from streamrec.stack import StackSettings

BAD = [0.0, -1.0, math.nan, math.inf, -math.inf]
NEVER_ZERO = [
    (ServeSettings, "poll_s"), (ServeSettings, "redis_timeout_s"), (ServeSettings, "history_retry_after_s"),
    (ServeSettings, "request_timeout_s"), (ServeSettings, "keepalive_timeout_s"),
    (LearnerSettings, "checkpoint_every_s"), (LearnerSettings, "exit_when_idle_s"), (LearnerSettings, "id_ttl_s"),
    (LearnerSettings, "attribution_window_s"), (LearnerSettings, "user_bucket_half_life_s"),
    (JoinerSettings, "attribution_window_s"), (JoinerSettings, "batch_within_s"), (JoinerSettings, "click_idle_s"),
    (JoinerSettings, "counts_flush_s"), (JoinerSettings, "exit_when_idle_s"), (JoinerSettings, "max_input_drift_s"),
    (ReplaySettings, "rate"), (ReplaySettings, "speed"), (SyntheticSettings, "impressions_per_s"),
    (StackSettings, "start_timeout_s"),
]
ZERO_MEANS_OFF = [(LearnerSettings, "deltas_every_s"), (LearnerSettings, "future_ts_s"),
                  (JoinerSettings, "gc_every_s"), (JoinerSettings, "allowed_lateness_s"),
                  (ReplaySettings, "click_delay_median_s"), (SyntheticSettings, "new_user_session_s")]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("cls, name", NEVER_ZERO)
def test_a_duration_must_be_finite_and_positive(cls: Any, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"{name} must be a finite number (of seconds )?> 0"):
        cls(**{name: value})


@pytest.mark.parametrize("value", [-1.0, -0.001, math.nan, math.inf])
@pytest.mark.parametrize("cls, name", ZERO_MEANS_OFF)
def test_a_duration_where_zero_means_off_takes_zero_but_no_negative_or_non_finite(cls: Any, name: str,
                                                                                   value: float) -> None:
    cls(**{name: 0.0})
    with pytest.raises(ConfigError, match=rf"{name} must be a finite number (of seconds )?>= 0"):
        cls(**{name: value})


def test_serve_durations_are_bounded_by_a_day_and_come_through_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"\[serve\] poll_s .* <= 86400, got 86401"):
        ServeSettings(poll_s=MAX_DURATION_S + 1)
    for raw in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"\[serve\] poll_s must be"):
            build(ServeSettings, "serve", environ={"STREAMREC_SERVE_POLL_S": raw})
    assert build(ServeSettings, "serve", environ={"STREAMREC_SERVE_POLL_S": "0.25"}).poll_s == 0.25


@pytest.mark.parametrize("flag", ["nan", "inf", "0", "-1", "1e400", "86401", "soon"])
def test_monitor_interval_and_audit_idle_timeout_refuse_non_finite_and_non_positive(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["monitor", "--check", "--interval", flag], ["audit", "--idle-timeout", flag]):
        with pytest.raises(SystemExit) as exc:  # parsed only: without the check audit would go on to Kafka
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "seconds" in err[-1] and "Traceback" not in "".join(err)


@pytest.mark.parametrize("env", [{"STREAMREC_LIMITS_MAX_MESSAGE_BYTES": "0"}, {"STREAMREC_LIMITS_FUTURE_TS_S": "-1"}])
def test_a_bad_limit_is_a_config_error_exit_2_not_a_value_error_traceback(env: dict[str, str]) -> None:
    from stream.limits import EventLimits
    from streamrec.settings import SettingsError

    with pytest.raises(SettingsError, match=r"\[limits\]"):  # build() turns only a ConfigError into one line
        build(EventLimits, "limits", environ=env)


@pytest.mark.parametrize("name, value, message", [
    ("lr_sparse", -0.05, "lr_sparse must be a finite number >= 0"),
    ("lr_dense", -1.0, "lr_dense must be a finite number >= 0"),
    ("initial_accumulator", -1.0, "initial_accumulator must be a finite number >= 0"),
    ("boost", -0.5, "boost must be a finite number >= 0"),
    ("boost_half_life", 0.0, "boost_half_life must be a finite number > 0"),
    ("dropout", 1.0, "dropout must be a share >= 0 and < 1"),
    ("dropout", -0.1, "dropout must be a share >= 0 and < 1"),
    ("min_field_share", 1.5, "min_field_share must be a share between 0 and 1"),
])
def test_the_learners_optimizer_and_model_knobs_are_refused_where_the_settings_are_built(
        name: str, value: float, message: str) -> None:
    # Not when the model is built, once the first samples arrived: torch refused a negative lr_dense or a dropout of
    # 1.5 then (a traceback, exit 1), and a negative lr_sparse or initial_accumulator trained in silence (NaN rows)
    with pytest.raises(ConfigError, match=rf"\[learner\] {message}, got {value!r}"):
        LearnerSettings(**{name: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"\[learner\] {message}"):
        build(LearnerSettings, "learner", environ={f"STREAMREC_LEARNER_{name.upper()}": str(value)})


def test_the_learners_knobs_take_their_edges_where_zero_means_off() -> None:
    ls = LearnerSettings(boost=0.0, initial_accumulator=0.0, dropout=0.0, min_field_share=1.0, dense_grad_clip=0.0)
    assert (ls.boost, ls.initial_accumulator, ls.dropout, ls.min_field_share) == (0.0, 0.0, 0.0, 1.0)
    LearnerSettings(min_field_share=0.0, dropout=0.5, lr_sparse=0.0, lr_dense=0.0, boost_half_life=0.5)  # 0: frozen
