"""What a run recorded, read back: the monitor's run log (:class:`Recording`, :func:`read_recording`) and what the
batch stages wrote themselves (their ``--json`` summaries, the learner's delta files; the publish root's
``last_run.json`` is read by ``cache_refresh.run_records.read_last_run`` and only checked here,
:func:`usable_last_run`). Used by the report (``monitor/report.py``) and its progress lines (``monitor/follow.py``).

The records are read in the order the monitor wrote them (rotated files oldest first) and split into epochs where the
wall clock stepped back (``t`` below the record's before, whatever either record is: :attr:`Recording.epoch`).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stream.files import open_regular, read_tail

Sample = tuple[str, dict[str, str], float]


class ReportError(ValueError):
    """A run log or summary that cannot be read, or matplotlib missing; the message says which and why."""


# -- reading ------------------------------------------------------------------------------------------------
def sample_value(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:  # an integer of 400 digits: beyond any float
            return math.inf if v > 0 else -math.inf
    return {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}.get(v, math.nan) if isinstance(v, str) \
        else math.nan


MAX_T = dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc).timestamp()  # the last time a date can show


@dataclass
class Recording:
    """A run log read back: per source its scrapes ``(t, samples, epoch)`` in the order the monitor wrote them, the
    rules' states ``(t, states, epoch)``, the alerts. :attr:`epoch` counts the wall clock's steps back over every
    record read but ``start`` (a scrape, a failed one, the rules' states, an alert): a step while a source did not
    answer split its scrapes nowhere (110 -> 115 read as 5 s where 35 had passed). A ``start`` line is left out: one
    that begins a rotated file is stamped at the rotation, after the ``now`` of the record written right after it
    (:class:`RunLog <monitor.run_log.RunLog>`). With :attr:`keep`, a scrape keeps the samples of those metrics only
    (every scrape is kept, its time and source counted, however few of its samples are)."""

    scrapes: dict[str, list[tuple[float, list[Sample], int]]] = field(default_factory=dict)
    errors: list[tuple[float, str, str]] = field(default_factory=list)
    rule_states: list[tuple[float, dict[str, str], int]] = field(default_factory=list)
    alerts: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bad_lines: int = 0
    epoch: int = 0  # of the last record read
    last_t: float = -math.inf  # its t
    # the metrics whose samples are kept (None: all): :func:`~monitor.sections.metrics_read`
    keep: frozenset[str] | None = None
    _shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)  # _sample(): one copy each

    @property
    def t0(self) -> float | None:
        ts = [s["t"] for s in self.starts] + [t for sc in self.scrapes.values() for t, _, _ in sc]
        return min(ts) if ts else None

    @property
    def t_end(self) -> float | None:
        ts = [t for sc in self.scrapes.values() for t, _, _ in sc] + [t for t, _, _ in self.rule_states]
        return max(ts) if ts else None

    def add(self, rec: Mapping[str, Any]) -> None:
        kind, t = rec.get("kind"), rec.get("t")
        if not isinstance(t, int | float) or not 0 <= t <= MAX_T:  # NaN, Infinity, 1e13: no date to show
            self.bad_lines += 1
            return
        if kind in ("scrape", "scrape_error", "rules", "alert"):
            self.epoch, self.last_t = self.epoch + (t < self.last_t), t
        if kind == "scrape" and isinstance(rec.get("samples"), list):
            samples = [self._sample(s) for s in rec["samples"]  # labels are strings: others broke every series()
                       if isinstance(s, list) and len(s) == 3 and (self.keep is None or str(s[0]) in self.keep)
                       and isinstance(s[1], dict) and all(isinstance(v, str) for v in s[1].values())]
            self.scrapes.setdefault(str(rec.get("source")), []).append((float(t), samples, self.epoch))
        elif kind == "scrape_error":
            self.errors.append((float(t), str(rec.get("source")), str(rec.get("error"))))
        elif kind == "rules" and isinstance(rec.get("states"), dict):
            self.rule_states.append((float(t), {str(k): str(v) for k, v in rec["states"].items()}, self.epoch))
        elif kind == "alert" and isinstance(rec.get("alert"), dict):
            self.alerts.append((float(t), rec["alert"]))
        elif kind == "start":
            self.starts.append(dict(rec))
        else:
            self.bad_lines += 1

    def kept(self, name: str) -> str:
        """``name``, whose samples this recording kept; a LookupError where the read left them out: a section that
        reads a metric it does not declare (:func:`~monitor.sections.reads`) would say "not recorded" of a metric the
        run log holds."""
        if self.keep is not None and name not in self.keep:
            raise LookupError(f"{name}: not kept when the run log was read; declare it in its section's @reads(...)")
        return name

    def _sample(self, s: list[Any]) -> Sample:
        """One recorded sample, its name and label set shared with every scrape that recorded the same: a run log
        repeats them in every scrape, and a copy of each per sample (a dict and its strings) made a 27 MiB log cost
        ~6x its size in memory (``python bench/report_memory.py``). The label dicts are read, never changed."""
        name, labels = str(s[0]), tuple(s[1].items())
        name = self._shared.setdefault(name, name)
        return name, self._shared.setdefault(labels, dict(labels)), sample_value(s[2])

    def identify_alerts(self) -> None:
        """Give every alert its ``kind`` and ``fingerprint`` as the monitor now does: an older monitor wrote alerts
        without them, and one fingerprint of all their labels (which carry the rule's) split an alert fired before
        an upgrade and resolved after it into two. Its rule's labels are those of the first ``start`` record that
        lists them (the monitor started after the upgrade, nearest the older records); a rule none lists reads its
        alerts' labels whole (right for a rule without labels). See :func:`monitor.alerts.legacy_identity`."""
        from monitor.alerts import AlertKind, legacy_identity

        rule_labels: dict[str, dict[str, str]] = {}
        for st in self.starts:
            known = st.get("rule_labels")
            for name, lb in (known.items() if isinstance(known, dict) else ()):
                if isinstance(lb, dict) and name not in rule_labels:
                    rule_labels[str(name)] = {str(k): str(v) for k, v in lb.items()}
        for i, (t, a) in enumerate(self.alerts):
            lb = a.get("labels")
            labels = {str(k): str(v) for k, v in lb.items()} if isinstance(lb, dict) else {}
            kind = AlertKind(a["kind"]) if a.get("kind") in ("series", "absent") else None
            if isinstance(a.get("fingerprint"), str) and a["fingerprint"]:
                fp = a["fingerprint"]
            else:
                kind, fp = legacy_identity(str(a.get("rule")), labels, rule_labels.get(str(a.get("rule"))), kind)
            self.alerts[i] = (t, {**a, "labels": labels, "kind": (kind or AlertKind.SERIES).value, "fingerprint": fp})


def run_log_files(path: Path) -> list[Path]:
    """``path`` and its rotated predecessors, oldest first (``path.3``, ``path.2``, ``path.1``, ``path``)."""
    rotated = sorted((p for p in path.parent.glob(path.name + ".*") if re.fullmatch(r"\.[0-9]+", p.suffix)),
                     key=lambda p: -int(p.suffix[1:]))
    return [*rotated, *([path] if path.exists() else [])]


def read_recording(path: str | Path, keep: frozenset[str] | None = None) -> Recording:
    """The run log ``path`` with its rotated predecessors, read line by line (a run log holds up to ``keep`` times
    ``max_bytes``: it is streamed, not bounded), keeping the samples of the metrics in ``keep`` (all where None). Each
    file is opened with :func:`~stream.files.open_regular`: one that is a FIFO or a device is refused unread
    (``NotRegularFile``, an OSError naming it), where a FIFO hung the report and ``/dev/zero`` was read until memory
    ran out."""
    path = Path(path)
    files = run_log_files(path)
    if not files:
        raise ReportError(f"run log {path}: no such file (the monitor writes it with [run_log] path = ... in its "
                          "rules file)")
    rec = Recording(files=[str(p) for p in files], keep=keep)
    for p in files:
        with open_regular(p) as (raw, _), io.TextIOWrapper(io.BufferedReader(raw), "utf-8", "replace") as f:
            for line in f:
                try:
                    obj = parse_record(line)
                except (ValueError, RecursionError):  # a line cut by a crash, say; "[[[[..." nested too deeply
                    rec.bad_lines += 1
                    continue
                if isinstance(obj, dict):
                    rec.add(obj)
                else:
                    rec.bad_lines += 1
    rec.identify_alerts()
    return rec


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_record(line: str) -> Any:
    """One line of JSON (a run-log record, a summary, last_run.json) parsed; a ValueError where it is not JSON, or holds
    a lone surrogate escape ("\\ud800"): no UTF-8 text holds one (the monitor refuses a label that is not UTF-8), and it
    crashed the alerts' fingerprints and the page's encoding."""
    obj = json.loads(line)
    if _SURROGATE_ESCAPE.search(line):  # a candidate (or an escaped backslash before "ud8..."): checked exactly
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError is a ValueError
    return obj


STAGE_KEYS = {"replay": ("dataset", "acked"), "join": ("group", "driver"), "train": ("samples_trained", "served"),
              "refresh": ("published",), "monitor": ("evaluations",)}


def stage_of(summary: Mapping[str, Any], name: str = "") -> str | None:
    """Which stage wrote a ``--json`` summary: its file name when that names a stage, else its keys."""
    stem = Path(name).stem.split("-")[0].split(".")[0]
    if stem in STAGE_KEYS:
        return stem
    return next((s for s, keys in STAGE_KEYS.items() if all(k in summary for k in keys)), None)


# How much of the end of a summary file is read: a ``--json`` summary is its last line, a few KiB; a file with a long
# log before it (stderr captured into it) is read from this far before its end, not whole.
SUMMARY_TAIL_BYTES = 64 << 20


def read_summaries(paths: Iterable[str | Path]) -> dict[str, dict[str, Any]]:
    """Stage -> its summary (the last JSON object in each file, as ``--json`` prints one), looked for in the last
    :data:`SUMMARY_TAIL_BYTES` of the file."""
    out: dict[str, dict[str, Any]] = {}
    for p in paths:
        text = read_tail(Path(p), SUMMARY_TAIL_BYTES).strip()
        obj = None
        for line in reversed(text.splitlines()):
            try:
                obj = parse_record(line)
                break
            except (ValueError, RecursionError):
                continue
        if not isinstance(obj, dict):
            raise ReportError(f"summary {p}: no JSON object in it (write it with the stage's --json)")
        stage = stage_of(obj, str(p))
        if stage is None:
            raise ReportError(f"summary {p}: not the --json summary of replay, join, train, refresh or monitor")
        out[stage] = obj
    return out


def usable_last_run(record: Mapping[str, Any]) -> dict[str, Any]:
    """The refresh's ``<publish_root>/last_run.json`` record as the report shows it (read by its one reader,
    ``cache_refresh.run_records.read_last_run``, which the command passes in): ``{}`` where it holds text that is no
    UTF-8 (a lone surrogate escape, "\\ud800"), as :func:`parse_record` refuses a run-log line: it crashed the page's
    encoding."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError is a ValueError
    except (ValueError, TypeError, RecursionError):
        return {}
    return dict(record)


def read_deltas(directory: str | Path | None) -> list[tuple[float, int, int]]:
    """The learner's delta files (``delta-<seq>-<samples>.delta``, learner/deltas.py): (written, seq, samples
    trained), by the file's modification time; nothing is opened."""
    if directory is None or not Path(directory).is_dir():
        return []
    out = []
    for p in Path(directory).glob("delta-*.delta"):
        m = re.fullmatch(r"delta-(\d+)-(\d+)\.delta", p.name)
        if m:
            try:
                out.append((p.stat().st_mtime, int(m.group(1)), int(m.group(2))))
            except OSError:
                continue
    return sorted(out)


def date_of(t: float) -> dt.datetime | None:
    """Unix seconds as a UTC date; None for 0 or less (not set yet) and for what no date can be (NaN, +Inf, 1e300:
    metric values, which a scraped process sets)."""
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc) if 0 < t <= MAX_T else None
