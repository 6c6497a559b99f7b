"""The alert monitor: scrape Prometheus endpoints, evaluate alert rules, send firing/resolved alerts.

Three parts, each usable alone:

* :class:`Scraper` fetches the ``[sources]`` of a rules file (all at once) and parses the Prometheus
  text format into a :class:`Snapshot` (a source that fails is counted and simply contributes no data: one that
  does not answer whole within ``scrape_timeout_s``, in total, or answers more than
  :data:`SCRAPE_MAX_BYTES`, or with text cut off (empty, or its last line without a newline) or that does not
  parse, contributes none of its series);
* :class:`RuleEngine` is pure logic with the clock passed in: it keeps the sample history that
  ``rate()``/``increase()`` need and runs one state machine per rule and label set::

      inactive --cond--> pending --cond held for_s--> firing --not cond--> resolved --> inactive
          ^                 |                                                  |
          +----not cond-----+                          (pending again if cond) +

  It returns one ``firing`` alert on entering firing and one ``resolved`` alert on leaving it. A
  ``for_s`` of 0 fires on the first evaluation where the condition holds. A rule's ``keep_firing_for_s`` delays
  "not cond" out of firing until the condition has not held that long (no data alike): a rule flapping at every
  evaluation is one firing alert, not a firing and a resolved per flap. "No data" (the metric is
  missing from every source, or a series disappears) is not a true condition: pending series go back
  to inactive and firing ones resolve. A series missing because a source it comes from failed this
  scrape is *unknown* instead, for up to ``hold_s`` (``scrape_error_hold_s`` of the rules file) since
  that source began failing: it keeps its state (a pending series stays pending, its ``for_s`` still
  counting; a firing one neither resolves nor fires again). Otherwise one timed-out scrape would resolve
  an alert whose condition still holds, and a source failing now and then (more often than ``for_s``)
  would keep every rule on it from ever firing. A rule with ``absent_for_s`` fires a separate alert (``kind``
  ``absent``, labels ``{"absent": "true"}``) once its expression has had no data for that long; its state is kept
  apart from the series' (:attr:`RuleEngine.absent`, ``"absent": true`` in the state file), not under a label set,
  so a series the expression yields with the label absent="true" is a series like any other, never that alert, and
  the sinks tell the two apart by the alerts' ``kind`` and ``fingerprint`` (:mod:`monitor.alerts`).
  :meth:`RuleEngine.firing` and :meth:`RuleEngine.restore` carry the firing series over a restart
  (:class:`FiringStateFile`, the ``state_path`` of the rules file): a restored series that still holds at the
  first evaluation is announced firing again (at least once: the alert may not have been delivered before the
  restart), and one that no longer holds resolves, as if the monitor had never stopped. A series whose
  resolved alert a sink has not delivered yet stays in that file as firing, so a restart resolves it again.
  :meth:`RuleEngine.pending` and :meth:`RuleEngine.restore_pending` carry the pending series over too, as
  Prometheus' ``ALERTS_FOR_STATE`` does: the time held before the restart counts towards ``for_s``, the outage
  does not, and a restored series fires no sooner than ``for_grace_period_s`` after the start.
  :meth:`RuleEngine.no_data` and :meth:`RuleEngine.restore_no_data` do the same for the absence timers
  (``absent_for_s``).
  Durations (``for_s``, ``absent_for_s``, the ranges of ``rate()``) are measured on the clock ``now`` is read
  from, which :class:`Monitor` makes ``time.monotonic()``: a step of the wall clock (NTP) neither fires a
  pending rule early nor empties the rates' history; the wall clock only stamps the alerts (``ts``).
* :class:`Monitor` ties them to a sink and a loop that stops when its ``stop`` event is set. Sending
  only queues the alerts (:class:`~monitor.alerts.QueuedSink`: one queue and worker thread per
  sink), so a slow or dead sink never delays an evaluation; :meth:`Monitor.close` drains the queues.
  The alerts of an evaluation are queued before anything else is done with them (the run log): the
  state machines have already moved, so an alert not queued then would never be sent.
* :class:`RunLog` (``[run_log]`` of the rules file) records what the monitor saw, for ``streamrec report``
  (``monitor/report.py``): one JSON line per source and scrape with its ``streamrec_*`` samples, one per
  evaluation with each rule's state, one per alert sent; bounded by rotation.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import Counter as PCounter

from monitor.alerts import (
    Alert,
    AlertKind,
    AlertSink,
    AlertState,
    FanOut,
    QueuedSink,
    Severity,
    alert_fingerprint,
    decode_value,
    drain,
    encode_value,
    get_text,
)
from monitor.cli_text import ONCE_CONDITION_HOLDS, ONCE_OK, ONCE_SCRAPE_FAILED
from monitor.exposition import families_of
from monitor.exposition import parse as parse_exposition
from monitor.expr import Labels, Point, Window, labels_of, metrics_of, ranged_metrics
from monitor.report import utc_text
from monitor.rules import HISTORY_MAX_SERIES, Rule, RulesConfig, RunLogSettings, check_interval
from stream.errors import ConfigError
from stream.files import MAX_STATE_FILE_BYTES, open_append_regular, open_regular, read_regular, write_atomic
from stream.secrets import redact

log = logging.getLogger("streamrec.monitor")

ALERTS = PCounter("streamrec_monitor_alerts_total", "Alerts sent, by rule and state (firing, resolved).",
                  ["rule", "state"])
EVALUATIONS = PCounter("streamrec_monitor_rule_evaluations_total", "Rule evaluations, by rule.", ["rule"])
SCRAPE_ERRORS = PCounter("streamrec_monitor_scrape_errors_total", "Failed scrapes, by source.", ["source"])
STALE_SAMPLES = PCounter("streamrec_monitor_stale_samples_total",
                         "Scraped samples read as no data, stamped older than sample_max_age_s or too far ahead of "
                         "the monitor's clock, by source.", ["source"])
HISTORY_DROPPED = PCounter("streamrec_monitor_history_series_dropped_total",
                           "Scraped series kept out of the rates' history (the metric had history_max_series "
                           "already), by metric: rate()/increase()/delta() give them no data.", ["metric"])

ABSENT_LABELS: Labels = (("absent", "true"),)  # what the sinks see of an absence alert (its identity is not these)
SCRAPE_MAX_BYTES = 16 * 1024 * 1024  # a source answering more is a failed scrape (a learner's answer is ~100 KB)
# a timestamped sample older than this (s) is no data: sample_max_age_s's default, Prometheus' 5 min lookback (a
# /federate source stamps its samples with their original scrape time, 15 to 60 s old as a rule)
STALE_AFTER_S = RulesConfig.sample_max_age_s
# a timestamped sample ahead of the monitor's clock by more than this (s), plus the scrape's timeout, is bad data, no
# value (Prometheus refuses samples too far in the future as "out of bounds"): a source's clock skew is tolerated
CLOCK_SKEW_S = 5.0


# -- scraping -----------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """One scrape of every source: metric name -> label set -> value (and the source it came from)."""

    metrics: dict[str, dict[Labels, Point]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # source -> why it gave no data
    # source -> its streamrec_* samples as scraped (name, labels, value), before "first wins": what RunLog records
    raw: dict[str, list[tuple[str, dict[str, str], float]]] = field(default_factory=dict)
    # (metric, labels) -> the sources that exported it, where more than one did (the first is the one used)
    duplicates: dict[tuple[str, Labels], list[str]] = field(default_factory=dict)
    # source -> (how many of its samples were stamped too long ago or too far ahead to be current, the first): no data
    stale: dict[str, tuple[int, str]] = field(default_factory=dict)
    # metric names the sources declared (# HELP / # TYPE) or exported stale, samples or not: a labelled counter before
    # its first count
    declared: set[str] = field(default_factory=set)
    # (metric, labels) -> the timestamp (ms) of the sample used, where it had one: the rates' history keeps it in order
    stamps: dict[tuple[str, Labels], int] = field(default_factory=dict)

    def add_text(self, source: str, text: str, now_s: float | None = None,
                 stale_after_s: float = STALE_AFTER_S, ahead_s: float = CLOCK_SKEW_S) -> None:
        """Parse Prometheus text exposition format; where two sources export the same series, the first wins
        (and :attr:`duplicates` says so). Text that does not parse (:func:`monitor.exposition.parse`: a line that
        is not ``metric_name [{labels}] value [timestamp]``, or a series the source gave on an earlier line) raises,
        naming the line, and adds nothing: a source whose answer is cut short or garbled gives no data, not some
        of its series.

        A sample whose timestamp (ms) is more than ``stale_after_s`` before ``now_s`` (Unix seconds; default
        the wall clock) is not a current value: it is left out, as if not exported (no data), and counted in
        :attr:`stale`. Read as current, a target exporting old timestamped samples looked fresh. So is one stamped
        more than ``ahead_s`` after ``now_s`` (a source's clock ahead of ours: it was read as current)."""
        declared: set[str] = set()
        samples = parse_exposition(text, declared)
        self.declared |= declared
        now_ms = (time.time() if now_s is None else now_s) * 1000
        oldest_ms, newest_ms = now_ms - stale_after_s * 1000, now_ms + ahead_s * 1000
        raw = self.raw.setdefault(source, [])
        for name, lb, value, ts in samples:
            if ts is not None and not oldest_ms <= ts <= newest_ms:
                count, example = self.stale.get(source, (0, ""))
                lbl = ",".join(f'{k}="{v}"' for k, v in lb)
                why = (f"{(now_ms - ts) / 1000:.0f}s ago, older than {stale_after_s:g}s" if ts < oldest_ms else
                       f"{(ts - now_ms) / 1000:.0f}s in the future, more than the {ahead_s:g}s of clock skew tolerated")
                self.stale[source] = (count + 1, example or f"{name}{{{lbl}}} stamped {why}")
                self.declared.add(name)  # exported, though no data: not a metric no source exports
                continue
            if name.startswith("streamrec_") and not name.endswith("_created"):
                raw.append((name, dict(lb), value))
            series = self.metrics.setdefault(name, {})
            first = series.setdefault(lb, Point(value, frozenset((source,))))
            if source not in first.sources:
                self.duplicates.setdefault((name, lb), [*first.sources]).append(source)
            elif ts is not None:
                self.stamps[(name, lb)] = ts

    @classmethod
    def from_texts(cls, texts: Mapping[str, str]) -> Snapshot:
        snap = cls()
        for source, text in texts.items():
            snap.add_text(source, text)
        return snap


def _whole(text: str) -> str:
    """``text`` if it is a whole exposition; :class:`ValueError` naming the last line if it was cut off. An answer
    without a Content-Length ends where the connection does: a target that died while writing ``streamrec_lag 12345``
    gave ``streamrec_lag 12``, parsed, and one that died after its headers gave an empty answer, read as a healthy
    source with no series. The text format ends every line with a newline, so a last line without one is taken for
    such a cut. This is the monitor's own guard: the Prometheus server reads that line (promparse.go appends a
    newline to the answer; expfmt's TextParser refuses it, "unexpected end of input stream")."""
    if not text:
        raise ValueError("the answer was cut off: it is empty")
    if not text.endswith("\n"):
        last = text[text.rfind("\n") + 1:]
        shown = repr(last if len(last) <= 80 else last[:77] + "...")
        number = text.count("\n") + 1  # every newline ends a line before the last
        raise ValueError(f"the answer was cut off: its last line, line {number} ({shown}), does not end with a "
                         "newline (a target that died while writing it)")
    return text


class Scraper:
    MAX_PARALLEL = 16  # sources fetched at the same time

    def __init__(self, sources: Mapping[str, str], timeout_s: float = 5.0, stale_after_s: float = STALE_AFTER_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.sources, self.timeout_s = dict(sources), timeout_s
        for name in self.sources:  # exported at 0 from the start: a series that appears at 1 is no increase()
            SCRAPE_ERRORS.labels(name)
            STALE_SAMPLES.labels(name)
        # a sample stamped before the scrape began by more than this is no data (Snapshot.add_text)
        self.stale_after_s, self.clock = stale_after_s, clock
        self._round_deadline: float | None = None  # time.monotonic() by which every fetch of a scrape() ends

    @classmethod
    def of(cls, config: RulesConfig, clock: Callable[[], float] = time.time) -> Scraper:
        """The scraper of a rules file: a timestamped sample is stale once stamped more than ``sample_max_age_s``
        before the scrape began. It was ``scrape_error_hold_s + scrape_timeout_s``, 5 s with a hold of 0: every
        sample of a /federate source (stamped with its original scrape time) read as no data."""
        return cls(config.sources, config.scrape_timeout_s, config.sample_max_age_s, clock)

    def fetch(self, url: str) -> str:
        """The answer of ``url`` by the round's deadline (``timeout_s`` from the start of :meth:`scrape`; outside
        one, from now) in total (connect, send, every read: a target that trickles its answer is cut off too), at
        most :data:`SCRAPE_MAX_BYTES` of it; raises otherwise."""
        deadline = self._round_deadline
        return get_text(url, time.monotonic() + self.timeout_s if deadline is None else deadline, SCRAPE_MAX_BYTES)

    def scrape(self) -> Snapshot:
        """Fetch every source at once (one thread each, up to :attr:`MAX_PARALLEL`), all by one deadline, so a round
        takes ``scrape_timeout_s`` at most however many sources hang (a source still waiting for a thread then is a
        failed scrape: each fetch's own timeout added one more per :attr:`MAX_PARALLEL` hanging sources), then
        parse them in the order of the rules file (which source wins a duplicate series does not depend on which
        answered first)."""
        snap = Snapshot()
        if not self.sources:
            return snap
        started, self._round_deadline = self.clock(), time.monotonic() + self.timeout_s
        try:
            with ThreadPoolExecutor(min(len(self.sources), self.MAX_PARALLEL), thread_name_prefix="scrape") as pool:
                answers = {name: pool.submit(self.fetch, url) for name, url in self.sources.items()}
        finally:
            self._round_deadline = None
        for name, url in self.sources.items():
            try:
                snap.add_text(name, _whole(answers[name].result()), started, self.stale_after_s,
                              self.timeout_s + CLOCK_SKEW_S)  # the answer may be stamped up to timeout_s after start
                STALE_SAMPLES.labels(name).inc(snap.stale.get(name, (0, ""))[0])
            except Exception as exc:  # noqa: BLE001 - a dead source is "no data", never a crash
                why = f"no answer within scrape_timeout_s={self.timeout_s:g}s" if isinstance(exc, TimeoutError) \
                    else f"{exc}" or type(exc).__name__
                snap.errors[name] = redact(f"{url}: {why}")  # (run log, status, log: a url's password as ***)
                SCRAPE_ERRORS.labels(name).inc()
        return snap


# -- rule state -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outages:
    """The monitor's outages inside one run of a rule without data: restoring an absence timer or a firing absence
    alert cuts the time the monitor was down out of the time counted (nothing watched the source then), so the
    alert's "no data for 300s" is the time seen, and the source may have been silent for longer. The text says so,
    with the times: a restored alert that said "no data for 300s" after a ten-minute outage hid those ten minutes."""

    down_s: float = 0.0  # the time cut out, over every restart of the run
    restarts: int = 0
    last_from: float = 0.0  # the last outage: its last evaluation without data and the restart (wall-clock seconds)
    last_to: float = 0.0

    @classmethod
    def of(cls, rec: Mapping[str, Any]) -> Outages:
        """The outages a state-file record carries (:meth:`as_record`; none in a record written before they were)."""
        if not rec.get("restarts"):
            return cls()
        return cls(float(rec["down_s"]), int(rec["restarts"]), float(rec["down_from"]), float(rec["down_to"]))

    def then(self, held: float, wall: float) -> Outages:
        """These and one more outage, from ``held`` (the last evaluation without data) to the restart at ``wall``."""
        return Outages(self.down_s + max(0.0, wall - held), self.restarts + 1, held, wall)

    def as_record(self) -> dict[str, Any]:
        return {} if not self.restarts else {"down_s": self.down_s, "restarts": self.restarts,
                                             "down_from": self.last_from, "down_to": self.last_to}

    def text(self) -> str:
        """`` (not counting the 615s the monitor did not watch it across a restart: from its last evaluation at
        2026-12-06 13:00:00 UTC to the restart at 2026-12-06 13:10:15 UTC)``; "" for none."""
        if not self.restarts:
            return ""
        across = f"{self.restarts} restarts, the last" if self.restarts > 1 else "a restart:"
        return (f" (not counting the {self.down_s:.0f}s the monitor did not watch it across {across} from its last "
                f"evaluation at {utc_text(self.last_from)} to the restart at {utc_text(self.last_to)})")


class State(str, enum.Enum):
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"  # for one evaluation after firing ends


@dataclass
class SeriesState:
    state: State = State.INACTIVE
    since: float = 0.0  # when the current state began (pending: when the condition first held)
    value: float | None = None
    sources: frozenset[str] = frozenset()
    restored: bool = False  # firing as restored after a restart: announced again if it still holds
    held: float = -math.inf  # when the condition last held (keep_firing_for_s counts from there)


@dataclass(frozen=True)
class SeriesStatus:
    """One row of ``streamrec monitor --once``."""

    rule: str
    labels: dict[str, str]
    state: State
    value: float | None
    since: float | None
    severity: str
    condition: str
    for_s: float
    kind: AlertKind = AlertKind.SERIES  # the rule's absence alert is "absent": its labels may be a series' too
    fingerprint: str = ""  # its alerts' (monitor.alerts); "" for the row of a rule with no series

    def as_dict(self) -> dict[str, Any]:
        from monitor.alerts import encode_value

        return {"rule": self.rule, "labels": self.labels, "state": self.state.value,
                "value": encode_value(self.value), "since": self.since, "severity": self.severity,
                "condition": self.condition, "for_s": self.for_s, "kind": self.kind.value,
                "fingerprint": self.fingerprint}


class MetricHistory:
    """The MetricStore of one evaluation: the latest snapshot plus the samples of earlier scrapes.

    Bounded whatever the sources export: only the metrics in ``metrics`` are kept (the rules' engine passes
    those a ``rate()``/``increase()``/``delta()`` reads; None keeps every metric), a label set is forgotten
    once it has no sample in the last ``keep_s`` (a label with a new value every scrape), and a metric keeps
    at most ``max_series`` label sets: a new one beyond that gets no history (counted in
    ``streamrec_monitor_history_series_dropped_total`` and logged once while the metric is over), the ones
    kept go on. Without that, every series of every scrape stayed for ``keep_s``, however many there were."""

    def __init__(self, keep_s: float, metrics: set[str] | None = None,
                 max_series: int = HISTORY_MAX_SERIES) -> None:
        self.keep_s, self.metrics, self.max_series = keep_s, metrics, max_series
        self.samples: dict[str, dict[Labels, deque[tuple[float, float]]]] = {}
        self.sources: dict[tuple[str, Labels], frozenset[str]] = {}
        # the history of another source's series of the same name and labels, set aside while this one's is read
        self.aside: dict[tuple[str, Labels, frozenset[str]], deque[tuple[float, float]]] = {}
        self.stamps: dict[tuple[str, Labels], int] = {}  # the timestamp (ms) of the last stamped sample kept
        self.over: set[str] = set()  # metrics over max_series at the last scrape (logged once while they are)
        self.now = 0.0
        self.snapshot = Snapshot()

    def record(self, snap: Snapshot, now: float) -> None:
        self.now, self.snapshot = now, snap
        if self.keep_s <= 0:
            return
        self._prune(now - self.keep_s)  # first: room for new label sets where old ones ended
        over: dict[str, int] = {}
        for metric, series in snap.metrics.items():
            if self.metrics is not None and metric not in self.metrics:
                continue
            per = self.samples.setdefault(metric, {})
            for lb, p in series.items():
                if (old := self.sources.get((metric, lb), p.sources)) != p.sources:
                    # another process's series of the same name and labels (two sources export it and the
                    # first failed this scrape): its counter is not this one's, so it reads its own history,
                    # not the other's (a reset or a rise: a false increase()); the other's is set aside, not
                    # dropped, so the first source's next answer still has its rate (it had none: resolved)
                    if (q := per.pop(lb, None)) is not None:
                        self.aside[(metric, lb, old)] = q
                    if (q := self.aside.pop((metric, lb, p.sources), None)) is not None:
                        per[lb] = q
                    self.stamps.pop((metric, lb), None)  # another source's clock
                stamp = snap.stamps.get((metric, lb))
                if stamp is not None and stamp < self.stamps.get((metric, lb), stamp):
                    # stamped before the last sample kept (two /federate replicas behind one URL, answering in turn):
                    # an older value, not the next one; read as the next, a counter's older value was a reset and
                    # its whole value an increase() (Prometheus drops such a sample: out of order)
                    continue
                q = per.get(lb)
                if q is None:
                    if len(per) >= self.max_series:
                        over[metric] = over.get(metric, 0) + 1
                        continue
                    q = per[lb] = deque()
                q.append((now, p.value))
                self.sources[(metric, lb)] = p.sources
                if stamp is not None:
                    self.stamps[(metric, lb)] = stamp
            if not per:
                del self.samples[metric]
        for metric, n in over.items():
            HISTORY_DROPPED.labels(metric).inc(n)
            if metric not in self.over:
                log.warning("metric %s has more than history_max_series=%d label sets: %d new one(s) get no "
                            "rate()/increase()/delta() history (streamrec_monitor_history_series_dropped_total "
                            "counts them; logged again only after it is back under)", metric, self.max_series, n)
        self.over = set(over)

    def _prune(self, horizon: float) -> None:
        """Drop the samples older than ``horizon``, and the label sets and metrics left with none."""
        for metric in list(self.samples):
            per = self.samples[metric]
            for lb in list(per):
                q = per[lb]
                while q and q[0][0] < horizon:
                    q.popleft()
                if not q:
                    del per[lb]
                    self.sources.pop((metric, lb), None)
                    self.stamps.pop((metric, lb), None)
            if not per:
                del self.samples[metric]
        for key in list(self.aside):
            q = self.aside[key]
            while q and q[0][0] < horizon:
                q.popleft()
            if not q:
                del self.aside[key]

    # MetricStore
    def instant(self, metric: str) -> Mapping[Labels, Point]:
        return self.snapshot.metrics.get(metric, {})

    def window(self, metric: str, range_s: float) -> Mapping[Labels, Window]:
        start = self.now - range_s
        return {lb: ([s for s in q if s[0] >= start], self.sources.get((metric, lb), frozenset()))
                for lb, q in self.samples.get(metric, {}).items()}


EXPORTED_PREFIX = "exported_"  # a series label named like one of its rule's labels, as Prometheus renames them


def alert_labels(rule_labels: Mapping[str, str], series: Labels) -> dict[str, str]:
    """The labels an alert shows: the rule's own labels (from the rules file) and the series', where a series label
    named like a rule label keeps its value under ``exported_<name>`` (``exported_exported_<name>``, ... while that
    name is taken), as Prometheus keeps a scraped label that collides with a target label (``honor_labels: false``).
    Merged plainly, the series' value replaced the rule's (or equalled it), so with rule labels {team="x"} the series
    {} and {team="x"} showed the same labels. The alert's identity is its fingerprint (of the series' own labels),
    not these: renaming keeps the colliding value readable but cannot make every pair of label sets differ (a
    series may have an ``exported_`` label of its own)."""
    out = {**dict(series), **rule_labels}
    for name, value in sorted((kv for kv in series if kv[0] in rule_labels), key=lambda kv: (len(kv[0]), kv[0])):
        renamed = EXPORTED_PREFIX + name
        while renamed in out:
            renamed = EXPORTED_PREFIX + renamed
        out[renamed] = value
    return out


def _fmt(v: float | None) -> str:
    return "no data" if v is None else f"{v:.4g}"


class RuleEngine:
    """Evaluates rules against snapshots; pure logic (``now`` is passed in, nothing sleeps)."""

    @classmethod
    def of(cls, config: RulesConfig) -> RuleEngine:
        """The engine of a rules file's rules and settings (``streamrec monitor`` and ``--once`` alike)."""
        return cls(config.rules, config.history_s, config.scrape_error_hold_s, config.history_max_series,
                   config.for_grace_period_s)

    def __init__(self, rules: Sequence[Rule], history_s: float = 0.0, hold_s: float = 0.0,
                 history_max_series: int = HISTORY_MAX_SERIES, grace_s: float = 0.0) -> None:
        self.rules = list(rules)
        self.by_name = {r.name: r for r in self.rules}
        self.hold_s = hold_s  # how long a series whose source fails to scrape keeps its state
        self.grace_s = grace_s  # a pending series restored at start fires no sooner than this after it
        self.failing_since: dict[str, float] = {}  # source -> when its scrapes began failing
        self.scrape_errors: dict[str, str] = {}  # source -> why its last scrape failed (the alerts' text says it)
        self.stale: set[str] = set()  # the sources of stale samples (no data) at the last scrape (the alerts' text)
        self.data_sources: dict[str, frozenset[str]] = {}  # rule -> the sources of its last data (absence text)
        # a little more than the longest range, so a range of 60 s still sees a sample 60 s old; only the metrics
        # a range is read over (every other is read from the latest scrape alone)
        ranged = set().union(*(ranged_metrics(r.tree) for r in self.rules if r.tree is not None))
        self.history = MetricHistory(history_s * 1.5 if history_s else 0.0, ranged, history_max_series)
        self.states: dict[str, dict[Labels, SeriesState]] = {r.name: {} for r in self.rules}
        # the absence alert of each rule with absent_for_s: apart from the series, keyed by nothing a label set can
        # equal (under ABSENT_LABELS a series with the label absent="true" resolved or silenced that alert)
        self.absent: dict[str, SeriesState] = {}
        self.no_data_since: dict[str, float | None] = {r.name: None for r in self.rules}
        self.no_data_held: dict[str, float] = {}  # rule -> the last evaluation without data (what no_data() saves)
        # rule -> the monitor's outages cut out of its time without data by restarts (restore_no_data, restore): the
        # absence text says them, as what it counts is not how long the source has been silent
        self.no_data_down: dict[str, Outages] = {}
        self.evaluations = 0
        self.wall_offset = 0.0  # wall clock minus the engine's clock, at the last evaluation
        # the resolved alerts of the last evaluation, each with its series as firing() writes it
        self.resolved: list[tuple[Alert, dict[str, Any]]] = []
        # restored firing records of rules no longer in the rules file (renamed, removed): resolved at the next
        # evaluation, as restore() could not give them a rule
        self.retired: list[dict[str, Any]] = []

    def evaluate(self, snap: Snapshot, now: float, wall: float | None = None) -> list[Alert]:
        """One evaluation at ``now`` (seconds on the clock durations are measured on; :class:`Monitor` uses
        ``time.monotonic()``); ``wall`` (Unix seconds, default ``now``) stamps the alerts and the status."""
        self.wall_offset = 0.0 if wall is None else wall - now
        for source in snap.errors:
            self.failing_since.setdefault(source, now)
        for source in set(self.failing_since) - set(snap.errors):
            del self.failing_since[source]
        self.scrape_errors = dict(snap.errors)
        self.stale = set(snap.stale)
        self.history.record(snap, now)
        self.evaluations += 1
        self.resolved = []
        alerts: list[Alert] = []
        for rule in self.rules:
            EVALUATIONS.labels(rule.name).inc()
            alerts.extend(self._evaluate_rule(rule, now))
        alerts.extend(self._resolve_retired(now))
        for a in alerts:
            ALERTS.labels(a.rule, a.state.value).inc()
        return alerts

    def _evaluate_rule(self, rule: Rule, now: float) -> list[Alert]:
        assert rule.tree is not None
        try:
            val = rule.tree.eval(self.history)
        except (ArithmeticError, ValueError) as exc:  # overflow and the like: no data this round
            log.warning("rule %s: %s evaluates to an error: %s", rule.name, rule.expr, exc)
            val = {}
        series: dict[Labels, Point] = val if isinstance(val, dict) else {(): Point(float(val), frozenset())}
        states = self.states[rule.name]
        out: list[Alert] = []
        for lb in set(states) | set(series):
            st = states.setdefault(lb, SeriesState(since=now))
            p = series.get(lb)
            if p is None and self._unknown(st, now):
                continue  # its source failed this scrape: neither true nor false, keep the state
            holds = p is not None and rule.op.holds(p.value, rule.threshold)
            st.value = None if p is None else p.value
            if p is not None:
                st.sources = p.sources
            alert = self._step(rule, lb, st, holds, now)
            if alert is not None:
                out.append(alert)
            if st.state is State.INACTIVE and p is None:
                del states[lb]  # the series is gone: forget it
        if series:
            self.data_sources[rule.name] = frozenset().union(*(p.sources for p in series.values()))
        out.extend(self._absence(rule, bool(series), now))
        return out

    def _resolve_retired(self, now: float) -> list[Alert]:
        """The resolved alert of each restored record whose rule is no longer in the rules file (or, an absence alert,
        no longer has ``absent_for_s``): with the identity (fingerprint), labels and severity its firing alert had, so
        the receiver does not show it firing for ever. A record written before ``severity`` was kept resolves with
        its rule's, or as a warning where the rule is gone (its fingerprint, what receivers match on, is exact)."""
        out = []
        for rec in self.retired:
            lb, absent, rule = labels_of(rec["labels"]), rec.get("absent") is True, self.by_name.get(rec["rule"])
            sources = sorted(rec.get("sources", ()))
            why = "the rule is no longer in the rules file" if rule is None else "the rule no longer has absent_for_s"
            alert = Alert(rule=rec["rule"], source=",".join(sources),
                          severity=Severity(rec.get("severity", (rule.severity if rule else Severity.WARNING).value)),
                          state=AlertState.RESOLVED, value=None, threshold=decode_value(rec.get("threshold")),
                          message=f"{rec['rule']}: {why}: its alert, firing when the monitor stopped, is resolved",
                          ts=int(round((now + self.wall_offset) * 1000)),
                          labels=alert_labels(rec.get("rule_labels", dict(rule.labels) if rule else {}), lb),
                          kind=AlertKind.ABSENT if absent else AlertKind.SERIES,
                          fingerprint=self._fingerprint(rec["rule"], lb, absent))
            self.resolved.append((alert, rec))
            out.append(alert)
        self.retired = []
        return out

    def _unknown(self, st: SeriesState, now: float) -> bool:
        """Whether a pending or firing series that is missing now comes from a source that has been failing
        to scrape for less than :attr:`hold_s`."""
        if st.state not in (State.PENDING, State.FIRING):
            return False
        since = [self.failing_since[s] for s in st.sources if s in self.failing_since]
        return bool(since) and now - min(since) < self.hold_s

    def _step(self, rule: Rule, lb: Labels, st: SeriesState, holds: bool, now: float) -> Alert | None:
        if st.state is State.RESOLVED:
            st.state, st.since = State.INACTIVE, now
        restored, st.restored = st.restored, False
        if holds:
            st.held = now
            if st.state is State.INACTIVE:
                st.state, st.since = State.PENDING, now
            if st.state is State.PENDING and now - st.since >= rule.for_s:
                st.state, st.since = State.FIRING, now
                return self._alert(rule, lb, st, AlertState.FIRING, now)
            if restored:  # still firing after a restart: say so again (it may never have been delivered)
                return self._alert(rule, lb, st, AlertState.FIRING, now)
            return None
        if st.state is State.PENDING:
            st.state, st.since = State.INACTIVE, now
        elif st.state is State.FIRING and now - st.held < rule.keep_firing_for_s:
            st.restored = restored  # (restored: announced again when it next holds, as it may never have been)
            return None  # a flap: keeps firing until the condition has not held for keep_firing_for_s
        elif st.state is State.FIRING:
            st.state, st.since = State.RESOLVED, now
            return self._alert(rule, lb, st, AlertState.RESOLVED, now)
        return None

    def _absence(self, rule: Rule, has_data: bool, now: float) -> list[Alert]:
        if has_data:
            self.no_data_since[rule.name] = None
            self.no_data_down.pop(rule.name, None)
        elif self.no_data_since[rule.name] is None:
            self.no_data_since[rule.name] = now
        if not has_data:
            self.no_data_held[rule.name] = now
        if rule.absent_for_s is None:
            return []
        st = self.absent.setdefault(rule.name, SeriesState(since=now))
        since = self.no_data_since[rule.name]
        absent = since is not None and now - since >= rule.absent_for_s
        if st.state is State.RESOLVED:
            st.state, st.since = State.INACTIVE, now
        restored, st.restored = st.restored, False
        if absent and (st.state is not State.FIRING or restored):
            if st.state is not State.FIRING:
                st.state, st.since = State.FIRING, now
            return [self._alert(rule, ABSENT_LABELS, st, AlertState.FIRING, now, absent=True)]
        if not absent and st.state is State.FIRING:
            st.state, st.since = State.RESOLVED, now
            return [self._alert(rule, ABSENT_LABELS, st, AlertState.RESOLVED, now, absent=True)]
        return []

    def _alert(self, rule: Rule, lb: Labels, st: SeriesState, state: AlertState, now: float,
               absent: bool = False) -> Alert:
        labels = alert_labels(rule.labels, lb)
        what = rule.description or rule.name
        if absent:
            since = self.no_data_since[rule.name]
            why = self._failing(self.data_sources.get(rule.name) or {*self.scrape_errors, *self.stale}, now)
            down = self.no_data_down.get(rule.name, Outages()).text()
            msg = (f"{what}: no data for {rule.expr} for {now - since:.0f}s{down}{why}"
                   if state is AlertState.FIRING and since is not None else f"{what}: {rule.expr} has data again")
            value = None
        elif state is AlertState.FIRING:
            held = f" for {rule.for_s:g}s" if rule.for_s else ""
            msg = f"{what}: {rule.condition} held{held} (value {_fmt(st.value)})"
            value = st.value
        else:
            now_is = "no data" + self._failing(st.sources, now) if st.value is None else f"value {_fmt(st.value)}"
            msg = f"{what}: {rule.condition} no longer holds ({now_is})"
            value = st.value
        alert = Alert(rule=rule.name, source=",".join(sorted(st.sources)), severity=rule.severity, state=state,
                      value=value, threshold=rule.threshold, message=msg,
                      ts=int(round((now + self.wall_offset) * 1000)), labels=labels,
                      kind=AlertKind.ABSENT if absent else AlertKind.SERIES,
                      fingerprint=self._fingerprint(rule.name, lb, absent))
        if state is AlertState.RESOLVED:
            self.resolved.append((alert, self._record(rule.name, lb, st, absent)))
        return alert

    def _failing(self, sources: Iterable[str], now: float) -> str:
        """Why an alert has no data where a source it reads fails to scrape: ``: source learner failing to scrape
        for 60s (<why>)`` (``; `` between two), or exported stale samples at the last scrape: `` (stale samples from
        source learner)`` (the log names one); "" where none does; an absence alert
        names the sources of its rule's last data, or every failing or stale source where it has had none since the
        start. Without it a dead target (or one exporting what it saw long ago) resolved its alerts as "no longer
        holds (no data)" and fired absence alerts as "no data", as if what they watch had recovered or stopped being
        exported."""
        shown = sorted(sources)
        failing = [f"source {s} failing to scrape for {now - self.failing_since.get(s, now):.0f}s "
                   f"({self.scrape_errors[s]})" for s in shown if s in self.scrape_errors]
        stale = "".join(f" (stale samples from source {s})" for s in shown if s in self.stale)
        return (": " + "; ".join(failing) if failing else "") + stale

    @staticmethod
    def _fingerprint(name: str, lb: Labels, absent: bool) -> str:
        """The identity the sinks see (``fingerprint`` of the alert JSON), of the alert of series ``lb`` of rule
        ``name`` or (``absent``) of its absence alert: of the series' own labels, not the ones the alert shows
        (:func:`alert_labels` adds the rule's), so two series are two alerts whatever the rule's labels are."""
        return alert_fingerprint(name, AlertKind.ABSENT if absent else AlertKind.SERIES, dict(lb))

    def _record(self, name: str, lb: Labels, st: SeriesState, absent: bool = False) -> dict[str, Any]:
        """A firing series for the state file; an absence alert is marked ``"absent": true`` (its labels are
        only what the sinks see: a series of the rule may have the same). ``fingerprint`` is its alerts' (written
        for whoever reads the file; restore computes it again from the rule, ``absent`` and the labels)."""
        rule = self.by_name[name]  # what a resolve needs once the rule is gone (_resolve_retired)
        counted = self._no_data_counted(name) if absent and st.state is State.FIRING else {}
        if not absent and math.isfinite(st.held):  # when it last held: restore() goes on with keep_firing_for_s
            counted = {"held": st.held + self.wall_offset}
        return {"rule": name, "labels": dict(lb), "since": st.since + self.wall_offset,
                "value": encode_value(st.value), "sources": sorted(st.sources), **({"absent": True} if absent else {}),
                **counted,
                "fingerprint": self._fingerprint(name, lb, absent), "severity": rule.severity.value,
                "threshold": encode_value(rule.threshold), "rule_labels": dict(rule.labels)}

    def firing(self) -> list[dict[str, Any]]:
        """The firing series, as :meth:`restore` reads them back (``since`` in wall-clock seconds)."""
        return ([self._record(name, lb, st)
                 for name, states in self.states.items() for lb, st in states.items() if st.state is State.FIRING]
                + [self._record(name, ABSENT_LABELS, st, absent=True)
                   for name, st in self.absent.items() if st.state is State.FIRING]
                + [dict(rec) for rec in self.retired])  # not resolved yet: kept for the next start

    def restore(self, records: Sequence[Mapping[str, Any]], now: float, wall: float) -> int:
        """Mark the series of ``records`` (from :meth:`firing`, before a restart) firing again; records of
        rules no longer in the file (renamed, removed) are resolved at the next evaluation (they were skipped, and
        their alerts stayed firing at the receivers for ever), and so is the absence alert of a rule that no longer
        has ``absent_for_s``. Returns how many were restored."""
        self.wall_offset = wall - now  # a save before the first evaluation (a stop at once) writes wall times too
        restored = 0
        for rec in records:
            rule = self.by_name.get(rec["rule"])
            if rule is None:
                self.retired.append(dict(rec))
                restored += 1
                continue
            since = min(now, now - (wall - float(rec["since"])))
            st = SeriesState(State.FIRING, since, decode_value(rec.get("value")), frozenset(rec.get("sources", ())),
                             restored=True)
            if rec.get("absent") is True:
                if rule.absent_for_s is None:  # its absent_for_s removed: nothing watches that alert any more
                    self.retired.append(dict(rec))
                    restored += 1
                    continue
                # absent still, until data comes; for the text, the time it had counted and the outage it did not
                counted = max(float(rec.get("counted_s", rule.absent_for_s)), rule.absent_for_s)
                self.no_data_since[rule.name] = now - counted
                # its outage said only from a last evaluation before the restart (a damaged file's time, past any
                # date, raised in every evaluation's text; a wall clock stepped back said it ended before it began)
                if "held" in rec and 0.0 <= float(rec["held"]) <= wall:
                    self.no_data_down[rule.name] = Outages.of(rec).then(float(rec["held"]), wall)
                self.absent[rule.name] = st
            else:
                # keep_firing_for_s counts on from when it last held, the outage included (not seen to hold then):
                # without it, a flapping rule restarted at a flap resolved at once and fired again at the next
                if "held" in rec and float(rec["held"]) <= wall:
                    st.held = now - (wall - float(rec["held"]))
                self.states[rule.name][labels_of(rec["labels"])] = st
            restored += 1
        return restored

    def pending(self) -> list[dict[str, Any]]:
        """The pending series, as :meth:`restore_pending` reads them back: ``since`` (the condition first held)
        and ``held`` (it last held) in wall-clock seconds, and the rule's ``condition`` they held under."""
        return [{"rule": name, "labels": dict(lb), "since": st.since + self.wall_offset,
                 "held": st.held + self.wall_offset, "value": encode_value(st.value), "sources": sorted(st.sources),
                 "condition": self.by_name[name].condition, "fingerprint": self._fingerprint(name, lb, False)}
                for name, states in self.states.items() for lb, st in states.items() if st.state is State.PENDING]

    def restore_pending(self, records: Sequence[Mapping[str, Any]], now: float, wall: float) -> int:
        """Mark the series of ``records`` (from :meth:`pending`, before a restart) pending again, their ``for_s``
        counting on from the time they had held, as Prometheus restores ``ALERTS_FOR_STATE``: the time the monitor
        was down is not counted (nothing saw the condition then), and a restored series fires no sooner than
        :attr:`grace_s` after this start (the rates' history starts empty; a short outage of the monitor must not
        fire every rule at once). A record is skipped (its series starts over, as without a state file) where its
        rule is gone or has another condition, its series is restored firing, or :meth:`_restored_since` finds
        nothing to save. Returns how many were restored."""
        self.wall_offset = wall - now  # a save before the first evaluation (a stop at once) writes wall times too
        restored = 0
        for rec in records:
            rule = self.by_name.get(rec["rule"])
            lb = labels_of(rec["labels"])
            if rule is None or rec.get("condition") != rule.condition or lb in self.states[rule.name]:
                continue
            since = self._restored_since(rule.for_s, float(rec["since"]), float(rec["held"]), now, wall)
            if since is not None:
                # held "now": the outage is cut out of its time, so a save before it holds again (a stop, its
                # source failing) keeps what it had held; -inf, the default, made that save raise (JSON has no -inf)
                self.states[rule.name][lb] = SeriesState(State.PENDING, since, decode_value(rec.get("value")),
                                                         frozenset(rec.get("sources", ())), held=now)
                restored += 1
        return restored

    def no_data(self) -> list[dict[str, Any]]:
        """The absence timers still running (a rule with ``absent_for_s`` without data, its absence alert not firing
        yet), as :meth:`restore_no_data` reads them back: ``since`` (the first evaluation without data) and ``held``
        (the last) in wall-clock seconds, and the rule's ``expr`` they ran under."""
        return [{"rule": rule.name, "expr": rule.expr, "since": since + self.wall_offset,
                 "held": self.no_data_held[rule.name] + self.wall_offset,
                 **self.no_data_down.get(rule.name, Outages()).as_record()}
                for rule in self.rules if rule.absent_for_s is not None
                and (since := self.no_data_since[rule.name]) is not None
                and (rule.name not in self.absent or self.absent[rule.name].state is not State.FIRING)]

    def restore_no_data(self, records: Sequence[Mapping[str, Any]], now: float, wall: float) -> int:
        """Start the absence timers of ``records`` (from :meth:`no_data`, before a restart) where they stopped, as
        :meth:`restore_pending` does the pending series: the time without data before the restart counts towards
        ``absent_for_s``, the time the monitor was down does not, and the alert fires no sooner than :attr:`grace_s`
        after this start. Without it a monitor restarted more often than ``absent_for_s`` (a crash loop) never sent
        the absence alert, however long the data had been missing. A record is skipped (its timer starts over) where
        its rule is gone, has another ``expr`` or no ``absent_for_s``, its absence alert is restored firing, or
        :meth:`_restored_since` finds nothing to save. Returns how many were restored."""
        self.wall_offset = wall - now  # a save before the first evaluation (a stop at once) writes wall times too
        restored = 0
        for rec in records:
            rule = self.by_name.get(rec["rule"])
            if (rule is None or rule.absent_for_s is None or rec["expr"] != rule.expr
                    or self.no_data_since[rule.name] is not None):
                continue
            since = self._restored_since(rule.absent_for_s, float(rec["since"]), float(rec["held"]), now, wall)
            if since is not None:
                self.no_data_since[rule.name], self.no_data_held[rule.name] = since, now  # the outage cut out
                self.no_data_down[rule.name] = Outages.of(rec).then(float(rec["held"]), wall)  # ...and said
                restored += 1
        return restored

    def _no_data_counted(self, name: str) -> dict[str, Any]:
        """What a firing absence alert's record keeps for :meth:`restore` to say how long its rule has had no data:
        ``held`` (the last evaluation without data, wall-clock seconds), ``counted_s`` (the time without data counted
        until then) and the outages cut out of it (:class:`Outages`); none where its timer is not running."""
        since = self.no_data_since[name]
        if since is None or name not in self.no_data_held:
            return {}
        held = self.no_data_held[name]
        return {"held": held + self.wall_offset, "counted_s": held - since,
                **self.no_data_down.get(name, Outages()).as_record()}

    def _restored_since(self, for_s: float, since: float, held: float, now: float, wall: float) -> float | None:
        """The ``since`` (on the engine's clock, ``now``) of a timer of ``for_s`` (a pending series' ``for_s``, an
        absence timer's ``absent_for_s``) restored after it had held from wall time ``since`` to ``held`` before the
        restart; None where restoring it cannot fire it sooner than a fresh ``for_s`` would (a ``for_s`` shorter
        than the grace period), or where the monitor has not seen it hold for longer than ``for_s`` (an outage
        longer than the whole hold: what the condition did meanwhile is anyone's guess, and a fresh ``for_s`` delays
        the alert by no more than the outage already did), or the times are out of order (a wall clock stepped back
        across the restart)."""
        spent, down = held - since, wall - held
        if not (0.0 <= spent and 0.0 <= down <= for_s):
            return None
        remaining = max(for_s - spent, self.grace_s)
        return None if remaining >= for_s else now - (for_s - remaining)

    def status(self) -> list[SeriesStatus]:
        rows = []
        for rule in self.rules:
            shown = sorted(self.states[rule.name].items())
            absent = self.absent.get(rule.name)
            rows_of = [(lb, st, False) for lb, st in shown]
            if absent is not None and absent.state is not State.INACTIVE:
                rows_of.append((ABSENT_LABELS, absent, True))
            if not rows_of:
                rows.append(SeriesStatus(rule.name, {}, State.INACTIVE, None, None, rule.severity.value,
                                         rule.condition, rule.for_s))
            for lb, st, is_absent in rows_of:
                rows.append(SeriesStatus(rule.name, dict(lb), st.state, st.value, st.since + self.wall_offset,
                                         rule.severity.value, rule.condition, rule.for_s,
                                         AlertKind.ABSENT if is_absent else AlertKind.SERIES,
                                         self._fingerprint(rule.name, lb, is_absent)))
        return rows


def evaluate_once(config: RulesConfig) -> tuple[dict[str, Any], int]:
    """Scrape every source once and evaluate every rule once: the summary (every rule's state, the scrape
    errors) and the exit status (``ONCE_*``). Sends nothing."""
    engine = RuleEngine.of(config)
    snap = Scraper.of(config).scrape()
    warn_stale(snap)  # as the daemon does at its first scrape
    UnexportedMetrics(config).warn(snap)
    engine.evaluate(snap, time.time())
    rows = engine.status()
    summary = {"rules_file": config.origin, "sources": dict(config.sources), "scrape_errors": snap.errors,
               "rules": [r.as_dict() for r in rows]}
    if snap.errors:
        return summary, ONCE_SCRAPE_FAILED
    holds = any(r.state in (State.PENDING, State.FIRING) for r in rows)
    return summary, ONCE_CONDITION_HOLDS if holds else ONCE_OK


def once_text(d: dict[str, Any]) -> str:
    """``evaluate_once``'s summary for a terminal: the sources, each failed scrape, one line per rule state."""
    lines = [f"rules: {d['rules_file']}", "sources: " + (", ".join(f"{k}={v}" for k, v in d["sources"].items())
                                                         or "none")]
    for name, err in d.get("scrape_errors", {}).items():
        lines.append(f"  scrape of {name} failed: {err}")
    for r in d["rules"]:
        lbl = ",".join(f'{k}="{v}"' for k, v in sorted(r["labels"].items()))
        lbl += "} absent" if r.get("kind") == AlertKind.ABSENT.value else "}"
        value = "no data" if r["value"] is None else r["value"]
        lines.append(f"  {r['state']:<9} {r['severity']:<8} {r['rule']}{{{lbl} value={value}  "
                     f"[{r['condition']} for {r['for_s']:g}s]")
    return "\n".join(lines)

# -- run log ----------------------------------------------------------------------------------------
def _json_value(v: float | None) -> float | str | None:
    """A sample value for JSON: non-finite values as Prometheus writes them ("NaN", "+Inf", "-Inf")."""
    if v is None or math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


_STATE_RANK = {State.INACTIVE: 0, State.RESOLVED: 1, State.PENDING: 2, State.FIRING: 3}


class RunLog:
    """What the monitor saw, appended as JSON lines (``monitor/report.py`` reads them back)::

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
            mine = os.fstat(f.fileno())
            try:  # the file the append goes to (one renamed away meanwhile, or not readable: left as it is)
                with open_regular(self.path) as (raw, st):
                    if ((st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) and st.st_size
                            and raw.seek(st.st_size - 1) >= 0 and raw.read(1) != b"\n"):
                        f.write("\n")
            except OSError as exc:  # (a log the monitor may write but not read ran before; a rotation's rename)
                log.debug("run log %s: its last line not checked (%s)", self.path, exc)
        except BaseException:
            f.close()
            raise
        return f

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
        self._file.close()


# -- firing state across restarts ---------------------------------------------------------------------
class FiringStateFile:
    """``state_path`` of the rules file: the firing series (:meth:`RuleEngine.firing`) as JSON, rewritten
    atomically after every evaluation that sent an alert and at close, read back at start. Without it a
    restart forgets what was firing: an alert whose condition cleared while the monitor was down never
    resolves, and one still holding fires again only after ``for_s``. :class:`Monitor` also keeps here, as
    firing, the series whose resolved alert some sink has not delivered yet (still queued at shutdown, or
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

    ``pending`` (:meth:`RuleEngine.pending`) was also added to version 2 later, the pending series, so a monitor
    restarted more often than a rule's ``for_s`` (a crash loop, frequent deploys) still fires it
    (:meth:`RuleEngine.restore_pending`): the file is then rewritten after every evaluation while a series is pending
    (``held``, when each last held, moves on). Not a version 3: a file without it (an older monitor's) is read
    as having none, in silence, and an older monitor reading a newer file ignores it and keeps its firing records,
    where an unknown version would have dropped them. ``no_data`` (:meth:`RuleEngine.no_data`), the absence timers
    still running, was added the same way and for the same reason (``absent_for_s``,
    :meth:`RuleEngine.restore_no_data`). The timers and the firing absence alerts' records also carry, where a restart
    cut the monitor's outage out of their time, ``down_s``/``restarts``/``down_from``/``down_to`` (:class:`Outages`),
    and a firing absence alert's record ``held`` and ``counted_s``, so the restored alert's text says what it counted
    and what it did not; a record without them (an older monitor's) restores as before. A firing series' record also
    carries ``held`` (when its condition last held, wall-clock seconds), so ``keep_firing_for_s`` counts on across the
    restart (an older monitor's record without it resolves at the first evaluation that does not hold, as before)."""

    VERSION = 2

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failures = 0
        self.failing = False  # the last write failed: write again at the next evaluation

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
        """Whether the outages of a record (:meth:`Outages.as_record`) are none or whole: a count of restarts and
        finite times."""
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
        data = json.dumps({"version": self.VERSION, "firing": list(firing), "pending": list(pending),
                           "no_data": list(no_data)}, allow_nan=False).encode()
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


# -- loop -----------------------------------------------------------------------------------------
def warn_stale(snap: Snapshot, logged: Iterable[str] = ()) -> set[str]:
    """Log each source of ``snap`` whose samples were stamped too old or too far ahead to be current, except those
    in ``logged`` (the daemon's last scrape: once while they stay so); the sources logged (``streamrec monitor`` and
    ``--once``, where the rule reading them otherwise showed "no data" without a reason)."""
    for source in set(snap.stale).difference(logged):
        n, first = snap.stale[source]
        log.warning("source %s: %d sample(s) carry a timestamp too old or too far ahead to be current (e.g. %s): "
                    "read as no data (a target exporting what it last saw long ago, or a clock ahead of this "
                    "host's?)", source, n, first)
    return set(snap.stale)


class UnexportedMetrics:
    """The rules reading a metric no source exports, warned about once (``streamrec monitor`` and ``--once``)."""

    def __init__(self, config: RulesConfig) -> None:
        self.sources = set(config.sources)
        # the metrics each rule reads, until it is settled: some source exported them all, or it was warned about
        self._unsettled = {r.name: metrics_of(r.tree) for r in config.rules if r.tree is not None}
        self._exported: set[str] = set()  # the rules' metrics some source has exported since the start
        self._answered: set[str] = set()  # the sources scraped successfully at least once

    def warn(self, snap: Snapshot) -> None:
        """One warning per rule whose expression reads a metric that no source has exported, once every source has
        answered at least once: without it such a rule (a misspelt metric, a source missing from ``[sources]``)
        read as "no data" for ever, in silence."""
        if not self._unsettled:
            return
        self._answered.update(set(snap.raw) - set(snap.errors))
        wanted = set().union(*self._unsettled.values())
        self._exported.update(m for m in wanted if m in snap.metrics or families_of(m) & snap.declared)
        if not self.sources <= self._answered:
            return  # a source that never answered may still export them
        for rule, metrics in list(self._unsettled.items()):
            missing = sorted(metrics - self._exported)
            if missing:
                log.warning("rule %s reads %s, which no source has exported since the monitor started (sources "
                            "scraped: %s): it has no data until one does (a misspelt metric? a source missing from "
                            "[sources]?)", rule,
                            ", ".join(missing), ", ".join(sorted(self._answered)) or "none")
            del self._unsettled[rule]


class Monitor:
    """Scrape, evaluate, send; :meth:`run` repeats that every ``interval_s`` until ``stop`` is set.

    ``sink`` is a :class:`FanOut` or :class:`QueuedSink`; any other sink is put behind a
    :class:`QueuedSink` (with the ``[sinks]`` settings of ``config``), so :meth:`step` never waits for
    a delivery. :meth:`close` drains and closes the sink. ``clock`` (Unix seconds) stamps alerts and
    the run log; ``monotonic`` measures durations (``for_s``, ``absent_for_s``, rate ranges), so a step
    of the wall clock changes neither.
    """

    DUPLICATES_REMEMBERED = 10_000  # duplicated series whose warning is not repeated (the least recent are forgotten)

    def __init__(self, config: RulesConfig, sink: AlertSink | FanOut | QueuedSink,
                 scrape: Callable[[], Snapshot] | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.sink: FanOut | QueuedSink = (sink if isinstance(sink, FanOut | QueuedSink)
                                          else QueuedSink(sink, config.sinks))
        self.scrape = scrape or Scraper.of(config, clock).scrape
        self.clock, self.monotonic = clock, monotonic
        self.engine = RuleEngine.of(config)
        # the duplicated series already logged, most recently seen last: at most DUPLICATES_REMEMBERED (a label
        # that churns made it grow by one key per scrape for ever); one seen again is moved to the end, so a
        # steady duplicate is not forgotten (and logged again) for the churning ones
        self._duplicates_seen: dict[tuple[str, Labels, tuple[str, ...]], None] = {}
        self.sent: dict[str, int] = {s.value: 0 for s in AlertState}
        self.scrape_errors: dict[str, int] = {}
        self._last_errors: dict[str, str] = {}
        self._stale: set[str] = set()  # sources whose stale samples were logged at the last scrape
        self._unexported = UnexportedMetrics(config)
        self.state_file: FiringStateFile | None = None
        # resolved alerts some sink has not delivered yet, with their series: kept in the state file as firing
        self._resolving: list[tuple[Alert, dict[str, Any]]] = []
        if config.state_path is not None:
            self.state_file = FiringStateFile(config.state_path)
            firing, pending, no_data = self.state_file.read()
            n = self.engine.restore(firing, self.monotonic(), self.clock())
            if n:
                log.info("restored %d firing alert(s) from %s: each is sent again if it still holds, resolved "
                         "if not", n, config.state_path)
            if n := self.engine.restore_pending(pending, self.monotonic(), self.clock()):
                log.info("restored %d pending series from %s: each fires once its condition has held for_s in all "
                         "(not sooner than for_grace_period_s=%gs from now)", n, config.state_path,
                         config.for_grace_period_s)
            if n := self.engine.restore_no_data(no_data, self.monotonic(), self.clock()):
                log.info("restored %d absence timer(s) from %s: each fires once its rule has had no data for "
                         "absent_for_s in all (not sooner than for_grace_period_s=%gs from now)", n,
                         config.state_path, config.for_grace_period_s)
        # the last save held pending series or absence timers: the next one must (they move on or go)
        self._saved_pending = False
        self.run_log: RunLog | None = None
        if config.run_log.path is not None:
            self.run_log = RunLog(config.run_log, clock)
            self.run_log.start(config.sources, config.interval_s, config.rules)

    def step(self) -> list[Alert]:
        snap = self.scrape()
        for source, err in snap.errors.items():
            self.scrape_errors[source] = self.scrape_errors.get(source, 0) + 1
            if self._last_errors.get(source) != err:  # log a source's failure once, not every interval
                log.warning("scrape of source %s failed: %s", source, err)
        for source in set(self._last_errors) - set(snap.errors):
            log.info("source %s answers again", source)
        self._last_errors = dict(snap.errors)
        self._stale = warn_stale(snap, self._stale)
        self._unexported.warn(snap)
        for (metric, lb), sources in snap.duplicates.items():
            key = (metric, lb, tuple(sources))
            if key in self._duplicates_seen:  # once per series and sources, not every interval
                self._duplicates_seen[key] = self._duplicates_seen.pop(key)
            else:
                self._duplicates_seen[key] = None
                if len(self._duplicates_seen) > self.DUPLICATES_REMEMBERED:
                    del self._duplicates_seen[next(iter(self._duplicates_seen))]
                lbl = ",".join(f'{k}="{v}"' for k, v in lb)
                log.warning("sources %s all export %s{%s}: rules read %s's only (give each process a label of "
                            "its own, e.g. rank, to watch them all)", ", ".join(sources), metric, lbl, sources[0])
        now = self.clock()
        alerts = self.engine.evaluate(snap, self.monotonic(), now)
        # queue first: the state machines have moved, so an alert not queued now is never sent
        self.sink.send(alerts)  # queues only: returns at once whatever the sinks do
        if self.state_file is not None:
            self._resolving.extend(self.engine.resolved)
            delivered = self._forget_delivered()
            if (alerts or delivered or self.state_file.failing or self._saved_pending or self.engine.pending()
                    or self.engine.no_data()):
                self._save_state()
        for a in alerts:
            self.sent[a.state.value] += 1
        if self.run_log is not None:
            self.run_log.scrape(now, snap)
            self.run_log.evaluation(now, self.engine, alerts)
        return alerts

    def run(self, stop: threading.Event, interval_s: float | None = None) -> None:
        interval = self.config.interval_s if interval_s is None else interval_s
        check_interval(interval, self.config.origin)
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one bad round must not end monitoring
                log.exception("monitor evaluation failed; trying again in %.3gs", interval)
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def run_until_signalled(self) -> int:
        """:meth:`run` until SIGTERM or SIGINT, then :meth:`close` under the same handlers: a further signal ends the
        drain (with the default handlers back, a second SIGTERM during the drain killed the process: no summary, no
        last state-file save). Returns the count of alerts left undelivered; the previous handlers are put back."""
        stop, signals = threading.Event(), []

        def note(signum: int, _frame: Any) -> None:
            signals.append(signum)
            stop.set()

        previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.run(stop)
            finally:
                seen = min(len(signals), 1)  # the stop's; a second one before the drain began ends it too
                undelivered = self.close(abort=lambda: signal.Signals(signals[-1]).name if len(signals) > seen
                                         else None)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        return undelivered

    def _forget_delivered(self) -> bool:
        """Drop from :attr:`_resolving` the resolved alerts no sink still waits to deliver; whether any went."""
        waiting = {id(a) for a in self.sink.waiting()}
        kept = [(a, rec) for a, rec in self._resolving if id(a) in waiting]
        gone, self._resolving = len(kept) < len(self._resolving), kept
        return gone

    def _save_state(self) -> None:
        assert self.state_file is not None
        pending, no_data = self.engine.pending(), self.engine.no_data()
        self.state_file.save(self._firing_records(), pending, no_data)
        self._saved_pending = bool(pending or no_data)

    def _firing_records(self) -> list[dict[str, Any]]:
        """What the state file keeps: the firing series, and the series whose resolved alert a sink has not
        delivered yet (written as still firing, so that a restart resolves them again instead of never)."""
        records = self.engine.firing()
        kept = {(r["rule"], labels_of(r["labels"]), r.get("absent", False)) for r in records}
        for _, rec in self._resolving:
            if (key := (rec["rule"], labels_of(rec["labels"]), rec.get("absent", False))) not in kept:
                kept.add(key)
                records.append(rec)
        return records

    def close(self, timeout_s: float | None = None, abort: Callable[[], str | None] | None = None) -> int:
        """Deliver the queued alerts for at most ``timeout_s`` (default ``close_timeout_s`` of
        ``[sinks]``) and close the sinks; the count of alerts left undelivered (each sink logs its own). ``abort``
        naming a reason ends the drain at once (:func:`monitor.alerts.drain`: a further stop signal); the state file
        is saved either way, keeping the undelivered resolves firing."""
        try:
            if isinstance(self.sink, FanOut):
                return self.sink.close(timeout_s, abort)
            return drain([self.sink], time.monotonic() + (self.sink.close_timeout_s if timeout_s is None
                                                          else timeout_s), abort)
        finally:
            if self.state_file is not None:
                self._forget_delivered()  # after close: the alerts it left undelivered
                self._save_state()
            if self.run_log is not None:
                self.run_log.close()

    def summary(self) -> dict[str, Any]:
        sinks = self.sink.stats() if isinstance(self.sink, FanOut) else {self.sink.name: self.sink.stats.as_dict()}
        return {"evaluations": self.engine.evaluations, "alerts": dict(self.sent),
                "scrape_errors": dict(self.scrape_errors), "sinks": sinks,
                "firing": [s.as_dict() for s in self.engine.status() if s.state is State.FIRING],
                **({"run_log": {"path": str(self.run_log.path), "records": self.run_log.records,
                                "rotations": self.run_log.rotations, "failures": self.run_log.failures}}
                   if self.run_log is not None else {})}

