"""The evaluation interval has a floor (``monitor.rules.MIN_INTERVAL_S``), checked in one place that the rules
file's ``interval_s``, ``streamrec monitor --interval`` and ``Monitor.run`` all go through: 1e-9 made the loop scrape
every source without pause."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from monitor.delivery import QueuedSink
from monitor.engine import Monitor
from monitor.rules import MIN_INTERVAL_S, RulesError, loads_rules
from monitor.scrape import Snapshot
from streamrec.cli import main

RULES = '[sources]\n[sinks]\nlog = false\n[[rule]]\nname = "x"\nexpr = "streamrec_x"\nop = ">"\nthreshold = 0\n'


@pytest.mark.parametrize("value", ["1e-9", "0.0999"])
def test_a_rules_file_interval_below_the_floor_is_refused(value: str) -> None:
    with pytest.raises(RulesError, match=rf'interval_s.*at least {MIN_INTERVAL_S:g}'):
        loads_rules(f"interval_s = {value}\n" + RULES)


def test_the_floor_itself_is_accepted() -> None:
    assert loads_rules(f"interval_s = {MIN_INTERVAL_S}\n" + RULES).interval_s == MIN_INTERVAL_S


def test_an_interval_flag_below_the_floor_is_exit_2_naming_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text("interval_s = 15\n" + RULES)
    assert main(["monitor", "--check", "--rules", str(rules), "--interval", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "--interval" in err and f"at least {MIN_INTERVAL_S:g}" in err and "Traceback" not in err


def test_a_rules_file_interval_below_the_floor_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text("interval_s = 1e-9\n" + RULES)
    assert main(["monitor", "--check", "--rules", str(rules)]) == 2
    assert "interval_s" in capsys.readouterr().err


def test_every_way_to_set_the_interval_meets_the_same_floor() -> None:
    config = loads_rules(RULES)
    with pytest.raises(RulesError):
        dataclasses.replace(config, interval_s=1e-9)

    class Null:
        name, timeout_s, batch_max = "null", 1.0, 100

        def send(self, alerts: object, deadline: float | None = None) -> None:
            pass

        def close(self) -> None:
            pass

    mon = Monitor(config, QueuedSink(Null(), config.sinks), scrape=Snapshot)
    try:
        with pytest.raises(RulesError):
            mon.run(threading.Event(), interval_s=1e-9)
        assert mon.engine.evaluations == 0
    finally:
        mon.close(0)
