"""``streamrec counts top`` says a bad ``--days`` or ``--k`` (exit 2) before it asks Redis anything. Without ``--day``
it read the latest day first, so with Redis down the operator was told only "Redis ... cannot be reached" (exit 1),
and learned of the mistake after fixing Redis."""

from __future__ import annotations

import pytest

from streamrec.cli import main

DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1: the connection is refused


@pytest.mark.parametrize(("flag", "value"), [("--days", "0"), ("--k", "-1"), ("--k", "0")])
def test_a_bad_window_or_k_is_a_usage_error_even_with_redis_down(flag: str, value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["counts", "top", "--kind", "item", flag, value, "--redis-url", DOWN]) == 2
    err = capsys.readouterr().err
    assert f"argument '{flag[2:]}': got {value}, expected an integer >= 1" in err and "Redis" not in err


def test_good_flags_with_redis_down_still_say_redis_cannot_be_reached(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["counts", "top", "--kind", "item", "--k", "3", "--redis-url", DOWN]) == 1
    assert "cannot be reached" in capsys.readouterr().err
