"""``streamrec report`` over a run log whose wall clock stepped backwards (an NTP correction, a VM restored): each
source's records are read in the order the monitor wrote them, in epochs split where ``t`` drops, and no rate,
histogram interval or average spans two epochs (monitor/report.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from monitor import follow, plotter, recording, report, sections, series
from tests.unit.monitor.test_report import Printed

SAMPLES = "streamrec_learner_samples_total"
GRAD = "streamrec_learner_grad_norm"
STEPPED = (100.0, 110.0, 105.0, 115.0)  # the clock steps back 5 s after t=110: truly 10 s between scrapes


def scrape(t: float, *samples: list[Any]) -> str:
    return json.dumps({"kind": "scrape", "t": t, "source": "learner", "samples": list(samples)})


def start(t: float) -> str:
    return json.dumps({"kind": "start", "t": t, "sources": {"learner": "http://127.0.0.1:1/metrics"},
                       "interval_s": 10, "rules": []})


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def counted(values: tuple[float, ...]) -> list[str]:
    return [scrape(t, [SAMPLES, {}, v]) for t, v in zip(STEPPED, values, strict=True)]


def test_a_clock_stepping_back_between_scrapes_gives_the_learners_true_rate_and_average(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 samples/s all along; sorted by t the scrapes read 0, 200, 100, 300 at t=100, 105, 110, 115: 40/s at t=105
    # and 115 (200 -> 100 read as a restart), and the average bar 33.3/s (500 counted over 15 s)
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", start(99.0), *counted((0, 100, 200, 300))))
    assert series.counter_rates(rec, SAMPLES) == {"": ([110.0, 115.0], [10.0, 10.0])}
    pytest.importorskip("matplotlib")
    drawn: dict[str, float] = {}
    monkeypatch.setattr(plotter.Plotter, "bars", lambda self, ax, values, *a, **k: drawn.update(values) or len(values))
    p = plotter.Plotter(99.0, 16.0)
    sections.s_throughput(p, sections.Inputs(rec))
    assert drawn == {"train\n(samples/s, counter)": pytest.approx(10.0)}
    fig, (ax,) = p.figure()
    p.lines(ax, series.series(rec, SAMPLES), "samples", "")  # over wall time: one segment per epoch
    xs = list(ax.get_lines()[0].get_xdata())
    p.plt.close(fig)
    assert xs[:2] == [1.0, 11.0] and math.isnan(xs[2]) and xs[3:] == [6.0, 16.0]


def test_a_clock_step_is_an_epoch_boundary_even_where_the_counter_is_missing_from_the_scrape_after_it(
        tmp_path: Path) -> None:
    # the scrape at t=105 (after the step) lacks the counter: its series alone reads 100, 110, 115 with no drop,
    # yet 110 -> 115 spans the step (truly 20 s): no rate there, and nothing to average after the step
    lines = [scrape(100.0, [SAMPLES, {}, 0]), scrape(110.0, [SAMPLES, {}, 100]),
             scrape(105.0, ["streamrec_learner_lag_samples", {}, 1]), scrape(115.0, [SAMPLES, {}, 300])]
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", *lines))
    assert series.counter_rates(rec, SAMPLES) == {"": ([110.0], [10.0])}
    assert series.average_rate(*series.series_numbered(rec, SAMPLES).values()) == pytest.approx(10.0)


def test_a_clock_stepping_back_between_two_rotated_files_is_an_epoch_boundary(tmp_path: Path) -> None:
    log = tmp_path / "run-log.jsonl"
    old = counted((0, 100, 200, 300))
    write(log.with_name("run-log.jsonl.1"), start(99.0), *old[:2])
    write(log, start(111.0), *old[2:])
    rec = report.read_run_log(log)
    assert rec.files == [str(log.with_name("run-log.jsonl.1")), str(log)]
    assert series.counter_rates(rec, SAMPLES) == {"": ([110.0, 115.0], [10.0, 10.0])}
    assert series.average_rate(*series.series_numbered(rec, SAMPLES).values()) == pytest.approx(10.0)


def test_a_clock_stepping_back_between_scrapes_gives_the_histogram_of_each_interval_it_recorded(
        tmp_path: Path) -> None:
    # 10 steps of norm 0.05 from t=100 to 110, then (after the step back) 10 of norm 5.5 from t=105 to 115; sorted
    # by t, the intervals 100 -> 105 -> 110 -> 115 mixed both and one of them read as a reset
    def hist(counts: tuple[float, float, float], total: float) -> list[list[Any]]:
        lb = {"part": "dense"}
        return ([[f"{GRAD}_bucket", {**lb, "le": le}, c] for le, c in zip(("0.1", "1", "10"), counts, strict=True)]
                + [[f"{GRAD}_bucket", {**lb, "le": "+Inf"}, counts[-1]], [f"{GRAD}_sum", lb, total],
                   [f"{GRAD}_count", lb, counts[-1]]])

    cumulative = ((0, 0, 0), 0.0), ((10, 10, 10), 0.5), ((10, 10, 20), 55.5), ((10, 10, 30), 110.5)
    lines = [scrape(t, *hist(c, s)) for t, (c, s) in zip(STEPPED, cumulative, strict=True)]
    h = series.histogram_over_time(report.read_run_log(write(tmp_path / "run-log.jsonl", *lines)), GRAD, "part")
    assert h["dense"]["mean"] == ([110.0, 115.0], [pytest.approx(0.05), pytest.approx(5.5)])
    assert h["dense"]["p50"] == ([110.0, 115.0], [pytest.approx(0.05), pytest.approx(5.5)])


def test_the_progress_line_after_a_clock_step_back_reads_the_rate_since_the_step(tmp_path: Path) -> None:
    out = Printed()
    path = write(tmp_path / "run-log.jsonl", *counted((0, 100, 200, 300)))
    assert follow.follow(path, "learner", lambda: False, out, print_every_s=0) == 4  # type: ignore[arg-type]
    # the line at t=115 read 40/s: its rate was taken from the scrape at t=110, before the step
    assert out == ["learner: 0 samples trained\n", "learner: 100 samples trained (10/s)\n",
                   "learner: 200 samples trained\n", "learner: 300 samples trained (10/s)\n"]


def record(kind: str, t: float, **fields: Any) -> str:
    return json.dumps({"kind": kind, "t": t, **fields})


@pytest.mark.parametrize("between", [
    [record("scrape_error", t, source="learner", error="connection refused") for t in (90.0, 100.0, 110.0)],
    [record("rules", 95.0, states={}), record("alert", 96.0, alert={"rule": "r", "state": "firing"})],
], ids=["failed-scrapes", "rules-and-alert"])
def test_a_clock_step_seen_only_in_the_monitors_other_records_is_an_epoch_boundary(
        tmp_path: Path, between: list[str]) -> None:
    # 10/s all along; the clock steps back 20 s after t=110 while the learner does not answer (or between two of its
    # scrapes, seen only by the rules): split on its own scrapes alone, 110 -> 115 read 350 samples in 5 s, 70/s
    lines = [scrape(100.0, [SAMPLES, {}, 0]), scrape(110.0, [SAMPLES, {}, 100]), *between,
             scrape(115.0, [SAMPLES, {}, 450])]
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", *lines))
    assert series.counter_rates(rec, SAMPLES) == {"": ([110.0], [10.0])}
    assert series.average_rate(*series.series_numbered(rec, SAMPLES).values()) == pytest.approx(10.0)


def test_the_start_line_of_a_rotated_file_stamped_after_the_record_that_follows_it_is_no_epoch_boundary(
        tmp_path: Path) -> None:
    # RunLog stamps a rotation's start line with the clock at the rotation, after the `now` of the scrape that
    # rotated the file and is written right after it: no step back, and the rate at t=110 is kept
    log = tmp_path / "run-log.jsonl"
    write(log.with_name("run-log.jsonl.1"), start(99.0), scrape(100.0, [SAMPLES, {}, 0]))
    write(log, start(110.2), scrape(110.0, [SAMPLES, {}, 100]), scrape(120.0, [SAMPLES, {}, 200]))
    rec = report.read_run_log(log)
    assert series.counter_rates(rec, SAMPLES) == {"": ([110.0, 120.0], [10.0, 10.0])}
    assert series.average_rate(*series.series_numbered(rec, SAMPLES).values()) == pytest.approx(10.0)


def test_the_joiner_watermark_keeps_every_scrape_of_each_epoch_in_the_order_written(tmp_path: Path) -> None:
    # keyed by t, the scrape at t=100 after the step overwrote the one at t=100 before it: the 5000 point was lost and
    # 7000 drawn before 6000
    wm = "streamrec_join_watermark_ms"
    lines = [json.dumps({"kind": "scrape", "t": t, "source": "joiner", "samples": [[wm, {"partition": "0"}, v]]})
             for t, v in ((100.0, 5000), (110.0, 6000), (100.0, 7000))]
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", *lines))
    assert series._min_over(rec, wm) == ([100.0, 110.0, 100.0], [5000.0, 6000.0, 7000.0])


def test_the_joiner_watermark_is_the_slowest_partition_over_every_joiner_source(tmp_path: Path) -> None:
    # two joiners of one consumer group, each with its partitions, scraped at one time: the freshness plot took the
    # last source's watermark (9000), not the slowest partition's (5000)
    wm = "streamrec_join_watermark_ms"
    lines = [json.dumps({"kind": "scrape", "t": 100.0, "source": source, "samples": [[wm, {"partition": p}, v]]})
             for source, p, v in (("joiner-a", "0", 5000), ("joiner-b", "1", 9000))]
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", *lines))
    assert series._min_over(rec, wm) == ([100.0], [5000.0])


def test_served_quality_over_event_time_draws_each_value_at_the_event_time_of_its_own_scrape() -> None:
    # matched by t alone, the AUC 0.7 scraped at t=100 before the step was drawn at E3, the event time of the scrape at
    # t=100 after it
    pytest.importorskip("matplotlib")
    e1, e2, e3 = 978_300_000.0, 978_303_600.0, 978_307_200.0
    rec = recording.Recording()
    for t, event_s, auc in ((100.0, e1, 0.7), (110.0, e2, None), (100.0, e3, 0.9)):
        samples = [["streamrec_learner_event_time_seconds", {}, event_s]]
        rec.add({"kind": "scrape", "t": t, "source": "learner",
                 "samples": samples + ([["streamrec_learner_served_auc", {}, auc]] if auc else [])})
    p = plotter.Plotter(90.0, 30.0)
    drawn: list[tuple[list[float], list[float]]] = []

    def png(fig: Any) -> bytes:
        import matplotlib.dates as mdates

        drawn.extend(([mdates.num2date(x).timestamp() for x in line.get_xdata(orig=False)], list(line.get_ydata()))
                     for line in fig.axes[2].get_lines())
        p.plt.close(fig)
        return b""

    p.png = png  # type: ignore[method-assign]
    sections.s_quality(p, sections.Inputs(rec))
    assert drawn == [([e1, e3], [0.7, 0.9])]


def test_the_progress_line_after_a_clock_step_seen_only_in_failed_scrapes_reads_no_rate_across_it(
        tmp_path: Path) -> None:
    errors = [record("scrape_error", t, source="learner", error="connection refused") for t in (90.0, 100.0, 110.0)]
    path = write(tmp_path / "run-log.jsonl", scrape(100.0, [SAMPLES, {}, 0]), scrape(110.0, [SAMPLES, {}, 100]),
                 *errors, scrape(115.0, [SAMPLES, {}, 450]))
    out = Printed()
    assert follow.follow(path, "learner", lambda: False, out, print_every_s=0) == 3  # type: ignore[arg-type]
    # the line at t=115 read 70/s: 350 samples over 5 s, where 35 s had passed
    assert out == ["learner: 0 samples trained\n", "learner: 100 samples trained (10/s)\n",
                   "learner: 450 samples trained\n"]


def test_the_average_bar_over_two_ranks_on_either_side_of_a_clock_step_spans_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 trains 1000 samples from t=1000 to 1100; the clock steps back 600 s; rank 1 then trains 1000 from t=500
    # to 600: 2000 samples over the 200 s they were seen training, 10/s. Each rank alone has one epoch, so the two
    # were put on one time line: 2000 over 1100 - 500, 3.3/s
    lines = [json.dumps({"kind": "scrape", "t": t, "source": src, "samples": [[SAMPLES, {}, v]]})
             for src, t, v in (("rank0", 1000.0, 0), ("rank0", 1100.0, 1000), ("rank1", 500.0, 0),
                               ("rank1", 600.0, 1000))]
    rec = report.read_run_log(write(tmp_path / "run-log.jsonl", *lines))
    pytest.importorskip("matplotlib")
    drawn: dict[str, float] = {}
    monkeypatch.setattr(plotter.Plotter, "bars", lambda self, ax, values, *a, **k: drawn.update(values) or len(values))
    sections.s_throughput(plotter.Plotter(500.0, 600.0), sections.Inputs(rec))
    assert drawn == {"train\n(samples/s, counter)": pytest.approx(10.0)}


def test_the_average_bar_of_ranks_side_by_side_before_a_clock_step_is_what_it_reads_without_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 trains 1000 samples from t=1000 to 1100, rank 1 1000 from 1050 to 1100: 2000 in 100 s, 20/s, as the bar
    # reads without a step. After a step back both train 10/s from t=500 to 600 (2000 more): 4000 in 200 s, 20/s.
    # Each rank's own average summed: 2000 in 200 s and 2000 in 150 s, 23.3/s
    pts = [("rank0", 1000.0, 0), ("rank1", 1050.0, 0), ("rank0", 1100.0, 1000), ("rank1", 1100.0, 1000),
           ("rank0", 500.0, 1000), ("rank1", 500.0, 1000), ("rank0", 600.0, 2000), ("rank1", 600.0, 2000)]
    lines = [json.dumps({"kind": "scrape", "t": t, "source": src, "samples": [[SAMPLES, {}, v]]}) for src, t, v in pts]
    pytest.importorskip("matplotlib")
    drawn: dict[str, float] = {}
    monkeypatch.setattr(plotter.Plotter, "bars", lambda self, ax, values, *a, **k: drawn.update(values) or len(values))
    for n in (4, 8):  # before the step, and all of it
        sections.s_throughput(plotter.Plotter(500.0, 600.0),
                            sections.Inputs(report.read_run_log(write(tmp_path / "run-log.jsonl", *lines[:n]))))
        assert drawn == {"train\n(samples/s, counter)": pytest.approx(20.0)}, n


def test_a_curve_over_wall_time_breaks_at_a_clock_step_seen_only_in_failed_scrapes() -> None:
    # the learner's count at t=100 and 110, then failed scrapes at t=90, 100, 110 (the clock stepped back 20 s), then
    # 450 at t=115: its own t never drops, and the freshness plot drew one line from t=110 to 115 across the step
    pytest.importorskip("matplotlib")
    rec = recording.Recording()
    for line in (scrape(100.0, [SAMPLES, {}, 0]), scrape(110.0, [SAMPLES, {}, 100]),
                 *(record("scrape_error", t, source="learner", error="refused") for t in (90.0, 100.0, 110.0)),
                 scrape(115.0, [SAMPLES, {}, 450])):
        rec.add(json.loads(line))
    p = plotter.Plotter(90.0, 30.0)
    drawn: list[list[float]] = []

    def png(fig: Any) -> bytes:
        drawn.extend(list(line.get_xdata()) for line in fig.axes[0].get_lines())
        p.plt.close(fig)
        return b""

    p.png = png  # type: ignore[method-assign]
    sections.s_fresh(p, sections.Inputs(rec))
    (xs,) = drawn
    assert xs[:2] == [10.0, 20.0] and math.isnan(xs[2]) and xs[3:] == [25.0]


def _broken_at_the_step(ax: Any) -> list[list[float]]:
    """The stretches drawn as one line on ``ax`` (a line is cut by NaN), by x."""
    out: list[list[float]] = []
    for line in ax.get_lines():
        out.append([])
        for x in line.get_xdata():
            if math.isnan(x):
                out.append([])
            else:
                out[-1].append(float(x))
    return [seg for seg in out if seg]


HIDDEN_STEP = {  # a clock step back after t=110 that no curve's own t shows: 110 -> (95) -> 115
    "another-source": [json.dumps({"kind": "scrape", "t": 95.0, "source": "other", "samples": []})],
    "another-record-kind": [record("rules", 95.0, states={})],
}


@pytest.mark.parametrize("between", HIDDEN_STEP.values(), ids=HIDDEN_STEP.keys())
@pytest.mark.parametrize(("section", "axis"), [(sections.s_throughput, 1), (sections.s_hot, 1), (sections.s_grad, 0),
                                               (sections.s_fresh, 2)],
                         ids=["learner-rate", "rows-read-per-tier", "gradient-quantiles", "joiner-watermark"])
def test_every_curve_over_wall_time_breaks_at_a_clock_step_seen_only_in_another_source_or_record_kind(
        section: Any, axis: int, between: list[str]) -> None:
    # rates, quantiles and the watermark were kept flat and cut only where their own t drops: the point at t=110
    # (before the step) and the ones at t=125, 135 (after it) were drawn as one line across it
    pytest.importorskip("matplotlib")

    def samples(i: int) -> list[list[Any]]:
        grad = [[f"{GRAD}_bucket", {"part": "dense", "le": le}, 10 * i] for le in ("1", "+Inf")]
        return [[SAMPLES, {}, 100 * i], *grad, [f"{GRAD}_sum", {"part": "dense"}, 2.0 * i],
                [f"{GRAD}_count", {"part": "dense"}, 10 * i],
                ["streamrec_serving_embedding_lookups_total", {"tier": "hot"}, 50 * i],
                ["streamrec_join_watermark_ms", {"partition": "0"}, 978_300_000_000 + 1000 * i]]

    rec = recording.Recording()
    before = [scrape(t, *samples(i)) for i, t in enumerate((100.0, 110.0))]
    after = [scrape(t, *samples(i)) for i, t in enumerate((115.0, 125.0, 135.0), start=2)]
    for line in (*before, *between, *after):
        rec.add(json.loads(line))
    p = plotter.Plotter(90.0, 50.0)
    drawn: list[list[float]] = []

    def png(fig: Any) -> bytes:
        drawn.extend(_broken_at_the_step(fig.axes[axis]))
        p.plt.close(fig)
        return b""

    p.png = png  # type: ignore[method-assign]
    section(p, sections.Inputs(rec))
    assert drawn and any(min(seg) >= 25.0 for seg in drawn)  # something drawn after the step (x = t - 90)
    assert not any(min(seg) <= 20.0 and max(seg) >= 25.0 for seg in drawn), drawn


def _bars(ax: Any) -> list[tuple[float, float]]:
    """The rule-state bars drawn on ``ax`` (broken_barh), each as its (start, end) x."""
    spans = [(float(v[:, 0].min()), float(v[:, 0].max())) for c in ax.collections for v in
             (path.vertices for path in c.get_paths())]
    return sorted(spans)


@pytest.mark.parametrize("between", [
    HIDDEN_STEP["another-source"], [record("scrape_error", 95.0, source="learner", error="connection refused")],
], ids=["another-source", "failed-scrape"])
def test_a_rules_state_bar_ends_at_its_epochs_last_evaluation_across_a_clock_step_the_rules_do_not_show(
        monkeypatch: pytest.MonkeyPatch, between: list[str]) -> None:
    # the state at t=110 was drawn to the next evaluation's t=115, across the step back after it (20 s truly passed):
    # bars were cut only where the rules' own t drops (a negative width, clamped); like every other curve, they now
    # break at each epoch
    rec = recording.Recording()
    evaluations = [record("rules", t, states={"auc_low": state})
                   for t, state in ((100.0, "pending"), (110.0, "firing"), (115.0, "firing"), (125.0, "inactive"))]
    for line in (*evaluations[:2], *between, *evaluations[2:]):
        rec.add(json.loads(line))
    p = plotter.Plotter(90.0, 50.0)
    drawn: list[tuple[float, float]] = []

    def png(fig: Any) -> bytes:
        drawn.extend(_bars(fig.axes[0]))
        p.plt.close(fig)
        return b""

    monkeypatch.setattr(p, "png", png)
    sections.s_alerts(p, sections.Inputs(rec))
    # x = seconds since t0=90; an epoch's last evaluation draws as a bar of no width (as the run log's last one did)
    assert drawn == [pytest.approx(span) for span in [(10.0, 20.0), (20.0, 20.0), (25.0, 35.0), (35.0, 35.0)]]
