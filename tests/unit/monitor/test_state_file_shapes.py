"""The firing-state file read back at start (monitor.state_file.FiringStateFile.load): any valid JSON that is not what
the monitor writes is logged and monitoring starts fresh, never a traceback nor records read under a version the
monitor does not know (a newer monitor's, or a ``version`` of another type: ``true`` compared equal to 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monitor.state_file import FiringStateFile

RECORD = {"rule": "r", "labels": {}, "since": 1.0, "value": 2.0}


@pytest.mark.parametrize("text", [
    "[]", "[1]", '"x"', "1", "null", "true", "{}", '{"firing": {}}', '{"firing": [[]]}', '{"firing": "ab"}',
    json.dumps({"version": 2, "firing": [{**RECORD, "value": [1]}]}),
    json.dumps({"version": 2, "firing": [{**RECORD, "threshold": {"a": 1}}]}),
    json.dumps({"version": 3, "firing": [RECORD]}), json.dumps({"version": "2", "firing": [RECORD]}),
    json.dumps({"version": True, "firing": [RECORD]}), json.dumps({"version": 2.0, "firing": [RECORD]}),
    json.dumps({"version": None, "firing": [RECORD]}), json.dumps({"version": 0, "firing": [RECORD]}),
])
def test_a_state_file_not_as_written_is_logged_and_read_as_empty(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    assert FiringStateFile(path).load() == []
    assert f"state file {path}" in caplog.text


@pytest.mark.parametrize("version", [1, 2])
def test_the_versions_it_writes_are_read(tmp_path: Path, version: int) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": version, "firing": [RECORD]}))
    assert FiringStateFile(path).load() == [RECORD]
