"""The operator report: one HTML file with plots of what the running system recorded (``streamrec report``).

Nothing in it is recomputed from the data: every curve is a metric the stages exported and the monitor
scraped into its run log (``[run_log]`` of the rules file, :class:`monitor.run_log.RunLog`), and every number
beside it comes from what the batch stages wrote themselves: the ``--json`` summaries of ``streamrec replay``,
``join``, ``train`` and ``refresh``, the publish root's ``last_run.json`` and the names and times of the
learner's delta files. Rates are the increase of a counter between two scrapes over the time between them,
and a gradient-norm quantile is read from the increase of the histogram's buckets between two scrapes (what
Prometheus' ``rate`` and ``histogram_quantile`` do); nothing else is derived.

The parts, each in its module: what was recorded, read back (``recording.py``), the curves, rates and quantiles over
it, epoch by epoch where the wall clock stepped back (``series.py``), the drawing (``plotter.py``), the sections and
the metrics each reads (``sections.py``), and here the report's read of the run log (:func:`read_run_log`) and the
HTML page. Progress lines while a stage runs: ``follow.py``.

The time axis of every plot is **wall-clock time** since the run log began: the learner exports no event time,
so "over event time" is only as good as the order the samples arrived in (event-time order in a replay).

Pure parts (reading, series, rates, quantiles, the HTML) need the standard library and numpy; the plots need
matplotlib (``pip install 'streamrec[dev]'``), imported only when a report is written.
"""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monitor.cli_text import utc_text
from monitor.plotter import Section
from monitor.recording import Recording, ReportError, read_recording
from monitor.sections import Inputs, build_sections, fmt_num, metrics_read, served_quality
from stream.files import write_atomic


def read_run_log(path: str | Path, *, every_metric: bool = False) -> Recording:
    """The run log ``path`` as the report reads it (:func:`~monitor.recording.read_recording`): keeping the samples of
    the metrics some section reads (:func:`~monitor.sections.metrics_read`), or of ``every_metric``: ~70% of the ML-1M
    demo's samples were series no section draws (the per-field gradient norms, the time to admission), held in memory
    and scanned by every series read."""
    return read_recording(path, None if every_metric else metrics_read())


def render_html(inp: Inputs, sections: Sequence[Section], title: str = "streamrec run report") -> str:
    rec, esc = inp.rec, html.escape
    t0, t1 = rec.t0, rec.t_end
    head = [f"<h1>{esc(title)}</h1>"]
    if t0 is not None and t1 is not None:
        head.append(f"<p>Recorded by the monitor from {utc_text(t0)} to {utc_text(t1)} ({t1 - t0:,.0f} s of wall-clock "
                    f"time), sources: {esc(', '.join(sorted(rec.scrapes)) or 'none')}; "
                    f"{sum(len(s) for s in rec.scrapes.values()):,} scrapes, {len(rec.errors):,} failed "
                    f"(a stage not running yet or any more). Every x axis is wall-clock time since "
                    f"{utc_text(t0)}.</p>")
    sq = served_quality(inp.summaries)
    if sq and sq.get("impressions"):
        head.append(f"<p class=big>Served quality ({fmt_num(sq['impressions'], ',')} impressions, train summary): "
                    f"AUC <b>{fmt_num(sq.get('auc'))}</b>, NE <b>{fmt_num(sq.get('ne'))}</b>, logloss "
                    f"{fmt_num(sq.get('logloss'))}</p>")
    rows = "".join(f"<tr><td>{esc(s)}</td><td>{esc(summary_line(s, d))}</td></tr>" for s, d in inp.summaries.items())
    if rows:
        head.append(f"<h2>Stage summaries</h2><table>{rows}</table>")
    toc = "".join(f"<li><a href='#{s.id}'>{esc(s.title)}</a>{'' if s.points else ' (not recorded)'}</li>"
                  for s in sections)
    body = []
    for s in sections:
        img = (f"<img alt='{esc(s.title)}' src='data:image/png;base64,{base64.b64encode(s.png).decode()}'>"
               if s.png else "")
        notes = "".join(f"<p class=missing>{esc(m)}</p>" for m in s.missing)
        facts = "".join(f"<li>{esc(f)}</li>" for f in s.facts)
        body.append(f"<section id='{s.id}' data-points='{s.points}' data-png='{1 if s.png else 0}'>"
                    f"<h2>{esc(s.title)}</h2><p class=what>{esc(s.what)}</p>{img}{notes}"
                    f"{f'<ul>{facts}</ul>' if facts else ''}</section>")
    foot = (f"<footer>Run log: {esc(', '.join(rec.files))}"
            f"{f'; {rec.bad_lines} unreadable line(s) skipped' if rec.bad_lines else ''}. "
            f"Written {utc_text(time.time())} by streamrec report.</footer>")
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto;padding:1em;color:#222}"
             "img{max-width:100%;border:1px solid #ddd}.what{color:#444;font-size:90%}.missing{color:#a60}"
             ".big{font-size:120%}table{border-collapse:collapse;font-size:85%}td{border:1px solid #ddd;"
             "padding:2px 6px;vertical-align:top}section{margin-top:2em}footer{margin-top:2em;color:#666;"
             "font-size:80%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{style}</style>"
            f"</head><body>{''.join(head)}<h2>Sections</h2><ol>{toc}</ol>{''.join(body)}{foot}</body></html>\n")


def summary_line(stage: str, d: Mapping[str, Any]) -> str:
    keys = {"replay": ("dataset", "impressions", "clicks", "dead_lettered", "elapsed_s", "events_per_s"),
            "join": ("group", "events", "samples", "positives", "late_clicks", "dead_lettered", "elapsed_s",
                     "events_per_s"),
            "train": ("samples_trained", "steps", "reason", "device", "precision"),
            "refresh": ("published", "version", "samples_trained", "format"),
            "monitor": ("evaluations", "alerts", "undelivered")}.get(stage, ())
    return ", ".join(f"{k} {_plain(d[k])}" for k in keys if k in d)


def _plain(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else (f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}")


def write_report(inp: Inputs, out: str | Path) -> list[Section]:
    """Build every section and write the HTML (PNGs embedded as base64: one self-contained file)."""
    out = Path(out)
    if out.is_dir():
        raise ReportError(f"{out} is a directory: give a file to write, such as {out / 'report.html'}")
    sections = build_sections(inp)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, render_html(inp, sections).encode("utf-8"))  # nothing half-written is left behind
    return sections
