"""streamrec monitor: rules files, the expression language, the alert state machine, the sinks, and
the whole loop against the real broker (a burst of new users fires the cold-start alert to Kafka and
to a webhook, and it resolves after the burst)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from monitor.alerts import (
    Alert,
    AlertKind,
    AlertState,
    LogSink,
    Severity,
    SinkError,
    SinkSettings,
    WebhookSink,
    alert_fingerprint,
)
from monitor.delivery import Backoff, FanOut, QueuedSink
from monitor.engine import Monitor
from monitor.expr import ExprError, parse
from monitor.rule_engine import MetricHistory, RuleEngine
from monitor.rules import DEFAULT_RULES, Op, Rule, RulesError, load_rules, loads_rules
from monitor.scrape import Snapshot
from stream.config import KafkaSettings
from streamrec.cli import main
from tests.bounded_teardown import kill_and_reap
from tests.kafka_io import read_topic

REPO = Path(__file__).resolve().parents[2]

GOOD_RULE = """
[[rule]]
name = "cold_start_share"
expr = 'streamrec_learner_bucket_share{field="user_id"}'
op = ">"
threshold = 0.5
for_s = 300
severity = "warning"
"""


# -- rules files ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "expected"), [
    (('op = ">"', 'op = "=>"'),
     'rule "cold_start_share": field "op": expected one of > >= < <= == != isnan, got "=>"'),
    (('severity = "warning"', 'severity = "urgent"'),
     'rule "cold_start_share": field "severity": expected one of info warning critical, got "urgent"'),
    (("for_s = 300", "for_s = -5"), 'rule "cold_start_share": field "for_s": expected a number >= 0, got -5'),
    (("for_s = 300", "for_s = \"5m\""), 'rule "cold_start_share": field "for_s": expected a number, got "5m"'),
    (("for_s = 300", "for_s = 300\nthreshhold = 1"), 'rule "cold_start_share": unknown field "threshhold"'),
    (("threshold = 0.5\n", ""), 'rule "cold_start_share": field "threshold": missing (required with op ">")'),
    (("""expr = 'streamrec_learner_bucket_share{field="user_id"}'""", 'expr = "streamrec_learner_warm_auc - "'),
     'rule "cold_start_share": field "expr": expected a number, a metric name, a function or \'(\' at column 30, '
     "got the end"),
    (("""expr = 'streamrec_learner_bucket_share{field="user_id"}'""", "expr = 'open(\"/etc/passwd\")'"),
     'rule "cold_start_share": field "expr": unknown function open() at column 1; known: rate, increase'),
    (("""expr = 'streamrec_learner_bucket_share{field="user_id"}'""", 'expr = "rate(x)"'),
     'rule "cold_start_share": field "expr": rate() needs a range selector such as x[60s]'),
    (("""expr = 'streamrec_learner_bucket_share{field="user_id"}'""", 'expr = "x[5m] + 1"'),
     'rule "cold_start_share": field "expr": a range selector [...] only goes inside rate, increase, delta()'),
    (('name = "cold_start_share"', 'name = "cold start"'),
     'rule "cold start": field "name": expected letters, digits'),
    (('name = "cold_start_share"\n', ""), 'rule #1: field "name": missing (required)'),
    (("[[rule]]", "[[rules]]"), 'unknown top-level key "rules" (a rule is written [[rule]], not [[rules]])'),
    (('op = ">"', 'op = "isnan"'), 'rule "cold_start_share": field "threshold": op "isnan" takes no threshold'),
])
def test_rule_file_mistakes_name_the_rule_and_field(change: tuple[str, str], expected: str) -> None:
    text = GOOD_RULE.replace(*change)
    assert text != GOOD_RULE
    with pytest.raises(RulesError) as info:
        loads_rules(text, "rules.toml")
    assert str(info.value).startswith("alert rules file rules.toml: ")
    assert expected in str(info.value)


def test_duplicate_rule_names_and_bad_sections_are_errors() -> None:
    with pytest.raises(RulesError, match='rule "cold_start_share": field "name": duplicate rule name'):
        loads_rules(GOOD_RULE + GOOD_RULE, "r.toml")
    with pytest.raises(RulesError, match=r'\[sinks\]: unknown field "kafka"'):
        loads_rules('[sinks]\nkafka = "alerts"\n' + GOOD_RULE, "r.toml")
    with pytest.raises(RulesError, match=r'\[sources\]: field "learner": expected an http:// or https:// URL'):
        loads_rules('[sources]\nlearner = "127.0.0.1:9102"\n' + GOOD_RULE, "r.toml")
    with pytest.raises(RulesError, match="not valid TOML"):
        loads_rules("[[rule]\n", "r.toml")


def test_cli_exits_2_with_the_rule_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD_RULE.replace('op = ">"', 'op = "=>"'))
    assert main(["monitor", "--rules", str(bad), "--once"]) == 2
    err = capsys.readouterr().err
    assert (f'streamrec monitor: error: alert rules file {bad}: rule "cold_start_share": field "op": expected one '
            'of > >= < <= == != isnan, got "=>"') in err
    assert main(["monitor", "--rules", str(tmp_path / "missing.toml"), "--check"]) == 2
    assert "missing.toml: cannot read it" in capsys.readouterr().err


def test_default_rules_load_and_compose_ships_the_same_file(capsys: pytest.CaptureFixture[str]) -> None:
    packaged = (REPO / "monitor" / DEFAULT_RULES).read_text()
    assert (REPO / "compose" / "alert-rules.toml").read_text() == packaged
    config = load_rules(None)
    names = {r.name for r in config.rules}
    assert {"cold_start_share", "cold_user_auc_gap", "nan_losses", "logloss_nan", "learner_lag",
            "learner_trains_nothing"} <= names
    assert config.sinks.kafka_topic == "alerts" and config.history_s == 300
    assert main(["monitor", "--check", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rules"]) == len(config.rules)


# -- expressions ----------------------------------------------------------------------------------
METRICS = """
# TYPE streamrec_learner_bucket_share gauge
streamrec_learner_bucket_share{field="user_id"} 0.8
streamrec_learner_bucket_share{field="item_id"} 0.2
streamrec_learner_bucket_share{field="gender"} 0
streamrec_learner_warm_auc 0.78
streamrec_learner_cold_auc 0.61
streamrec_learner_lag_samples{partition="0"} 10
streamrec_learner_lag_samples{partition="1"} 32
streamrec_learner_progressive_logloss NaN
"""


def evaluate(expr: str, text: str = METRICS) -> float | dict[tuple, float]:
    store = MetricHistory(0)
    store.record(Snapshot.from_texts({"learner": text}), 0.0)
    val = parse(expr).eval(store)
    if isinstance(val, dict):
        return {lb: p.value for lb, p in val.items()}
    return val


def test_expressions_select_labels_and_do_arithmetic() -> None:
    assert evaluate('streamrec_learner_bucket_share{field="user_id"}') == {(("field", "user_id"),): 0.8}
    assert set(evaluate('streamrec_learner_bucket_share{field=~"user_id|item_id"}')) == {
        (("field", "user_id"),), (("field", "item_id"),)}
    assert len(evaluate('streamrec_learner_bucket_share{field!="gender"}')) == 2
    gap = evaluate("streamrec_learner_warm_auc - streamrec_learner_cold_auc")
    assert gap[()] == pytest.approx(0.17)
    assert evaluate("1 + 2 * 3 - -(4 - 2) / 2") == 8.0
    assert evaluate("(1 + 2) * 3") == 9.0
    assert evaluate("1 / 0") == math.inf and math.isnan(evaluate("0 / 0"))
    # a vector against a single unlabelled series combines like a scalar
    ratio = evaluate("streamrec_learner_bucket_share / streamrec_learner_warm_auc")
    assert ratio[(("field", "user_id"),)] == pytest.approx(0.8 / 0.78)
    assert evaluate("sum(streamrec_learner_lag_samples)") == {(): 42.0}
    assert evaluate("max(streamrec_learner_bucket_share)") == {(): 0.8}
    assert evaluate("max by (field) (streamrec_learner_bucket_share)")[(("field", "item_id"),)] == 0.2
    assert evaluate("count without (partition) (streamrec_learner_lag_samples)") == {(): 2.0}
    assert evaluate("abs(streamrec_learner_cold_auc - streamrec_learner_warm_auc)")[()] == pytest.approx(0.17)
    assert math.isnan(evaluate("streamrec_learner_progressive_logloss")[()])
    # vectors match on equal label sets only; a missing metric is an empty vector ("no data")
    assert evaluate("streamrec_learner_bucket_share - streamrec_learner_lag_samples") == {}
    assert evaluate("not_exported_anywhere + 1") == {}
    assert evaluate("sum(not_exported_anywhere)") == {}


@pytest.mark.parametrize("src", ["", "a +", "a{b=1}", "a{b=\"1\"", "(a", "a b", "max by field (a)", "5m",
                                 "os.system('x')", "a{b=~\"(\"}", "rate(a[0s])", "__class__[1]"])
def test_unsafe_or_broken_expressions_do_not_parse(src: str) -> None:
    with pytest.raises(ExprError):
        parse(src)


def test_rate_and_increase_use_the_engines_own_history_with_counter_resets() -> None:
    store = MetricHistory(300)
    for t, v in [(0, 0), (15, 3), (30, 9), (45, 2), (60, 5)]:  # reset to 0 between 30 and 45
        store.record(Snapshot.from_texts({"learner": f"streamrec_learner_nan_losses_total {v}\n"}), float(t))
    inc = parse("increase(streamrec_learner_nan_losses_total[60s])").eval(store)
    assert inc[()].value == 3 + 6 + 2 + 3
    assert parse("rate(streamrec_learner_nan_losses_total[60s])").eval(store)[()].value == pytest.approx(14 / 60)
    assert parse("increase(streamrec_learner_nan_losses_total[20s])").eval(store)[()].value == 3
    assert parse("delta(streamrec_learner_nan_losses_total[30s])").eval(store)[()].value == -4
    assert parse("rate(streamrec_learner_nan_losses_total[10s])").eval(store) == {}  # one sample: no value yet
    assert inc[()].sources == frozenset({"learner"})


# -- the state machine ------------------------------------------------------------------------------
def snap(share_user: float | None, share_item: float = 0.1) -> Snapshot:
    lines = [f'streamrec_learner_bucket_share{{field="item_id"}} {share_item}']
    if share_user is not None:
        lines.append(f'streamrec_learner_bucket_share{{field="user_id"}} {share_user}')
    return Snapshot.from_texts({"learner": "\n".join(lines) + "\n"})


def rule(**kw) -> Rule:
    base = dict(name="cold_start_share", expr="streamrec_learner_bucket_share", op=Op.GT, threshold=0.5,
                for_s=300.0, severity=Severity.WARNING, description="buckets serve most lookups",
                labels={"team": "ranking"})
    base.update(kw)
    return Rule(**base)


def states(engine: RuleEngine) -> dict[str, str]:
    return {s.labels.get("field", ""): s.state.value for s in engine.status()}


def test_pending_firing_resolved_per_label_set_with_an_injected_clock() -> None:
    engine = RuleEngine([rule()])
    assert engine.evaluate(snap(0.2), 0) == []
    assert states(engine) == {"user_id": "inactive", "item_id": "inactive"}
    assert engine.evaluate(snap(0.9), 100) == []  # condition holds: pending, for_s not yet elapsed
    assert states(engine)["user_id"] == "pending"
    assert engine.evaluate(snap(0.9), 399) == []
    [fired] = engine.evaluate(snap(0.9), 400)
    assert (fired.rule, fired.state, fired.value, fired.threshold, fired.ts) == (
        "cold_start_share", AlertState.FIRING, 0.9, 0.5, 400_000)
    assert fired.labels == {"team": "ranking", "field": "user_id"} and fired.source == "learner"
    assert "buckets serve most lookups" in fired.message and "held for 300s" in fired.message
    assert states(engine) == {"user_id": "firing", "item_id": "inactive"}
    assert engine.evaluate(snap(0.95), 500) == []  # still firing: no second alert
    [resolved] = engine.evaluate(snap(0.3), 600)
    assert (resolved.state, resolved.value, resolved.labels["field"]) == (AlertState.RESOLVED, 0.3, "user_id")
    assert states(engine)["user_id"] == "resolved"
    assert engine.evaluate(snap(0.3), 615) == [] and states(engine)["user_id"] == "inactive"


def test_a_blip_shorter_than_for_s_never_fires_and_no_data_never_fires() -> None:
    engine = RuleEngine([rule(for_s=60)])
    for t, v in [(0, 0.9), (30, 0.9), (45, 0.1), (60, 0.9), (90, 0.9)]:
        assert engine.evaluate(snap(v), t) == []
    assert engine.evaluate(snap(None), 130) == []  # the series vanished: pending ends, nothing fires
    assert engine.evaluate(Snapshot(), 1000) == []


def test_for_s_zero_fires_at_once_and_a_vanished_series_resolves() -> None:
    engine = RuleEngine([rule(for_s=0)])
    [a] = engine.evaluate(snap(0.9), 0)
    assert a.state is AlertState.FIRING
    [r] = engine.evaluate(snap(None), 15)
    assert r.state is AlertState.RESOLVED and r.value is None and "no data" in r.message


def test_nan_never_compares_true_but_isnan_fires() -> None:
    text = "streamrec_learner_progressive_logloss NaN\n"
    gt = rule(name="logloss_high", expr="streamrec_learner_progressive_logloss", for_s=0, threshold=1.0)
    nan = rule(name="logloss_nan", expr="streamrec_learner_progressive_logloss", op=Op.ISNAN, threshold=None,
               for_s=0, severity=Severity.CRITICAL)
    engine = RuleEngine([gt, nan])
    [a] = engine.evaluate(Snapshot.from_texts({"learner": text}), 0)
    assert a.rule == "logloss_nan" and math.isnan(a.value) and a.severity is Severity.CRITICAL
    assert json.loads(a.to_json())["value"] == "NaN" and json.loads(a.to_json())["threshold"] is None
    [r] = engine.evaluate(Snapshot.from_texts({"learner": "streamrec_learner_progressive_logloss 0.4\n"}), 15)
    assert r.rule == "logloss_nan" and r.state is AlertState.RESOLVED


def test_nan_loss_counter_rising_fires_through_increase() -> None:
    config = loads_rules("""
[[rule]]
name = "nan_losses"
expr = "increase(streamrec_learner_nan_losses_total[5m])"
op = ">"
threshold = 0
severity = "critical"
""")
    engine = RuleEngine(config.rules, config.history_s)
    counter = "# TYPE streamrec_learner_nan_losses counter\nstreamrec_learner_nan_losses_total {}\n"
    assert engine.evaluate(Snapshot.from_texts({"learner": counter.format(0)}), 0) == []
    assert engine.evaluate(Snapshot.from_texts({"learner": counter.format(0)}), 15) == []
    [a] = engine.evaluate(Snapshot.from_texts({"learner": counter.format(2)}), 30)
    assert a.state is AlertState.FIRING and a.value == 2
    # 5 minutes without new NaN losses: the increase falls back to 0 and the alert resolves
    alerts = [x for t in range(45, 400, 15) for x in engine.evaluate(Snapshot.from_texts(
        {"learner": counter.format(2)}), t)]
    assert [x.state for x in alerts] == [AlertState.RESOLVED]


def test_absent_for_s_fires_when_a_metric_disappears() -> None:
    engine = RuleEngine([rule(expr="sum(streamrec_learner_lag_samples)", threshold=500, absent_for_s=60)])
    lag = Snapshot.from_texts({"learner": 'streamrec_learner_lag_samples{partition="0"} 3\n'})
    assert engine.evaluate(lag, 0) == []
    assert engine.evaluate(Snapshot(), 10) == []
    [a] = engine.evaluate(Snapshot(), 70)
    assert a.state is AlertState.FIRING and a.labels["absent"] == "true" and a.value is None
    assert "no data" in a.message
    [r] = engine.evaluate(lag, 85)
    assert r.state is AlertState.RESOLVED and r.labels["absent"] == "true"


def test_alert_json_round_trips() -> None:
    a = Alert(rule="r", source="learner", severity=Severity.INFO, state=AlertState.FIRING, value=math.inf,
              threshold=1.0, message="m", ts=1, labels={"field": "user_id"})
    d = json.loads(a.to_json())
    assert set(d) == {"rule", "source", "severity", "state", "value", "threshold", "message", "ts", "labels", "kind",
                      "fingerprint"}
    assert d["value"] == "+Inf" and Alert.from_json(a.to_json()) == a
    assert d["kind"] == "series" and d["fingerprint"] == alert_fingerprint("r", AlertKind.SERIES, {"field": "user_id"})
    absent = dataclasses.replace(a, kind=AlertKind.ABSENT, fingerprint="")
    assert json.loads(absent.to_json())["kind"] == "absent" and Alert.from_json(absent.to_json()) == absent
    assert absent.fingerprint != a.fingerprint  # same rule and labels, another alert


def test_the_refresh_jobs_alert_records_read_as_alerts() -> None:
    # the shape cache_refresh/job.py wrote to the same topic before alerts said their kind and fingerprint: it reads
    # as a series alert, and writes back the same fields plus those two
    record = {"rule": "refresh_failed", "source": "refresh", "severity": "critical", "state": "firing",
              "value": None, "threshold": None, "message": "validate: AUC dropped", "ts": 1718000000000,
              "labels": {"stage": "validate"}}
    a = Alert.from_json(json.dumps(record))
    assert a.state is AlertState.FIRING and a.value is None and a.kind is AlertKind.SERIES
    assert a.fingerprint == alert_fingerprint("refresh_failed", AlertKind.SERIES, {"stage": "validate"})
    assert json.loads(a.to_json()) == {**record, "kind": "series", "fingerprint": a.fingerprint}


# -- sinks ------------------------------------------------------------------------------------------
class Recorder:
    """A local HTTP server: GET serves Prometheus text, POST records the JSON body."""

    def __init__(self, fail_first: int = 0) -> None:
        self.metrics = ""
        self.posts: list[dict] = []
        self.scrapes = 0
        self.fail_first = fail_first
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                rec.scrapes += 1
                body = rec.metrics.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if rec.fail_first > 0:
                    rec.fail_first -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                rec.posts.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    try:
        yield r
    finally:
        r.close()


def an_alert(state: AlertState = AlertState.FIRING) -> Alert:
    return Alert(rule="cold_start_share", source="learner", severity=Severity.WARNING, state=state, value=0.9,
                 threshold=0.5, message="m", ts=int(time.time() * 1000), labels={"field": "user_id"})


FAST_RETRIES = SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=0.05)


def test_webhook_failures_stay_queued_and_are_retried_with_backoff(recorder: Recorder) -> None:
    assert [Backoff(0.5, 4).delay(n) for n in range(6)] == [0, 0.5, 1.0, 2.0, 4.0, 4.0]
    recorder.fail_first = 2
    sink = QueuedSink(WebhookSink(recorder.url + "/hook", timeout_s=2), FAST_RETRIES)
    sink.send([an_alert()])
    assert sink.wait_idle(10)
    assert len(recorder.posts) == 1 and (sink.stats.failed, sink.stats.retried, sink.stats.delivered) == (2, 2, 1)
    assert recorder.posts[0]["rule"] == "cold_start_share" and recorder.posts[0]["state"] == "firing"
    assert sink.close(1) == 0


class ListSink:
    name, timeout_s, batch_max = "list", 1.0, 100

    def __init__(self) -> None:
        self.got: list[Alert] = []

    def send(self, alerts, deadline=None) -> None:
        self.got.extend(alerts)

    def close(self) -> None:
        pass


def test_a_failing_sink_never_stops_the_others(recorder: Recorder, caplog: pytest.LogCaptureFixture) -> None:
    recorder.fail_first = 100
    dead = WebhookSink(recorder.url + "/hook", timeout_s=1)
    refused = WebhookSink("http://127.0.0.1:9/hook", timeout_s=1)
    listed = ListSink()
    fan = FanOut([dead, refused, LogSink(), listed], FAST_RETRIES)
    with caplog.at_level("INFO", logger="streamrec.alerts"):
        fan.send([an_alert(), an_alert(AlertState.RESOLVED)])
        assert fan.sinks[3].wait_idle(5) and fan.sinks[2].wait_idle(5)
        deadline = time.monotonic() + 5
        while fan.failures["webhook"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fan.close(timeout_s=0.3) == 4  # both alerts are still queued for each dead webhook
    assert len(listed.got) == 2 and fan.failures["webhook"] >= 4
    text = caplog.text
    assert "HTTP 503" in text and "FIRING warning cold_start_share" in text and "RESOLVED" in text
    assert "closed with 2 alert(s) undelivered" in text
    with pytest.raises(SinkError, match="1 of 1 alert"):
        refused.send([an_alert()])


def test_monitor_loop_sends_to_a_webhook_and_survives_dead_sources(recorder: Recorder) -> None:
    config = loads_rules(f"""
interval_s = 0.1
[sources]
learner = "{recorder.url}/metrics"
dead = "http://127.0.0.1:9/metrics"
[sinks]
log = false
webhook_url = "{recorder.url}/hook"
""" + GOOD_RULE.replace("for_s = 300", "for_s = 0"))
    from monitor.delivery import build_sinks

    sink = build_sinks(config.sinks, None)
    monitor = Monitor(config, sink)
    recorder.metrics = 'streamrec_learner_bucket_share{field="user_id"} 0.7\n'
    monitor.step()
    recorder.metrics = 'streamrec_learner_bucket_share{field="user_id"} 0.1\n'
    stop = threading.Event()
    t = threading.Thread(target=monitor.run, args=(stop,))
    t.start()
    deadline = time.monotonic() + 10
    while len(recorder.posts) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(5)
    assert not t.is_alive()
    assert [(p["state"], p["value"]) for p in recorder.posts] == [("firing", 0.7), ("resolved", 0.1)]
    assert monitor.scrape_errors["dead"] >= 2 and "learner" not in monitor.scrape_errors
    assert monitor.close(1) == 0 and monitor.summary()["sinks"]["webhook"]["delivered"] == 2


# -- the whole command against the real broker -------------------------------------------------
def test_burst_of_new_users_fires_and_resolves_on_the_kafka_alerts_topic(
        stack, kafka: KafkaSettings, recorder: Recorder, tmp_path: Path) -> None:
    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    rules = tmp_path / "rules.toml"
    rules.write_text(f"""
interval_s = 0.2
[sources]
learner = "{recorder.url}/metrics"
[sinks]
log = true
kafka_topic = "{topic}"
webhook_url = "{recorder.url}/hook"
""" + GOOD_RULE.replace("for_s = 300", "for_s = 0.6"))
    steady = ('streamrec_learner_bucket_share{field="user_id"} 0.1\n'
              'streamrec_learner_bucket_share{field="item_id"} 0.05\n')
    recorder.metrics = steady
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "monitor", "--rules", str(rules),
                             "--bootstrap-servers", kafka.bootstrap_servers, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        def wait_for(cond, what: str, timeout_s: float = 15) -> None:
            deadline = time.monotonic() + timeout_s
            while not cond():
                if proc.poll() is not None:
                    raise AssertionError(f"monitor exited early ({proc.returncode}): {proc.stderr.read()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {what}")
                time.sleep(0.02)

        wait_for(lambda: recorder.scrapes >= 3, "the monitor to scrape the steady state")
        burst_at = time.time()
        recorder.metrics = steady.replace("} 0.1", "} 0.93")  # a burst of new users: buckets serve most
        wait_for(lambda: len(recorder.posts) >= 1, "the firing alert")
        recorder.metrics = steady
        wait_for(lambda: len(recorder.posts) >= 2, "the resolved alert")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        kill_and_reap(proc)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["alerts"] == {"firing": 1, "resolved": 1} and summary["firing"] == []
    assert "FIRING warning cold_start_share" in err and "RESOLVED warning cold_start_share" in err

    records = read_topic(kafka, topic)
    assert [r.key for r in records] == [b"cold_start_share", b"cold_start_share"]
    fired, resolved = (Alert.from_json(r.value) for r in records)
    assert (fired.state, fired.value, fired.threshold, fired.labels) == (
        AlertState.FIRING, 0.93, 0.5, {"field": "user_id"})
    assert (resolved.state, resolved.value) == (AlertState.RESOLVED, 0.1)
    assert fired.source == "learner" and fired.severity is Severity.WARNING
    assert fired.ts / 1000 >= burst_at + 0.6  # it waited for_s before firing
    assert resolved.ts > fired.ts
    assert [p["state"] for p in recorder.posts] == ["firing", "resolved"]
    assert recorder.posts[0] == json.loads(records[0].value)


def test_a_monitor_restarted_by_sigterm_resolves_on_the_kafka_topic_what_cleared_while_it_was_down(
        stack, kafka: KafkaSettings, recorder: Recorder, tmp_path: Path) -> None:
    """With state_path, the firing alert survives a SIGTERM restart: the restarted monitor resolves it on the
    real alerts topic once the condition has cleared (it used to forget it, and nothing resolved it)."""
    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    rules = tmp_path / "rules.toml"
    rules.write_text(f"""
interval_s = 0.2
state_path = "{tmp_path / 'state.json'}"
[sources]
learner = "{recorder.url}/metrics"
[sinks]
log = true
kafka_topic = "{topic}"
""" + GOOD_RULE.replace("for_s = 300", "for_s = 0.4"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run_until(cond, what: str) -> dict:
        proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "monitor", "--rules", str(rules),
                                 "--bootstrap-servers", kafka.bootstrap_servers, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + 60
            while not cond():
                assert proc.poll() is None, f"monitor exited early ({proc.returncode}): {proc.stderr.read()}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            kill_and_reap(proc)
        assert proc.returncode == 0, err
        return json.loads(out)

    def on_topic() -> int:
        try:
            return len(read_topic(kafka, topic, timeout_s=5))
        except TimeoutError:
            return 0

    recorder.metrics = 'streamrec_learner_bucket_share{field="user_id"} 0.9\n'
    first = run_until(lambda: on_topic() >= 1, "the firing alert")
    assert first["alerts"] == {"firing": 1, "resolved": 0} and first["undelivered"] == 0
    recorder.metrics = 'streamrec_learner_bucket_share{field="user_id"} 0.1\n'  # cleared while it was down
    second = run_until(lambda: on_topic() >= 2, "the resolved alert")
    assert second["alerts"] == {"firing": 0, "resolved": 1} and second["firing"] == []
    records = [Alert.from_json(r.value) for r in read_topic(kafka, topic)]
    assert [(a.state, a.value, a.labels) for a in records] == [
        (AlertState.FIRING, 0.9, {"field": "user_id"}), (AlertState.RESOLVED, 0.1, {"field": "user_id"})]
