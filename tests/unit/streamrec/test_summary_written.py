"""A command's summary is written when it is printed (``streamrec.commands.common.emit`` flushes): to a pipe or a file
it sat in stdout's buffer until the interpreter's exit, and a SIGTERM after the command put the process's own
dispositions back (the end of its StopsTaken, before main returned) killed the process with it unwritten. The child
here prints a summary to a pipe and is then killed by SIGTERM's default action."""

from __future__ import annotations

import json
import signal

import pytest

from tests.python_child import run_python

CHILD = """
import argparse, os, signal, sys
from streamrec.commands.common import emit, kv_lines

emit(argparse.Namespace(json=sys.argv[1] == "json"), {"samples": 7, "reason": "input idle"},
     lambda d: "join summary\\n" + kv_lines(d))
os.kill(os.getpid(), signal.SIGTERM)  # the process's own: its default action ends it at once
"""


@pytest.mark.parametrize("form", ["json", "human"])
def test_a_summary_printed_before_a_sigterm_kills_the_process_reaches_the_pipe(form: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # stdout buffered, as a supervisor or a shell's pipe has it
    done = run_python(CHILD, form)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    if form == "json":
        assert json.loads(done.stdout) == {"samples": 7, "reason": "input idle"}
    else:
        assert done.stdout.startswith("join summary\n") and "samples: 7" in done.stdout
