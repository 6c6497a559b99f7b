"""The report's sections (:data:`SECTIONS`): served quality, cold vs warm users, throughput, lag, gradient norms,
feature coverage, memory, hot set and hit rate, freshness, dead letters, alerts. Each declares the metrics it reads
(:func:`reads`); one whose metrics are not in the run log says so ("not recorded", naming the metrics and who exports
them) instead of drawing an empty plot.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from monitor.cli_text import utc_text
from monitor.plotter import LOG_MAX, PLOT_MAX, Plotter, Section, event_time_plot
from monitor.recording import Recording, date_of
from monitor.series import (
    _T,
    Curve,
    Numbered,
    average_rate,
    counter_rates_numbered,
    epochs,
    finite,
    flat,
    has_points,
    histogram_names,
    histogram_numbered,
    min_numbered,
    series,
    series_numbered,
)


# -- sections -----------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    rec: Recording
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_run: dict[str, Any] = field(default_factory=dict)  # <publish_root>/last_run.json
    deltas: list[tuple[float, int, int]] = field(default_factory=list)


Draw = Callable[[Plotter, Inputs], Section]  # a section: it draws and describes what the run log recorded
_READS: dict[Draw, frozenset[str]] = {}  # reads()


def reads(*names: str) -> Callable[[Draw], Draw]:
    """Declares the metrics a section reads from the run log, a histogram by its :func:`histogram_names`: the one
    list of them. :func:`~monitor.report.read_run_log` keeps their samples and no others (:func:`metrics_read`), and a
    section that reads another raises (:meth:`Recording.kept`) rather than call it "not recorded"."""
    def declare(f: Draw) -> Draw:
        _READS[f] = frozenset(names)
        return f

    return declare


def metrics_read() -> frozenset[str]:
    """Every metric the :data:`SECTIONS` read, as each declares them (:func:`reads`)."""
    return frozenset().union(*(_READS.get(f, ()) for f in SECTIONS))


def _missing(names: Iterable[str], who: str) -> str:
    return f"not recorded: {', '.join(names)} (exported by {who}) is not in the run log"


def _set_numbered(curves: Mapping[str, Numbered]) -> dict[str, Numbered]:
    """A gauge reads 0 until its process first sets it (an AUC before any sample): over each curve's epochs, the points
    before its first nonzero value in any epoch are left out, and a curve with none."""
    out = {}
    for k, eps in curves.items():
        skip = next((i for i, v in enumerate(flat(eps)[1]) if v != 0), None)
        if skip is None:
            continue
        out[k] = kept = Numbered()
        for e, (ts, vs) in eps:
            if skip < len(ts):
                kept.append((e, (ts[skip:], vs[skip:])))
            skip = max(0, skip - len(ts))
    return out


def _named(curves: Mapping[str, _T], name: str) -> dict[str, _T]:
    return {(f"{name} {k}" if k else name): s for k, s in curves.items()}


@reads("streamrec_learner_served_auc", "streamrec_learner_window_auc", "streamrec_learner_served_ne",
       "streamrec_learner_event_time_seconds")
def s_quality(p: Plotter, inp: Inputs) -> Section:
    sec = Section("served-quality", "Served quality: AUC and normalized entropy",
                  "Each impression's first prediction (made before the learner trained on it) against the label it "
                  "ended with: streamrec_learner_served_auc and streamrec_learner_served_ne (both over the last "
                  "quality_recent_s; NE >= 1 is no better than predicting the click rate), with the learner's "
                  "test-then-train streamrec_learner_window_auc for reference, first over wall-clock time, then "
                  "(bottom) over event time: each scrape's values against streamrec_learner_event_time_seconds, the "
                  "event time of the newest sample trained at that scrape (the slowest learner's, with several).")
    rec = inp.rec
    auc = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_served_auc"), "served AUC (window)"),
                         **_named(series_numbered(rec, "streamrec_learner_window_auc"),
                                  "progressive AUC (window, trained samples)")})
    ne = _set_numbered(_named(series_numbered(rec, "streamrec_learner_served_ne"), "served NE (window)"))
    fig, (a1, a2, a3) = p.figure(3, 1)
    sec.points = p.lines(a1, auc, "AUC", "Served AUC over time (learner)") + p.lines(
        a2, ne, "NE (logloss / base-rate entropy)", "Served normalized entropy over time (learner)")
    if ne:
        a2.axhline(1.0, color="red", linestyle=":", linewidth=1, label="1 = no better than the base rate")
        a2.legend(fontsize=8, loc="best")
    sec.points += event_time_plot(a3, rec, {**auc, **ne})
    sec.png = p.png(fig)
    if not auc and not ne:
        sec.missing.append(_missing(["streamrec_learner_served_auc", "streamrec_learner_served_ne"],
                                    "streamrec train --metrics-port"))
    sv = served_quality(inp.summaries)
    if sv and sv.get("impressions"):
        sec.facts.append(f"Final served quality (train summary, {fmt_num(sv['impressions'], ',')} impressions): AUC "
                         f"{fmt_num(sv.get('auc'))}, logloss {fmt_num(sv.get('logloss'))}, NE {fmt_num(sv.get('ne'))}")
    return sec


@reads("streamrec_learner_cold_auc", "streamrec_learner_warm_auc", "streamrec_learner_served_cold_auc",
       "streamrec_learner_bucket_share")
def s_cold(p: Plotter, inp: Inputs) -> Section:
    sec = Section("cold-warm", "Cold vs warm users",
                  "Window AUC of cold users' samples (their first cold_k impressions) and of warm users' "
                  "(streamrec_learner_cold_auc, _warm_auc, test-then-train), and the served AUC of cold users' "
                  "impressions (streamrec_learner_served_cold_auc); below, the share of id lookups answered by a "
                  "shared hash bucket (ids not admitted yet), per field (streamrec_learner_bucket_share).")
    rec = inp.rec
    auc = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_cold_auc"), "cold users"),
                         **_named(series_numbered(rec, "streamrec_learner_warm_auc"), "warm users"),
                         **_named(series_numbered(rec, "streamrec_learner_served_cold_auc"), "cold users, served")})
    share = series_numbered(rec, "streamrec_learner_bucket_share", by=("field",))
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, auc, "AUC", "Window AUC, cold vs warm users (learner)")
    p.lines(a2, share, "share of lookups (0-1)", "Lookups served by hash buckets, per field (learner)")
    sec.png = p.png(fig)
    if not auc:
        sec.missing.append(_missing(["streamrec_learner_cold_auc", "streamrec_learner_warm_auc"], "the learner"))
    if _get(inp.summaries, "train", "cold_users"):
        cold, warm = (_get(inp.summaries, "train", "cold_users", k) or {} for k in ("cold", "warm"))
        sec.facts.append(f"Train summary: cold users AUC {fmt_num(cold.get('auc'))} over "
                         f"{fmt_num(cold.get('samples', 0), ',')} samples, warm users AUC "
                         f"{fmt_num(warm.get('auc'))} over {fmt_num(warm.get('samples', 0), ',')}")
    return sec


@reads("streamrec_join_samples_total", "streamrec_events_total", "streamrec_learner_samples_total",
       "streamrec_serving_requests_total", "streamrec_serving_candidates_total")
def s_throughput(p: Plotter, inp: Inputs) -> Section:
    sec = Section("throughput", "Throughput of each stage",
                  "Per second between consecutive scrapes: samples written by the joiner "
                  "(streamrec_join_samples_total), events it read (streamrec_events_total{stage=\"join\"}), "
                  "samples the learner trained (streamrec_learner_samples_total), requests serving answered "
                  "(streamrec_serving_requests_total). Below: each stage's average, from the replay and join "
                  "summaries (events/s over their run) and the learner's counter (first to last increase).")
    rec = inp.rec
    join_samples = series(rec, "streamrec_join_samples_total")
    learner = series(rec, "streamrec_learner_samples_total")
    rates = counter_rates_numbered
    joiner = {**_named(rates(rec, "streamrec_events_total", where={"stage": "join"}), "events read/s"),
              **_named(rates(rec, "streamrec_join_samples_total"), "samples written/s")}
    trained = _named(rates(rec, "streamrec_learner_samples_total"), "samples trained/s")
    served = {**_named(rates(rec, "streamrec_serving_requests_total"), "requests/s"),
              **_named(rates(rec, "streamrec_serving_candidates_total"), "candidates scored/s")}
    avg: dict[str, float] = {}
    for stage in ("replay", "join"):
        if (v := _number(inp.summaries.get(stage, {}).get("events_per_s"))) is not None:
            avg[f"{stage}\n(events/s, summary)"] = v
    if (r := average_rate(*series_numbered(rec, "streamrec_learner_samples_total").values())) is not None:
        avg["train\n(samples/s, counter)"] = r
    fig, (a1, a2, a3, a4) = p.figure(4, 1, height=2.6)
    sec.points = p.lines(a1, joiner, "per second", "Joiner: events read and samples written per second")
    sec.points += p.lines(a2, trained, "per second", "Learner: samples trained per second")
    sec.points += p.lines(a3, served, "per second", "Serving: requests and candidates scored per second")
    if avg:
        sec.points += p.bars(a4, avg, "per second", "Average throughput per stage (over its own run)")
    else:
        a4.set_axis_off()
    sec.png = p.png(fig)
    if not join_samples:
        sec.missing.append(_missing(["streamrec_join_samples_total"], "streamrec join --metrics-port"))
    if not learner:
        sec.missing.append(_missing(["streamrec_learner_samples_total"], "streamrec train --metrics-port"))
    for stage in ("replay", "join"):
        d = inp.summaries.get(stage)
        if d:
            sec.facts.append(f"{stage} summary: {fmt_num(d.get('impressions', 0), ',')} impressions, "
                             f"{fmt_num(d.get('clicks', 0), ',')} clicks in {fmt_num(d.get('elapsed_s'), '.1f')} s")
    return sec


@reads("streamrec_learner_lag_samples", "streamrec_join_pending_impressions", "streamrec_join_input_paused")
def s_lag(p: Plotter, inp: Inputs) -> Section:
    sec = Section("lag", "Lag",
                  "The learner's lag: messages of the samples topic not yet trained, summed over partitions "
                  "(streamrec_learner_lag_samples; a message holds up to batch_max samples). The joiner's "
                  "impressions waiting for their attribution window to close (streamrec_join_pending_impressions) "
                  "and its input partitions paused for backpressure (streamrec_join_input_paused).")
    rec = inp.rec
    lag = _named(series_numbered(rec, "streamrec_learner_lag_samples"), "learner: messages behind")
    pending = _named(series_numbered(rec, "streamrec_join_pending_impressions"), "joiner: pending impressions")
    paused = _named(series_numbered(rec, "streamrec_join_input_paused"), "joiner: partitions paused")
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, lag, "messages", "Learner lag behind the samples topic")
    sec.points += p.lines(a2, {**pending, **paused}, "impressions / partitions", "Joiner backlog")
    sec.png = p.png(fig)
    if not lag:
        sec.missing.append(_missing(["streamrec_learner_lag_samples"], "the learner"))
    if not pending:
        sec.missing.append(_missing(["streamrec_join_pending_impressions"], "streamrec join --metrics-port"))
    return sec


@reads(*histogram_names("streamrec_learner_grad_norm"), "streamrec_learner_update_norm")
def s_grad(p: Plotter, inp: Inputs) -> Section:
    sec = Section("gradient-norms", "Gradient and update norms",
                  "L2 norm of each optimizer step's gradient, dense part (MLP, bias) and embedding rows apart: the "
                  "mean, p50 and p90 of the steps between two scrapes, from the histogram "
                  "streamrec_learner_grad_norm (quantiles interpolated within its buckets, as Prometheus' "
                  "histogram_quantile). Below: the L2 norm of what one sampled step changed "
                  "(streamrec_learner_update_norm; 0 = the model no longer changes).")
    rec = inp.rec
    hist = histogram_numbered(rec, "streamrec_learner_grad_norm", "part")
    curves = {f"{k} {stat}": s for k, stats in hist.items() for stat, s in stats.items()}
    upd = series_numbered(rec, "streamrec_learner_update_norm", by=("part",))
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, curves, "L2 norm (log)", "Gradient L2 norm per step (learner)", logy=True)
    sec.points += p.lines(a2, {k: s for k, s in upd.items()}, "L2 norm (log)",
                          "Update L2 norm of a sampled step (learner)", logy=True)
    sec.png = p.png(fig)
    if not has_points(curves):
        sec.missing.append(_missing(["streamrec_learner_grad_norm"], "the learner (learner/health.py)"))
    if not upd:
        sec.missing.append(_missing(["streamrec_learner_update_norm"], "the learner (learner/health.py)"))
    return sec


@reads("streamrec_learner_field_coverage", "streamrec_learner_id_occupancy")
def s_coverage(p: Plotter, inp: Inputs) -> Section:
    sec = Section("coverage", "Feature coverage",
                  "Per field, the share of recent samples carrying it (streamrec_learner_field_coverage; a field "
                  "whose upstream broke drops to 0). Below: per dynamic-id field, the share of its own rows in use "
                  "(streamrec_learner_id_occupancy).")
    rec = inp.rec
    cov = series_numbered(rec, "streamrec_learner_field_coverage", by=("field",))
    occ = series_numbered(rec, "streamrec_learner_id_occupancy", by=("field",))
    fig, (a1, a2) = p.figure(2, 1, height=3.6)
    sec.points = p.lines(a1, cov, "share of samples (0-1)", "Samples carrying each field (learner)",
                         ylim=(0, 1.05))
    p.lines(a2, occ, "share of own rows (0-1)", "Id rows in use, per field (learner)")
    sec.png = p.png(fig)
    if not cov:
        sec.missing.append(_missing(["streamrec_learner_field_coverage"], "the learner (learner/health.py)"))
    return sec


@reads("streamrec_learner_rss_bytes", "streamrec_learner_cuda_memory_bytes",
       "streamrec_learner_memory_growth_bytes_per_hour")
def s_memory(p: Plotter, inp: Inputs) -> Section:
    sec = Section("memory", "Memory",
                  "The learner's resident set (streamrec_learner_rss_bytes) and, on CUDA, device memory allocated "
                  "and reserved (streamrec_learner_cuda_memory_bytes), in MiB. Below: its growth rate "
                  "(streamrec_learner_memory_growth_bytes_per_hour, least-squares slope over 10 minutes; NaN, "
                  "so not drawn, for the first 5).")
    rec = inp.rec
    mem = _set_numbered({**_named(series_numbered(rec, "streamrec_learner_rss_bytes"), "learner RSS"),
                         **_named(series_numbered(rec, "streamrec_learner_cuda_memory_bytes", by=("kind",)), "CUDA")})
    growth = {k: [(e, finite(s)) for e, s in eps] for k, eps in
              series_numbered(rec, "streamrec_learner_memory_growth_bytes_per_hour", by=("memory",)).items()}
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, mem, "MiB", "Learner memory", scale=2**20)
    p.lines(a2, growth, "MiB per hour", "Learner memory growth rate", scale=2**20,
            empty="no finite value: NaN until the learner's memory samples span 5 minutes")
    sec.png = p.png(fig)
    if not mem:
        sec.missing.append(_missing(["streamrec_learner_rss_bytes"], "the learner (learner/health.py)"))
    if not has_points(growth):
        sec.missing.append("memory growth: no finite value recorded (the learner reports NaN until its samples "
                           "span 5 minutes)")
    return sec


@reads("streamrec_serving_hot_cache_hit_rate", "streamrec_serving_embedding_lookups_total")
def s_hot(p: Plotter, inp: Inputs) -> Section:
    sec = Section("hot-set", "Hot set and hit rate",
                  "Share of serving's embedding row reads answered by the artifact's hot set since serving started "
                  "(streamrec_serving_hot_cache_hit_rate), and the reads per second by tier "
                  "(streamrec_serving_embedding_lookups_total). The hot set's size is the refresh summary's.")
    rec = inp.rec
    hit = _named(series_numbered(rec, "streamrec_serving_hot_cache_hit_rate"), "hit rate")
    tiers = {k + " rows/s": s
             for k, s in counter_rates_numbered(rec, "streamrec_serving_embedding_lookups_total", by=("tier",)).items()}
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, hit, "share of row reads (0-1)", "Hot-set hit rate since serving started (serving)",
                         ylim=(0, 1.05))
    p.lines(a2, tiers, "rows per second", "Embedding rows read, by tier (serving)")
    sec.png = p.png(fig)
    if not hit:
        sec.missing.append(_missing(["streamrec_serving_hot_cache_hit_rate"], "streamrec serve (/metrics)"))
    hs = inp.summaries.get("refresh", {}).get("hot_set")
    if isinstance(hs, dict):
        shown = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in hs.items()
                          if not isinstance(v, dict | list))
        sec.facts.append(f"Hot set of the published artifact (refresh summary): {shown}")
    return sec


@reads("streamrec_learner_samples_total", "streamrec_serving_delta_seq", "streamrec_join_watermark_ms")
def s_fresh(p: Plotter, inp: Inputs) -> Section:
    sec = Section("freshness", "Freshness",
                  "How far behind the newest training the served model is. Top: samples trained at each delta the "
                  "learner wrote (file names and times of delta-<seq>-<samples>.delta) beside the learner's own "
                  "count (streamrec_learner_samples_total); the refresh's publish (last_run.json) as a vertical "
                  "line. Middle: the last delta serving applied (streamrec_serving_delta_seq; 0 = none newer than "
                  "its artifact). Bottom: the joiner's event-time watermark (streamrec_join_watermark_ms, oldest "
                  "partition) against wall time.")
    rec = inp.rec
    learner: dict[str, Curve] = {**_named(series_numbered(rec, "streamrec_learner_samples_total"),
                                          "learner: samples trained")}
    deltas: dict[str, Curve] = {}
    if inp.deltas:
        deltas["deltas written: samples trained"] = ([d[0] for d in inp.deltas], [float(d[2]) for d in inp.deltas])
    seq = _named(series_numbered(rec, "streamrec_serving_delta_seq"), "serving: delta seq applied")
    wm = series(rec, "streamrec_join_watermark_ms")
    wm_dates = [[(t, d) for t, v in zip(*s, strict=True) if (d := date_of(v / 1000)) is not None]
                for _, s in min_numbered(rec, "streamrec_join_watermark_ms")]  # a segment per epoch
    wm_dates = [seg for seg in wm_dates if seg]
    fig, (a1, a2, a3) = p.figure(3, 1, height=2.8)
    sec.points = p.lines(a1, {**learner, **deltas}, "samples", "Samples trained: learner and its deltas",
                         step=True)
    pub = inp.last_run.get("last_success")
    if isinstance(pub, int | float) and p.t0 <= pub <= p.t0 + p.span_s:  # 1e300 broke matplotlib's transform
        a1.axvline(p.x([pub])[0], color="green", linestyle="--", linewidth=1)
        a1.text(p.x([pub])[0], 0.95, " refresh published", transform=a1.get_xaxis_transform(), fontsize=8,
                va="top", color="green")
    sec.points += p.lines(a2, seq, "delta seq", "Last delta applied by serving", step=True)
    if wm_dates:
        p.timeline(a3)
        for i, seg in enumerate(wm_dates):
            a3.plot(p.x([t for t, _ in seg]), [d for _, d in seg], marker=".", markersize=3, color="C0",
                    label="" if i else "joiner watermark (oldest partition)")
        a3.set_title("Event time reached by the joiner (UTC) vs wall time", fontsize=10)
        a3.set_ylabel("event time (UTC)")
        a3.grid(True, alpha=0.3)
        a3.legend(fontsize=8)
        sec.points += sum(len(seg) for seg in wm_dates)
    else:
        p.lines(a3, {}, "event time", "Event time reached by the joiner")
    sec.png = p.png(fig)
    if not deltas:
        sec.missing.append("no delta files found (the learner writes them with deltas_every_s > 0; pass "
                           "--deltas-dir)")
    if not seq:
        sec.missing.append(_missing(["streamrec_serving_delta_seq"], "streamrec serve (/metrics)"))
    if not wm:
        sec.missing.append(_missing(["streamrec_join_watermark_ms"], "streamrec join --metrics-port"))
    if inp.last_run:
        sec.facts.append(f"last_run.json: version {inp.last_run.get('version')} published "
                         f"{inp.last_run.get('last_success_utc')}")
    return sec


@reads("streamrec_dlq_messages_total")
def s_dlq(p: Plotter, inp: Inputs) -> Section:
    sec = Section("dead-letters", "Dead letters",
                  "Malformed messages sent to <topic>.dlq, by source topic and reason, as the stages counted them "
                  "(streamrec_dlq_messages_total over time, where a scraped stage dead-lettered any), and the "
                  "totals of the batch stages' summaries (replay: dead-lettered at the source and malformed "
                  "published; join: dead-lettered).")
    rec = inp.rec
    dlq = series_numbered(rec, "streamrec_dlq_messages_total", by=("topic", "kind"))
    totals: dict[str, float] = {}
    for stage, key, bar in (("replay", "dead_lettered", "replay: dead-lettered\nat source"),
                            ("replay", "malformed_published", "replay: malformed\npublished"),
                            ("join", "dead_lettered", "join: dead-lettered")):
        if d := inp.summaries.get(stage):
            if (v := _number(d.get(key) or 0)) is not None:
                totals[bar] = v
            else:
                sec.missing.append(f"{stage} summary: {key} is not a number ({str(d.get(key))[:40]!r})")
    fig, (a1, a2) = p.figure(2, 1)
    sec.points = p.lines(a1, dlq, "messages (cumulative)", "Dead-lettered messages over time", step=True,
                         empty="none: no scraped stage dead-lettered a message")
    if totals:
        sec.points += p.bars(a2, totals, "messages", "Dead letters per stage (summaries)")
    else:
        a2.set_axis_off()
    sec.png = p.png(fig)
    if not dlq:
        sec.missing.append("no streamrec_dlq_messages_total series in the run log: no scraped stage dead-lettered "
                           "a message (the counter appears with its first dead letter)")
    if not totals:
        sec.missing.append("no replay or join summary given (--summary FILE)")
    return sec


_STATE_COLOR = {"pending": "tab:orange", "firing": "tab:red", "resolved": "tab:green"}


@reads()
def s_alerts(p: Plotter, inp: Inputs) -> Section:
    sec = Section("alerts", "Alerts",
                  "Each rule's state at every evaluation the monitor recorded (worst over its label sets: "
                  "inactive, pending, firing), and each alert it sent (firing x, resolved o). Alerts written to "
                  "the alerts topic by other processes (a failed refresh) are not in the run log.")
    rec = inp.rec
    rules = sorted({r for _, st, _ in rec.rule_states for r in st} | {str(a.get("rule")) for _, a in rec.alerts})
    fig, (ax,) = p.figure(1, 1, height=max(2.5, 0.32 * len(rules) + 1.2))
    ys = {r: i for i, r in enumerate(rules)}
    for r, (xranges, colors) in state_bars(rec, p).items():  # one collection per rule: one per bar took minutes
        ax.broken_barh(xranges, (ys[r] - 0.3, 0.6), color=colors, linewidth=0)
    for t, a in rec.alerts:
        r = str(a.get("rule"))
        ax.plot(p.x([t]), [ys[r]], marker="x" if a.get("state") == "firing" else "o", color="black")
    ax.set_yticks(range(len(rules)), rules, fontsize=8)
    p.timeline(ax)
    ax.set_title("Rule states per evaluation (grey inactive, orange pending, red firing) and alerts sent",
                 fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    sec.points = len(rec.rule_states) + len(rec.alerts)
    if not rules:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        sec.missing.append("no rule evaluations in the run log")
    sec.png = p.png(fig)
    fired = [a for _, a in rec.alerts if a.get("state") == "firing"]
    last = {a.get("fingerprint"): a.get("state") for _, a in rec.alerts}  # by identity, in time order
    sec.facts.append(f"{len(fired)} alert(s) fired, {len(rec.alerts) - len(fired)} resolved, over "
                     f"{len(rec.rule_states)} evaluation(s) of {len(rules)} rule(s); "
                     f"{sum(st == 'firing' for st in last.values())} still firing at the end of the run log")
    sec.facts.extend(alert_line(t, a) for t, a in rec.alerts)
    return sec


def state_bars(rec: Recording, p: Plotter) -> dict[str, tuple[list[tuple[float, float]], list[str]]]:
    """Per rule, its state bars ``(x0, width)`` and their colours, one per evaluation in the order the monitor wrote
    them, each lasting until the next evaluation of its epoch (a bar ends at its epoch's last evaluation, as every
    curve breaks there). Drawn as one collection per rule: one ``broken_barh`` per bar (18 rules x 1,769 evaluations
    of the ML-1M demo) made ~32,000 artists, and the alerts section most of the report's minutes and memory; rules'
    bars never overlap (0.6 high, a row apart), so the pixels are the same."""
    bars: dict[str, tuple[list[tuple[float, float]], list[str]]] = {}
    evals = list(epochs(rec.rule_states))  # (epoch, t, states), in the order the monitor wrote them
    for (e, t, st), (e_next, t_next, _) in zip(evals, evals[1:] + evals[-1:], strict=True):
        t_next = t_next if e_next == e else t
        x0, x1 = p.x([t, t_next])
        for r, state in st.items():
            xranges, colors = bars.setdefault(r, ([], []))
            xranges.append((x0, max(x1 - x0, 1e-9)))
            colors.append(_STATE_COLOR.get(state, "lightgray"))
    return bars


def alert_line(t: float, a: Mapping[str, Any]) -> str:
    """One alert as the report lists it, with what tells it from the rule's other alerts: its labels (two series of
    one rule differ only there), its kind (an absence alert may have a series' labels) and its fingerprint::

        2024-06-10 06:13:20 UTC firing warning auc_low{partition="0",team="ranking"} series id=9e32f1501515c148: ...

    Label values are quoted as Prometheus writes them (``"`` and ``\\`` escaped: a value cannot pass for two labels).
    This is text: the page escapes it (labels come from the scraped processes)."""
    labels = lb if isinstance(lb := a.get("labels"), dict) else {}
    lbl = ",".join(f"{k}={json.dumps(str(v), ensure_ascii=False)}" for k, v in sorted(labels.items()))
    return (f"{utc_text(t)} {a.get('state')} {a.get('severity')} {a.get('rule')}{{{lbl}}} {a.get('kind', 'series')} "
            f"id={a.get('fingerprint', '-')}: {a.get('message')}")


SECTIONS: tuple[Draw, ...] = (
    s_quality, s_cold, s_throughput, s_lag, s_grad, s_coverage, s_memory, s_hot, s_fresh, s_dlq, s_alerts)


# -- the page -----------------------------------------------------------------------------------------------
def fmt_num(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if _number(v) is not None else "n/a"


def served_quality(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The train summary's served quality over every impression (learner/served.py), or None."""
    sv = _get(summaries, "train", "served", "all")
    return dict(sv) if isinstance(sv, dict) and _number(sv.get("impressions", 0)) is not None else None


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is not a dict (a summary is outside input: any key any type)."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _number(v: Any) -> float | None:
    """A finite number (not a bool) as a float, else None."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        return float(v) if math.isfinite(v) else None
    except OverflowError:  # an integer of 400 digits
        return None


def build_sections(inp: Inputs) -> list[Section]:
    t0 = inp.rec.t0 if inp.rec.t0 is not None else time.time()
    span = (inp.rec.t_end or t0) - t0
    phases = {src: (min(t for t, _, _ in sc), max(t for t, _, _ in sc)) for src, sc in inp.rec.scrapes.items() if sc}
    p = Plotter(t0, span, phases)
    with p.plt.rc_context({"text.parse_math": False}):  # a label "$\foo{$" (event data) is text, not mathtext
        return [_beyond(p, f, inp) for f in SECTIONS]


def _beyond(p: Plotter, f: Draw, inp: Inputs) -> Section:
    """Section ``f``, saying how many of its values were beyond :data:`PLOT_MAX` and so not drawn."""
    before = p.beyond
    sec = f(p, inp)
    if p.beyond > before:
        sec.missing.append(f"{p.beyond - before} recorded value(s) beyond ±{PLOT_MAX:g} (1/{LOG_MAX:g} to "
                           f"{LOG_MAX:g} on a log axis) not drawn (no axis can show them)")
    return sec
