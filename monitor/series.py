"""Curves from a :class:`~monitor.recording.Recording`: a metric's series, counter rates, histogram quantiles, each
per epoch (:func:`epochs`), what Prometheus' ``rate`` and ``histogram_quantile`` do and nothing else derived.

No rate, increase, histogram interval or average spans two epochs (the wall clock stepped back between them), and
every curve drawn over wall time breaks at each epoch (:func:`_point`, :func:`curve_segments`). A step forward cannot be
detected: the interval across it is read as if the monitor had paused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

from monitor.expr import counter_rise
from monitor.recording import Recording, sample_value

Series = tuple[list[float], list[float]]  # (t, value), t in unix seconds
Numbered = list[tuple[int, Series]]  # a curve's epochs, each with its number (Recording.epoch): series_numbered()
Curve = Series | Numbered  # a curve drawn: numbered, it breaks at every epoch; a Series, where its t drops
_T = TypeVar("_T")


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
    over wall time is kept numbered so, and breaks at each epoch (:func:`curve_segments`)."""
    if not eps or eps[-1][0] != e:
        eps.append((e, ([], [])))
    eps[-1][1][0].append(t)
    eps[-1][1][1].append(v)


def series(rec: Recording, name: str, by: Sequence[str] = (), where: Mapping[str, str] | None = None,
           agg: str = "sum", source: str | None = None) -> dict[str, Series]:
    """:func:`series_numbered` with each curve's epochs one after the other (``t`` drops where one starts): for plots
    and gauges; a rate or an average is taken per epoch (:func:`counter_rates`, :func:`average_rate`)."""
    return {k: flat(eps) for k, eps in series_numbered(rec, name, by, where, agg, source).items()}


def flat(eps: Numbered) -> Series:
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
    return {k: flat(eps) for k, eps in counter_rates_numbered(rec, name, by, where).items()}


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
    return {k: {stat: flat(c) for stat, c in stats.items()} for k, stats in histogram_numbered(rec, name, by).items()}


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
                    field = sample_value(_le(lb["le"]))
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
    return sum(len(ts) for c in s.values() for ts, _ in curve_segments(c))


def curve_segments(curve: Curve) -> list[Series]:
    """The stretches of a curve drawn as one line each: its epochs (every curve read from the run log is numbered:
    :func:`_point`), or of a Series (the deltas' files, which have no epochs) the stretches between the points where
    ``t`` drops."""
    if not isinstance(curve, tuple):
        return [s for _, s in curve if s[0]]
    ts, vs = curve
    cuts = [0, *(i for i in range(1, len(ts)) if ts[i] < ts[i - 1]), len(ts)]
    return [(ts[a:b], vs[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def finite(s: Series) -> Series:
    keep = [i for i, v in enumerate(s[1]) if math.isfinite(v)]
    return [s[0][i] for i in keep], [s[1][i] for i in keep]


def min_numbered(rec: Recording, name: str) -> Numbered:
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
    """:func:`min_numbered` with its epochs one after the other."""
    return flat(min_numbered(rec, name))
