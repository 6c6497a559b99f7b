"""Contract: the Grafana dashboards under compose/grafana/dashboards read what the code exports, on axes that show it.

* Every metric name in every panel's PromQL is one the code exports: the names come from importing every module
  of stream, learner, serving, monitor, cache_refresh and streamrec and reading prometheus_client's default
  registry, plus serving's own ``CollectorRegistry`` (serving/metrics.py); counters as ``<name>_total``,
  histograms as ``<name>_bucket/_sum/_count``.
* Counters are only shown through ``rate``/``irate``/``increase``: a bare counter is a line that only climbs (but
  for COUNTED_AT_START, losses found as a process starts, which ``increase`` would never show).
* A percent axis (``percentunit``) shows only shares in [0, 1] (SHARES below, kept honest against the names and
  help texts of what is exported) or the rate of a seconds counter (a share of wall time); no panel mixes a
  share with a count on one axis; no axis has a fixed minimum above 0 (a value under it is not drawn) and no
  rate of a counter sits on a percent axis starting at 0.5.
* Every ``streamrec_*`` metric exported (the joiner's, the learner's, serving's, the stream stages' and the
  monitor's) is on at least one panel, or in NOT_ON_A_PANEL with the reason.
* The learner's lag gauge counts samples-topic messages (each an Arrow batch of many samples), whatever its name
  says: its panel says messages.
* Prometheus (compose/prometheus.yml) scrapes every process whose metrics the dashboard reads, at the port the
  compose service serves them on, and the compose monitor runs the shipped alert rules against the compose
  services (not their 127.0.0.1 defaults).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from monitor.rules import load_rules

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
DASHBOARD_FILES = sorted((COMPOSE / "grafana" / "dashboards").glob("*.json"))
METRIC_PACKAGES = ("stream", "learner", "serving", "monitor", "cache_refresh", "streamrec")

# Gauges whose value is a share, a rate or an AUC in [0, 1]: the only gauges a percent axis may show.
SHARES = {
    "streamrec_join_click_coverage": "clicks joined / clicks seen",
    "streamrec_learner_bucket_share": "share of recent id lookups served by a hash bucket",
    "streamrec_learner_id_occupancy": "share of a field's own rows in use",
    "streamrec_learner_progressive_auc": "AUC",
    "streamrec_learner_window_auc": "AUC",
    "streamrec_learner_served_auc": "AUC",
    "streamrec_learner_served_cold_auc": "AUC",
    "streamrec_learner_cold_auc": "AUC",
    "streamrec_learner_warm_auc": "AUC",
    "streamrec_serving_hot_cache_hit_rate": "hot / (hot + cold) embedding row reads",
    "streamrec_learner_field_coverage": "share of recent samples carrying the field",
    "streamrec_learner_window_positive_rate": "share of positive labels among the recent samples trained",
    "streamrec_refresh_hot_share_of_table": "share of the table's rows held hot",
}
# Gauges whose name looks like a share (SHARE_NAME) but whose value is not one, with the reason.
NOT_SHARES: dict[str, str] = {}
SHARE_NAME = re.compile(r"_(share|rate|auc|occupancy|coverage|ratio|fraction)(_|$)")
SHARE_HELP = re.compile(r"^\s*(share|fraction|ratio) of\b", re.IGNORECASE)
# Counters of seconds: their rate is the share of wall time spent, in [0, 1] for one thread.
TIME_SHARES = {"streamrec_join_gc_seconds_total"}
# streamrec_* metrics deliberately on no panel, with the reason.
NOT_ON_A_PANEL: dict[str, str] = {
    "streamrec_serving_deltas_configured": "a setting (1 when serving reads deltas), not a measurement: the "
                                           "served_model_stale rule multiplies the model's age by it",
}
# Series Prometheus makes itself (not exported by the code).
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
RATE_FUNCTIONS = {"rate", "irate", "increase"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


# -- PromQL, enough to find metric names and the functions around them -------------------------------------------
@dataclass(frozen=True)
class Selector:
    metric: str
    within: tuple[str, ...]  # the functions enclosing it, outermost first ("" for a bare parenthesis)

    @property
    def rated(self) -> bool:
        return bool(RATE_FUNCTIONS.intersection(self.within))


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+|\S")


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression, each with the functions around it."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers (their strings are gone already)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # range and subquery selectors
    s = _GROUPING.sub(" ", s)  # by (le), on (instance) group_left (field), ...
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    tokens = _TOKEN.findall(s)
    out: list[Selector] = []
    stack: list[str] = []
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok == "(":
            prev = tokens[i - 1] if i else ""
            stack.append(prev if re.fullmatch(r"[A-Za-z_]\w*", prev) and prev not in PROMQL_WORDS else "")
        elif tok == ")":
            assert stack, f"unbalanced parentheses in {expr!r}"
            stack.pop()
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok) and nxt != "(" and tok.lower() not in PROMQL_WORDS:
            out.append(Selector(tok, tuple(stack)))
    assert not stack, f"unbalanced parentheses in {expr!r}"
    return out


def test_the_promql_reader_finds_metrics_inside_functions_aggregations_and_arithmetic() -> None:
    q = "histogram_quantile(0.99, sum by (le) (rate(streamrec_serving_request_seconds_bucket{endpoint=~\"a|b\"}[5m])))"
    assert selectors(q) == [Selector("streamrec_serving_request_seconds_bucket",
                                     ("histogram_quantile", "sum", "rate"))]
    q = '60 * rate(a_total{x="b(c)", y!="d"}[1m]) / on (instance) group_left (field) (b + 2.5e3) - time()'
    assert [(x.metric, x.rated) for x in selectors(q)] == [("a_total", True), ("b", False)]
    assert selectors("sum(increase(x_total[1h])) by (rule, state)") == [Selector("x_total", ("sum", "increase"))]


# -- what the dashboards show ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Panel:
    dashboard: str
    title: str
    description: str
    unit: str
    min: float | None
    max: float | None
    exprs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.dashboard}: panel {self.title!r}"

    @property
    def selectors(self) -> list[Selector]:
        return [s for e in self.exprs for s in selectors(e)]


def _walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _walk(p.get("panels", []))  # rows may hold their panels


def _panels() -> list[Panel]:
    out = []
    for f in DASHBOARD_FILES:
        dash = json.loads(f.read_text())
        for p in _walk(dash.get("panels", [])):
            exprs = tuple(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            if not exprs:
                continue  # a row or a text panel
            d = p.get("fieldConfig", {}).get("defaults", {})
            out.append(Panel(f.name, p.get("title", ""), p.get("description", ""), d.get("unit", ""),
                             d.get("min"), d.get("max"), exprs))
    return out


PANELS = _panels()


def test_there_are_dashboards_with_panels_to_check() -> None:
    assert DASHBOARD_FILES and len(PANELS) >= 10, "no dashboard found: the test no longer looks at the right place"


# -- what the code exports ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    name: str  # as registered: a counter without _total
    kind: str  # counter | gauge | histogram | summary | info | ...
    help: str

    def series(self) -> set[str]:
        if self.kind == "counter":
            return {f"{self.name}_total", f"{self.name}_created"}
        if self.kind == "histogram":
            return {f"{self.name}_{s}" for s in ("bucket", "sum", "count", "created")}
        if self.kind == "summary":
            return {self.name, *(f"{self.name}_{s}" for s in ("sum", "count", "created"))}
        if self.kind == "info":
            return {f"{self.name}_info"}
        return {self.name}


@cache
def exported() -> dict[str, Family]:
    """Every series name the code exports -> its family."""
    for pkg in METRIC_PACKAGES:
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, f"{pkg}."):
            importlib.import_module(info.name)
    from serving.metrics import ServingMetrics

    registries: list[CollectorRegistry] = [REGISTRY, ServingMetrics(lambda: None).registry]
    out: dict[str, Family] = {}
    for reg in registries:
        for mf in reg.collect():
            fam = Family(mf.name, mf.type, mf.documentation)
            for s in fam.series():
                out[s] = fam
    return out


def _family(series: str) -> Family:
    return exported()[series]


def test_the_exported_metrics_include_each_stage() -> None:
    names = set(exported())
    for must in ("streamrec_join_samples_total", "streamrec_learner_progressive_auc", "streamrec_events_total",
                 "streamrec_serving_requests_total", "streamrec_serving_request_seconds_bucket",
                 "streamrec_serving_hot_cache_hit_rate", "streamrec_monitor_alerts_total"):
        assert must in names, f"{must} not found: the collection of exported metrics misses a module or registry"


# -- the checks --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_every_metric_a_panel_queries_is_exported_by_the_code(panel: Panel) -> None:
    names = exported()
    for s in panel.selectors:
        assert s.metric in names or s.metric in PROMETHEUS_OWN, (
            f"{panel} queries {s.metric}, which no module of {', '.join(METRIC_PACKAGES)} exports")


# Counters of losses found as a process starts, before Prometheus first scrapes it: increase() never counts a
# series' first value, so a panel of their increase would show 0 for the very losses they count. Shown as they are
# (they stay 0 in a healthy deployment, so they do not climb).
COUNTED_AT_START = {"streamrec_input_lost_to_retention_total": "records lost to retention, found when a reader resumes"}


@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_counters_are_shown_as_rates_not_as_ever_growing_totals(panel: Panel) -> None:
    for s in panel.selectors:
        fam = exported().get(s.metric)
        if (fam is not None and fam.kind in {"counter", "histogram", "summary"} and s.metric != fam.name
                and s.metric not in COUNTED_AT_START):
            assert s.rated, f"{panel} shows the counter {s.metric} without rate()/increase()"


@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_a_percent_axis_shows_only_shares_in_0_1(panel: Panel) -> None:
    if panel.unit != "percentunit":
        return
    for s in panel.selectors:
        share = s.metric in SHARES and not s.rated
        time_share = s.metric in TIME_SHARES and s.rated
        assert share or time_share, (f"{panel} shows {s.metric}{' rated' if s.rated else ''} on a percent axis: "
                                     "it is not a share in [0, 1] (SHARES/TIME_SHARES)")


@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_no_panel_mixes_a_share_with_a_count_on_one_axis(panel: Panel) -> None:
    kinds = {(s.metric in SHARES and not s.rated) or (s.metric in TIME_SHARES and s.rated) for s in panel.selectors
             if s.metric not in PROMETHEUS_OWN}
    assert len(kinds) <= 1, f"{panel} puts shares and counts on one axis: {[s.metric for s in panel.selectors]}"


@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_no_axis_hides_values_below_a_fixed_minimum(panel: Panel) -> None:
    assert panel.min is None or panel.min <= 0, (
        f"{panel} fixes its axis minimum at {panel.min}: values below it are not drawn (use softMin)")
    if panel.max is not None:
        assert panel.unit == "percentunit" and panel.max >= 1, (
            f"{panel} fixes its axis maximum at {panel.max}: only a share's axis may end (at 1)")


@pytest.mark.parametrize("panel", PANELS, ids=str)
def test_no_counter_rate_on_a_percent_axis_starting_at_half(panel: Panel) -> None:
    if panel.unit == "percentunit" and panel.min is not None and panel.min >= 0.5:
        rated = [s.metric for s in panel.selectors if s.rated]
        assert not rated, f"{panel} draws rates of counters ({rated}) on a percent axis from {panel.min}"


def test_the_share_list_matches_the_exported_gauges() -> None:
    gauges = {n: f for n, f in exported().items() if f.kind == "gauge" and n.startswith("streamrec_")}
    for name in SHARES:
        assert name in gauges, f"SHARES names {name}, which is not an exported gauge"
    for name, fam in gauges.items():
        looks_like_share = bool(SHARE_NAME.search(name)) or bool(SHARE_HELP.match(fam.help))
        if looks_like_share and name not in NOT_SHARES:
            assert name in SHARES, (f"{name} ({fam.help!r}) looks like a share: add it to SHARES, or to NOT_SHARES "
                                    "with the reason")
    for name in TIME_SHARES:
        assert name in exported() and name.endswith("_seconds_total"), f"TIME_SHARES: {name} is no seconds counter"


def test_every_streamrec_metric_is_on_a_panel() -> None:
    shown = {exported()[s.metric].name for p in PANELS for s in p.selectors if s.metric in exported()}
    families = {f.name: f for f in exported().values() if f.name.startswith("streamrec_")}
    missing = sorted(set(families) - shown - set(NOT_ON_A_PANEL))
    assert not missing, "exported but on no panel (add a panel, or NOT_ON_A_PANEL with the reason): " + ", ".join(
        f"{n} ({families[n].kind}: {families[n].help})" for n in missing)
    for name in NOT_ON_A_PANEL:
        assert name in families and name not in shown, f"NOT_ON_A_PANEL: {name} is not exported or is shown"


def test_the_learner_lag_panel_says_it_counts_messages() -> None:
    assert "Messages" in _family("streamrec_learner_lag_samples").help  # the gauge: high watermark - offset
    lag = [p for p in PANELS if any(s.metric == "streamrec_learner_lag_samples" for s in p.selectors)]
    assert lag, "the learner lag is on no panel"
    for p in lag:
        assert "message" in p.title.lower(), f"{p} shows samples-topic messages under a title that does not say so"
        assert not re.search(r"\(samples\)", p.title), f"{p} calls messages samples"


# -- compose: Prometheus scrapes what the dashboard reads; the monitor alerts as the local stack does ------------
def _compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]


def _flag(command: list[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def _scrape_targets() -> set[str]:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        for sc in job.get("static_configs", []):
            targets.update(sc["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{n}:{dns['port']}" for n in dns["names"])
    return targets


def _metrics_endpoints() -> dict[str, str]:
    """service -> host:port where compose serves its Prometheus metrics."""
    svc = _compose()
    monitor = svc["monitor"]["command"]
    endpoints = {
        "joiner": f"joiner:{svc['joiner']['environment']['STREAMREC_JOINER_METRICS_PORT']}",
        "learner": f"learner:{svc['learner']['environment']['STREAMREC_LEARNER_METRICS_PORT']}",
        "serving": f"serving:{_flag(svc['serving']['command'], '--port')}",
        "refresh": f"refresh:{svc['refresh']['environment']['STREAMREC_REFRESH_METRICS_PORT']}",
    }
    assert _flag(monitor, "--metrics-port"), "the compose monitor serves no metrics (--metrics-port)"
    assert _flag(monitor, "--metrics-host") == "0.0.0.0", "the monitor's metrics bind loopback: Prometheus can't"
    endpoints["monitor"] = f"monitor:{_flag(monitor, '--metrics-port')}"
    assert svc["joiner"]["environment"]["STREAMREC_JOINER_METRICS_HOST"] == "0.0.0.0"
    assert svc["learner"]["environment"]["STREAMREC_LEARNER_METRICS_HOST"] == "0.0.0.0"
    assert svc["refresh"]["environment"]["STREAMREC_REFRESH_METRICS_HOST"] == "0.0.0.0"
    assert _flag(svc["serving"]["command"], "--host") == "0.0.0.0"
    return endpoints


def test_prometheus_scrapes_every_process_whose_metrics_the_dashboard_reads() -> None:
    targets = _scrape_targets()
    for service, endpoint in _metrics_endpoints().items():
        assert endpoint in targets, f"compose/prometheus.yml does not scrape {service} at {endpoint}"


def test_the_compose_monitor_runs_the_shipped_rules_against_the_compose_services() -> None:
    monitor = _compose()["monitor"]
    command = monitor["command"]
    rules_path = _flag(command, "--rules")
    mounts = {m.split(":")[1]: m.split(":")[0] for m in monitor["volumes"]}
    assert mounts.get(rules_path) == "./alert-rules.toml", f"--rules {rules_path} is not compose/alert-rules.toml"
    # the file itself is the packaged default rules (tests/integration/test_monitor.py keeps them identical)
    config = load_rules(str(COMPOSE / "alert-rules.toml"))
    overridden = dict(a.split("=", 1) for i, a in enumerate(command) if i and command[i - 1] == "--source")
    endpoints = _metrics_endpoints()
    for name in config.sources:
        assert name in overridden, (f"the rules' source {name!r} ({config.sources[name]}) is not pointed at a "
                                    "compose service with --source: inside the container it is loopback")
    for name, url in overridden.items():
        assert any(url == f"http://{e}/metrics" for e in endpoints.values()), f"--source {name}={url}: no such endpoint"
