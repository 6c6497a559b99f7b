"""The monitor's run log: what it saw, for ``streamrec report``.

:class:`RunLog` (``[run_log]`` of the rules file) records what the monitor saw, for ``streamrec report``
(``monitor/report.py``): one JSON line per source and scrape with its ``streamrec_*`` samples, one per
evaluation with each rule's state, one per alert sent; bounded by rotation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from monitor.alerts import Alert
from monitor.rule_engine import RuleEngine, State
from monitor.rules import Rule, RunLogSettings
from monitor.scrape import Snapshot
from stream.errors import ConfigError
from stream.files import open_append_regular, open_regular
from stream.secrets import redact

log = logging.getLogger("streamrec.monitor")


def _json_value(v: float | None) -> float | str | None:
    """A sample value for JSON: non-finite values as Prometheus writes them ("NaN", "+Inf", "-Inf")."""
    if v is None or math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


_STATE_RANK = {State.INACTIVE: 0, State.RESOLVED: 1, State.PENDING: 2, State.FIRING: 3}


class RunLog:
    """What the monitor saw, appended as JSON lines (``monitor/recording.py`` reads them back)::

        {"kind": "start", "t": <unix s>, "sources": {name: url}, "interval_s", "rules": [name, ...],
         "rule_labels": {name: {label: value}}}
        {"kind": "scrape", "t", "source", "samples": [[name, {label: value}, value], ...]}   # streamrec_* only
        {"kind": "scrape_error", "t", "source", "error"}
        {"kind": "rules", "t", "states": {rule: "inactive" | "pending" | "firing" | "resolved"}}  # worst series
        {"kind": "alert", "t", "alert": <the alert's JSON, as the sinks send it>}

    ``rule_labels`` (each rule's own labels, added later) let a reader give an alert record an older monitor wrote
    without ``kind`` and ``fingerprint`` the identity this one gives it (:func:`monitor.alerts.legacy_identity`).
    Values that are not finite are the strings "NaN", "+Inf", "-Inf". Each record is flushed as written (a
    reader may follow the file). Past ``max_bytes`` the file is rotated (``path`` -> ``path.1`` -> ... up to
    ``keep``) and a new one starts with a fresh ``start`` line. A write that fails (disk full) is logged once
    and the record dropped: recording never stops monitoring. A rotation that fails (the directory
    removed, say) is tried again at the next write, which makes the directory again.
    """

    def __init__(self, settings: RunLogSettings, clock: Callable[[], float] = time.time) -> None:
        if settings.path is None:
            raise ValueError("RunLog needs [run_log] path")
        self.path, self.max_bytes, self.keep = Path(settings.path), settings.max_bytes, settings.keep
        self.clock = clock
        self.records = self.failures = self.rotations = 0
        self._start: dict[str, Any] = {}
        self._failing = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._open()  # closed by close()
        except OSError as exc:  # at start: a settings mistake (exit 2), not a traceback (a FIFO: a hang)
            raise ConfigError(f"[run_log] path {self.path}: cannot open it for appending: "
                              f"{exc.strerror or exc}") from None

    def _open(self) -> TextIO:
        """``path`` opened for appending, its last line ended first where it was cut (a monitor killed mid-write):
        the next record was glued to the cut one, and both were one unreadable line (a restart's ``start`` record
        lost)."""
        f = open_append_regular(self.path)
        try:
            self._end_cut_line(f)
        except BaseException:
            f.close()
            raise
        return f

    def _end_cut_line(self, f: TextIO) -> None:
        """End the last line of ``f`` (open for appending at :attr:`path`) where it was cut."""
        mine = os.fstat(f.fileno())
        try:  # the file the append goes to (one renamed away meanwhile, or not readable: left as it is)
            with open_regular(self.path) as (raw, st):
                if ((st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) and st.st_size
                        and raw.seek(st.st_size - 1) >= 0 and raw.read(1) != b"\n"):
                    f.write("\n")
        except OSError as exc:  # (a log the monitor may write but not read ran before; a rotation's rename)
            log.debug("run log %s: its last line not checked (%s)", self.path, exc)

    def start(self, sources: Mapping[str, str], interval_s: float, rules: Sequence[Rule]) -> None:
        # The sources as logs show them: a user:password in a url is written as *** (the file outlives the process
        # and is read by `streamrec report`; it held the password in clear)
        self._start = {"kind": "start", "sources": {name: redact(url) for name, url in sources.items()},
                       "interval_s": interval_s,
                       "rules": [r.name for r in rules], "rule_labels": {r.name: dict(r.labels) for r in rules}}
        self.write({**self._start, "t": self.clock()})

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        try:
            if self._file.closed:  # a rotation failed half way: start a file again
                self._reopen()
            elif self._failing:  # a write that failed (disk full) may have left part of its line: ended first, or
                self._file.flush()  # the next record was glued to it, one unreadable line
                self._end_cut_line(self._file)
            if self._file.tell() and self._file.tell() + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self.records += 1
            self._failing = False
        except OSError as exc:
            self.failures += 1
            if not self._failing:
                log.warning("run log %s: cannot write (%s); records are dropped until it can", self.path, exc)
            self._failing = True

    def _rotate(self) -> None:
        self._file.close()
        if self.keep <= 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self.rotations += 1
        self._reopen()

    def _reopen(self) -> None:
        """Open ``path`` (making its directory) and start it with the ``start`` line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._open()  # a FIFO put there since the start cannot hang the monitor
        if self._start:
            self._file.write(json.dumps({**self._start, "t": self.clock()}, separators=(",", ":")) + "\n")

    def scrape(self, now: float, snap: Snapshot) -> None:
        for source, samples in snap.raw.items():
            if source not in snap.errors:
                self.write({"kind": "scrape", "t": now, "source": source,
                            "samples": [[n, lb, _json_value(v)] for n, lb, v in samples]})
        for source, err in snap.errors.items():
            self.write({"kind": "scrape_error", "t": now, "source": source, "error": err})

    def evaluation(self, now: float, engine: RuleEngine, alerts: Sequence[Alert]) -> None:
        states: dict[str, str] = {}
        for rule in engine.rules:
            absent = engine.absent.get(rule.name)
            worst = max((st.state for st in [*engine.states[rule.name].values(), *([absent] if absent else [])]),
                        key=_STATE_RANK.__getitem__, default=State.INACTIVE)
            states[rule.name] = worst.value
        self.write({"kind": "rules", "t": now, "states": states})
        for a in alerts:
            self.write({"kind": "alert", "t": now, "alert": a.as_dict()})

    def close(self) -> None:
        """Close the file, never raising for it: a record whose write failed (disk full; counted in ``failures`` and
        said then) stays in the file's buffer, and closing flushes it once more. That failure escaped
        ``Monitor.close`` and ``streamrec monitor`` stopped with a traceback instead of its summary (the count of
        alerts left undelivered); the file is closed either way."""
        try:
            self._file.close()
        except OSError as exc:
            self.failures += 1
            log.warning("run log %s: its last records were not written at close (%s)", self.path, exc)
