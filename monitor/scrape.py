"""Scraping: every source of a rules file fetched at once and parsed into one :class:`Snapshot`.

:class:`Scraper` fetches the ``[sources]`` of a rules file (all at once) and parses the Prometheus
text format into a :class:`Snapshot` (a source that fails is counted and simply contributes no data: one that
does not answer whole within ``scrape_timeout_s``, in total, or answers more than
:data:`SCRAPE_MAX_BYTES`, or with text cut off (empty, or its last line without a newline) or that does not
parse, contributes none of its series). :func:`warn_stale` logs the sources whose samples were stamped too old
or too far ahead to be current.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from prometheus_client import Counter as PCounter

from monitor.exposition import parse as parse_exposition
from monitor.expr import Labels, Point
from monitor.http_deadline import get_text
from monitor.rules import RulesConfig
from stream.errors import quoted, shown
from stream.secrets import redact

log = logging.getLogger("streamrec.monitor")

SCRAPE_ERRORS = PCounter("streamrec_monitor_scrape_errors_total", "Failed scrapes, by source.", ["source"])
STALE_SAMPLES = PCounter("streamrec_monitor_stale_samples_total",
                         "Scraped samples read as no data, stamped older than sample_max_age_s or too far ahead of "
                         "the monitor's clock, by source.", ["source"])

SCRAPE_MAX_BYTES = 16 * 1024 * 1024  # a source answering more is a failed scrape (a learner's answer is ~100 KB)
# a timestamped sample older than this (s) is no data: sample_max_age_s's default, Prometheus' 5 min lookback (a
# /federate source stamps its samples with their original scrape time, 15 to 60 s old as a rule)
STALE_AFTER_S = RulesConfig.sample_max_age_s
# a timestamped sample ahead of the monitor's clock by more than this (s), plus the scrape's timeout, is bad data, no
# value (Prometheus refuses samples too far in the future as "out of bounds"): a source's clock skew is tolerated
CLOCK_SKEW_S = 5.0


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
                self.stale[source] = (count + 1, example or f"{quoted(f'{name}{{{lbl}}}', 200)} stamped {why}")
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
        number = text.count("\n") + 1  # every newline ends a line before the last
        raise ValueError(f"the answer was cut off: its last line, line {number} ({shown(last)}), does not end with a "
                         "newline (a target that died while writing it)")
    return text


_QUOTE_OR_DIGITS = re.compile(r"""['"].*|[0-9]+""", re.DOTALL)


def failure_kind(reason: str) -> str:
    """A failed scrape's reason less what changes from one scrape of a failing source to the next: the source's
    text it quotes (from the first quote on: the line that does not parse, the line a cut answer ends in) and the
    numbers (a line's). ``monitor.engine.Monitor.step`` logs a source's failure again only when its kind changes:
    compared whole, a source answering ``streamrec_lag 12,5`` (a decimal comma) was logged every interval for as
    long as it did."""
    return _QUOTE_OR_DIGITS.sub("#", reason)


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
        failed scrape: each fetch's own timeout added one more per :attr:`MAX_PARALLEL` hanging sources; so is one
        whose fetch is stuck where its deadline does not reach, resolving the host's name: left to end alone), then
        parse them in the order of the rules file (which source wins a duplicate series does not depend on which
        answered first)."""
        snap = Snapshot()
        if not self.sources:
            return snap
        started, self._round_deadline = self.clock(), time.monotonic() + self.timeout_s
        pool = ThreadPoolExecutor(min(len(self.sources), self.MAX_PARALLEL), thread_name_prefix="scrape")
        try:
            answers = {name: pool.submit(self.fetch, url) for name, url in self.sources.items()}
            # not the pool's shutdown: a fetch stuck where no deadline reaches (name resolution: the resolver's own
            # timeouts, tens of seconds) held the round, and the next, past scrape_timeout_s; it is a failed scrape
            wait(answers.values(), max(0.0, self._round_deadline - time.monotonic()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            self._round_deadline = None
        for name, url in self.sources.items():
            try:
                answer = answers[name]
                if not answer.done() or answer.cancelled():  # (cancelled: still waiting for a thread)
                    raise TimeoutError(f"{name} still fetching at the deadline")
                snap.add_text(name, _whole(answer.result()), started, self.stale_after_s,
                              self.timeout_s + CLOCK_SKEW_S)  # the answer may be stamped up to timeout_s after start
                STALE_SAMPLES.labels(name).inc(snap.stale.get(name, (0, ""))[0])
            except Exception as exc:  # noqa: BLE001 - a dead source is "no data", never a crash
                why = f"no answer within scrape_timeout_s={self.timeout_s:g}s" if isinstance(exc, TimeoutError) \
                    else quoted(redact(f"{exc}") or type(exc).__name__, 200)  # a peer's text quoted: cut, escaped
                snap.errors[name] = redact(f"{url}: {why}")  # (run log, status, log: a url's password as ***)
                SCRAPE_ERRORS.labels(name).inc()
        return snap


# -- stale samples --------------------------------------------------------------------------------
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
