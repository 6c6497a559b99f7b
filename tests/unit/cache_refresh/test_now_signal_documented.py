"""``streamrec refresh --now`` ends a run on SIGTERM/SIGINT as a failed run (cache_refresh/job.py ``run_now``: staged
files removed, nothing published, a refresh_failed alert, exit 1); the command's ``--help`` and README's "Nightly
refresh" section say so. Before, neither did: an operator's Ctrl-C looked like it should just stop the process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrec.cli import main

ROOT = Path(__file__).resolve().parents[3]
SAYS_IT = re.compile(r"--now.{0,200}SIGTERM.{0,40}SIGINT.{0,200}failed run.{0,200}exit(?:s)? 1"
                     r"|SIGTERM.{0,40}SIGINT.{0,200}--now.{0,200}failed run.{0,200}exit(?:s)? 1")


def test_refresh_help_says_a_signal_ends_a_now_run_as_a_failed_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["refresh", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert SAYS_IT.search(text), text


def test_readme_refresh_section_says_a_signal_ends_a_now_run_as_a_failed_run() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Nightly refresh (`streamrec refresh`)", 1)[1].split("\n## ", 1)[0]
    assert SAYS_IT.search(" ".join(section.split())), "README's refresh section does not say it"
