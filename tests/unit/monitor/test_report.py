"""The run log (monitor/run_log.py RunLog, [run_log] of the rules file) and the report built from it
(monitor/report.py): what is recorded is what is read back and drawn; rates, quantiles and missing data."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from monitor import follow, plotter, recording, report, sections, series
from monitor.alerts import Alert, AlertKind, SinkSettings, alert_fingerprint
from monitor.delivery import QueuedSink
from monitor.engine import Monitor
from monitor.rules import RulesError, RunLogSettings, loads_rules
from monitor.run_log import RunLog
from monitor.scrape import Snapshot

RULES = '''
interval_s = 1
[sources]
learner = "http://127.0.0.1:1/metrics"
[sinks]
log = false
[run_log]
path = "{path}"
max_bytes = {max_bytes}
keep = 2
[[rule]]
name = "auc_low"
expr = "streamrec_learner_served_auc"
op = "<"
threshold = 0.6
'''


def learner_text(samples: int, auc: float, grad_counts: tuple[int, int, int], grad_sum: float) -> str:
    le_small, le_big, total = grad_counts
    return (f"streamrec_learner_samples_total {samples}\n"
            f"streamrec_learner_served_auc {auc}\n"
            "streamrec_learner_served_ne NaN\n"
            'streamrec_learner_lag_samples{partition="0"} 3\nstreamrec_learner_lag_samples{partition="1"} 4\n'
            f'streamrec_learner_grad_norm_bucket{{part="dense",le="0.1"}} {le_small}\n'
            f'streamrec_learner_grad_norm_bucket{{part="dense",le="1.0"}} {le_big}\n'
            f'streamrec_learner_grad_norm_bucket{{part="dense",le="+Inf"}} {total}\n'
            f'streamrec_learner_grad_norm_count{{part="dense"}} {total}\n'
            f'streamrec_learner_grad_norm_sum{{part="dense"}} {grad_sum}\n'
            "process_cpu_seconds_total 12\n")


class Printed(list[str]):
    """What :func:`follow.follow` printed, a string per write: an output that is no terminal."""

    def write(self, s: str) -> None:
        self.append(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class Nothing:
    name, timeout_s, batch_max = "nothing", 1.0, 100

    def send(self, alerts: object, deadline: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def run_monitor(tmp_path: Path, texts: list[str], max_bytes: int = 1 << 20) -> Path:
    path = tmp_path / "run-log.jsonl"
    config = loads_rules(RULES.format(path=path, max_bytes=max_bytes))
    it = iter(texts)
    clock = iter(float(1000 + i) for i in range(1000))
    mon = Monitor(config, QueuedSink(Nothing(), SinkSettings()), scrape=lambda: Snapshot.from_texts(
        {"learner": next(it)}), clock=lambda: next(clock))
    for _ in texts:
        mon.step()
    assert mon.summary()["run_log"]["records"] > 0
    mon.close()
    return path


def test_the_run_log_records_each_scrape_rule_state_and_alert(tmp_path: Path) -> None:
    texts = [learner_text(100 * i, 0.5 + 0.05 * i, (i, 2 * i, 3 * i), 0.2 * i) for i in range(4)]
    path = run_monitor(tmp_path, texts)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines[:1]] == ["start"]
    scrape = next(x for x in lines if x["kind"] == "scrape")
    names = {s[0] for s in scrape["samples"]}
    assert "process_cpu_seconds_total" not in names and "streamrec_learner_samples_total" in names
    assert ["streamrec_learner_served_ne", {}, "NaN"] in scrape["samples"]  # valid JSON, NaN as Prometheus writes it
    alerts = [x["alert"] for x in lines if x["kind"] == "alert"]
    assert [(a["rule"], a["state"]) for a in alerts] == [("auc_low", "firing"), ("auc_low", "resolved")]

    rec = report.read_run_log(path)
    assert rec.t0 == 1000.0 and len(rec.scrapes["learner"]) == 4  # the start line, then a scrape a second
    assert series.series(rec, "streamrec_learner_samples_total")[""] == ([1001.0, 1002.0, 1003.0, 1004.0],
                                                                          [0.0, 100.0, 200.0, 300.0])
    assert series.series(rec, "streamrec_learner_lag_samples")[""][1] == [7.0] * 4  # summed over partitions
    assert set(series.series(rec, "streamrec_learner_lag_samples", by=("partition",))) == {"0", "1"}
    assert math.isnan(series.series(rec, "streamrec_learner_served_ne")[""][1][0])
    assert [st["auc_low"] for _, st, _ in rec.rule_states] == ["firing", "firing", "resolved", "inactive"]


def test_the_run_log_rotates_and_is_read_back_whole(tmp_path: Path) -> None:
    texts = [learner_text(i, 0.7, (0, 0, 0), 0) for i in range(40)]
    path = run_monitor(tmp_path, texts, max_bytes=4096)
    files = recording.run_log_files(path)
    assert [p.name for p in files] == ["run-log.jsonl.2", "run-log.jsonl.1", "run-log.jsonl"]  # keep = 2
    assert all(p.stat().st_size <= 4096 for p in files)
    rec = report.read_run_log(path)
    ts, vs = series.series(rec, "streamrec_learner_samples_total")[""]
    assert vs == sorted(vs) and vs[-1] == 39 and len(vs) < 40  # the oldest rotated away, the rest in order
    assert all(json.loads(line)["kind"] == "start" for line in path.read_text().splitlines()[:1])


def test_run_log_settings_are_checked() -> None:
    base = 'interval_s = 1\n[run_log]\n'
    assert loads_rules(base + 'path = "x.jsonl"').run_log == RunLogSettings(path=Path("x.jsonl"))
    assert loads_rules("interval_s = 1").run_log.path is None
    for bad, says in (('path = 3', 'field "path"'), ('path = "x"\nmax_bytes = 10', 'field "max_bytes"'),
                      ('keep = -1', 'field "keep"'), ('colour = 1', 'unknown field "colour"')):
        with pytest.raises(RulesError, match=re.escape(says)):
            loads_rules(base + bad)


def test_a_run_log_that_cannot_be_written_drops_records_and_says_so_once(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    log = RunLog(RunLogSettings(path=tmp_path / "r.jsonl"))
    log._file.close()
    log._file = open(tmp_path / "r.jsonl", encoding="utf-8")  # noqa: SIM115 - read-only: every write fails
    with caplog.at_level("WARNING"):
        log.write({"kind": "x", "t": 1})
        log.write({"kind": "x", "t": 2})
    assert log.failures == 2 and sum("cannot write" in r.message for r in caplog.records) == 1
    log.close()


def test_rates_skip_counter_resets_and_quantiles_interpolate() -> None:
    assert series.rate(([0, 1, 2, 4], [0, 10, 5, 9])) == ([1, 4], [10.0, 2.0])
    assert series.average_rate(([0, 1, 2, 3, 4], [0, 0, 10, 30, 30])) == 15.0
    buckets = [(0.1, 5.0), (1.0, 10.0), (math.inf, 10.0)]
    assert series.quantile(buckets, 0.5) == pytest.approx(0.1)
    assert series.quantile(buckets, 0.75) == pytest.approx(0.55)
    assert math.isnan(series.quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5))


def test_histograms_over_time_are_the_observations_between_scrapes(tmp_path: Path) -> None:
    texts = [learner_text(0, 0.7, (0, 0, 0), 0.0), learner_text(0, 0.7, (10, 10, 10), 0.5),
             learner_text(0, 0.7, (10, 20, 20), 6.0)]
    rec = report.read_run_log(run_monitor(tmp_path, texts))
    h = series.histogram_over_time(rec, "streamrec_learner_grad_norm", "part")["dense"]
    assert h["mean"][1] == pytest.approx([0.05, 0.55])
    assert h["p50"][1] == pytest.approx([0.05, 0.55])  # second interval: 10 observations in (0.1, 1]


def test_the_report_has_every_section_and_says_what_was_not_recorded(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    texts = [learner_text(100 * i, 0.6 + 0.01 * i, (i, 2 * i, 2 * i), 0.1 * i) for i in range(5)]
    path = run_monitor(tmp_path, texts)
    train = {"samples_trained": 400, "served": {"all": {"impressions": 400, "auc": 0.71, "ne": 0.93,
                                                        "logloss": 0.6}}}
    (tmp_path / "train.json").write_text("progress noise\n" + json.dumps(train) + "\n")
    inp = sections.Inputs(report.read_run_log(path), recording.read_summaries([tmp_path / "train.json"]))
    out = tmp_path / "r" / "report.html"
    made = report.write_report(inp, out)
    page = out.read_text()
    assert [s.id for s in made] == re.findall(r"<section id='([^']+)'", page)
    assert len(made) == len(sections.SECTIONS) == 11
    assert all(s.png and s.png.startswith(b"\x89PNG") for s in made)
    by_id = {s.id: s for s in made}
    assert by_id["served-quality"].points >= 5 and "AUC <b>0.7100</b>" in page
    assert by_id["hot-set"].points == 0 and "not recorded: streamrec_serving_hot_cache_hit_rate" in page
    assert by_id["alerts"].points == 5  # one rule state per evaluation
    assert "wall-clock time" in page


def test_summaries_are_told_apart_and_bad_ones_named(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"dataset": "ml-1m", "acked": {}}))
    (tmp_path / "b.json").write_text("not json")
    assert list(recording.read_summaries([tmp_path / "a.json"])) == ["replay"]
    with pytest.raises(recording.ReportError, match="b.json"):
        recording.read_summaries([tmp_path / "b.json"])
    with pytest.raises(recording.ReportError, match="no such file"):
        report.read_run_log(tmp_path / "missing.jsonl")


def test_progress_lines_follow_one_source(tmp_path: Path) -> None:
    path = run_monitor(tmp_path, [learner_text(0, 0.7, (0, 0, 0), 0), learner_text(500, 0.7, (0, 0, 0), 0)])

    out = Printed()
    assert follow.follow(path, "learner", lambda: False, out, print_every_s=0) == 2  # type: ignore[arg-type]
    assert out[-1] == "learner: 500 samples trained (500/s), 7 messages behind, served AUC 0.7000\n"


def test_served_quality_is_drawn_over_the_learners_event_time_at_the_same_scrapes(tmp_path: Path) -> None:
    event_s = 978_300_760  # a replay's event time: December 2000
    texts = [learner_text(100 * i, 0.6 + 0.02 * i, (0, 0, 0), 0.0)
             + ("" if i == 0 else f"streamrec_learner_event_time_seconds {event_s + 3600 * i}\n") for i in range(5)]
    rec = report.read_run_log(run_monitor(tmp_path, texts))
    plot = plotter.Plotter(rec.t0, 10.0)
    fig, (ax,) = plot.figure(1, 1)
    auc = series.series(rec, "streamrec_learner_served_auc")
    assert plotter.event_time_plot(ax, rec, auc) == 4  # every scrape with an event time: the first had none
    (line,) = ax.get_lines()
    import matplotlib.dates as mdates

    xs = [mdates.num2date(x).timestamp() for x in line.get_xdata(orig=False)]
    assert xs == [float(event_s + 3600 * i) for i in range(1, 5)]  # x is event time, not the scrape's wall time
    assert list(line.get_ydata()) == pytest.approx([0.62, 0.64, 0.66, 0.68])
    fig2, (ax2,) = plot.figure(1, 1)
    assert plotter.event_time_plot(ax2, report.read_run_log(run_monitor(tmp_path / "none", texts[:1])), auc) == 0


def test_alerts_an_older_monitor_wrote_without_a_fingerprint_read_with_the_one_the_monitor_now_gives_them(
        tmp_path: Path) -> None:
    run, state = tmp_path / "run-log.jsonl", tmp_path / "state.json"
    # as a monitor wrote them before alerts had a kind and a fingerprint (monitor/alerts.py before c995681): labels
    # were {**rule.labels, **series}, the absence alert's {**rule.labels, "absent": "true"}; the start line named the
    # rules only, and the state file (version 2) held the series' own labels
    alert = {"rule": "auc_low", "source": "learner", "severity": "warning", "state": "firing", "threshold": 0.6,
             "ts": 1_000_001_000}
    old = [{"kind": "start", "t": 1000.0, "sources": {"learner": "http://127.0.0.1:1/metrics"}, "interval_s": 1,
            "rules": ["auc_low"]},
           {"kind": "alert", "t": 1001.0, "alert": {**alert, "value": 0.5, "message": "auc_low: held (value 0.5)",
                                                    "labels": {"team": "ranking", "partition": "0"}}},
           {"kind": "alert", "t": 1001.0, "alert": {**alert, "value": None, "message": "auc_low: no data",
                                                    "labels": {"team": "ranking", "absent": "true"}}}]
    run.write_text("".join(json.dumps(r) + "\n" for r in old))
    state.write_text(json.dumps({"version": 2, "firing": [
        {"rule": "auc_low", "labels": {"partition": "0"}, "since": 1000.5, "value": 0.5, "sources": ["learner"]},
        {"rule": "auc_low", "labels": {"absent": "true"}, "since": 1000.5, "value": None, "sources": [],
         "absent": True}]}))
    # the upgraded monitor restores both and resolves them: its alerts carry the fingerprints of today
    config = loads_rules(f'interval_s = 1\nstate_path = "{state}"\n[sources]\nlearner = "http://127.0.0.1:1/m"\n'
                         f'[sinks]\nlog = false\n[run_log]\npath = "{run}"\n[[rule]]\nname = "auc_low"\n'
                         'expr = "streamrec_learner_served_auc"\nop = "<"\nthreshold = 0.6\nabsent_for_s = 60\n'
                         'labels = { team = "ranking" }\n')
    mon = Monitor(config, QueuedSink(Nothing(), SinkSettings()), scrape=lambda: Snapshot.from_texts(
        {"learner": 'streamrec_learner_served_auc{partition="0"} 0.7\n'}), clock=lambda: 1010.0,
        monotonic=lambda: 100.0)
    try:
        resolved = mon.step()
    finally:
        mon.close(5)
    assert sorted((a.kind.value, a.state.value) for a in resolved) == [("absent", "resolved"), ("series", "resolved")]

    rec = report.read_run_log(run)
    by_state: dict[str, dict[str, str]] = {}
    for _, a in rec.alerts:
        by_state.setdefault(a["state"], {})[a["kind"]] = a["fingerprint"]
    # each firing and its resolution are one alert: the old records read with the fingerprints the monitor now gives
    assert by_state["firing"] == by_state["resolved"] == {a.kind.value: a.fingerprint for a in resolved}
    assert by_state["firing"]["series"] == alert_fingerprint("auc_low", AlertKind.SERIES, {"partition": "0"})
    # a consumer of the alerts topic reads them the same, given the rule's labels
    older = [Alert.from_json(json.dumps(r["alert"]), rule_labels={"team": "ranking"}) for r in old[1:]]
    assert {a.kind.value: a.fingerprint for a in older} == by_state["resolved"]


def test_the_reports_alert_lines_show_each_alerts_labels_kind_and_fingerprint_escaped(tmp_path: Path) -> None:
    path = tmp_path / "run-log.jsonl"
    alert = {"rule": "auc_low", "source": "learner", "severity": "warning", "state": "firing", "value": 0.5,
             "threshold": 0.6, "message": "auc_low held", "ts": 1_000_001_000}
    series = [{"partition": "0"}, {"partition": "1"}, {"partition": '<script>alert("x")</script>'}]
    sent = [Alert.from_json(json.dumps({**alert, "labels": lb})) for lb in series]
    sent.append(Alert.from_json(json.dumps({**alert, "labels": {"absent": "true"}, "kind": "absent", "value": None})))
    lines = [{"kind": "start", "t": 1000.0, "sources": {}, "interval_s": 1, "rules": ["auc_low"]},
             *({"kind": "alert", "t": 1001.0, "alert": a.as_dict()} for a in sent)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    inp = sections.Inputs(report.read_run_log(path))
    section = sections.s_alerts(plotter.Plotter(1000.0, 10.0), inp)
    page = report.render_html(inp, [section])
    # two series of one rule, and the absence alert, are told apart by their labels, kind and fingerprint
    assert 'auc_low{partition=&quot;0&quot;} series id=' + sent[0].fingerprint in page
    assert 'auc_low{partition=&quot;1&quot;} series id=' + sent[1].fingerprint in page
    assert 'auc_low{absent=&quot;true&quot;} absent id=' + sent[3].fingerprint in page
    assert "4 still firing at the end of the run log" in page
    # a label is what a scraped process exported: on the page it is text, never markup
    assert "<script>" not in page
    assert 'partition=&quot;&lt;script&gt;alert(\\&quot;x\\&quot;)&lt;/script&gt;&quot;} series' in page


def test_follow_starts_from_the_tail_of_a_large_run_log_then_follows_what_is_appended(tmp_path: Path) -> None:
    path = tmp_path / "run-log.jsonl"

    def scrape(i: int) -> bytes:
        return (json.dumps({"kind": "scrape", "t": 1000.0 + i, "source": "learner",
                            "samples": [["streamrec_learner_samples_total", {}, 1000 * i]]}) + "\n").encode()

    data = b"".join(scrape(i) for i in range(500))
    path.write_bytes(data)
    tail_bytes = 2000
    assert len(data) > 10 * tail_bytes
    # the scrapes wholly within the last tail_bytes (a line cut at the start is skipped)
    cut = len(data) - tail_bytes
    starts = [0]
    for i in range(499):
        starts.append(starts[-1] + len(scrape(i)))
    in_tail = [i for i, s in enumerate(starts) if s > cut]
    calls = []

    def alive() -> bool:  # the first pass; then the monitor appends a scrape and ends
        calls.append(1)
        if len(calls) == 2:
            with path.open("ab") as f:
                f.write(scrape(500))
        return len(calls) < 2

    out = Printed()
    seen = follow.follow(path, "learner", alive, out, every_s=0, print_every_s=0,  # type: ignore[arg-type]
                         tail_bytes=tail_bytes)
    printed = [int(line.split()[1].replace(",", "")) // 1000 for line in out]
    assert printed == [*in_tail, 500] and seen == len(in_tail) + 1
    assert 0 < len(in_tail) < 30  # only the tail, not the 500 scrapes before


def test_report_follow_help_says_the_first_pass_reads_the_tail() -> None:
    from monitor.cli_text import FOLLOW_TAIL_BYTES
    from streamrec.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["report"].format_help().split())  # type: ignore[index]
    assert f"like tail -f, it starts from the last {FOLLOW_TAIL_BYTES >> 20} MiB of the run log" in text


def test_average_rate_counts_a_counter_reset_as_a_restart_from_zero_not_a_loss() -> None:
    # the learner trains 100/s, is restarted at t=3 (its counter starts again from 0) and trains on
    assert series.average_rate(([0, 1, 2, 3, 4], [0, 100, 200, 100, 200])) == pytest.approx(100.0)
    # a restart whose first scrape still reads 0 moves nothing; the next rise does
    assert series.average_rate(([0, 1, 2, 3, 4], [0, 100, 200, 0, 100])) == pytest.approx(75.0)


def test_a_series_two_sources_export_is_one_curve_per_source_not_their_scrapes_interleaved() -> None:
    # two learner ranks without a rank label: 1000/s and 10/s; interleaved, the rates read 2000, 3980, 5960/s
    rec = recording.Recording()
    for i in range(4):
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "rank0",
                 "samples": [["streamrec_learner_samples_total", {}, 1000 * i]]})
        rec.add({"kind": "scrape", "t": 1e9 + i + 0.5, "source": "rank1",
                 "samples": [["streamrec_learner_samples_total", {}, 10 * i]]})
    curves = series.series(rec, "streamrec_learner_samples_total")
    assert {k: series.rate(s)[1] for k, s in curves.items()} == {"(rank0)": [1000.0] * 3, "(rank1)": [10.0] * 3}
    assert list(series.series(rec, "streamrec_learner_samples_total", source="rank1")) == [""]  # one source: as was


def test_histogram_quantiles_of_two_sources_are_one_curve_per_source_not_their_buckets_interleaved() -> None:
    # two learner ranks without a rank label, scraped half a second apart: rank0 observes 10 steps of norm
    # in (0, 0.1] per second, rank1 10 steps in (1, 10]; merged, each "interval" differences one rank's
    # cumulative buckets against the other's and its p50/p90 describe neither
    rec = recording.Recording()
    name = "streamrec_learner_grad_norm"
    for i in range(4):
        for src, dt_s, counts in (("rank0", 0.0, (10 * i, 10 * i, 10 * i)), ("rank1", 0.5, (0, 0, 10 * i))):
            samples = [[f"{name}_bucket", {"part": "dense", "le": le}, c]
                       for le, c in zip(("0.1", "1", "10"), counts, strict=True)]
            samples += [[f"{name}_bucket", {"part": "dense", "le": "+Inf"}, counts[-1]],
                        [f"{name}_sum", {"part": "dense"}, (0.05 if src == "rank0" else 5.5) * counts[-1]],
                        [f"{name}_count", {"part": "dense"}, counts[-1]]]
            rec.add({"kind": "scrape", "t": 1e9 + i + dt_s, "source": src, "samples": samples})
    h = series.histogram_over_time(rec, name, "part")
    assert set(h) == {"dense (rank0)", "dense (rank1)"}
    assert h["dense (rank0)"]["mean"][1] == pytest.approx([0.05] * 3)
    assert h["dense (rank0)"]["p50"][1] == pytest.approx([0.05] * 3)
    assert h["dense (rank1)"]["mean"][1] == pytest.approx([5.5] * 3)
    assert h["dense (rank1)"]["p90"][1] == pytest.approx([9.1] * 3)


def test_the_learners_average_throughput_counts_every_rank_when_two_sources_export_the_counter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    # two learner ranks without a rank label, 1000/s and 10/s over the same 3 s: 3030 samples, 1010/s. Drawn as one
    # curve per source, the counter had no "" curve any more and the average bar was left out of the report.
    rec = recording.Recording()
    for i in range(4):
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "rank0",
                 "samples": [["streamrec_learner_samples_total", {}, 1000 * i]]})
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "rank1",
                 "samples": [["streamrec_learner_samples_total", {}, 10 * i]]})
    drawn: dict[str, float] = {}
    monkeypatch.setattr(plotter.Plotter, "bars", lambda self, ax, values, *a, **k: drawn.update(values) or len(values))
    sections.s_throughput(plotter.Plotter(1e9, 3.0), sections.Inputs(rec))
    assert drawn == {"train\n(samples/s, counter)": pytest.approx(1010.0)}
    # one source: its own average, as before
    assert series.average_rate(([0, 1, 2, 3, 4], [0, 100, 200, 100, 200])) == pytest.approx(100.0)


def _histogram_scrape(name: str, part: str, counts: tuple[float, float, float], total: float,
                      extra: dict[str, str] | None = None) -> list[list[Any]]:
    """One scrape's samples of histogram ``name`` (buckets le 0.1, 1, 10, +Inf) for ``part`` and ``extra`` labels."""
    lb = {"part": part, **(extra or {})}
    return ([[f"{name}_bucket", {**lb, "le": le}, c] for le, c in zip(("0.1", "1", "10"), counts, strict=True)]
            + [[f"{name}_bucket", {**lb, "le": "+Inf"}, counts[-1]], [f"{name}_sum", lb, total],
               [f"{name}_count", lb, counts[-1]]])


def test_histogram_series_of_one_source_that_differ_in_another_label_are_summed_bucket_by_bucket() -> None:
    # one source exports the dense part per rank: rank 0 observes 10 steps in (0, 0.1] per second, rank 1 10 in
    # (1, 10]. Their _sum and _count were summed but each rank's buckets overwrote the other's in the same scrape: the
    # quantiles described rank 1 alone (p50 5.5) while the mean described both
    rec = recording.Recording()
    name = "streamrec_learner_grad_norm"
    for i in range(4):
        samples = (_histogram_scrape(name, "dense", (10 * i, 10 * i, 10 * i), 0.05 * 10 * i, {"rank": "0"})
                   + _histogram_scrape(name, "dense", (0, 0, 10 * i), 5.5 * 10 * i, {"rank": "1"}))
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "learner", "samples": samples})
    h = series.histogram_over_time(rec, name, "part")
    assert h["dense"]["mean"][1] == pytest.approx([2.775] * 3)
    assert h["dense"]["p50"][1] == pytest.approx([0.1] * 3)  # half the 20 observations are at most 0.1
    assert h["dense"]["p90"][1] == pytest.approx([8.2] * 3)


def test_a_histogram_reset_between_scrapes_counts_the_observations_since_the_restart() -> None:
    # a learner restarted between the second and third scrape: its buckets went from (20, 20, 20) to (10, 10, 10):
    # differenced, the interval had -10 observations in every bucket and no quantile; the mean skipped it
    rec = recording.Recording()
    name = "streamrec_learner_grad_norm"
    for i, (c, total) in enumerate([(0, 0.0), (10, 0.5), (20, 1.0), (10, 0.5)]):
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "learner",
                 "samples": _histogram_scrape(name, "dense", (c, c, c), total)})
    h = series.histogram_over_time(rec, name, "part")
    assert h["dense"]["mean"] == ([1e9 + 1, 1e9 + 2, 1e9 + 3], pytest.approx([0.05] * 3))
    assert h["dense"]["p50"][0] == [1e9 + 1, 1e9 + 2, 1e9 + 3]
    assert h["dense"]["p50"][1] == pytest.approx([0.05] * 3)


def test_a_histogram_reset_of_one_series_counts_the_others_rise_and_its_observations_since_the_restart() -> None:
    # one source, two ranks: rank 0 observes 10 steps at 0.05 per scrape; rank 1 10 at 5.5, then restarts and has 5
    # since. Summed first, the drop of the sum (40 -> 35) read as a reset of both: 35 observations, rank 0's whole
    # history counted again (mean 29 / 35); a reset is per series, as Prometheus's sum(increase(...)) reads it
    rec = recording.Recording()
    name = "streamrec_learner_grad_norm"
    for i, (c0, c1) in enumerate([(0, 0), (10, 10), (20, 20), (30, 5)]):
        samples = (_histogram_scrape(name, "dense", (c0, c0, c0), 0.05 * c0, {"rank": "0"})
                   + _histogram_scrape(name, "dense", (0, 0, c1), 5.5 * c1, {"rank": "1"}))
        rec.add({"kind": "scrape", "t": 1e9 + i, "source": "learner", "samples": samples})
    h = series.histogram_over_time(rec, name, "part")
    assert h["dense"]["mean"] == ([1e9 + 1, 1e9 + 2, 1e9 + 3], pytest.approx([2.775, 2.775, 28 / 15]))
    assert h["dense"]["p50"][1] == pytest.approx([0.1, 0.1, 0.075])  # 15 observations, 10 of them at most 0.1
    assert h["dense"]["p90"][1] == pytest.approx([8.2, 8.2, 7.3])


def test_a_monitor_restarted_after_being_killed_mid_line_starts_its_records_on_a_line_of_their_own(
        tmp_path: Path) -> None:
    path = tmp_path / "run-log.jsonl"
    path.write_text('{"kind":"start","t":999,"sources":{},"interval_s":1,"rules":[]}\n'
                    '{"kind":"scrape","t":999.5,"source":"learner","samples":[["streamrec_learner_sam')  # SIGKILLed
    log = RunLog(RunLogSettings(path=path), clock=lambda: 1000.0)
    log.start({}, 1.0, [])
    log.write({"kind": "scrape", "t": 1001.0, "source": "learner", "samples": [["streamrec_learner_samples_total", {},
                                                                                  5]]})
    log.close()
    rec = report.read_run_log(path)
    assert [s["t"] for s in rec.starts] == [999, 1000.0]  # the restart's start record was glued to the cut line
    assert rec.bad_lines == 1 and series.series(rec, "streamrec_learner_samples_total")[""] == ([1001.0], [5.0])


@pytest.mark.parametrize("error", [FileNotFoundError(2, "renamed away by a rotation"), PermissionError(13, "no read")])
def test_a_run_log_whose_last_line_cannot_be_checked_still_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                error: OSError) -> None:
    """The check for a cut last line opens the path a second time, to read: a log renamed between the two opens (an
    outside rotation) or one the monitor may write but not read stopped the monitor at start (exit 2); it ran before
    the check existed. The check is skipped then, and the records are appended."""
    from monitor import run_log as run_log_mod

    path = tmp_path / "run-log.jsonl"
    path.write_text('{"kind":"start","t":999,"sources":{},"interval_s":1,"rules":[]}\n')

    def refused(_path: Path) -> None:
        raise error

    monkeypatch.setattr(run_log_mod, "open_regular", refused)
    log = RunLog(RunLogSettings(path=path), clock=lambda: 1000.0)
    log.start({}, 1.0, [])
    log.close()
    assert [json.loads(line)["t"] for line in path.read_text().splitlines()] == [999, 1000.0]


def test_a_run_log_is_read_with_one_copy_of_each_name_and_label_set_and_every_sample_as_written(
        tmp_path: Path) -> None:
    # a dict and strings per sample made a 27 MiB run log cost ~6x its size (bench/report_memory.py); shared, every
    # scrape must still read back exactly as parsed, so every figure drawn from it is what it was
    rng = random.Random(0)
    lines = [{"kind": "scrape", "t": 100.0 + 10 * (i % 7), "source": src,
              "samples": [["streamrec_learner_lag_samples", {"partition": str(p)}, rng.randrange(9)] for p in range(3)]
              + [["streamrec_learner_served_auc", {}, rng.random()], ["streamrec_x", {"a": "1", "b": "2"}, "NaN"],
                 ["streamrec_x", {"b": "2", "a": "1"}, 1e400 if i == 3 else -1]]}
             for i in range(20) for src in ("learner", "rank1")]
    path = tmp_path / "run-log.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rec = report.read_run_log(path, every_metric=True)
    parsed = [[(str(n), dict(lb), recording.sample_value(v)) for n, lb, v in json.loads(json.dumps(line))["samples"]]
              for line in lines]
    assert [s for src in ("learner", "rank1") for _, s, _ in rec.scrapes[src]] == parsed[0::2] + parsed[1::2]
    assert [list(lb) for n, lb, _ in rec.scrapes["learner"][0][1] if n == "streamrec_x"] == [["a", "b"], ["b", "a"]]
    first, *others = [s for sc in rec.scrapes.values() for _, s, _ in sc]
    assert all(a[0] is b[0] and a[1] is b[1] for other in others for a, b in zip(first, other, strict=True))


def test_served_quality_over_event_time_reads_the_slowest_of_several_learner_sources() -> None:
    # two ranks: rank0 trains ahead of rank1, and rank0 exports no event time at the second scrape; the plot read
    # rank0's event time alone (rank1 never counted, the second scrape not drawn)
    e0 = 978_300_000.0
    rec = recording.Recording()
    for t, ev0, ev1 in ((100.0, e0 + 7200, e0 + 3600), (110.0, None, e0 + 5400), (120.0, e0 + 9000, e0 + 10800)):
        for src, ev in (("rank0", ev0), ("rank1", ev1)):
            samples = [["streamrec_learner_served_auc", {}, 0.7]]
            samples += [] if ev is None else [["streamrec_learner_event_time_seconds", {}, ev]]
            rec.add({"kind": "scrape", "t": t, "source": src, "samples": samples})
    p = plotter.Plotter(90.0, 30.0)
    fig, (ax,) = p.figure(1, 1)
    curves = series.series_numbered(rec, "streamrec_learner_served_auc")
    assert plotter.event_time_plot(ax, rec, curves) == 6
    import matplotlib.dates as mdates

    for line in ax.get_lines():
        assert [mdates.num2date(x).timestamp() for x in line.get_xdata(orig=False)] == [e0 + 3600, e0 + 5400,
                                                                                        e0 + 9000]
    assert "slowest learner" in ax.get_title() and "slowest learner" in ax.get_xlabel()
    p.plt.close(fig)


def test_two_scrapes_of_a_source_at_one_time_are_both_drawn_in_the_order_written() -> None:
    # a clock that stood still for a cycle: the AUC 0.6 scraped first at t=110 was dropped for the 0.8 after it
    pytest.importorskip("matplotlib")
    rec = recording.Recording()
    for t, auc in ((100.0, 0.7), (110.0, 0.6), (110.0, 0.8), (120.0, 0.75)):
        rec.add({"kind": "scrape", "t": t, "source": "learner", "samples": [["streamrec_learner_served_auc", {}, auc]]})
    assert series.series(rec, "streamrec_learner_served_auc") == {"": ([100.0, 110.0, 110.0, 120.0],
                                                                       [0.7, 0.6, 0.8, 0.75])}
    p = plotter.Plotter(100.0, 20.0)
    fig, (ax,) = p.figure(1, 1)
    assert p.lines(ax, series.series_numbered(rec, "streamrec_learner_served_auc"), "AUC", "") == 4
    assert list(ax.get_lines()[0].get_ydata()) == [0.7, 0.6, 0.8, 0.75]
    p.plt.close(fig)


def test_a_plot_is_laid_out_and_drawn_once_for_its_png(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tight_layout`` left a placeholder layout engine, so ``savefig`` drew the whole figure a second time before
    drawing it into the PNG: a third of a report's time spent on a draw whose result was thrown away."""
    p = plotter.Plotter(1000.0, 10.0)
    fig, (ax,) = p.figure()
    p.lines(ax, {"a": ([1001.0, 1002.0], [1.0, 2.0])}, "y", "title")
    draws: list[object] = []
    draw = type(fig).draw
    monkeypatch.setattr(type(fig), "draw", lambda self, renderer: (draws.append(renderer), draw(self, renderer))[1])
    assert p.png(fig).startswith(b"\x89PNG") and len(draws) == 1


def test_rule_state_bars_are_one_collection_per_rule_and_draw_the_png_a_bar_per_evaluation_drew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a broken_barh per rule and evaluation made 18 x 1,769 artists on the ML-1M demo: 190 of the report's 197 CPU
    # seconds and most of its 700 MB; one per rule draws the same pixels (rules' rows never overlap)
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    rec = recording.Recording()
    states = ("inactive", "pending", "firing", "resolved", "bogus")
    for i in range(40):  # the clock steps back 15 s after the 20th evaluation
        rec.add({"kind": "rules", "t": 100.0 + 10 * i - 15 * (i >= 20),
                 "states": {f"rule{r}": states[(i // (r + 2)) % len(states)] for r in range(3)}})
    rec.add({"kind": "alert", "t": 150.0, "alert": {"rule": "rule1", "state": "firing"}})
    figures: list[Any] = []

    def alerts_png() -> bytes:
        p = plotter.Plotter(100.0, 400.0)
        monkeypatch.setattr(p, "png", lambda fig: (figures.append(fig), plotter.Plotter.png(p, fig))[1])
        return sections.s_alerts(p, sections.Inputs(rec)).png or b""

    png = alerts_png()
    assert len(figures[0].axes[0].collections) == 3  # one per rule

    broken_barh = Axes.broken_barh

    def a_bar_per_evaluation(ax: Any, xranges: Any, yrange: Any, color: Any, **kw: Any) -> list[Any]:
        return [broken_barh(ax, [xr], yrange, color=c, **kw) for xr, c in zip(xranges, color, strict=True)]

    monkeypatch.setattr(Axes, "broken_barh", a_bar_per_evaluation)
    assert alerts_png() == png and len(figures[1].axes[0].collections) == 3 * 40


FULL_DISK_CLOSE = """
import logging, resource, signal, sys
from pathlib import Path
from monitor.rules import RunLogSettings
from monitor.run_log import RunLog
log = RunLog(RunLogSettings(path=Path(sys.argv[1])))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
logging.disable()  # (stderr is a file too: nothing more is written until the limit is lifted)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
log.write({"kind": "x", "pad": "a" * 300})
try:
    log.close()
    outcome = "closed"
except OSError as exc:
    outcome = f"raised {exc!r}"
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(outcome, log.failures, log._file.closed)
"""


def test_a_run_log_closed_after_a_write_the_full_disk_refused_closes_without_raising(tmp_path: Path) -> None:
    """The refused record stays in the file's buffer and the close flushes it again: that OSError escaped
    ``Monitor.close`` (``streamrec monitor`` stopped with a traceback, no summary). A real write failure of the OS,
    in a child process (its file size limit would hit pytest's own files)."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK_CLOSE, str(tmp_path / "r.jsonl")], capture_output=True,
                          text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed", "2", "True"], done.stdout
