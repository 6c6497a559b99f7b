"""``python -m streamrec`` runs the command line, as the ``streamrec`` console script does: it said "No module named
streamrec.__main__; 'streamrec' is a package and cannot be directly executed" (exit 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_python_dash_m_streamrec_prints_the_help_and_passes_on_the_exit_code() -> None:
    shown = subprocess.run([sys.executable, "-m", "streamrec", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and "usage: streamrec" in shown.stdout and "COMMAND" in shown.stdout
    refused = subprocess.run([sys.executable, "-m", "streamrec", "nosuch"], cwd=ROOT, capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "invalid choice: 'nosuch'" in refused.stderr
