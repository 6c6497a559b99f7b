"""``python -m serving.cpp_request``'s request file is read with ``stream.files.read_regular``: a FIFO (or a device)
named as the file is a usage error (exit 2) naming it, where a blocking open of an unfed FIFO hung the tool. The FIFO
here is fed a request by a writer thread (``tests.fifos``), so the old code read it and fails on the assertion."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving import cpp_request
from tests.fifos import fed_fifo


def test_a_request_file_that_is_a_fifo_is_a_usage_error_naming_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with fed_fifo(tmp_path / "req.json", b'{"user_id": "a", "items": [1]}') as path, \
            pytest.raises(SystemExit) as exit_:
        cpp_request.main([str(tmp_path / "no-version"), str(path), str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"request file {path}" in err and "not a regular file" in err
