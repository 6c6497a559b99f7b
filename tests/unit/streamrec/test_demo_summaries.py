"""How the demo script (``streamrec/demo.sh``) reads a finished stage's ``--json`` summary to decide whether to go on:
its ``halt_on_signal`` and ``digest`` functions run alone, on summary files written here (the whole demo takes a
stack and minutes; tests/integration/test_demo_smoke.py runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[3] / "streamrec" / "demo.sh"


def _after_stage(stage: str, rc: int, summary: Path) -> subprocess.CompletedProcess[str]:
    """The demo's check of ``stage`` ended with exit status ``rc`` and its summary at ``summary``, then ``went on``
    printed when the demo would go on to the next step."""
    script = DEMO.read_text()
    functions = script[script.index("halt_on_signal() {"):script.index("\nif [[ ${DEMO_STACK")]
    return subprocess.run(["bash", "-c", f'set -euo pipefail\nPY="$1"\n{functions}\nhalt_on_signal "$2" "$3" "$4"\n'
                           "echo went on", "check", sys.executable, stage, str(rc), str(summary)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content", [None, "", "\n", "not json\n", '{"group": "g", "events": 3, "sam', "[]\n"],
                         ids=["missing", "empty", "blank", "not-json", "cut-short", "not-an-object"])
def test_a_stage_that_left_no_readable_summary_stops_the_demo_naming_the_stage_and_the_file(
        content: str | None, tmp_path: Path) -> None:
    """A stage killed while writing its summary, or one on a full disk, exits 0 with no summary to read: the signal
    check's ``json.load`` failed and counted that as a stage that ended well, and only the summary line after it
    stopped the demo, with a Python traceback. Now a message naming the stage and the file, exit 1."""
    summary = tmp_path / "join.json"
    if content is not None:
        summary.write_text(content)
    out = _after_stage("joiner", 0, summary)
    assert out.returncode == 1 and "went on" not in out.stdout, out.stderr
    assert f"demo: the joiner left no summary to read in {summary}: stopping here" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_signal_reason_after_other_lines_in_the_summary_stops_the_demo(tmp_path: Path) -> None:
    """The summary is the last JSON object of its file (monitor.recording.read_summaries, which the summary line used):
    with a line before it, the signal check's ``json.load`` failed, missed ``"reason": "signal"``, and the demo went
    on to refresh and serve what the stopped learner had half trained."""
    summary = tmp_path / "train.json"
    summary.write_text('a line a library printed\n{"samples_trained": 10, "steps": 1, "reason": "signal"}\n')
    out = _after_stage("learner", 0, summary)
    assert out.returncode == 1 and "went on" not in out.stdout, out.stderr
    assert "demo: the learner was stopped by a signal" in out.stderr and str(summary) in out.stderr


def test_a_stage_that_ended_well_shows_its_summary_line_and_the_demo_goes_on(tmp_path: Path) -> None:
    summary = tmp_path / "join.json"
    summary.write_text('{"group": "g", "events": 3, "samples": 2, "reason": "input idle"}\n')
    out = _after_stage("joiner", 0, summary)
    assert out.returncode == 0 and out.stdout == "went on\n", out.stderr
    assert "  join: group g, events 3, samples 2" in out.stderr
