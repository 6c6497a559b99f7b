"""The alert monitor: scrape Prometheus endpoints, evaluate alert rules, send firing/resolved alerts.

Its parts are each usable alone, each in its own module: :class:`~monitor.scrape.Scraper` (``scrape.py``),
:class:`~monitor.rule_engine.RuleEngine` (``rule_engine.py``), :class:`~monitor.run_log.RunLog` (``run_log.py``) and
:class:`~monitor.state_file.FiringStateFile` (``state_file.py``). This module ties them together:
:class:`Monitor` runs them with a sink in a loop that stops when its ``stop`` event is set. Sending
only queues the alerts (:class:`~monitor.delivery.QueuedSink`: one queue and worker thread per
sink), so a slow or dead sink never delays an evaluation; :meth:`Monitor.close` drains the queues.
The alerts of an evaluation are queued before anything else is done with them (the run log): the
state machines have already moved, so an alert not queued then would never be sent. :func:`evaluate_once` is
``streamrec monitor --once``: one scrape and one evaluation, nothing sent.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from monitor.alerts import Alert, AlertKind, AlertSink, AlertState
from monitor.cli_text import ONCE_CONDITION_HOLDS, ONCE_OK, ONCE_SCRAPE_FAILED
from monitor.delivery import FanOut, QueuedSink, drain
from monitor.exposition import families_of
from monitor.expr import Labels, labels_of, metrics_of
from monitor.rule_engine import RuleEngine, State
from monitor.rules import RulesConfig, check_interval
from monitor.run_log import RunLog
from monitor.scrape import Scraper, Snapshot, failure_kind, warn_stale
from monitor.state_file import FiringStateFile
from stream.errors import quoted
from stream.stop_signals import StopFlag, put_back_signals, take_stop_signals

log = logging.getLogger("streamrec.monitor")


# -- one evaluation ---------------------------------------------------------------------------
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


# -- loop -----------------------------------------------------------------------------------------
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
        self._last_errors: dict[str, str] = {}  # source -> failure_kind of its last failed scrape
        self._stale: set[str] = set()  # sources whose stale samples were logged at the last scrape
        self._unexported = UnexportedMetrics(config)
        self.state_file: FiringStateFile | None = None
        # resolved alerts some sink has not delivered yet, with their series: kept in the state file as firing
        self._resolving: list[tuple[Alert, dict[str, Any]]] = []
        if config.state_path is not None:
            self.state_file = FiringStateFile(config.state_path)
            self.state_file.hold()  # one monitor a state file: a second is refused, naming the first's pid
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
            try:
                self.run_log = RunLog(config.run_log, clock)
                self.run_log.start(config.sources, config.interval_s, config.rules)
            except BaseException:  # a run log that cannot be opened: this monitor never runs, its state file is free
                if self.state_file is not None:
                    self.state_file.release()
                raise

    def step(self) -> list[Alert]:
        snap = self.scrape()
        for source, err in snap.errors.items():
            self.scrape_errors[source] = self.scrape_errors.get(source, 0) + 1
            if self._last_errors.get(source) != failure_kind(err):  # once, not every interval
                log.warning("scrape of source %s failed: %s", source, err)
        for source in set(self._last_errors) - set(snap.errors):
            log.info("source %s answers again", source)
        self._last_errors = {source: failure_kind(err) for source, err in snap.errors.items()}
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
                lbl = ",".join(f'{k}="{v}"' for k, v in lb)  # scraped values: a line break, megabytes (quoted)
                log.warning("sources %s all export %s: rules read %s's only (give each process a label of its own, "
                            "e.g. rank, to watch them all)", ", ".join(sources), quoted(f"{metric}{{{lbl}}}", 200),
                            sources[0])
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

    def run(self, stop: threading.Event | StopFlag, interval_s: float | None = None) -> None:
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
        stop, signals = StopFlag(), []  # set by the handler: an Event's set() could deadlock there (StopFlag)

        def note(signum: int, _frame: Any) -> None:
            signals.append(signum)
            stop.set()

        previous: dict[int, Any] = {}
        take_stop_signals(previous, note)
        try:
            try:
                self.run(stop)
            finally:
                seen = min(len(signals), 1)  # the stop's; a second one before the drain began ends it too
                undelivered = self.close(abort=lambda: signal.Signals(signals[-1]).name if len(signals) > seen
                                         else None)
        finally:
            put_back_signals(previous)
        return undelivered

    def _forget_delivered(self) -> bool:
        """Drop from :attr:`_resolving` the resolved alerts no sink still waits to deliver; whether any went. An alert
        is told by its fingerprint, state and time, not by the object: a sink queues one over ``MAX_BODY`` as its
        :meth:`~monitor.alerts.Alert.shortened` copy, and looked for as the object, an undelivered resolve of a series
        with a label of megabytes was taken for delivered at once (out of the state file: after a restart its alert
        stayed firing at the receiver)."""
        waiting = {(a.fingerprint, a.state, a.ts) for a in self.sink.waiting()}
        kept = [(a, rec) for a, rec in self._resolving if (a.fingerprint, a.state, a.ts) in waiting]
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
        naming a reason ends the drain at once (:func:`monitor.delivery.drain`: a further stop signal); the state file
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
                self.state_file.release()
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
