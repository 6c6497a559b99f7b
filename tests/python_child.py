"""A Python program run as a child process of the tests, from the repository's root (so it imports this checkout's
packages): for what only a process can show, such as a signal's default action ending it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` run to its end; its status, stdout and stderr (text)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def last_json(done: subprocess.CompletedProcess[str]) -> Any:
    """The JSON object a child printed last on stdout (a command's ``--json`` summary)."""
    return json.loads(done.stdout.strip().splitlines()[-1])
