"""The demo script's own settings (``streamrec/demo.sh``), checked before anything runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[3] / "streamrec" / "demo.sh"


@pytest.mark.parametrize("interval", ["abc", "0", "-1", "1s", "0.0", " 1", "nan", "inf", "0x10", "1e400", "."])
def test_a_demo_interval_the_background_monitor_would_refuse_stops_the_demo_before_it_starts(
        interval: str, tmp_path: Path) -> None:
    """``DEMO_INTERVAL`` goes to ``streamrec monitor --interval``, which runs in the background: a value it refuses
    ended it at once, and the demo ran its minutes of replay, join and training before failing at the end (its
    ``kill`` of the monitor under ``set -e``). Now exit 2 naming the setting, before any step (``SR`` would fail)."""
    env = dict(os.environ, DEMO_INTERVAL=interval, DEMO_DIR=str(tmp_path / "run"), SR="false", PY="false")
    out = subprocess.run(["bash", str(DEMO)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and f"DEMO_INTERVAL must be a number of seconds > 0, got '{interval}'" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_fractional_demo_interval_is_accepted() -> None:
    check = DEMO.read_text().split("interval=${DEMO_INTERVAL:-1}\n", 1)[1].split("\nif ", 1)[0]
    for ok in ("0.5", "2", ".25", "5.", "1e1", "2.5E-1"):  # what the monitor's --interval (a float) takes
        assert subprocess.run(["bash", "-c", f"set -euo pipefail\ninterval={ok}\n{check}"], timeout=10).returncode == 0
