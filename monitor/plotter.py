"""Drawing for the report: :class:`Plotter` (matplotlib, imported only when a report is written), a
:class:`Section`'s parts, and the event-time plot; values no axis can hold are left out and said.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from monitor.recording import Recording, ReportError, date_of
from monitor.series import Curve, Numbered, Series, curve_segments, min_numbered


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
            left_out, segments = 0, curve_segments(curve)
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
    second axis. A curve is its epochs numbered (:func:`~monitor.series.series_numbered`), each value matched to the
    event time of its own scrape by epoch and ``t`` (by ``t`` alone, a value scraped before the clock stepped back was
    drawn at the event time scraped at that ``t`` after it); or a Series of a recording without a step (all epoch 0).
    Returns the points drawn."""
    clock = {(e, t): v for e, (ts, vs) in min_numbered(rec, "streamrec_learner_event_time_seconds")
             for t, v in zip(ts, vs, strict=True)}
    n, drawn = 0, []
    right = ax.twinx()
    for i, (label, curve) in enumerate(curves.items()):
        pts = [(d, v) for e, (ts, vs) in ([(0, curve)] if isinstance(curve, tuple) else curve)
               for t, v in zip(ts, vs, strict=True)  # a value beyond PLOT_MAX: counted over wall time
               if (d := date_of(clock.get((e, t), 0))) is not None and not _unplottable(v)]
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
