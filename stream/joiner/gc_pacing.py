"""When Python's cyclic garbage collector runs in a joiner worker: between batches, on a clock.

The join state is hundreds of thousands of long-lived objects (each pending impression a ``Pending`` with a
context dict, a dense dict and a history list; the finalized ids; the heaps). CPython's automatic collector
walks all of them in every full collection, and it starts one whenever the objects that survived since the
last one reach a quarter of the old ones: a state that keeps growing triggers full collections over and over,
each in the middle of a batch. Measured with ``python bench/joiner.py`` (220 k synthetic events, one kafka
worker): 7 of the worker's 15.7 busy seconds were collector time (37 full collections); with the pacing below
0.7 s, and the worker ran 1.7x faster.

The state needs no cyclic collector: it holds no reference cycles, so reference counting frees every impression
the moment its window retires. So with :class:`GcPacing` on, the automatic collector keeps only its cheap young
collections (every ``YOUNG_THRESHOLD`` allocations instead of 700, still bounded), never a full one, and the
worker runs one full ``gc.collect()`` between batches every ``every_s`` seconds: anything cyclic is still
reclaimed, at a time and a cost one can see (``streamrec_join_gc_seconds_total``, the ``gc`` stage of the
summary). ``every_s = 0`` leaves Python's collector as it is.

The thresholds are process-wide: :meth:`close` puts back what it found (a pipeline run inside a test process).
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Counter

YOUNG_THRESHOLD = 100_000  # container allocations between young collections (Python's default: 700)
_NEVER = 1 << 30  # older-generation thresholds no allocation count reaches: full collections only on the clock

GC_SECONDS = Counter("streamrec_join_gc_seconds_total", "Seconds a joiner spent in its paced full garbage "
                     "collections (between batches; stream/joiner/gc_pacing.py).")


class GcPacing:
    """Full collections between batches every ``every_s`` seconds (0: Python's automatic collector unchanged)."""

    def __init__(self, every_s: float) -> None:
        if every_s < 0:
            raise ValueError(f"gc_every_s must be >= 0 (0: Python's own collector), got {every_s!r}")
        self.every_s = every_s
        self.collections = 0
        self.seconds = 0.0
        self._found: tuple[int, int, int] | None = None
        self._last = time.monotonic()
        if every_s > 0:
            self._found = gc.get_threshold()
            gc.set_threshold(YOUNG_THRESHOLD, _NEVER, _NEVER)

    def between_batches(self) -> float:
        """Collect if ``every_s`` has passed since the last full collection; returns the seconds it took."""
        if self._found is None or time.monotonic() - self._last < self.every_s:
            return 0.0
        t0 = time.monotonic()
        gc.collect()
        self._last = time.monotonic()
        took = self._last - t0
        self.collections += 1
        self.seconds += took
        GC_SECONDS.inc(took)
        return took

    def close(self) -> None:
        """Give the process its collector back as it was."""
        if self._found is not None:
            gc.set_threshold(*self._found)
            self._found = None
