"""[synthetic] settings are checked where they are built, with the bounds the generator itself has."""

import pytest

from stream.errors import ConfigError
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.synthetic import build_synthetic
from streamrec.settings import SettingsError, build

YEAR_S = 365 * 86_400.0


@pytest.mark.parametrize("name, value", [
    ("latent_dim", 1025), ("latent_dim", 4096),  # the settings took up to 4,096, the generator 1,024
    ("new_user_share", -1.0), ("new_user_share", 1.5), ("base_ctr", 0.0), ("base_ctr", 1.0), ("base_ctr", -0.5),
    ("zipf_exponent", -1.0), ("late_click_share", 2.0), ("duplicate_click_share", -0.1),
    ("orphan_click_share", 1.1), ("malformed_share", 1.0),
    ("attribution_window_s", YEAR_S * 2), ("new_user_session_s", YEAR_S * 2),  # within ten years, past one
])
def test_a_synthetic_setting_the_generator_refuses_is_refused_where_the_settings_are_built(
        name: str, value: float) -> None:
    with pytest.raises(SettingsError, match=rf"\[synthetic\] {name} must be.*config file \[synthetic\]\.{name}"):
        build(SyntheticSettings, "synthetic", {"synthetic": {name: value}}, {})


@pytest.mark.parametrize("name, value", [("new_user_share", float("nan")), ("base_ctr", float("nan")),
                                         ("zipf_exponent", float("inf")), ("zipf_exponent", float("nan")),
                                         ("signal", float("inf")), ("late_click_share", "0.5"), ("base_ctr", True)])
def test_a_synthetic_setting_given_in_code_is_checked_too(name: str, value: object) -> None:
    # the loader refuses a non-finite float in a file or variable; settings built in code (the evaluation harness,
    # the benchmarks) reached the generator with them
    with pytest.raises(ConfigError, match=rf"\[synthetic\] {name} must be"):
        SyntheticSettings(**{name: value})  # type: ignore[arg-type]


def test_settings_at_the_bounds_build_and_the_generator_takes_them() -> None:
    s = build(SyntheticSettings, "synthetic", {"synthetic": {
        "impressions": 5, "users": 10, "items": 10, "latent_dim": 1024, "new_user_share": 1.0, "base_ctr": 0.999,
        "zipf_exponent": 0.0, "late_click_share": 1.0, "duplicate_click_share": 0.0, "orphan_click_share": 1.0,
        "malformed_share": 0.99, "attribution_window_s": YEAR_S, "new_user_session_s": YEAR_S}}, {})
    assert len(build_synthetic(s, ClickDelay(), 1).impression_id) >= 5


def test_a_rate_past_its_bound_is_refused_as_a_rate_not_as_seconds() -> None:
    # impressions_per_s ends in "_s": the duration check called it "a finite number of seconds"
    with pytest.raises(ConfigError) as info:
        SyntheticSettings(impressions_per_s=1e9)
    assert "[synthetic] impressions_per_s must be a finite number > 0" in str(info.value)
    assert "seconds" not in str(info.value)
