"""The operator report: one HTML file with plots of what the running system recorded (``streamrec report``).

Nothing in it is recomputed from the data: every curve is a metric the stages exported and the monitor
scraped into its run log (``[run_log]`` of the rules file, :class:`monitor.run_log.RunLog`), and every number
beside it comes from what the batch stages wrote themselves: the ``--json`` summaries of ``streamrec replay``,
``join``, ``train`` and ``refresh``, the publish root's ``last_run.json`` and the names and times of the
learner's delta files. Rates are the increase of a counter between two scrapes over the time between them,
and a gradient-norm quantile is read from the increase of the histogram's buckets between two scrapes (what
Prometheus' ``rate`` and ``histogram_quantile`` do); nothing else is derived.

Sections (:data:`SECTIONS`): served quality, cold vs warm users, throughput, lag, gradient norms, feature
coverage, memory, hot set and hit rate, freshness, dead letters, alerts. A section whose metrics are not in the
run log says so ("not recorded", naming the metrics and who exports them) instead of drawing an empty plot. Each
section declares the metrics it reads (:func:`reads`): the run log's other samples are not kept (:func:`read_run_log`).

The time axis of every plot is **wall-clock time** since the run log began: the learner exports no event time,
so "over event time" is only as good as the order the samples arrived in (event-time order in a replay). The
records are read in the order the monitor wrote them (rotated files oldest first) and split into epochs where the wall
clock stepped back (``t`` below the record's before, whatever either record is: :attr:`Recording.epoch`): no rate,
increase, histogram interval or average spans two, and every curve drawn over wall time (a metric, a rate, a quantile,
the joiner's watermark, a rule's state bars) breaks at each epoch (:func:`_point`, :func:`_segments`). A step forward
cannot be detected: the interval across it is read as if the monitor had paused.

Also :func:`follow`: a progress line per scrape of one source while a stage runs (``make demo``).

Pure parts (reading, series, rates, quantiles, the HTML) need the standard library and numpy; the plots need
matplotlib (``pip install 'streamrec[dev]'``), imported only when a report is written.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from monitor.cli_text import FOLLOW_TAIL_BYTES, utc_text
from monitor.expr import counter_rise
from stream.errors import StreamrecError
from stream.files import MAX_STATE_FILE_BYTES, NotRegularFile, open_regular, read_regular, read_tail, write_atomic

Sample = tuple[str, dict[str, str], float]
Series = tuple[list[float], list[float]]  # (t, value), t in unix seconds
Numbered = list[tuple[int, Series]]  # a curve's epochs, each with its number (Recording.epoch): series_numbered()
Curve = Series | Numbered  # a curve drawn: numbered, it breaks at every epoch; a Series, where its t drops
_T = TypeVar("_T")


class ReportError(ValueError):
    """A run log or summary that cannot be read, or matplotlib missing; the message says which and why."""


class FollowError(StreamrecError):
    """``--follow`` has nothing to follow: the process is not running, or the run log never appeared while it ran."""


# -- reading ------------------------------------------------------------------------------------------------
def _value(v: Any) -> float:
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
    keep: frozenset[str] | None = None  # the metrics whose samples are kept (None: all): :func:`metrics_read`
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
        reads a metric it does not declare (:func:`reads`) would say "not recorded" of a metric the run log holds."""
        if self.keep is not None and name not in self.keep:
            raise LookupError(f"{name}: not kept when the run log was read; declare it in its section's @reads(...)")
        return name

    def _sample(self, s: list[Any]) -> Sample:
        """One recorded sample, its name and label set shared with every scrape that recorded the same: a run log
        repeats them in every scrape, and a copy of each per sample (a dict and its strings) made a 27 MiB log cost
        ~6x its size in memory (``python bench/report_memory.py``). The label dicts are read, never changed."""
        name, labels = str(s[0]), tuple(s[1].items())
        name = self._shared.setdefault(name, name)
        return name, self._shared.setdefault(labels, dict(labels)), _value(s[2])

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


def read_run_log(path: str | Path, *, every_metric: bool = False) -> Recording:
    """The run log ``path`` with its rotated predecessors, read line by line (a run log holds up to ``keep`` times
    ``max_bytes``: it is streamed, not bounded), keeping the samples of the metrics some section reads
    (:func:`metrics_read`), or of ``every_metric``: ~70% of the ML-1M demo's samples were series no section draws
    (the per-field gradient norms, the time to admission), held in memory and scanned by every series read. Each file
    is opened with :func:`~stream.files.open_regular`: one that is a FIFO or a device is refused unread
    (``NotRegularFile``, an OSError naming it), where a FIFO hung the report and ``/dev/zero`` was read until memory
    ran out."""
    path = Path(path)
    files = run_log_files(path)
    if not files:
        raise ReportError(f"run log {path}: no such file (the monitor writes it with [run_log] path = ... in its "
                          "rules file)")
    rec = Recording(files=[str(p) for p in files], keep=None if every_metric else metrics_read())
    for p in files:
        with open_regular(p) as (raw, _), io.TextIOWrapper(io.BufferedReader(raw), "utf-8", "replace") as f:
            for line in f:
                try:
                    obj = _record(line)
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


def _record(line: str) -> Any:
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
                obj = _record(line)
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


def read_last_run(root: str | Path) -> dict[str, Any]:
    """``<publish_root>/last_run.json`` as the refresh wrote it (cache_refresh/job.py); ``{}`` when absent or not a
    regular file of at most :data:`~stream.files.MAX_STATE_FILE_BYTES`."""
    try:
        data = _record(read_regular(Path(root) / "last_run.json", MAX_STATE_FILE_BYTES, "a last-run record").decode())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


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


# -- series -------------------------------------------------------------------------------------------------
def _key(labels: Mapping[str, str], by: Sequence[str]) -> str:
    return "/".join(labels.get(k, "") for k in by)


def epochs(scrapes: Iterable[tuple[float, _T, int]]) -> Iterator[tuple[int, float, _T]]:
    """One source's scrapes, in the order the monitor wrote them, each with its epoch: a new one starts wherever ``t``
    drops below the record's before, of any kind (the wall clock stepped back: NTP, a restored VM;
    :class:`Recording`). Each epoch is read as a stretch of time of its own: no rate, increase, histogram interval or
    average spans two (sorted by ``t``, the scrapes from before and after a step were interleaved: 10/s read as 40/s).
    A step forward cannot be told from a monitor that paused: the interval across it is read at face value."""
    for t, x, epoch in scrapes:
        yield epoch, t, x


def series_numbered(rec: Recording, name: str, by: Sequence[str] = (), where: Mapping[str, str] | None = None,
                    agg: str = "sum", source: str | None = None) -> dict[str, Numbered]:
    """Per value of the ``by`` labels, the metric ``name`` at each scrape (``agg`` = sum or max over the other
    labels), one Series per :func:`epochs` of its source that holds it; ``where`` keeps the samples whose labels equal
    those given; of two scrapes of a source at one time (a clock that stood still for a cycle, or stepped back to the
    very time), both, in the order written: each is a value the process exported, and keyed by ``t`` (as the curves
    were before :func:`epochs`) a gauge's first was lost unseen. Every source unless ``source``; a value more than
    one source exported is one curve per source, keyed ``"<value> (<source>)"`` (their scrapes, at other times, were
    interleaved into one curve: two learner ranks' counters read as a sawtooth). Each Series comes with its epoch's
    number: a scrape is the (epoch, t) of its monitor cycle, the same at every source; ``t`` alone is not, once the
    clock stepped back."""
    out: dict[tuple[str, str], Numbered] = {}
    for src, e, t, k, _, v in _grouped(rec, name, by, where, agg, source):
        _point(out.setdefault((src, k), []), e, t, v)
    return dict(sorted(per_source(out).items()))


def _point(eps: Numbered, e: int, t: float, v: float) -> None:
    """``(t, v)`` appended to a curve's epochs, in epoch ``e`` (a new one where the last is another): every curve drawn
    over wall time is kept numbered so, and breaks at each epoch (:func:`_segments`)."""
    if not eps or eps[-1][0] != e:
        eps.append((e, ([], [])))
    eps[-1][1][0].append(t)
    eps[-1][1][1].append(v)


def series(rec: Recording, name: str, by: Sequence[str] = (), where: Mapping[str, str] | None = None,
           agg: str = "sum", source: str | None = None) -> dict[str, Series]:
    """:func:`series_numbered` with each curve's epochs one after the other (``t`` drops where one starts): for plots
    and gauges; a rate or an average is taken per epoch (:func:`counter_rates`, :func:`average_rate`)."""
    return {k: _flat(eps) for k, eps in series_numbered(rec, name, by, where, agg, source).items()}


def _flat(eps: Numbered) -> Series:
    """A curve's epochs one after the other."""
    return [t for _, (ts, _) in eps for t in ts], [v for _, (_, vs) in eps for v in vs]


def _grouped(rec: Recording, name: str, by: Sequence[str], where: Mapping[str, str] | None, agg: str, source: str | None
             ) -> Iterator[tuple[str, int, float, str, frozenset[tuple[tuple[str, str], ...]], float]]:
    """Per source, scrape (with its epoch) and value of the ``by`` labels: the label sets of ``name`` there and their
    sum (or max)."""
    rec.kept(name)
    for src, scrapes in rec.scrapes.items():
        if source is not None and src != source:
            continue
        for e, t, samples in epochs(scrapes):
            acc: dict[str, tuple[set[tuple[tuple[str, str], ...]], float]] = {}
            for n, lb, v in samples:
                if n != name or (where and any(lb.get(k) != val for k, val in where.items())):
                    continue
                k, one = _key(lb, by), tuple(sorted(lb.items()))
                if k not in acc:
                    acc[k] = ({one}, v)
                else:
                    acc[k][0].add(one)
                    acc[k] = (acc[k][0], max(acc[k][1], v) if agg == "max" else acc[k][1] + v)
            for k, (sets, v) in acc.items():
                yield src, e, t, k, frozenset(sets), v


def counter_rates_numbered(rec: Recording, name: str, by: Sequence[str] = (), where: Mapping[str, str] | None = None
                           ) -> dict[str, Numbered]:
    """:func:`rate` of the counter ``name`` summed per value of the ``by`` labels (curves named as :func:`series`
    names them), with no point between two scrapes whose label sets differ: a series missing from one scrape (a
    sample the monitor left out as stale) and back in the next made the sum drop and then rise by its whole count;
    nor between two :func:`epochs`. Each point in the epoch of its interval, for plots: flat, a rate before a step
    back seen only in other records and one after it were drawn as one line across it."""
    out: dict[tuple[str, str], list[tuple[int, float, frozenset[tuple[tuple[str, str], ...]], float]]] = {}
    for src, e, t, k, sets, v in _grouped(rec, name, by, where, "sum", None):
        out.setdefault((src, k), []).append((e, t, sets, v))
    curves: dict[str, Numbered] = {}
    for k, pts in sorted(per_source(out).items()):
        curves[k] = eps = Numbered()
        for (ea, ta, sa, va), (eb, tb, sb, vb) in zip(pts, pts[1:], strict=False):
            if sa == sb and ea == eb:
                for t, r in zip(*rate(([ta, tb], [va, vb])), strict=True):
                    _point(eps, eb, t, r)
    return curves


def counter_rates(rec: Recording, name: str, by: Sequence[str] = (), where: Mapping[str, str] | None = None
                  ) -> dict[str, Series]:
    """:func:`counter_rates_numbered` with each curve's epochs one after the other."""
    return {k: _flat(eps) for k, eps in counter_rates_numbered(rec, name, by, where).items()}


def per_source(out: Mapping[tuple[str, str], _T]) -> dict[str, _T]:
    """Curves keyed ``(source, key)`` named as every report curve is: a key one source exported keeps its name, a
    key more than one source exported is one curve per source, ``"<key> (<source>)"`` (:func:`series`)."""
    sources_of: dict[str, int] = {}
    for _, k in out:
        sources_of[k] = sources_of.get(k, 0) + 1
    named: dict[str, _T] = {k: d for (_, k), d in out.items() if sources_of[k] == 1}
    for (src, k), d in out.items():
        if sources_of[k] > 1:
            key = f"{k} ({src})".lstrip()
            while key in named:  # a label value that reads like it: never merge two curves
                key += f" ({src})"
            named[key] = d
    return named


def rate(s: Series) -> Series:
    """Per second increase of a counter between consecutive scrapes; a decrease (a restarted process) and a
    repeated timestamp give no point."""
    ts, vs = s
    out_t, out_v = [], []
    for i in range(1, len(ts)):
        dt_s, dv = ts[i] - ts[i - 1], vs[i] - vs[i - 1]
        if dt_s > 0 and dv >= 0 and math.isfinite(dv):
            out_t.append(ts[i])
            out_v.append(dv / dt_s)
    return out_t, out_v


def average_rate(*curves: Series | Numbered) -> float | None:
    """A counter's increase from its first to its last nonzero-increase scrape, per second; over several ``curves``
    (one per source: :func:`series` draws the ranks that export it apart), what they all counted from the first such
    scrape of any to the last of any. A drop is a restart from 0 (:func:`monitor.expr.counter_rise`: a restarted
    learner's counter), never a loss. NaN samples are skipped. A curve may be its source's epochs numbered
    (:func:`series_numbered`): within each epoch, what every source counted from the first such scrape of any to the
    last of any, as above; the average is all that over the sum of the epochs' times (the epochs follow one another;
    no time spans two: a source seen only before a step back and one only after it were read on one time line)."""
    per: dict[int, list[float]] = {}  # per epoch: what every curve counted; the first and last moving scrape of any
    two = False  # some epoch has two samples: a counter that stood still reads 0
    for c in curves:
        for e, s in ([(0, c)] if isinstance(c, tuple) else c):
            pts = [(t, v) for t, v in zip(*s, strict=True) if not math.isnan(v)]
            two |= len(pts) >= 2
            rises = [counter_rise(prev, cur) for (_, prev), (_, cur) in zip(pts, pts[1:], strict=False)]
            moving = [i for i, r in enumerate(rises, 1) if r > 0]
            if moving:
                a, b = moving[0] - 1, moving[-1]
                got = per.setdefault(e, [0.0, math.inf, -math.inf])
                got[0], got[1], got[2] = got[0] + sum(rises[a:b]), min(got[1], pts[a][0]), max(got[2], pts[b][0])
    if not per:
        return 0.0 if two else None
    time_s = sum(last - first for _, first, last in per.values())
    return sum(counted for counted, _, _ in per.values()) / time_s if time_s > 0 else None


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """``histogram_quantile``: the ``q`` quantile of cumulative bucket counts ``(le, count)`` sorted by ``le``,
    linear within a bucket; NaN without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return prev_le


def histogram_over_time(rec: Recording, name: str, by: str) -> dict[str, dict[str, Series]]:
    """:func:`histogram_numbered` with each curve's epochs one after the other."""
    return {k: {stat: _flat(c) for stat, c in stats.items()} for k, stats in histogram_numbered(rec, name, by).items()}


def histogram_numbered(rec: Recording, name: str, by: str) -> dict[str, dict[str, Numbered]]:
    """Per value of label ``by``: the mean (increase of _sum over increase of _count), p50 and p90 of the
    observations made between consecutive scrapes; a value more than one source exported is one curve per source
    (:func:`per_source`), never one source's buckets differenced against another's. A source's series of one value
    with other labels besides (a rank label) are differenced each on its own, then summed, as Prometheus's
    ``sum(increase(...))``: a drop of a series' count or bucket is its reset (a restarted process), which counted
    what it has now (:func:`~monitor.expr.counter_rise`). Summed first, one rank's reset read as every rank's (their
    whole history counted again), or was hidden by another's rise; a series absent from either scrape adds nothing.
    No interval spans two :func:`epochs`; each point is in the epoch of its interval (:func:`_point`)."""
    # per source and label value, per scrape (epoch, t), per series (its labels but le): le or "sum"/"count" -> value
    per: dict[tuple[str, str], list[tuple[int, float, dict[tuple[tuple[str, str], ...], dict[float | str, float]]]]]
    per = {}
    bucket, total, count = (rec.kept(n) for n in histogram_names(name))
    fields = {total: "sum", count: "count"}
    for src, scrapes in rec.scrapes.items():
        for e, t, samples in epochs(scrapes):
            for n, lb, v in samples:
                field: float | str | None = fields.get(n)
                if n == bucket and "le" in lb:
                    field = _value(_le(lb["le"]))
                if field is not None:
                    one = tuple(sorted((a, b) for a, b in lb.items() if a != "le"))
                    at = per.setdefault((src, _key(lb, (by,))), [])
                    if not at or at[-1][:2] != (e, t):  # two scrapes at one time: one, the later (no count lost)
                        at.append((e, t, {}))
                    at[-1][2].setdefault(one, {})[field] = v
    out: dict[str, dict[str, Numbered]] = {}
    for k, pts in per_source(per).items():
        curves: dict[str, Numbered] = {}
        for (ea, _, at_a), (eb, b, at_b) in zip(pts, pts[1:], strict=False):
            if ea != eb:
                continue
            rise: dict[float | str, float] = {}  # what the interval added, summed over the series
            for one in at_a.keys() & at_b.keys():
                va, vb = at_a[one], at_b[one]
                both = va.keys() & vb.keys()
                reset = any(vb[f] < va[f] for f in both if f != "sum")  # (a _sum may fall: negative observations)
                for f in both:
                    rise[f] = rise.get(f, 0.0) + (vb[f] if reset else vb[f] - va[f])
            if rise.get("count", 0.0) > 0 and "sum" in rise:
                _point(curves.setdefault("mean", []), eb, b, rise["sum"] / rise["count"])
            delta = sorted((f, r) for f, r in rise.items() if isinstance(f, float))
            if delta and delta[-1][1] > 0:
                for label, q in (("p50", 0.5), ("p90", 0.9)):
                    _point(curves.setdefault(label, []), eb, b, quantile(delta, q))
        has = {f for _, _, at in pts for one in at.values() for f in one}
        out[k] = {**({"mean": []} if {"sum", "count"} <= has else {}),
                  **({"p50": [], "p90": []} if any(isinstance(f, float) for f in has) else {}), **curves}
    return out


def histogram_names(name: str) -> tuple[str, str, str]:
    """The series a Prometheus histogram ``name`` is exported as: its buckets, sum and count."""
    return f"{name}_bucket", f"{name}_sum", f"{name}_count"


def _le(le: str) -> float | str:
    try:
        return float(le)
    except ValueError:
        return le


def has_points(s: Mapping[str, Curve]) -> int:
    return sum(len(ts) for c in s.values() for ts, _ in _segments(c))


# -- plots --------------------------------------------------------------------------------------------------
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report's plots need matplotlib: pip install 'streamrec[dev]' (or pip install "
                          "matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Section:
    id: str
    title: str
    what: str  # what is plotted and where each curve comes from
    png: bytes | None = None
    points: int = 0  # recorded points drawn
    missing: list[str] = field(default_factory=list)  # "not recorded" notes
    facts: list[str] = field(default_factory=list)  # numbers from the summaries, shown under the plot


# The largest value drawn: matplotlib cannot lay out an axis near the float maximum (a constant 1e308 raised "arange:
# cannot compute length", 1.7e308 in a bar "Axis limits cannot be NaN or Inf"); beyond it a value is left out and its
# section says how many (:attr:`Plotter.beyond`). No metric comes near it: such a value is a process's garbage.
PLOT_MAX = 1e300
# A log axis draws positive values from 1/LOG_MAX to LOG_MAX: its ticks go a stride of decades (up to the whole span)
# beyond the data, and a tick past the float range (1e280 beside 1 put one at 10^350 = inf) raised "cannot convert
# float infinity to integer"; 200 decades plus a stride of at most 200 stay inside it.
LOG_MAX = 1e100


class Plotter:
    """The figures of one report, on one time axis: wall-clock time since ``t0``, in s or min. :attr:`beyond` counts
    the values left out for being beyond what an axis can show (:func:`_unplottable`)."""

    def __init__(self, t0: float, span_s: float, phases: Mapping[str, tuple[float, float]] | None = None) -> None:
        self.plt = _pyplot()
        self.t0, self.span_s = t0, max(span_s, 1.0)
        self.scale, self.unit = (60.0, "min") if span_s > 900 else (1.0, "s")
        self.phases = dict(phases or {})  # source -> (first, last) scrape that answered: when the stage ran
        self.beyond = 0

    @property
    def xlabel(self) -> str:
        return f"wall-clock time since the run log began ({self.unit})"

    def x(self, ts: Sequence[float]) -> list[float]:
        return [(t - self.t0) / self.scale for t in ts]

    def figure(self, rows: int = 1, cols: int = 1, height: float = 3.2) -> tuple[Any, list[Any]]:
        fig, axes = self.plt.subplots(rows, cols, figsize=(10, height * rows), squeeze=False)
        return fig, [a for row in axes for a in row]

    def timeline(self, ax: Any) -> None:
        """Every time plot on the same axis (the whole run), with each stage's running time shaded and named."""
        ax.set_xlim(0, self.span_s / self.scale)
        ax.set_xlabel(self.xlabel)
        for i, (source, (a, b)) in enumerate(sorted(self.phases.items(), key=lambda x: x[1])):
            x0, x1 = self.x([a, b])
            ax.axvspan(x0, x1, color=f"C{i % 10}", alpha=0.07, linewidth=0)
            ax.text(x0, 1.0, f" {source}", transform=ax.get_xaxis_transform(), fontsize=7, va="top", color="gray")

    def lines(self, ax: Any, curves: Mapping[str, Curve], ylabel: str, title: str, *, logy: bool = False,
              scale: float = 1.0, step: bool = False, marker: str = ".",
              ylim: tuple[float, float] | None = None, empty: str = "not recorded") -> int:
        n, drawn = 0, []
        self.timeline(ax)
        for label, curve in curves.items():
            xs: list[float] = []
            ys: list[float] = []
            left_out, segments = 0, _segments(curve)
            for ts, vs in segments:  # NaN between two: not drawn, nor joined
                out = [_unplottable(v / scale, logy) for v in vs]
                left_out += sum(out)
                xs += [math.nan] * bool(xs) + self.x(ts)
                ys += [math.nan] * bool(ys) + [math.nan if o else v / scale for v, o in zip(vs, out, strict=True)]
            if not xs:
                continue
            self.beyond += left_out
            if step:
                drawn += ax.step(xs, ys, where="post", label=label)
            else:
                drawn += ax.plot(xs, ys, marker=marker, markersize=3, linewidth=1.2, label=label)
            n += sum(len(ts) for ts, _ in segments) - left_out
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if logy and n:
            ax.set_yscale("log")
        if ylim is not None:
            ax.set_ylim(*ylim)
        if n == 0:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(curves) > 1 or any(curves):
            _legend(ax, drawn)
        return n

    def bars(self, ax: Any, values: Mapping[str, float], ylabel: str, title: str, fmt: str = "{:,.0f}") -> int:
        names = [k for k, v in values.items() if not _unplottable(v)]
        self.beyond += len(values) - len(names)
        vals = [values[k] for k in names]
        ax.bar(names, vals, color="tab:blue")
        for i, v in enumerate(vals):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, max([1.0, *vals]) * 1.15)
        ax.grid(True, axis="y", alpha=0.3)
        return len(vals)

    def png(self, fig: Any) -> bytes:
        """The figure laid out once and drawn once: ``tight_layout`` leaves a placeholder layout engine, for which
        ``savefig`` draws the whole figure a second time (a third of the report's time) to lay out nothing."""
        fig.tight_layout()
        fig.set_layout_engine(None)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        self.plt.close(fig)
        return buf.getvalue()


# -- sections -----------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    rec: Recording
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_run: dict[str, Any] = field(default_factory=dict)  # <publish_root>/last_run.json
    deltas: list[tuple[float, int, int]] = field(default_factory=list)


Draw = Callable[[Plotter, Inputs], Section]  # a section: it draws and describes what the run log recorded
_READS: dict[Draw, frozenset[str]] = {}  # reads()


def reads(*names: str) -> Callable[[Draw], Draw]:
    """Declares the metrics a section reads from the run log, a histogram by its :func:`histogram_names`: the one
    list of them. :func:`read_run_log` keeps their samples and no others (:func:`metrics_read`), and a section that
    reads another raises (:meth:`Recording.kept`) rather than call it "not recorded"."""
    def declare(f: Draw) -> Draw:
        _READS[f] = frozenset(names)
        return f

    return declare


def metrics_read() -> frozenset[str]:
    """Every metric the :data:`SECTIONS` read, as each declares them (:func:`reads`)."""
    return frozenset().union(*(_READS.get(f, ()) for f in SECTIONS))


def _missing(names: Iterable[str], who: str) -> str:
    return f"not recorded: {', '.join(names)} (exported by {who}) is not in the run log"


def _set_numbered(curves: Mapping[str, Numbered]) -> dict[str, Numbered]:
    """A gauge reads 0 until its process first sets it (an AUC before any sample): over each curve's epochs, the points
    before its first nonzero value in any epoch are left out, and a curve with none."""
    out = {}
    for k, eps in curves.items():
        skip = next((i for i, v in enumerate(_flat(eps)[1]) if v != 0), None)
        if skip is None:
            continue
        out[k] = kept = Numbered()
        for e, (ts, vs) in eps:
            if skip < len(ts):
                kept.append((e, (ts[skip:], vs[skip:])))
            skip = max(0, skip - len(ts))
    return out


def _named(curves: Mapping[str, _T], name: str) -> dict[str, _T]:
    return {(f"{name} {k}" if k else name): s for k, s in curves.items()}


@reads("streamrec_learner_served_auc", "streamrec_learner_window_auc", "streamrec_learner_served_ne",
       "streamrec_learner_event_time_seconds")
def s_quality(p: Plotter, inp: Inputs) -> Section:
    sec = Section("served-quality", "Served quality: AUC and normalized entropy",
                  "Each impression's first prediction (made before the learner trained on it) against the label it "
                  "ended with: streamrec_learner_served_auc and streamrec_learner_served_ne (both over the last "
                  "quality_recent_s; NE >= 1 is no better than predicting the click rate), with the learner's "
                  "test-then-train streamrec_learner_window_auc for reference, first over wall-clock time, then "
                  "(bottom) over event time: each scrape's values against streamrec_learner_event_time_seconds, the "
                  "event time of the newest sample trained at that scrape (the slowest learner's, with several).")
    rec = inp.rec
    auc = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_served_auc"), "served AUC (window)"),
                         **_named(series_numbered(rec, "streamrec_learner_window_auc"),
                                  "progressive AUC (window, trained samples)")})
    ne = _set_numbered(_named(series_numbered(rec, "streamrec_learner_served_ne"), "served NE (window)"))
    fig, (a1, a2, a3) = p.figure(3, 1)
    sec.points = p.lines(a1, auc, "AUC", "Served AUC over time (learner)") + p.lines(
        a2, ne, "NE (logloss / base-rate entropy)", "Served normalized entropy over time (learner)")
    if ne:
        a2.axhline(1.0, color="red", linestyle=":", linewidth=1, label="1 = no better than the base rate")
        a2.legend(fontsize=8, loc="best")
    sec.points += event_time_plot(a3, rec, {**auc, **ne})
    sec.png = p.png(fig)
    if not auc and not ne:
        sec.missing.append(_missing(["streamrec_learner_served_auc", "streamrec_learner_served_ne"],
                                    "streamrec train --metrics-port"))
    sv = served_quality(inp.summaries)
    if sv and sv.get("impressions"):
        sec.facts.append(f"Final served quality (train summary, {fmt_num(sv['impressions'], ',')} impressions): AUC "
                         f"{fmt_num(sv.get('auc'))}, logloss {fmt_num(sv.get('logloss'))}, NE {fmt_num(sv.get('ne'))}")
    return sec


def _unplottable(v: float, logy: bool = False) -> bool:
    """Beyond what an axis can show: ±:data:`PLOT_MAX`, or on a log axis a positive value outside 1/:data:`LOG_MAX`
    to :data:`LOG_MAX` (a value of 0 or less is not drawn on one either way)."""
    return abs(v) > PLOT_MAX or (logy and (v > LOG_MAX or 0 < v < 1 / LOG_MAX))


def _legend(ax: Any, drawn: Sequence[Any]) -> None:
    """A legend naming every curve ``drawn`` with a label: handed over explicitly, since matplotlib leaves an artist
    labelled "_..." (a DLQ topic "_schemas", a field "_hour") out of the legend it finds itself."""
    named = [h for h in drawn if h.get_label()]
    ax.legend(named, [h.get_label() for h in named], fontsize=8, loc="best")


def event_time_plot(ax: Any, rec: Recording, curves: Mapping[str, Series | Numbered]) -> int:
    """``curves`` (values at scrape times) against the learners' event time at the same scrapes: the slowest learner
    source's (the oldest event time any of them had trained up to, zeros left out: a rank not started; the monitor
    scrapes every source at one time), so that N ranks all count, where the first source's alone was read; NE on a
    second axis. A curve is its epochs numbered (:func:`series_numbered`), each value matched to the event time of its
    own scrape by epoch and ``t`` (by ``t`` alone, a value scraped before the clock stepped back was drawn at the event
    time scraped at that ``t`` after it); or a Series of a recording without a step (all epoch 0). Returns the points
    drawn."""
    clock = {(e, t): v for e, (ts, vs) in _min_numbered(rec, "streamrec_learner_event_time_seconds")
             for t, v in zip(ts, vs, strict=True)}
    n, drawn = 0, []
    right = ax.twinx()
    for i, (label, curve) in enumerate(curves.items()):
        pts = [(d, v) for e, (ts, vs) in ([(0, curve)] if isinstance(curve, tuple) else curve)
               for t, v in zip(ts, vs, strict=True)  # a value beyond PLOT_MAX: counted over wall time
               if (d := _date(clock.get((e, t), 0))) is not None and not _unplottable(v)]
        if not pts:
            continue
        on = right if "NE" in label else ax
        drawn += on.plot([x for x, _ in pts], [y for _, y in pts], marker=".", markersize=3, linewidth=1.2,
                         label=label, color=f"C{i}")
        n += len(pts)
    ax.set_title("Served AUC (left) and NE (right) over event time (slowest learner)", fontsize=10)
    ax.set_xlabel("event time of the newest sample trained, slowest learner (UTC)")
    ax.set_ylabel("AUC")
    right.set_ylabel("NE")
    ax.grid(True, alpha=0.3)
    if n == 0:
        ax.text(0.5, 0.5, "not recorded: streamrec_learner_event_time_seconds", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    else:
        _legend(ax, drawn)
        ax.tick_params(axis="x", labelrotation=15)
    return n


@reads("streamrec_learner_cold_auc", "streamrec_learner_warm_auc", "streamrec_learner_served_cold_auc",
       "streamrec_learner_bucket_share")
def s_cold(p: Plotter, inp: Inputs) -> Section:
    sec = Section("cold-warm", "Cold vs warm users",
                  "Window AUC of cold users' samples (their first cold_k impressions) and of warm users' "
                  "(streamrec_learner_cold_auc, _warm_auc, test-then-train), and the served AUC of cold users' "
                  "impressions (streamrec_learner_served_cold_auc); below, the share of id lookups answered by a "
                  "shared hash bucket (ids not admitted yet), per field (streamrec_learner_bucket_share).")
    rec = inp.rec
    auc = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_cold_auc"), "cold users"),
                         **_named(series_numbered(rec, "streamrec_learner_warm_auc"), "warm users"),
                         **_named(series_numbered(rec, "streamrec_learner_served_cold_auc"), "cold users, served")})
    share = series_numbered(rec, "streamrec_learner_bucket_share", by=("field",))
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, auc, "AUC", "Window AUC, cold vs warm users (learner)")
    p.lines(a2, share, "share of lookups (0-1)", "Lookups served by hash buckets, per field (learner)")
    sec.png = p.png(fig)
    if not auc:
        sec.missing.append(_missing(["streamrec_learner_cold_auc", "streamrec_learner_warm_auc"], "the learner"))
    if _get(inp.summaries, "train", "cold_users"):
        cold, warm = (_get(inp.summaries, "train", "cold_users", k) or {} for k in ("cold", "warm"))
        sec.facts.append(f"Train summary: cold users AUC {fmt_num(cold.get('auc'))} over "
                         f"{fmt_num(cold.get('samples', 0), ',')} samples, warm users AUC "
                         f"{fmt_num(warm.get('auc'))} over {fmt_num(warm.get('samples', 0), ',')}")
    return sec


@reads("streamrec_join_samples_total", "streamrec_events_total", "streamrec_learner_samples_total",
       "streamrec_serving_requests_total", "streamrec_serving_candidates_total")
def s_throughput(p: Plotter, inp: Inputs) -> Section:
    sec = Section("throughput", "Throughput of each stage",
                  "Per second between consecutive scrapes: samples written by the joiner "
                  "(streamrec_join_samples_total), events it read (streamrec_events_total{stage=\"join\"}), "
                  "samples the learner trained (streamrec_learner_samples_total), requests serving answered "
                  "(streamrec_serving_requests_total). Below: each stage's average, from the replay and join "
                  "summaries (events/s over their run) and the learner's counter (first to last increase).")
    rec = inp.rec
    join_samples = series(rec, "streamrec_join_samples_total")
    learner = series(rec, "streamrec_learner_samples_total")
    rates = counter_rates_numbered
    joiner = {**_named(rates(rec, "streamrec_events_total", where={"stage": "join"}), "events read/s"),
              **_named(rates(rec, "streamrec_join_samples_total"), "samples written/s")}
    trained = _named(rates(rec, "streamrec_learner_samples_total"), "samples trained/s")
    served = {**_named(rates(rec, "streamrec_serving_requests_total"), "requests/s"),
              **_named(rates(rec, "streamrec_serving_candidates_total"), "candidates scored/s")}
    avg: dict[str, float] = {}
    for stage in ("replay", "join"):
        if (v := _number(inp.summaries.get(stage, {}).get("events_per_s"))) is not None:
            avg[f"{stage}\n(events/s, summary)"] = v
    if (r := average_rate(*series_numbered(rec, "streamrec_learner_samples_total").values())) is not None:
        avg["train\n(samples/s, counter)"] = r
    fig, (a1, a2, a3, a4) = p.figure(4, 1, height=2.6)
    sec.points = p.lines(a1, joiner, "per second", "Joiner: events read and samples written per second")
    sec.points += p.lines(a2, trained, "per second", "Learner: samples trained per second")
    sec.points += p.lines(a3, served, "per second", "Serving: requests and candidates scored per second")
    if avg:
        sec.points += p.bars(a4, avg, "per second", "Average throughput per stage (over its own run)")
    else:
        a4.set_axis_off()
    sec.png = p.png(fig)
    if not join_samples:
        sec.missing.append(_missing(["streamrec_join_samples_total"], "streamrec join --metrics-port"))
    if not learner:
        sec.missing.append(_missing(["streamrec_learner_samples_total"], "streamrec train --metrics-port"))
    for stage in ("replay", "join"):
        d = inp.summaries.get(stage)
        if d:
            sec.facts.append(f"{stage} summary: {fmt_num(d.get('impressions', 0), ',')} impressions, "
                             f"{fmt_num(d.get('clicks', 0), ',')} clicks in {fmt_num(d.get('elapsed_s'), '.1f')} s")
    return sec


@reads("streamrec_learner_lag_samples", "streamrec_join_pending_impressions", "streamrec_join_input_paused")
def s_lag(p: Plotter, inp: Inputs) -> Section:
    sec = Section("lag", "Lag",
                  "The learner's lag: messages of the samples topic not yet trained, summed over partitions "
                  "(streamrec_learner_lag_samples; a message holds up to batch_max samples). The joiner's "
                  "impressions waiting for their attribution window to close (streamrec_join_pending_impressions) "
                  "and its input partitions paused for backpressure (streamrec_join_input_paused).")
    rec = inp.rec
    lag = _named(series_numbered(rec, "streamrec_learner_lag_samples"), "learner: messages behind")
    pending = _named(series_numbered(rec, "streamrec_join_pending_impressions"), "joiner: pending impressions")
    paused = _named(series_numbered(rec, "streamrec_join_input_paused"), "joiner: partitions paused")
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, lag, "messages", "Learner lag behind the samples topic")
    sec.points += p.lines(a2, {**pending, **paused}, "impressions / partitions", "Joiner backlog")
    sec.png = p.png(fig)
    if not lag:
        sec.missing.append(_missing(["streamrec_learner_lag_samples"], "the learner"))
    if not pending:
        sec.missing.append(_missing(["streamrec_join_pending_impressions"], "streamrec join --metrics-port"))
    return sec


@reads(*histogram_names("streamrec_learner_grad_norm"), "streamrec_learner_update_norm")
def s_grad(p: Plotter, inp: Inputs) -> Section:
    sec = Section("gradient-norms", "Gradient and update norms",
                  "L2 norm of each optimizer step's gradient, dense part (MLP, bias) and embedding rows apart: the "
                  "mean, p50 and p90 of the steps between two scrapes, from the histogram "
                  "streamrec_learner_grad_norm (quantiles interpolated within its buckets, as Prometheus' "
                  "histogram_quantile). Below: the L2 norm of what one sampled step changed "
                  "(streamrec_learner_update_norm; 0 = the model no longer changes).")
    rec = inp.rec
    hist = histogram_numbered(rec, "streamrec_learner_grad_norm", "part")
    curves = {f"{k} {stat}": s for k, stats in hist.items() for stat, s in stats.items()}
    upd = series_numbered(rec, "streamrec_learner_update_norm", by=("part",))
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, curves, "L2 norm (log)", "Gradient L2 norm per step (learner)", logy=True)
    sec.points += p.lines(a2, {k: s for k, s in upd.items()}, "L2 norm (log)",
                          "Update L2 norm of a sampled step (learner)", logy=True)
    sec.png = p.png(fig)
    if not has_points(curves):
        sec.missing.append(_missing(["streamrec_learner_grad_norm"], "the learner (learner/health.py)"))
    if not upd:
        sec.missing.append(_missing(["streamrec_learner_update_norm"], "the learner (learner/health.py)"))
    return sec


@reads("streamrec_learner_field_coverage", "streamrec_learner_id_occupancy")
def s_coverage(p: Plotter, inp: Inputs) -> Section:
    sec = Section("coverage", "Feature coverage",
                  "Per field, the share of recent samples carrying it (streamrec_learner_field_coverage; a field "
                  "whose upstream broke drops to 0). Below: per dynamic-id field, the share of its own rows in use "
                  "(streamrec_learner_id_occupancy).")
    rec = inp.rec
    cov = series_numbered(rec, "streamrec_learner_field_coverage", by=("field",))
    occ = series_numbered(rec, "streamrec_learner_id_occupancy", by=("field",))
    fig, (a1, a2) = p.figure(2, 1, height=3.6)
    sec.points = p.lines(a1, cov, "share of samples (0-1)", "Samples carrying each field (learner)",
                         ylim=(0, 1.05))
    p.lines(a2, occ, "share of own rows (0-1)", "Id rows in use, per field (learner)")
    sec.png = p.png(fig)
    if not cov:
        sec.missing.append(_missing(["streamrec_learner_field_coverage"], "the learner (learner/health.py)"))
    return sec


@reads("streamrec_learner_rss_bytes", "streamrec_learner_cuda_memory_bytes",
       "streamrec_learner_memory_growth_bytes_per_hour")
def s_memory(p: Plotter, inp: Inputs) -> Section:
    sec = Section("memory", "Memory",
                  "The learner's resident set (streamrec_learner_rss_bytes) and, on CUDA, device memory allocated "
                  "and reserved (streamrec_learner_cuda_memory_bytes), in MiB. Below: its growth rate "
                  "(streamrec_learner_memory_growth_bytes_per_hour, least-squares slope over 10 minutes; NaN, "
                  "so not drawn, for the first 5).")
    rec = inp.rec
    mem = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_rss_bytes"), "learner RSS"),
                         **_named(series_numbered(rec, "streamrec_learner_cuda_memory_bytes", by=("kind",)), "CUDA")})
    growth = {k: [(e, _finite(s)) for e, s in eps] for k, eps in
              series_numbered(rec, "streamrec_learner_memory_growth_bytes_per_hour", by=("memory",)).items()}
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, mem, "MiB", "Learner memory", scale=2**20)
    p.lines(a2, growth, "MiB per hour", "Learner memory growth rate", scale=2**20,
            empty="no finite value: NaN until the learner's memory samples span 5 minutes")
    sec.png = p.png(fig)
    if not mem:
        sec.missing.append(_missing(["streamrec_learner_rss_bytes"], "the learner (learner/health.py)"))
    if not has_points(growth):
        sec.missing.append("memory growth: no finite value recorded (the learner reports NaN until its samples "
                           "span 5 minutes)")
    return sec


@reads("streamrec_serving_hot_cache_hit_rate", "streamrec_serving_embedding_lookups_total")
def s_hot(p: Plotter, inp: Inputs) -> Section:
    sec = Section("hot-set", "Hot set and hit rate",
                  "Share of serving's embedding row reads answered by the artifact's hot set since serving started "
                  "(streamrec_serving_hot_cache_hit_rate), and the reads per second by tier "
                  "(streamrec_serving_embedding_lookups_total). The hot set's size is the refresh summary's.")
    rec = inp.rec
    hit = _named(series_numbered(rec, "streamrec_serving_hot_cache_hit_rate"), "hit rate")
    tiers = {k + " rows/s": s
             for k, s in counter_rates_numbered(rec, "streamrec_serving_embedding_lookups_total", by=("tier",)).items()}
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, hit, "share of row reads (0-1)", "Hot-set hit rate since serving started (serving)",
                         ylim=(0, 1.05))
    p.lines(a2, tiers, "rows per second", "Embedding rows read, by tier (serving)")
    sec.png = p.png(fig)
    if not hit:
        sec.missing.append(_missing(["streamrec_serving_hot_cache_hit_rate"], "streamrec serve (/metrics)"))
    hs = inp.summaries.get("refresh", {}).get("hot_set")
    if isinstance(hs, dict):
        shown = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in hs.items()
                          if not isinstance(v, dict | list))
        sec.facts.append(f"Hot set of the published artifact (refresh summary): {shown}")
    return sec


@reads("streamrec_learner_samples_total", "streamrec_serving_delta_seq", "streamrec_join_watermark_ms")
def s_fresh(p: Plotter, inp: Inputs) -> Section:
    sec = Section("freshness", "Freshness",
                  "How far behind the newest training the served model is. Top: samples trained at each delta the "
                  "learner wrote (file names and times of delta-<seq>-<samples>.delta) beside the learner's own "
                  "count (streamrec_learner_samples_total); the refresh's publish (last_run.json) as a vertical "
                  "line. Middle: the last delta serving applied (streamrec_serving_delta_seq; 0 = none newer than "
                  "its artifact). Bottom: the joiner's event-time watermark (streamrec_join_watermark_ms, oldest "
                  "partition) against wall time.")
    rec = inp.rec
    learner: dict[str, Curve] = {**_named(series_numbered(rec, "streamrec_learner_samples_total"),
                                          "learner: samples trained")}
    deltas: dict[str, Curve] = {}
    if inp.deltas:
        deltas["deltas written: samples trained"] = ([d[0] for d in inp.deltas], [float(d[2]) for d in inp.deltas])
    seq = _named(series_numbered(rec, "streamrec_serving_delta_seq"), "serving: delta seq applied")
    wm = series(rec, "streamrec_join_watermark_ms")
    wm_dates = [[(t, d) for t, v in zip(*s, strict=True) if (d := _date(v / 1000)) is not None]
                for _, s in _min_numbered(rec, "streamrec_join_watermark_ms")]  # a segment per epoch
    wm_dates = [seg for seg in wm_dates if seg]
    fig, (a1, a2, a3) = p.figure(3, 1, height=2.8)
    sec.points = p.lines(a1, {**learner, **deltas}, "samples", "Samples trained: learner and its deltas",
                         step=True)
    pub = inp.last_run.get("last_success")
    if isinstance(pub, int | float) and p.t0 <= pub <= p.t0 + p.span_s:  # 1e300 broke matplotlib's transform
        a1.axvline(p.x([pub])[0], color="green", linestyle="--", linewidth=1)
        a1.text(p.x([pub])[0], 0.95, " refresh published", transform=a1.get_xaxis_transform(), fontsize=8,
                va="top", color="green")
    sec.points += p.lines(a2, seq, "delta seq", "Last delta applied by serving", step=True)
    if wm_dates:
        p.timeline(a3)
        for i, seg in enumerate(wm_dates):
            a3.plot(p.x([t for t, _ in seg]), [d for _, d in seg], marker=".", markersize=3, color="C0",
                    label="" if i else "joiner watermark (oldest partition)")
        a3.set_title("Event time reached by the joiner (UTC) vs wall time", fontsize=10)
        a3.set_ylabel("event time (UTC)")
        a3.grid(True, alpha=0.3)
        a3.legend(fontsize=8)
        sec.points += sum(len(seg) for seg in wm_dates)
    else:
        p.lines(a3, {}, "event time", "Event time reached by the joiner")
    sec.png = p.png(fig)
    if not deltas:
        sec.missing.append("no delta files found (the learner writes them with deltas_every_s > 0; pass "
                           "--deltas-dir)")
    if not seq:
        sec.missing.append(_missing(["streamrec_serving_delta_seq"], "streamrec serve (/metrics)"))
    if not wm:
        sec.missing.append(_missing(["streamrec_join_watermark_ms"], "streamrec join --metrics-port"))
    if inp.last_run:
        sec.facts.append(f"last_run.json: version {inp.last_run.get('version')} published "
                         f"{inp.last_run.get('last_success_utc')}")
    return sec


def _segments(curve: Curve) -> list[Series]:
    """The stretches of a curve drawn as one line each: its epochs (every curve read from the run log is numbered:
    :func:`_point`), or of a Series (the deltas' files, which have no epochs) the stretches between the points where
    ``t`` drops."""
    if not isinstance(curve, tuple):
        return [s for _, s in curve if s[0]]
    ts, vs = curve
    cuts = [0, *(i for i in range(1, len(ts)) if ts[i] < ts[i - 1]), len(ts)]
    return [(ts[a:b], vs[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _finite(s: Series) -> Series:
    keep = [i for i, v in enumerate(s[1]) if math.isfinite(v)]
    return [s[0][i] for i in keep], [s[1][i] for i in keep]


def _min_numbered(rec: Recording, name: str) -> Numbered:
    """The smallest value over every label set and every source at each scrape (a watermark: the slowest partition,
    whichever joiner holds it; the monitor scrapes its sources at one time), ignoring zeros (a partition not seen
    yet), in its :func:`epochs` (keyed by ``t`` alone, a scrape after a step back overwrote the one at that time
    before it). Two joiners of one group were read as the last source's."""
    out: dict[tuple[int, float], float] = {}
    rec.kept(name)
    for scrapes in rec.scrapes.values():
        for e, t, samples in epochs(scrapes):
            vals = [v for n, _, v in samples if n == name and v > 0 and math.isfinite(v)]
            if vals:
                out[e, t] = min(vals + ([out[e, t]] if (e, t) in out else []))
    eps = Numbered()
    for e, t in sorted(out):
        _point(eps, e, t, out[e, t])
    return eps


def _min_over(rec: Recording, name: str) -> Series:
    """:func:`_min_numbered` with its epochs one after the other."""
    return _flat(_min_numbered(rec, name))


@reads("streamrec_dlq_messages_total")
def s_dlq(p: Plotter, inp: Inputs) -> Section:
    sec = Section("dead-letters", "Dead letters",
                  "Malformed messages sent to <topic>.dlq, by source topic and reason, as the stages counted them "
                  "(streamrec_dlq_messages_total over time, where a scraped stage dead-lettered any), and the "
                  "totals of the batch stages' summaries (replay: dead-lettered at the source and malformed "
                  "published; join: dead-lettered).")
    rec = inp.rec
    dlq = series_numbered(rec, "streamrec_dlq_messages_total", by=("topic", "kind"))
    totals: dict[str, float] = {}
    for stage, key, bar in (("replay", "dead_lettered", "replay: dead-lettered\nat source"),
                            ("replay", "malformed_published", "replay: malformed\npublished"),
                            ("join", "dead_lettered", "join: dead-lettered")):
        if d := inp.summaries.get(stage):
            if (v := _number(d.get(key) or 0)) is not None:
                totals[bar] = v
            else:
                sec.missing.append(f"{stage} summary: {key} is not a number ({str(d.get(key))[:40]!r})")
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, dlq, "messages (cumulative)", "Dead-lettered messages over time", step=True,
                         empty="none: no scraped stage dead-lettered a message")
    if totals:
        sec.points += p.bars(a2, totals, "messages", "Dead letters per stage (summaries)")
    else:
        a2.set_axis_off()
    sec.png = p.png(fig)
    if not dlq:
        sec.missing.append("no streamrec_dlq_messages_total series in the run log: no scraped stage dead-lettered "
                           "a message (the counter appears with its first dead letter)")
    if not totals:
        sec.missing.append("no replay or join summary given (--summary FILE)")
    return sec


_STATE_COLOR = {"pending": "tab:orange", "firing": "tab:red", "resolved": "tab:green"}


@reads()
def s_alerts(p: Plotter, inp: Inputs) -> Section:
    sec = Section("alerts", "Alerts",
                  "Each rule's state at every evaluation the monitor recorded (worst over its label sets: "
                  "inactive, pending, firing), and each alert it sent (firing x, resolved o). Alerts written to "
                  "the alerts topic by other processes (a failed refresh) are not in the run log.")
    rec = inp.rec
    rules = sorted({r for _, st, _ in rec.rule_states for r in st} | {str(a.get("rule")) for _, a in rec.alerts})
    fig, (ax,) = p.figure(1, 1, height=max(2.5, 0.32 * len(rules) + 1.2))
    ys = {r: i for i, r in enumerate(rules)}
    for r, (xranges, colors) in state_bars(rec, p).items():  # one collection per rule: one per bar took minutes
        ax.broken_barh(xranges, (ys[r] - 0.3, 0.6), color=colors, linewidth=0)
    for t, a in rec.alerts:
        r = str(a.get("rule"))
        ax.plot(p.x([t]), [ys[r]], marker="x" if a.get("state") == "firing" else "o", color="black")
    ax.set_yticks(range(len(rules)), rules, fontsize=8)
    p.timeline(ax)
    ax.set_title("Rule states per evaluation (grey inactive, orange pending, red firing) and alerts sent",
                 fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    sec.points = len(rec.rule_states) + len(rec.alerts)
    if not rules:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        sec.missing.append("no rule evaluations in the run log")
    sec.png = p.png(fig)
    fired = [a for _, a in rec.alerts if a.get("state") == "firing"]
    last = {a.get("fingerprint"): a.get("state") for _, a in rec.alerts}  # by identity, in time order
    sec.facts.append(f"{len(fired)} alert(s) fired, {len(rec.alerts) - len(fired)} resolved, over "
                     f"{len(rec.rule_states)} evaluation(s) of {len(rules)} rule(s); "
                     f"{sum(st == 'firing' for st in last.values())} still firing at the end of the run log")
    sec.facts.extend(alert_line(t, a) for t, a in rec.alerts)
    return sec


def state_bars(rec: Recording, p: Plotter) -> dict[str, tuple[list[tuple[float, float]], list[str]]]:
    """Per rule, its state bars ``(x0, width)`` and their colours, one per evaluation in the order the monitor wrote
    them, each lasting until the next evaluation of its epoch (a bar ends at its epoch's last evaluation, as every
    curve breaks there). Drawn as one collection per rule: one ``broken_barh`` per bar (18 rules x 1,769 evaluations
    of the ML-1M demo) made ~32,000 artists, and the alerts section most of the report's minutes and memory; rules'
    bars never overlap (0.6 high, a row apart), so the pixels are the same."""
    bars: dict[str, tuple[list[tuple[float, float]], list[str]]] = {}
    evals = list(epochs(rec.rule_states))  # (epoch, t, states), in the order the monitor wrote them
    for (e, t, st), (e_next, t_next, _) in zip(evals, evals[1:] + evals[-1:], strict=True):
        t_next = t_next if e_next == e else t
        x0, x1 = p.x([t, t_next])
        for r, state in st.items():
            xranges, colors = bars.setdefault(r, ([], []))
            xranges.append((x0, max(x1 - x0, 1e-9)))
            colors.append(_STATE_COLOR.get(state, "lightgray"))
    return bars


def alert_line(t: float, a: Mapping[str, Any]) -> str:
    """One alert as the report lists it, with what tells it from the rule's other alerts: its labels (two series of
    one rule differ only there), its kind (an absence alert may have a series' labels) and its fingerprint::

        2024-06-10 06:13:20 UTC firing warning auc_low{partition="0",team="ranking"} series id=9e32f1501515c148: ...

    Label values are quoted as Prometheus writes them (``"`` and ``\\`` escaped: a value cannot pass for two labels).
    This is text: the page escapes it (labels come from the scraped processes)."""
    labels = lb if isinstance(lb := a.get("labels"), dict) else {}
    lbl = ",".join(f"{k}={json.dumps(str(v), ensure_ascii=False)}" for k, v in sorted(labels.items()))
    return (f"{utc_text(t)} {a.get('state')} {a.get('severity')} {a.get('rule')}{{{lbl}}} {a.get('kind', 'series')} "
            f"id={a.get('fingerprint', '-')}: {a.get('message')}")


SECTIONS: tuple[Draw, ...] = (
    s_quality, s_cold, s_throughput, s_lag, s_grad, s_coverage, s_memory, s_hot, s_fresh, s_dlq, s_alerts)


# -- the page -----------------------------------------------------------------------------------------------
def fmt_num(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if _number(v) is not None else "n/a"


def _date(t: float) -> dt.datetime | None:
    """Unix seconds as a UTC date; None for 0 or less (not set yet) and for what no date can be (NaN, +Inf, 1e300:
    metric values, which a scraped process sets)."""
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc) if 0 < t <= MAX_T else None


def served_quality(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The train summary's served quality over every impression (learner/served.py), or None."""
    sv = _get(summaries, "train", "served", "all")
    return dict(sv) if isinstance(sv, dict) and _number(sv.get("impressions", 0)) is not None else None


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is not a dict (a summary is outside input: any key any type)."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _number(v: Any) -> float | None:
    """A finite number (not a bool) as a float, else None."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        return float(v) if math.isfinite(v) else None
    except OverflowError:  # an integer of 400 digits
        return None


def build_sections(inp: Inputs) -> list[Section]:
    t0 = inp.rec.t0 if inp.rec.t0 is not None else time.time()
    span = (inp.rec.t_end or t0) - t0
    phases = {src: (min(t for t, _, _ in sc), max(t for t, _, _ in sc)) for src, sc in inp.rec.scrapes.items() if sc}
    p = Plotter(t0, span, phases)
    with p.plt.rc_context({"text.parse_math": False}):  # a label "$\foo{$" (event data) is text, not mathtext
        return [_beyond(p, f, inp) for f in SECTIONS]


def _beyond(p: Plotter, f: Draw, inp: Inputs) -> Section:
    """Section ``f``, saying how many of its values were beyond :data:`PLOT_MAX` and so not drawn."""
    before = p.beyond
    sec = f(p, inp)
    if p.beyond > before:
        sec.missing.append(f"{p.beyond - before} recorded value(s) beyond ±{PLOT_MAX:g} (1/{LOG_MAX:g} to "
                           f"{LOG_MAX:g} on a log axis) not drawn (no axis can show them)")
    return sec


def render_html(inp: Inputs, sections: Sequence[Section], title: str = "streamrec run report") -> str:
    rec, esc = inp.rec, html.escape
    t0, t1 = rec.t0, rec.t_end
    head = [f"<h1>{esc(title)}</h1>"]
    if t0 is not None and t1 is not None:
        head.append(f"<p>Recorded by the monitor from {utc_text(t0)} to {utc_text(t1)} ({t1 - t0:,.0f} s of wall-clock "
                    f"time), sources: {esc(', '.join(sorted(rec.scrapes)) or 'none')}; "
                    f"{sum(len(s) for s in rec.scrapes.values()):,} scrapes, {len(rec.errors):,} failed "
                    f"(a stage not running yet or any more). Every x axis is wall-clock time since "
                    f"{utc_text(t0)}.</p>")
    sq = served_quality(inp.summaries)
    if sq and sq.get("impressions"):
        head.append(f"<p class=big>Served quality ({fmt_num(sq['impressions'], ',')} impressions, train summary): "
                    f"AUC <b>{fmt_num(sq.get('auc'))}</b>, NE <b>{fmt_num(sq.get('ne'))}</b>, logloss "
                    f"{fmt_num(sq.get('logloss'))}</p>")
    rows = "".join(f"<tr><td>{esc(s)}</td><td>{esc(summary_line(s, d))}</td></tr>" for s, d in inp.summaries.items())
    if rows:
        head.append(f"<h2>Stage summaries</h2><table>{rows}</table>")
    toc = "".join(f"<li><a href='#{s.id}'>{esc(s.title)}</a>{'' if s.points else ' (not recorded)'}</li>"
                  for s in sections)
    body = []
    for s in sections:
        img = (f"<img alt='{esc(s.title)}' src='data:image/png;base64,{base64.b64encode(s.png).decode()}'>"
               if s.png else "")
        notes = "".join(f"<p class=missing>{esc(m)}</p>" for m in s.missing)
        facts = "".join(f"<li>{esc(f)}</li>" for f in s.facts)
        body.append(f"<section id='{s.id}' data-points='{s.points}' data-png='{1 if s.png else 0}'>"
                    f"<h2>{esc(s.title)}</h2><p class=what>{esc(s.what)}</p>{img}{notes}"
                    f"{f'<ul>{facts}</ul>' if facts else ''}</section>")
    foot = (f"<footer>Run log: {esc(', '.join(rec.files))}"
            f"{f'; {rec.bad_lines} unreadable line(s) skipped' if rec.bad_lines else ''}. "
            f"Written {utc_text(time.time())} by streamrec report.</footer>")
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto;padding:1em;color:#222}"
             "img{max-width:100%;border:1px solid #ddd}.what{color:#444;font-size:90%}.missing{color:#a60}"
             ".big{font-size:120%}table{border-collapse:collapse;font-size:85%}td{border:1px solid #ddd;"
             "padding:2px 6px;vertical-align:top}section{margin-top:2em}footer{margin-top:2em;color:#666;"
             "font-size:80%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{style}</style>"
            f"</head><body>{''.join(head)}<h2>Sections</h2><ol>{toc}</ol>{''.join(body)}{foot}</body></html>\n")


def summary_line(stage: str, d: Mapping[str, Any]) -> str:
    keys = {"replay": ("dataset", "impressions", "clicks", "dead_lettered", "elapsed_s", "events_per_s"),
            "join": ("group", "events", "samples", "positives", "late_clicks", "dead_lettered", "elapsed_s",
                     "events_per_s"),
            "train": ("samples_trained", "steps", "reason", "device", "precision"),
            "refresh": ("published", "version", "samples_trained", "format"),
            "monitor": ("evaluations", "alerts", "undelivered")}.get(stage, ())
    return ", ".join(f"{k} {_plain(d[k])}" for k in keys if k in d)


def _plain(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else (f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}")


def write_report(inp: Inputs, out: str | Path) -> list[Section]:
    """Build every section and write the HTML (PNGs embedded as base64: one self-contained file)."""
    out = Path(out)
    if out.is_dir():
        raise ReportError(f"{out} is a directory: give a file to write, such as {out / 'report.html'}")
    sections = build_sections(inp)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, render_html(inp, sections).encode("utf-8"))  # nothing half-written is left behind
    return sections


# -- progress while a stage runs ----------------------------------------------------------------------------
def _total(samples: Sequence[Sample], name: str, where: Mapping[str, str] | None = None) -> float | None:
    vals = [v for n, lb, v in samples if n == name and not (where and any(lb.get(k) != x for k, x in where.items()))]
    return sum(vals) if vals else None


def progress_line(samples: Sequence[Sample], prev: tuple[float, Sequence[Sample]] | None, t: float) -> str:
    """One line saying where a stage is, from one scrape of it (and the one before, for rates)."""

    def per_s(name: str) -> str:
        now = _total(samples, name)
        if prev is None or now is None or t <= prev[0]:
            return ""
        before = _total(prev[1], name) or 0.0
        return f" ({max(0.0, now - before) / (t - prev[0]):,.0f}/s)"

    parts = []
    if (v := _total(samples, "streamrec_join_samples_total")) is not None:
        parts.append(f"{v:,.0f} samples written{per_s('streamrec_join_samples_total')}")
        if (pend := _total(samples, "streamrec_join_pending_impressions")) is not None:
            parts.append(f"{pend:,.0f} impressions pending")
        wms = [v for n, _, v in samples if n == "streamrec_join_watermark_ms" and v > 0]
        if wms and (day := _date(min(wms) / 1000)) is not None:
            parts.append("event time " + day.strftime("%Y-%m-%d"))
    if (v := _total(samples, "streamrec_learner_samples_total")) is not None:
        parts.append(f"{v:,.0f} samples trained{per_s('streamrec_learner_samples_total')}")
        if (lag := _total(samples, "streamrec_learner_lag_samples")) is not None:
            parts.append(f"{lag:,.0f} messages behind")
        for name, label in (("streamrec_learner_served_auc", "served AUC"),
                            ("streamrec_learner_served_ne", "NE")):
            if (x := _total(samples, name)) is not None and math.isfinite(x) and x:
                parts.append(f"{label} {x:.4f}")
    if (v := _total(samples, "streamrec_serving_requests_total")) is not None:
        parts.append(f"{v:,.0f} requests")
        if (hr := _total(samples, "streamrec_serving_hot_cache_hit_rate")) is not None:
            parts.append(f"hot-set hit rate {hr:.3f}")
    return ", ".join(parts) or "started, nothing counted yet"


def follow(path: str | Path, source: str, alive: Callable[[], bool], out: IO[str], every_s: float = 0.5,
           print_every_s: float | None = None, clock: Callable[[], float] = time.monotonic,
           tail_bytes: int = FOLLOW_TAIL_BYTES) -> int:
    """Print a progress line for each scrape of ``source`` appended to the run log while ``alive()``: over
    itself (carriage return) on a terminal, else at most one line per ``print_every_s`` (default 10 s).
    Like ``tail -f``, the first pass reads only the last ``tail_bytes`` of the run log (from the start of a line):
    a run log of days of records was read, and every line of it parsed, before the first progress line. A file
    rotated since is read from its start (it began with the rotation). Returns the scrapes seen."""
    path, tty = Path(path), out.isatty()
    gap = 0.0 if tty else (10.0 if print_every_s is None else print_every_s)
    pos: int | None = None  # None before the first pass
    seen, last_print, last, printed = 0, -math.inf, "", ""
    cut = False  # the first pass started inside a line: skip to its end
    recent: list[tuple[float, list[Sample]]] = []  # rates over the last ~10 s: a gauge set once a second and
    # scraped once a second would otherwise read 0/s between two of its updates
    tail = ""
    appeared = said_waiting = False
    steps, epoch = Recording(), 0  # the clock's steps back over every record read (epochs()); the epoch of recent
    while True:
        running = alive()
        try:
            with open_regular(path) as (f, _):  # a FIFO there hung the follower for good
                f.seek(0, 2)
                if pos is None:  # the first pass: the tail only
                    pos = max(0, f.tell() - tail_bytes)
                    cut = pos > 0
                elif f.tell() < pos:  # rotated
                    pos, cut = 0, False
                f.seek(pos)
                data = b""
                while block := f.read(1 << 20):
                    data += block
                pos = f.tell()
            if cut:
                cut, data = b"\n" not in data, data[data.find(b"\n") + 1:] if b"\n" in data else b""
            chunk = data.decode("utf-8", errors="replace")
            appeared = True
        except NotRegularFile as exc:  # a FIFO, a device: no monitor will ever write a run log there
            raise FollowError(f"{exc}: not a run log (streamrec monitor writes a regular file)") from None
        except OSError:
            chunk = ""
            if not appeared and not said_waiting and running:
                out.write(f"waiting for the run log {path} (streamrec monitor writes it: [run_log] path in its "
                          "rules file)\n")
                out.flush()
                said_waiting = True
        tail += chunk
        *lines, tail = tail.split("\n")
        for e, t, samples in _scrapes_of(lines, source, steps):
            recent, epoch = [r for r in recent if r[0] >= t - 10.0] if e == epoch else [], e
            last = f"{source}: {progress_line(samples, recent[0] if recent else None, t)}"
            recent.append((t, samples))
            seen += 1
            if clock() - last_print >= gap:
                out.write(("\r\033[K" if tty else "") + last + ("" if tty else "\n"))
                out.flush()
                last_print, printed = clock(), last
        if not running:
            break
        time.sleep(every_s)
    if last and (tty or last != printed):
        out.write(("\r\033[K" if tty else "") + last + "\n")
        out.flush()
    if not appeared:
        raise FollowError(f"the run log {path} never appeared: is streamrec monitor running with [run_log] "
                          f"path = {str(path)!r} in its rules file?")
    return seen


def process_alive(pid: int | None) -> Callable[[], bool]:
    """Whether process ``pid`` still runs (a zombie has ended); always true without a pid."""
    def alive() -> bool:
        if pid is None:
            return True
        if pid <= 0:  # kill(0 or -n) signals a process group: no process of that number
            return False
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, OverflowError):
            return False
        except PermissionError:  # another user's process
            return True
        try:  # a zombie: ended, not yet reaped
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return True

    return alive


def follow_process(path: str | Path, source: str, pid: int | None, out: IO[str]) -> int:
    """:func:`follow` while process ``pid`` runs (for ever without one); a ``pid`` not running at the start is a
    :class:`FollowError`, not a silent exit."""
    alive = process_alive(pid)
    if not alive():
        raise FollowError(f"--pid {pid}: no such process is running (it has ended, or never ran): nothing to follow")
    return follow(path, source, alive, out)


def _scrapes_of(lines: Iterable[str], source: str, steps: Recording | None = None
                ) -> Iterator[tuple[int, float, list[Sample]]]:
    """The scrapes of ``source`` in ``lines`` with their :func:`epochs`, counted over every record as a
    :class:`Recording` counts them (a step back seen only in failed scrapes read 350 samples in 5 s as 70/s where 35 s
    had passed); ``steps`` keeps the count from one call to the next, and nothing else."""
    steps = Recording() if steps is None else steps
    for line in lines:
        try:
            rec = _record(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            r = Recording(epoch=steps.epoch, last_t=steps.last_t)
            r.add(rec)
            steps.epoch, steps.last_t = r.epoch, r.last_t
            yield from epochs(r.scrapes.get(source, []))
