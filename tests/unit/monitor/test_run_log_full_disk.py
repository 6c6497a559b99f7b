"""The run log on a full disk: a record cut where the disk filled up is ended before the next record is written."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from monitor.recording import read_recording
from monitor.rules import RunLogSettings
from monitor.run_log import RunLog


class FullDisk:
    """The run log's file on a disk that fills up: while ``full``, a write gets its first 10 characters on disk, then
    ENOSPC (a write(2) that wrote part of its bytes, then none)."""

    def __init__(self, real: Any) -> None:
        self.real, self.full = real, False

    def write(self, text: str) -> int:
        if self.full:
            self.real.write(text[:10])
            self.real.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.real.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_the_first_record_after_a_full_disk_is_not_glued_to_the_one_it_cut(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    run_log = RunLog(RunLogSettings(path=path))
    disk = FullDisk(run_log._file)
    run_log._file = disk  # type: ignore[assignment]
    run_log.write({"kind": "rules", "t": 1.0, "states": {}})
    disk.full = True
    run_log.write({"kind": "rules", "t": 2.0, "states": {}})  # cut after 10 characters
    assert run_log.failures == 1
    disk.full = False  # space again
    run_log.write({"kind": "rules", "t": 3.0, "states": {}})
    run_log.close()
    rec = read_recording(path)
    assert rec.bad_lines == 1  # the cut one; was 2: the record at t=3 was glued to it, one unreadable line
    assert [line for line in path.read_text().splitlines() if line.endswith("}")] == [
        '{"kind":"rules","t":1.0,"states":{}}', '{"kind":"rules","t":3.0,"states":{}}']
