"""The click-delay distribution replays draw from (stream/replay/config.py, table.py): a nonsense setting (NaN, inf,
negative, beyond any attribution window) is a ConfigError naming it, before anything is loaded or sent; before, a
negative sigma was a traceback after the data set was read and NaN, inf or a huge median or sigma made every click
come 1 ms after its impression (the draws overflowed the cast to milliseconds), silently."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stream.errors import ConfigError
from stream.events import MAX_TS_MS
from stream.replay import movielens, synthetic
from stream.replay.config import ClickDelay, DelayKind, ReplaySettings, SyntheticSettings
from stream.replay.table import draw_click_delays_ms


@pytest.mark.parametrize(("name", "value"), [
    ("click_delay_sigma", -1.0), ("click_delay_sigma", float("nan")), ("click_delay_sigma", float("inf")),
    ("click_delay_sigma", 50.0), ("click_delay_median_s", 1e30),
])
def test_a_nonsense_click_delay_setting_is_a_config_error_naming_it(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\[replay\] {name} must be a finite number (of seconds )?>= 0"):
        ReplaySettings(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("median_s", "sigma"), [(30.0, float("nan")), (30.0, -0.5), (float("inf"), 1.0)])
def test_a_click_delay_built_directly_refuses_nonsense(median_s: float, sigma: float) -> None:
    with pytest.raises(ConfigError, match="click delay"):
        ClickDelay(DelayKind.LOGNORMAL, median_s, sigma)


def test_the_widest_click_delay_allowed_draws_long_delays_not_1_ms() -> None:
    """The far tail (a year's median, sigma 5) is clamped at the largest event time, not wrapped to 1 ms."""
    delays = draw_click_delays_ms(ClickDelay(DelayKind.LOGNORMAL, 365 * 86_400.0, 5.0), 10_000,
                                  np.random.Generator(np.random.PCG64(1)))
    assert delays.min() > 1 and delays.max() == MAX_TS_MS


def test_the_cli_exits_2_for_a_nonsense_click_delay(capsys: pytest.CaptureFixture[str]) -> None:
    from streamrec.cli import main

    rc = main(["replay", "--dataset", "synthetic", "--click-delay-sigma", "50", "--no-progress",
               "--bootstrap-servers", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "sigma" in err and "<= 5" in err and "Traceback" not in err


def test_every_source_keeps_its_clicks_within_the_last_event_time(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The longest delay a draw gives (MAX_TS_MS) added to an impression's time put the MovieLens and synthetic clicks
    past 2100 (a sixth of them at a year's median and sigma 5), events the decoder refuses; the event log clamped."""
    def longest(delay: ClickDelay, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, MAX_TS_MS, np.int64)

    monkeypatch.setattr(movielens, "draw_click_delays_ms", longest)
    monkeypatch.setattr(synthetic, "draw_click_delays_ms", longest)
    (tmp_path / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                                            "1\t10\t5\t881250949\n")
    (tmp_path / "ml-100k.user").write_text("user_id:token\tage:token\n1\t24\n")
    (tmp_path / "ml-100k.item").write_text("item_id:token\trelease_year:token\n10\t1995\n")
    monkeypatch.setattr(movielens.PackagedDataset, "locate", lambda self: tmp_path)
    ml = movielens.load_movielens("ml-100k", ClickDelay(), seed=1)
    syn = synthetic.build_synthetic(SyntheticSettings(impressions=200, users=10, items=10), ClickDelay(), 1)
    assert ml.n_clicks == 1 and syn.n_clicks > 0
    assert ml.click_ts.max() == syn.click_ts.max() == MAX_TS_MS
