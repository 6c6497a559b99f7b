"""``streamrec report`` under hostile input (monitor/report.py): run-log lines, summaries and last_run.json of
any shape, label values and names from event data, timestamps and metric values out of range. Each is read as
"not recorded" or drawn as text, never a traceback (issues 11 and 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_refresh import run_records
from monitor import follow, plotter, recording, report, sections, series

START = {"kind": "start", "t": 1000.0, "sources": {}, "interval_s": 1, "rules": []}


def write_log(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "run-log.jsonl"
    path.write_text("".join(line + "\n" for line in (json.dumps(START), *lines)))
    return path


def scrape(t: float, *samples: list[object]) -> str:
    return json.dumps({"kind": "scrape", "t": t, "source": "learner", "samples": list(samples)})


def drawing_only(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """The report drawn with only the sections a test's hostile value reaches (drawing is the slow part: ~0.3 s a
    section); the page around them (head, summaries, footer) is written as ever."""
    by_name = {f.__name__: f for f in sections.SECTIONS}
    monkeypatch.setattr(sections, "SECTIONS", tuple(by_name[s] for s in names))


# the sections that read the stage summaries (Inputs.summaries)
SUMMARY_SECTIONS = ("s_quality", "s_cold", "s_throughput", "s_hot", "s_dlq", "s_alerts")


def page_of(tmp_path: Path, inp: sections.Inputs) -> str:
    out = tmp_path / "report.html"
    report.write_report(inp, out)
    return out.read_text()


def test_json_nested_too_deeply_is_an_unreadable_line_or_a_named_summary_never_a_recursion_error(
        tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    rec = report.read_run_log(write_log(tmp_path, deep, scrape(1001.0, ["streamrec_learner_samples_total", {}, 5])))
    assert rec.bad_lines == 1 and series.series(rec, "streamrec_learner_samples_total")[""][1] == [5.0]
    assert list(follow._scrapes_of([deep], "learner")) == []  # --follow reads the same lines
    (tmp_path / "train.json").write_text(deep)
    with pytest.raises(recording.ReportError, match="train.json"):
        recording.read_summaries([tmp_path / "train.json"])
    (tmp_path / "last_run.json").write_text(deep)
    assert run_records.read_last_run(tmp_path) == {}


def test_samples_with_labels_that_are_not_strings_are_left_out_and_huge_integers_read_as_infinite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawing_only(monkeypatch, "s_coverage")  # the one section drawing streamrec_learner_field_coverage
    cov = "streamrec_learner_field_coverage"
    path = write_log(tmp_path, scrape(1001.0, [cov, {"field": 1}, 0.5], [cov, {"field": ["x"]}, 0.5],
                                      [cov, {"field": "user"}, 0.25], [cov, {"field": "item"}, 10 ** 400],
                                      [cov, {"field": "ad"}, -(10 ** 400)]))
    rec = report.read_run_log(path)
    assert series.series(rec, cov, by=("field",)) == {
        "ad": ([1001.0], [float("-inf")]), "item": ([1001.0], [float("inf")]), "user": ([1001.0], [0.25])}
    assert "Feature coverage" in page_of(tmp_path, sections.Inputs(rec))


BAD_TIMES = ["NaN", "Infinity", "-Infinity", "1e13", "-1e13", "-1"]


def test_a_record_whose_time_is_not_finite_negative_or_past_year_9999_is_an_unreadable_line(tmp_path: Path) -> None:
    """Each bad time in a scrape and in a rules record: every one an unreadable line, none moving the run's span
    (one report drawn for all of them: drawing is the slow part)."""
    bad = []
    for t in BAD_TIMES:
        bad.append(scrape(1001.0, ["streamrec_learner_samples_total", {}, 9]).replace('"t": 1001.0', f'"t": {t}'))
        rules = json.dumps({"kind": "rules", "t": 0, "states": {"auc_low": "firing"}})
        bad.append(rules.replace('"t": 0', f'"t": {t}'))
    path = write_log(tmp_path, *bad, scrape(1002.0, ["streamrec_learner_samples_total", {}, 5]))
    rec = report.read_run_log(path)
    assert rec.bad_lines == 2 * len(BAD_TIMES) and (rec.t0, rec.t_end) == (1000.0, 1002.0)
    assert f"{2 * len(BAD_TIMES)} unreadable line(s) skipped" in page_of(tmp_path, sections.Inputs(rec))
    for t in BAD_TIMES:  # and each alone, read without drawing
        alone = write_log(tmp_path, scrape(1001.0, ["streamrec_learner_samples_total", {}, 9]).replace(
            '"t": 1001.0', f'"t": {t}'), scrape(1002.0, ["streamrec_learner_samples_total", {}, 5]))
        one = report.read_run_log(alone)
        assert one.bad_lines == 1 and (one.t0, one.t_end) == (1000.0, 1002.0), t


def test_label_values_and_rule_names_holding_dollar_signs_are_drawn_as_text_not_parsed_as_math(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawing_only(monkeypatch, "s_coverage", "s_alerts")  # where a field label and a rule name are drawn
    cov, name = "streamrec_learner_field_coverage", r"$\foo{$"
    states = json.dumps({"kind": "rules", "t": 1002.0, "states": {name: "firing"}})
    rec = report.read_run_log(write_log(tmp_path, scrape(1001.0, [cov, {"field": name}, 0.5]),
                                        scrape(1002.0, [cov, {"field": name}, 0.5]), states))
    made = {s.id: s for s in report.write_report(sections.Inputs(rec), tmp_path / "report.html")}
    assert made["coverage"].points == 2 and made["alerts"].points == 1


def test_event_times_and_watermarks_beyond_any_date_are_left_out_of_the_plots_and_the_progress_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawing_only(monkeypatch, "s_quality", "s_fresh")  # the sections drawing the event time and the watermark
    auc, clock = "streamrec_learner_served_auc", "streamrec_learner_event_time_seconds"
    wm = "streamrec_join_watermark_ms"
    lines = [scrape(1001.0, [auc, {}, 0.7], [clock, {}, "+Inf"], [wm, {"partition": "0"}, 1e300]),
             scrape(1002.0, [auc, {}, 0.7], [clock, {}, 1e300], [wm, {"partition": "0"}, 1e300]),
             scrape(1003.0, [auc, {}, 0.7], [clock, {}, 1.7e9], [wm, {"partition": "0"}, 1.7e12])]
    rec = report.read_run_log(write_log(tmp_path, *lines))
    made = {s.id: s for s in report.write_report(sections.Inputs(rec), tmp_path / "report.html")}
    assert made["served-quality"].points == 3 + 1  # 3 over wall time, 1 over event time
    assert made["freshness"].points == 1
    samples = rec.scrapes["learner"][0][1] + [("streamrec_join_samples_total", {}, 5.0)]
    assert "event time" not in follow.progress_line(samples, None, 1001.0)


@pytest.mark.parametrize("summary", [
    {"samples_trained": 1, "served": [1]},
    {"samples_trained": 1, "served": {"all": [1]}},
    {"samples_trained": 1, "served": {"all": {"impressions": "many", "auc": 0.7}}},
    {"samples_trained": 1, "served": {"all": {"impressions": 10 ** 400, "auc": 10 ** 400}}},
    {"samples_trained": 1, "cold_users": [1]},
    {"samples_trained": 1, "cold_users": {"cold": {"samples": "x"}, "warm": []}},
    {"dataset": "x", "acked": {}, "impressions": "x", "clicks": [], "dead_lettered": "x", "events_per_s": 1e309},
    {"group": "g", "driver": "kafka", "dead_lettered": {"a": 1}, "events_per_s": "fast"},
], ids=["served-list", "all-list", "impressions-str", "impressions-400-digits",
      "cold-list", "cold-str", "replay-types", "join-types"])
def test_a_summary_with_a_key_of_the_wrong_type_is_written_not_a_traceback(
        tmp_path: Path, summary: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    drawing_only(monkeypatch, *SUMMARY_SECTIONS)
    stage = "train" if "samples_trained" in summary else "replay" if "dataset" in summary else "join"
    (tmp_path / f"{stage}.json").write_text(json.dumps(summary).replace("1e309", "Infinity"))
    inp = sections.Inputs(report.read_run_log(write_log(tmp_path)),
                          recording.read_summaries([tmp_path / f"{stage}.json"]))
    page = page_of(tmp_path, inp)
    assert sections.served_quality(inp.summaries) is None and "Served quality (" not in page
    if "dead_lettered" in summary:
        assert f"{stage} summary: dead_lettered is not a number" in page


def test_a_publish_time_far_past_the_run_log_is_not_drawn_and_the_page_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawing_only(monkeypatch, "s_fresh")  # the one section reading last_run.json
    (tmp_path / "last_run.json").write_text(json.dumps({"last_success": 1e300, "version": "v1"}))
    inp = sections.Inputs(report.read_run_log(write_log(tmp_path)), {}, run_records.read_last_run(tmp_path))
    assert "last_run.json: version v1" in page_of(tmp_path, inp)


def test_a_file_beside_the_run_log_with_a_non_ascii_digit_suffix_is_not_a_rotation(tmp_path: Path) -> None:
    path = write_log(tmp_path)
    (tmp_path / "run-log.jsonl.\u00b2").write_text("{}\n")
    assert report.read_run_log(path).files == [str(path)]


def test_values_near_the_largest_float_are_left_out_of_the_plots_and_counted_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib cannot lay out an axis near the float maximum (a constant 1e308 raised "arange: cannot compute
    length"): a value beyond plotter.PLOT_MAX is not drawn, and its section says how many were left out."""
    drawing_only(monkeypatch, *SUMMARY_SECTIONS, "s_lag", "s_fresh")  # every section drawing these metrics or the
    # replay summary
    lag, ne, samples = "streamrec_learner_lag_samples", "streamrec_learner_served_ne", "streamrec_learner_samples_total"
    clock = "streamrec_learner_event_time_seconds"
    path = write_log(tmp_path, *(scrape(1001.0 + i, [lag, {}, v], [ne, {}, v], [samples, {}, s], [clock, {}, 1.7e9 + i])
                                 for i, (v, s) in enumerate([(1e308, 1.7e308), (1e308, 5), (plotter.PLOT_MAX, 1e308)])))
    (tmp_path / "replay.json").write_text(json.dumps({"dataset": "x", "acked": 1, "events_per_s": 1.7e308}))
    inp = sections.Inputs(report.read_run_log(path), recording.read_summaries([tmp_path / "replay.json"]))
    made = {s.id: s for s in report.write_report(inp, tmp_path / "report.html")}
    assert made["lag"].points == 1 and any("2 recorded value(s) beyond" in m for m in made["lag"].missing)
    assert made["served-quality"].points == 1 + 1  # the 1e300 over wall time and over event time
    # the rate 5 -> 1e308 per second, the replay's bar and the learner's average (1e308 over 2 s)
    assert made["throughput"].points == 0 and any("3 recorded value(s) beyond" in m
                                                      for m in made["throughput"].missing)
    assert made["freshness"].points == 1 and any("2 recorded value(s) beyond" in m  # samples trained
                                                     for m in made["freshness"].missing)


def test_a_counters_rate_over_labels_gives_no_point_where_a_series_left_out_of_one_scrape_comes_back() -> None:
    """The clicks series missing from the middle scrape (a sample the monitor left out as stale) made the sum of the
    topics drop then rise by the whole clicks count: 520 events/s where the joiner read 15 (10 + 5)."""
    events = "streamrec_events_total"
    rec = recording.Recording()
    for t, counts in ((100.0, {"impressions": 1000, "clicks": 500}), (101.0, {"impressions": 1010}),
                      (102.0, {"impressions": 1020, "clicks": 510}), (103.0, {"impressions": 1030, "clicks": 515})):
        rec.add({"kind": "scrape", "t": t, "source": "joiner",
                 "samples": [[events, {"stage": "join", "topic": k}, v] for k, v in counts.items()]})
    assert series.counter_rates(rec, events, where={"stage": "join"}) == {"": ([103.0], [15.0])}
    by_topic = series.counter_rates(rec, events, by=("topic",))
    assert by_topic == {"clicks": ([102.0, 103.0], [5.0, 5.0]),  # 10 over the 2 s between its scrapes, then 5
                        "impressions": ([101.0, 102.0, 103.0], [10.0, 10.0, 10.0])}


def test_a_curve_whose_label_value_starts_with_an_underscore_is_named_in_the_legend() -> None:
    """matplotlib leaves an artist labelled "_..." out of a legend: a DLQ curve of topic "_schemas" or a field named
    "_hour" was drawn with nothing saying which it was."""
    p = plotter.Plotter(1000.0, 10.0)
    fig, (ax, ev) = p.figure(2, 1)
    curves = {"_schemas/bad_json": ([1001.0, 1002.0], [1.0, 2.0]), "impressions/bad_json": ([1001.0], [3.0])}
    assert p.lines(ax, curves, "messages", "dead letters") == 3
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)
    rec = recording.Recording()
    for t in (1001.0, 1002.0):
        rec.add({"kind": "scrape", "t": t, "source": "learner",
                 "samples": [["streamrec_learner_event_time_seconds", {}, 1.7e9 + t]]})
    assert plotter.event_time_plot(ev, rec, {"_auc": ([1001.0, 1002.0], [0.7, 0.8])}) == 2
    assert [t.get_text() for t in ev.get_legend().get_texts()] == ["_auc"]
    p.plt.close(fig)


def test_a_file_or_symlink_at_the_reports_temporary_name_is_neither_written_through_nor_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report was written to the fixed name <out>.tmp: a symlink there was followed (its target overwritten
    with the page) and a file of that name deleted on failure; it is written as every atomic file is
    (stream.files.write_atomic)."""
    drawing_only(monkeypatch)  # the writing is what this proves: the page with no plot on it
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / "report.html.tmp").symlink_to(precious)
    page = page_of(tmp_path, sections.Inputs(report.read_run_log(write_log(tmp_path))))
    assert precious.read_text() == "keep me" and "streamrec run report" in page
    assert not (tmp_path / "report.html").is_symlink()


def test_a_record_holding_a_lone_surrogate_escape_is_an_unreadable_line_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r"""JSON may escape a lone surrogate ("\ud800"), which no UTF-8 text holds (the monitor refuses a label that is not
    UTF-8): in an alert's rule it crashed the reading (its fingerprint), in a source name the page's encoding."""
    drawing_only(monkeypatch, "s_alerts")  # the one section drawing rule states (the escaped one is read)
    path = write_log(tmp_path, scrape(1001.0, ["streamrec_learner_field_coverage", {"field": "a"}, 0.5]).replace(
        '"learner"', '"learner\\ud800"'),
                     json.dumps({"kind": "alert", "t": 1002.0, "alert": {"rule": "r\ud800", "state": "firing"}}),
                     json.dumps({"kind": "rules", "t": 1002.0, "states": {"r": "firing\udfff"}}),
                     '{"kind": "rules", "t": 1003.0, "states": {"r": "\\\\ud800 firing"}}')  # an escaped backslash
    rec = report.read_run_log(path)
    assert rec.bad_lines == 3 and not rec.scrapes and not rec.alerts
    assert rec.rule_states == [(1003.0, {"r": "\\ud800 firing"}, 0)]
    assert "3 unreadable line(s) skipped" in page_of(tmp_path, sections.Inputs(rec))
    (tmp_path / "replay.json").write_text('{"dataset": "x", "acked": 1}\n{"dataset": "\\udcff", "acked": 2}\n')
    assert recording.read_summaries([tmp_path / "replay.json"]) == {"replay": {"dataset": "x", "acked": 1}}
    (tmp_path / "last_run.json").write_text('{"version": "v\\ud800"}')
    assert run_records.read_last_run(tmp_path) == {"version": "v\ud800"}  # the refresh's own reader keeps it
    assert recording.usable_last_run(run_records.read_last_run(tmp_path)) == {}


def test_values_a_log_axis_cannot_tick_are_left_out_of_the_gradient_plots_and_counted_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a log axis matplotlib places ticks a stride of decades beyond the data: an update norm of 1e280 beside 1
    put one at 10^350 = inf ("cannot convert float infinity to integer"). A log axis draws 1e-100 to 1e100."""
    drawing_only(monkeypatch, "s_grad")  # the one section drawing streamrec_learner_update_norm
    upd = "streamrec_learner_update_norm"
    path = write_log(tmp_path, *(scrape(1001.0 + i, [upd, {"part": "dense"}, v])
                                 for i, v in enumerate([1e280, 1.0, 1e100, 1e-100, 1e-101])))
    made = {s.id: s for s in report.write_report(sections.Inputs(report.read_run_log(path)),
                                                     tmp_path / "report.html")}
    assert made["gradient-norms"].points == 3
    assert any("2 recorded value(s)" in m and "not drawn" in m for m in made["gradient-norms"].missing)


def test_streamrec_report_writes_its_page_when_last_run_json_holds_text_that_is_no_utf8(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the refresh's reader keeps a lone surrogate escape (its own record: a file name it read may carry one); the
    # report's page is UTF-8, and that text ended `streamrec report` in a UnicodeEncodeError
    from streamrec.cli import main

    drawing_only(monkeypatch, "s_fresh")  # the one section reading last_run.json
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "last_run.json").write_text('{"last_success": 1001.5, "version": "v\\udcff"}')
    log = write_log(tmp_path, scrape(1001.0, ["streamrec_learner_samples_total", {}, 5]))
    out = tmp_path / "r.html"
    assert main(["report", "--run-log", str(log), "--publish-root", str(tmp_path / "root"), "--out", str(out)]) == 0
    assert "<html" in out.read_text(encoding="utf-8")
