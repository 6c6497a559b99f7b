"""The idle clock of every ``exit_when_idle_s``: how long a loop has waited for input, with a stall left out.

A process stopped past its limit (SIGSTOP, a long GC pause, a swapping or stalled host) while its input kept
arriving must not wake up idle: its first poll after the stall can come back empty (librdkafka's fetcher was stopped
too, or the group took its partitions and says so a heartbeat later), and a wall-clock idle time ended the run there:
the joiner drained stale joins as label-0 samples, the learner left the stall's samples untrained (the frozen-process
fault tests in tests/integration/test_faults.py). Here idle time is summed between ticks (one per poll or loop round),
and a gap between two ticks longer than ``stall_s`` is a stall, which either

- counts as ``stall_step_s``, one ordinary round (the learner): a loop whose every round is slow (a slow checkpoint
  at each heartbeat) still counts a round each time, so it still gets to its limit; or
- restarts idleness (``stall_step_s=None``, the joiner): a member woken from a stall past its session learns that
  its partitions are gone only a heartbeat later, and must not exit (and drain) before. So for ``after_stall_s``
  after a stall (the joiner: two heartbeat intervals) :meth:`IdleClock.tick` says the time still owed, negative,
  whatever came meanwhile (:meth:`IdleClock.reset` does not end the wait: records fetched before the stall, handed
  on before the heartbeat, must not make it count from 0): whatever the limit, even one under a heartbeat, the
  rounds right after a stall are never taken for the end of the input.

Never reset, it is a clock that leaves stalls out (the learner's event-time merge times its quiet partitions so)."""

from __future__ import annotations

import time
from collections.abc import Callable


class IdleClock:
    def __init__(self, stall_s: float, stall_step_s: float | None, now: Callable[[], float] | None = None,
                 after_stall_s: float = 0.0) -> None:
        if stall_step_s is not None and not 0 <= stall_step_s <= stall_s:
            raise ValueError(f"an idle clock needs 0 <= stall_step_s <= stall_s, got {stall_step_s} and {stall_s}")
        if after_stall_s < 0 or (after_stall_s and stall_step_s is not None):
            raise ValueError(f"after_stall_s is a wait after a stall that restarts idleness, got {after_stall_s}")
        self.stall_s, self.stall_step_s, self.after_stall_s = stall_s, stall_step_s, after_stall_s
        self._clock = now
        self.idle_s = 0.0
        self._last = self._now()
        self._owed_until = self._last  # after a stall that restarts idleness: no idleness before this time
        self.stalls = 0

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()  # looked up each time: tests patch it

    def tick(self) -> float:
        """One round without input ended now: the idle time so far, or, while a wait after a stall is owed, minus
        the time still owed (module docstring)."""
        now = self._now()
        gap, self._last = now - self._last, now
        if gap > self.stall_s:
            self.stalls += 1
            if self.stall_step_s is None:
                self.idle_s, self._owed_until = 0.0, now + self.after_stall_s
                return -self.after_stall_s
            gap = self.stall_step_s
        self.idle_s += gap
        return self.idle_s if now >= self._owed_until else now - self._owed_until

    def reset(self) -> None:
        """Input came (or something that is not idleness happened): idleness counts afresh from now."""
        self.idle_s = 0.0
        self._last = self._now()
