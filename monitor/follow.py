"""Progress while a stage runs (``streamrec report --follow``, ``make demo``): a line per scrape of one source read
from the run log as the monitor appends it (:func:`follow`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from monitor.cli_text import FOLLOW_TAIL_BYTES
from monitor.recording import Recording, Sample, date_of, parse_record
from monitor.series import epochs
from stream.errors import StreamrecError
from stream.files import NotRegularFile, open_regular


class FollowError(StreamrecError):
    """``--follow`` has nothing to follow: the process is not running, or the run log never appeared while it ran."""


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
        if wms and (day := date_of(min(wms) / 1000)) is not None:
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
            rec = parse_record(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            r = Recording(epoch=steps.epoch, last_t=steps.last_t)
            r.add(rec)
            steps.epoch, steps.last_t = r.epoch, r.last_t
            yield from epochs(r.scrapes.get(source, []))
