"""The report reads from the run log only the metrics its sections declare (monitor/report.py ``reads``,
``metrics_read``): ~70% of a real run log's samples were series no section draws, held in memory by the read. Kept
or not, the page is the same."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from monitor import recording, report, sections, series

UNDRAWN = ("streamrec_learner_field_grad_norm_bucket", "streamrec_learner_field_grad_norm_count",
           "streamrec_learner_id_time_to_admission_seconds_sum", "streamrec_never_drawn")
LABELS = {"part": "dense", "field": "user_id", "kind": "allocated", "tier": "hot", "stage": "join",
          "topic": "impressions", "memory": "rss", "partition": "0"}


def samples_at(i: int, names: frozenset[str] | tuple[str, ...]) -> list[list[Any]]:
    """Scrape ``i``'s samples of ``names``: counters that rise, a histogram's buckets cumulative, times as dates."""
    out: list[list[Any]] = []
    for name in sorted(names):
        v: float = 10 * i + 1
        if name in ("streamrec_learner_event_time_seconds", "streamrec_join_watermark_ms"):
            v = (978_300_000 + 60 * i) * (1000 if name.endswith("_ms") else 1)
        elif name.endswith("_auc") or name.endswith("_share") or name.endswith("_rate"):
            v = 0.5 + i / 100
        if name.endswith("_bucket"):
            out += [[name, {**LABELS, "le": le}, v * q] for le, q in (("0.1", 0.3), ("1.0", 0.8), ("+Inf", 1.0))]
        else:
            out.append([name, LABELS, v])
    return out


def write_log(path: Path, cycles: int = 12) -> Path:
    """Every metric some section reads and some none does, from two sources; the clock steps back half-way; rule
    states and an alert; one scrape holding only undrawn series."""
    lines: list[dict[str, Any]] = [{"kind": "start", "t": 1e9, "sources": {}, "interval_s": 10, "rules": ["r"]}]
    for i in range(cycles):
        t = 1e9 + 10 * i - (50 if i >= cycles // 2 else 0)
        for source in ("learner", "joiner"):
            lines.append({"kind": "scrape", "t": t, "source": source,
                          "samples": samples_at(i, sections.metrics_read() | set(UNDRAWN))})
        lines.append({"kind": "rules", "t": t, "states": {"r": "firing" if i % 4 == 3 else "inactive"}})
    lines.append({"kind": "scrape", "t": 1e9 + 200, "source": "serving", "samples": samples_at(1, UNDRAWN)})
    lines.append({"kind": "alert", "t": 1e9 + 30, "alert": {"rule": "r", "state": "firing", "labels": {}}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def names_in(rec: recording.Recording) -> set[str]:
    return {n for scrapes in rec.scrapes.values() for _, samples, _ in scrapes for n, _, _ in samples}


def test_the_run_log_is_read_keeping_the_samples_of_the_metrics_the_sections_declare_and_every_scrape(
        tmp_path: Path) -> None:
    path = write_log(tmp_path / "run-log.jsonl")
    every, kept = report.read_run_log(path, every_metric=True), report.read_run_log(path)
    assert set(UNDRAWN) <= names_in(every)
    assert names_in(kept) == sections.metrics_read() and not set(UNDRAWN) & names_in(kept)
    assert "streamrec_learner_grad_norm_bucket" in sections.metrics_read()  # a histogram declared by its series
    # every scrape kept, with its time and epoch: the page counts them and shades each source's running time
    assert {s: [(t, e) for t, _, e in sc] for s, sc in kept.scrapes.items()} == \
        {s: [(t, e) for t, _, e in sc] for s, sc in every.scrapes.items()}
    assert kept.scrapes["serving"] == [(1e9 + 200, [], 1)]


def test_a_series_read_of_a_metric_no_section_declares_raises_rather_than_draw_not_recorded(tmp_path: Path) -> None:
    rec = report.read_run_log(write_log(tmp_path / "run-log.jsonl"))
    with pytest.raises(LookupError, match="streamrec_learner_field_grad_norm_count.*@reads"):
        series.series(rec, "streamrec_learner_field_grad_norm_count")
    with pytest.raises(LookupError, match="streamrec_learner_field_grad_norm_bucket"):
        series.histogram_numbered(rec, "streamrec_learner_field_grad_norm", "field")
    assert series.series(report.read_run_log(tmp_path / "run-log.jsonl", every_metric=True),
                         "streamrec_learner_field_grad_norm_count")


def test_the_page_from_the_metrics_kept_is_byte_identical_to_the_page_from_every_sample(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every_metric reads the run log as main did before the sections declared what they read: its page, PNGs
    # included, is what the report drew; a section reading a metric it does not declare raises here
    pytest.importorskip("matplotlib")
    path = write_log(tmp_path / "run-log.jsonl")
    monkeypatch.setattr(report.time, "time", lambda: 2e9)  # the footer's write time
    pages, points = [], []
    for every in (True, False):
        out = tmp_path / f"report-{every}.html"
        made = report.write_report(sections.Inputs(report.read_run_log(path, every_metric=every)), out)
        pages.append(out.read_text())
        points.append({s.id: (s.points, s.missing) for s in made})
    assert pages[0] == pages[1] and points[0] == points[1]
    drawn = {k for k, (n, _) in points[1].items() if n}
    assert drawn == {s.id for s in made}, points[1]  # every section drew something from this log
    assert len(re.findall("data:image/png;base64,", pages[1])) == len(sections.SECTIONS)
