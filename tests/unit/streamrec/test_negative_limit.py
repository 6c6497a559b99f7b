"""A negative --limit is refused (exit 2): sliced as order[:limit] it meant "all but the last N"."""

from __future__ import annotations

import numpy as np
import pytest

from learner.evaluation.ratings import Ratings
from stream.errors import ConfigError
from stream.replay.config import ReplaySettings
from streamrec.cli import build_parser
from streamrec.settings import SettingsError, build


@pytest.mark.parametrize("argv", [["evaluate", "--protocol", "online", "--limit", "-5"],
                                  ["replay", "--dataset", "ml-100k", "--limit", "-5"]])
def test_a_negative_limit_flag_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # parsed only: the command itself never runs
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and "--limit: expected an integer >= 0, got '-5'" in capsys.readouterr().err


def test_a_negative_replay_limit_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"\[replay\] limit must be an integer >= 0, got -"):
        ReplaySettings(limit=-1)
    with pytest.raises(SettingsError, match=r"\[replay\] limit must be an integer >= 0, got -"):
        build(ReplaySettings, "replay", environ={"STREAMREC_REPLAY_LIMIT": "-5"})
    assert ReplaySettings(limit=0).limit == 0


def test_ratings_refuse_a_negative_limit_instead_of_dropping_the_last_rows() -> None:
    ids = np.array([1, 2, 3])
    assert len(Ratings.from_raw(ids, ids, np.array([5, 1, 4]), np.array([3, 1, 2]), {}, {}, limit=2).rating) == 2
    with pytest.raises(ConfigError, match="--limit must be >= 0, got -1"):
        Ratings.from_raw(ids, ids, np.array([5, 1, 4]), np.array([3, 1, 2]), {}, {}, limit=-1)
