"""The firing-state file: the firing, pending and absent series carried over a restart (``state_path`` of the
rules file).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monitor.alerts import Severity
from monitor.rule_engine import ABSENT_LABELS
from stream.errors import ConfigError
from stream.files import MAX_STATE_FILE_BYTES, describe_os_error, read_regular, write_atomic
from stream.lock_file import LockHeld, hold_lock, release_lock

log = logging.getLogger("streamrec.monitor")


class FiringStateFile:
    """``state_path`` of the rules file: the firing series (:meth:`~monitor.rule_engine.RuleEngine.firing`) as JSON,
    rewritten atomically after every evaluation that sent an alert and at close, read back at start. Without it a
    restart forgets what was firing: an alert whose condition cleared while the monitor was down never
    resolves, and one still holding fires again only after ``for_s``. :class:`~monitor.engine.Monitor` also keeps here,
    as firing, the series whose resolved alert some sink has not delivered yet (still queued at shutdown, or
    when the monitor is killed), rewriting the file once they are delivered: the restarted monitor resolves
    them again rather than leave the receiver showing them firing for ever. A file that cannot be read or written
    is logged and monitoring goes on (a write is tried again at the next change); so is one that is not a regular file
    (a FIFO there hung the monitor's start) or holds more than :data:`~stream.files.MAX_STATE_FILE_BYTES`.

    Version 2 marks a rule's absence alert ``"absent": true``; version 1 knew it by its labels
    ``{"absent": "true"}`` alone (no series with those labels was ever evaluated then, so such a record of a
    version 1 file is an absence alert, and is read as one). A record's ``labels`` are the series' own (without
    the rule's labels) and its ``fingerprint`` that of its alerts, for a reader of the file to match them; it was
    added to version 2 later, and is not read back: restore computes it from the rule, ``absent`` and the labels,
    so a file written before it was added restores the same identities.

    ``pending`` (:meth:`~monitor.rule_engine.RuleEngine.pending`) was also added to version 2 later, the pending series,
    so a monitor restarted more often than a rule's ``for_s`` (a crash loop, frequent deploys) still fires it
    (:meth:`~monitor.rule_engine.RuleEngine.restore_pending`): the file is then rewritten after every evaluation while a
    series is pending (``held``, when each last held, moves on). Not a version 3: a file without it (an older monitor's)
    is read as having none, in silence, and an older monitor reading a newer file ignores it and keeps its firing
    records, where an unknown version would have dropped them. ``no_data``
    (:meth:`~monitor.rule_engine.RuleEngine.no_data`), the absence timers still running, was added the same way and for
    the same reason (``absent_for_s``, :meth:`~monitor.rule_engine.RuleEngine.restore_no_data`). The timers and the
    firing absence alerts' records also carry, where a restart cut the monitor's outage out of their time,
    ``down_s``/``restarts``/``down_from``/``down_to`` (:class:`~monitor.rule_engine.Outages`), and a firing absence
    alert's record ``held`` and ``counted_s``, so the restored alert's text says what it counted and what it did not; a
    record without them (an older monitor's) restores as before. A firing series' record also carries ``held`` (when its
    condition last held, wall-clock seconds), so ``keep_firing_for_s`` counts on across the restart (an older monitor's
    record without it resolves at the first evaluation that does not hold, as before)."""

    VERSION = 2

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failures = 0
        self.failing = False  # the last write failed: write again at the next evaluation
        self.left_out: frozenset[tuple[str, int]] = frozenset()  # the records (kind, hash) the last write left out
        # to stay readable: logged when one is not among them, so each record left out is said once
        self.lock_path = path.with_name(path.name + ".lock")
        self._lock: int | None = None

    def hold(self) -> None:
        """Take :attr:`lock_path` (``<state_path>.lock``, :func:`~stream.lock_file.hold_lock`) for this monitor until
        :meth:`release`: a :class:`ConfigError` naming the other monitor's pid and the file when one holds it (two
        monitors on one state file both sent every alert and each overwrote the other's records); a lock that cannot
        be taken (its directory not writable) is logged, as a file that cannot be written is."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = hold_lock(self.lock_path, "monitor on this state file", log)
        except LockHeld as exc:
            raise ConfigError(f"state file {self.path} is in use by another monitor (pid {exc.holder}, holding "
                              f"{self.lock_path}): stop it first, or give this one its own state_path") from None
        except OSError as exc:  # as a file that cannot be written: logged, and monitoring goes on
            log.error("state file %s: cannot take its lock %s (%s); a second monitor on it is not detected",
                      self.path, self.lock_path, describe_os_error(exc))

    def release(self) -> None:
        """Give back what :meth:`hold` took (nothing where it took nothing)."""
        release_lock(self._lock)
        self._lock = None

    def load(self) -> list[dict[str, Any]]:
        """The firing records (:meth:`read`'s first part)."""
        return self.read()[0]

    def read(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """The firing and the pending records and the absence timers; none of any where the file is not one this
        monitor reads."""
        try:
            data = json.loads(read_regular(self.path, MAX_STATE_FILE_BYTES, "a firing-state file"))
        except FileNotFoundError:
            return [], [], []
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply ("[[[[...")
            log.error("state file %s: cannot read it (%s); alerts firing before this start will not resolve",
                      self.path, exc)
            return [], [], []
        version = data.get("version", 1) if isinstance(data, dict) else 1
        if type(version) is not int or not 1 <= version <= self.VERSION:  # true == 1; a newer writer's records
            log.error("state file %s: version %.40r, not one this monitor reads (1 to %d); alerts firing before this "
                      "start may not resolve", self.path, version, self.VERSION)
            return [], [], []
        firing = data.get("firing") if isinstance(data, dict) else None
        good = [r for r in firing if self._valid(r)] if isinstance(firing, list) else []
        if version == 1:
            good = [{**r, "absent": True} if r["labels"] == dict(ABSENT_LABELS) else r for r in good]
        if not isinstance(firing, list) or len(good) < len(firing):
            log.error("state file %s: %s; alerts firing before this start may not resolve", self.path,
                      "not a firing-state file" if not isinstance(firing, list)
                      else f"{len(firing) - len(good)} malformed record(s) skipped")
        if not isinstance(data, dict):
            return good, [], []
        return good, self._pending(data), self._no_data(data)

    def _pending(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """The valid pending records of ``data``; a malformed one is logged as a warning and skipped (its series
        only waits a full ``for_s`` again)."""
        pending = data.get("pending", [])
        good = [r for r in pending if self._valid(r) and self._number(r.get("held"), finite=True)
                and r.get("absent", False) is False and isinstance(r.get("condition"), str)] \
            if isinstance(pending, list) else []
        if not isinstance(pending, list) or len(good) < len(pending):
            log.warning("state file %s: %s pending record(s) malformed, skipped: their rules' for_s starts over",
                        self.path, len(pending) - len(good) if isinstance(pending, list) else "all")
        return good

    def _no_data(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """The valid absence timers of ``data``; a malformed one is logged as a warning and skipped (its rule only
        waits a full ``absent_for_s`` again)."""
        timers = data.get("no_data", [])
        good = [r for r in timers if isinstance(r, dict) and isinstance(r.get("rule"), str)
                and isinstance(r.get("expr"), str) and self._number(r.get("since"), finite=True)
                and self._number(r.get("held"), finite=True) and self._outages(r)] if isinstance(timers, list) else []
        if not isinstance(timers, list) or len(good) < len(timers):
            log.warning("state file %s: %s absence timer(s) malformed, skipped: their rules' absent_for_s starts over",
                        self.path, len(timers) - len(good) if isinstance(timers, list) else "all")
        return good

    @staticmethod
    def _valid(r: Any) -> bool:
        return (isinstance(r, dict) and isinstance(r.get("rule"), str) and isinstance(r.get("labels"), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in r["labels"].items())
                and FiringStateFile._number(r.get("since"), finite=True)
                and (r.get("value") is None or r["value"] in ("NaN", "+Inf", "-Inf")
                     or FiringStateFile._number(r["value"], finite=False))
                and isinstance(r.get("sources", []), list) and all(isinstance(x, str) for x in r.get("sources", []))
                and isinstance(r.get("absent", False), bool) and isinstance(r.get("fingerprint", ""), str)
                and isinstance(sev := r.get("severity", Severity.WARNING.value), str)
                and sev in {s.value for s in Severity}
                and (r.get("threshold") is None or r["threshold"] in ("NaN", "+Inf", "-Inf")
                     or FiringStateFile._number(r["threshold"], finite=False))
                and isinstance(r.get("rule_labels", {}), dict) and FiringStateFile._outages(r)
                and all(FiringStateFile._number(r[k], finite=True) for k in ("held", "counted_s") if k in r)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in r.get("rule_labels", {}).items()))

    @staticmethod
    def _outages(r: Mapping[str, Any]) -> bool:
        """Whether the outages of a record (:meth:`~monitor.rule_engine.Outages.as_record`) are none or whole: a count
        of restarts and finite times."""
        if "restarts" not in r:
            return True
        n = r["restarts"]
        return (type(n) is int and n >= 1
                and all(FiringStateFile._number(r.get(k), finite=True) for k in ("down_s", "down_from", "down_to")))

    @staticmethod
    def _number(v: Any, finite: bool) -> bool:
        """Whether ``v`` is a JSON number that reads as a float (an integer of 400 digits does not: restore
        would raise OverflowError), and a finite one where ``finite`` (JSON's -Infinity as ``since`` would make
        every later write of the file fail)."""
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        try:
            return math.isfinite(float(v)) or not finite
        except OverflowError:
            return False

    def save(self, firing: Sequence[Mapping[str, Any]], pending: Sequence[Mapping[str, Any]] = (),
             no_data: Sequence[Mapping[str, Any]] = ()) -> None:
        data = self._encode({"firing": list(firing), "pending": list(pending), "no_data": list(no_data)})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, data)
            self.failing = False
        except OSError as exc:
            self.failures += 1
            if not self.failing:
                log.error("state file %s: cannot write it (%s); a restart now would forget what is firing",
                          self.path, exc)
            self.failing = True

    def _encode(self, parts: dict[str, list[Mapping[str, Any]]]) -> bytes:
        """The file's bytes, at most :data:`~stream.files.MAX_STATE_FILE_BYTES`, which :meth:`read` refuses beyond:
        past it the largest records are left out, logged (each record once while it stays left out). A series with a
        scraped label value of megabytes (JSON writes a 3-byte character as 6) made the monitor write a file its next
        start refused whole: every alert firing before the restart, that one's and all the others', never
        resolved."""
        data = json.dumps({"version": self.VERSION, **parts}, allow_nan=False).encode()
        if len(data) <= MAX_STATE_FILE_BYTES:
            self.left_out = frozenset()
            return data
        sized = sorted(((len(json.dumps(r).encode()), kind, i) for kind, records in parts.items()
                        for i, r in enumerate(records)), reverse=True)
        over, left_out = len(data) - MAX_STATE_FILE_BYTES, set()
        for size, kind, i in sized:  # leaving one out saves its size, and the ", " before it where there is one
            if over <= 0:
                break
            left_out.add((kind, i))
            over -= size
        kept = {kind: [r for i, r in enumerate(records) if (kind, i) not in left_out]
                for kind, records in parts.items()}
        # a record's identity: its kind, rule and labels (its since and value change with each write)
        ids = frozenset((kind, hash((str(parts[kind][i].get("rule")), json.dumps(parts[kind][i].get("labels"),
                                                                                  sort_keys=True))))
                        for kind, i in left_out)
        if not ids <= self.left_out:  # (a record of another alert left out too: said, not only the first ones)
            rules = sorted({str(parts[kind][i].get("rule")) for kind, i in left_out})
            log.error("state file %s: %d bytes, more than the %d a start reads; the %d largest record(s) (rules %s) "
                      "are left out of it: after a restart their alerts may not resolve, nor their timers count on",
                      self.path, len(data), MAX_STATE_FILE_BYTES, len(left_out), ", ".join(rules)[:500])
        self.left_out = ids
        return json.dumps({"version": self.VERSION, **kept}, allow_nan=False).encode()
