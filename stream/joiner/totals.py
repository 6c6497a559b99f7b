"""What one joiner worker run did: the counters its batches add up, the time each stage took, and the summary printed
at exit (``streamrec join``'s last line, ``--json``).

A batch's counts are staged apart (:attr:`JoinTotals.batch`) and added to the run's only once the batch is durable
(:meth:`JoinTotals.batch_done`, where its state chunk is acknowledged): a batch that fails part-way (an outage, a
producer error) is done again from its input, and its first try's impressions, samples, dead letters, ... must not be
counted with its retry's. A failed try's are dropped (:meth:`JoinTotals.batch_failed`, counted in ``batches_failed``).
Gauges (``pending_impressions``, ``held_peak``) are set live. ``stage_s`` is time spent, so it counts every try, the
failed ones too; ``busy_s`` the time of the batch tries that completed."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory (MB) since it started, from ``VmHWM`` (Linux; None elsewhere). Not
    ``getrusage``'s ``ru_maxrss``: that carries the peak of the process it was forked from across ``exec``."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except (OSError, ValueError):
        pass
    return None


@dataclass
class JoinTotals:
    """Counters of one worker run, printed as the summary at exit."""

    counts: Counter[str] = field(default_factory=Counter)  # of the durable batches (and the live gauges)
    batch: Counter[str] = field(default_factory=Counter)  # of the batch in progress: counted once it is durable
    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # time spent in process(): the join's own throughput
    first_batch: float | None = None  # when the first batch arrived ...
    last_batch: float | None = None  # ... and the last one was done: events_per_s spans these
    stage_s: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds per stage

    def begin_batch(self) -> None:
        """A batch starts: nothing staged (a try that failed dropped its counts, :meth:`batch_failed`)."""
        self.batch.clear()

    def batch_done(self) -> Counter[str]:
        """The batch is durable: its staged counts join the run's (one update); returns them (for the metrics)."""
        done, self.batch = self.batch, Counter()
        self.counts.update(done)
        return done

    def batch_failed(self) -> None:
        """The batch failed before it was durable: its staged counts are dropped (it is done again from its input, or
        the worker stops without committing it), and the try is counted."""
        self.batch.clear()
        self.counts["batches_failed"] += 1

    def summary(self) -> dict[str, Any]:
        c = self.counts
        events = c["impressions"] + c["clicks"] + c["dead_lettered"]
        return {
            "events": events,
            "impressions": c["impressions"],
            "clicks": c["clicks"],
            "samples": c["samples"],
            "positives": c["positives"],
            "negatives": c["samples"] - c["positives"],
            "delayed_positives": c["delayed_positives"],  # fake_negative / es_dfm: clicks after an observed 0
            "late_clicks": c["late_clicks"],
            "orphan_clicks": c["orphan_clicks"],
            "duplicate_clicks": c["duplicate_clicks"],
            "clicks_before_impression": c["before_impression_clicks"],
            "duplicate_impressions": c["duplicate_impressions"],
            "redelivered_skipped": c["redelivered"],
            "dead_lettered": c["dead_lettered"],
            "samples_too_large": c["samples_too_large"],
            "state_too_large": c["state_too_large"],  # impressions dead-lettered: their join state alone too large
            "late_clicks_too_large": c["late_clicks_too_large"],  # late click records dead-lettered: too large
            "evicted_impressions": c["evicted_impressions"],
            "batches_failed": c["batches_failed"],  # tries of a batch that failed before it was durable: not counted
            "snapshots": c["snapshots"],  # state chunks written holding a partition's whole state (engine._compact)
            "overflow_clicks": c["overflow_clicks"],
            # records set aside past the event-time frontier, counted once per batch they wait (how much waiting
            # happened); of them, clicks the waiting cap had no room for; the most held at once (the hold's memory)
            "held_back": c["held_back"],
            "clicks_held_at_cap": c["clicks_held_at_cap"],
            "held_peak": c["held_peak"],
            "click_coverage": round(c["joined_clicks"] / c["clicks"], 6) if c["clicks"] else None,
            "pending_impressions": c["pending_impressions"],
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "max_rss_mb": _peak_rss_mb(),
            "process_s": round(self.busy_s, 3),
            "events_per_s": round(events / span) if (span := (self.last_batch or 0) - (self.first_batch or 0)) > 0
            else None,
            "stage_s": {k: round(v, 3) for k, v in sorted(self.stage_s.items())},
        }
