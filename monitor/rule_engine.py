"""The rule state machines (:class:`RuleEngine`), one per rule and label set.

:class:`RuleEngine` is pure logic with the clock passed in: it keeps the sample history that
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
(:class:`~monitor.state_file.FiringStateFile`, the ``state_path`` of the rules file): a restored series that still
holds at the first evaluation is announced firing again (at least once: the alert may not have been delivered before the
restart), and one that no longer holds resolves, as if the monitor had never stopped. A series whose
resolved alert a sink has not delivered yet stays in that file as firing, so a restart resolves it again.
:meth:`RuleEngine.pending` and :meth:`RuleEngine.restore_pending` carry the pending series over too, as
Prometheus' ``ALERTS_FOR_STATE`` does: the time held before the restart counts towards ``for_s``, the outage
does not, and a restored series fires no sooner than ``for_grace_period_s`` after the start.
:meth:`RuleEngine.no_data` and :meth:`RuleEngine.restore_no_data` do the same for the absence timers
(``absent_for_s``).
Durations (``for_s``, ``absent_for_s``, the ranges of ``rate()``) are measured on the clock ``now`` is read
from, which :class:`~monitor.engine.Monitor` makes ``time.monotonic()``: a step of the wall clock (NTP) neither fires a
pending rule early nor empties the rates' history; the wall clock only stamps the alerts (``ts``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter as PCounter

from monitor.alerts import Alert, AlertKind, AlertState, Severity, alert_fingerprint, decode_value, encode_value
from monitor.cli_text import utc_text
from monitor.expr import REGEX_VALUE_MAX, Labels, Point, Window, labels_of, ranged_metrics
from monitor.rules import HISTORY_MAX_SERIES, Rule, RulesConfig
from monitor.scrape import Snapshot

log = logging.getLogger("streamrec.monitor")

ALERTS = PCounter("streamrec_monitor_alerts_total", "Alerts sent, by rule and state (firing, resolved).",
                  ["rule", "state"])
EVALUATIONS = PCounter("streamrec_monitor_rule_evaluations_total", "Rule evaluations, by rule.", ["rule"])
HISTORY_DROPPED = PCounter("streamrec_monitor_history_series_dropped_total",
                           "Scraped series kept out of the rates' history (the metric had history_max_series "
                           "already), by metric: rate()/increase()/delta() give them no data.", ["metric"])

REGEX_VALUES_SKIPPED = PCounter("streamrec_monitor_regex_values_skipped_total",
                                "Label values longer than regex_value_max that a regex matcher (=~, !~) did not "
                                "run on (they do not match it), by metric and label.", ["metric", "label"])

ABSENT_LABELS: Labels = (("absent", "true"),)  # what the sinks see of an absence alert (its identity is not these)


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
                 max_series: int = HISTORY_MAX_SERIES, regex_value_max: int = REGEX_VALUE_MAX) -> None:
        self.keep_s, self.metrics, self.max_series = keep_s, metrics, max_series
        self.regex_value_max = regex_value_max
        self.regex_skipped_said: set[tuple[str, str]] = set()  # (metric, label) whose long values were logged
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

    def regex_value_skipped(self, metric: str, label: str, length: int) -> None:
        REGEX_VALUES_SKIPPED.labels(metric, label).inc()
        if (metric, label) not in self.regex_skipped_said:  # the pairs are the rules' matchers: a bounded set
            self.regex_skipped_said.add((metric, label))
            log.warning("metric %s: a value of label %s is %d characters, more than regex_value_max=%d: a regex "
                        "matcher does not run on it and it does not match (counted in "
                        "streamrec_monitor_regex_values_skipped_total; said once)", metric, label, length,
                        self.regex_value_max)


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
                   config.for_grace_period_s, config.regex_value_max)

    def __init__(self, rules: Sequence[Rule], history_s: float = 0.0, hold_s: float = 0.0,
                 history_max_series: int = HISTORY_MAX_SERIES, grace_s: float = 0.0,
                 regex_value_max: int = REGEX_VALUE_MAX) -> None:
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
        self.history = MetricHistory(history_s * 1.5 if history_s else 0.0, ranged, history_max_series,
                                     regex_value_max)
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
        # rule -> the error its expression evaluated to at the last evaluation (logged once until it changes or clears)
        self.rule_errors: dict[str, str] = {}
        self.wall_offset = 0.0  # wall clock minus the engine's clock, at the last evaluation
        # the resolved alerts of the last evaluation, each with its series as firing() writes it
        self.resolved: list[tuple[Alert, dict[str, Any]]] = []
        # restored firing records of rules no longer in the rules file (renamed, removed): resolved at the next
        # evaluation, as restore() could not give them a rule
        self.retired: list[dict[str, Any]] = []

    def evaluate(self, snap: Snapshot, now: float, wall: float | None = None) -> list[Alert]:
        """One evaluation at ``now`` (seconds on the clock durations are measured on; :class:`~monitor.engine.Monitor`
        uses ``time.monotonic()``); ``wall`` (Unix seconds, default ``now``) stamps the alerts and the status."""
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
            if self.rule_errors.get(rule.name) != (why := f"{type(exc).__name__}: {exc}"):
                log.warning("rule %s: %s evaluates to an error: %s (said once until it changes or clears)",
                            rule.name, rule.expr, why)
            self.rule_errors[rule.name] = why
            val = {}
        else:
            if self.rule_errors.pop(rule.name, None) is not None:
                log.info("rule %s: %s evaluates again", rule.name, rule.expr)
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
