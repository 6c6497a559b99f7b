"""Alert rules files (TOML): what ``streamrec monitor`` scrapes, which conditions it watches, where
alerts go. Loaded once at the process edge into frozen dataclasses; every mistake is a
:class:`RulesError` naming the file, the rule and the field.

::

    interval_s = 15                     # evaluate every 15 s (default 15; at least 0.1)
    scrape_timeout_s = 5                # per source, in total (default 5)
    scrape_error_hold_s = 60            # a series whose source fails to scrape keeps its state (pending,
                                        # firing) this long before it counts as no data (default 60; 0: at once)
    sample_max_age_s = 300              # a sample with a timestamp (a /federate source's: its original scrape
                                        # time) older than this is no data (default 300: Prometheus' lookback)

    state_path = "monitor-state.json"   # optional: the firing alerts, kept over a restart (resolved if they
                                        # cleared meanwhile, announced again if they still hold), and the
                                        # pending ones (their for_s goes on counting from where it stopped)
    for_grace_period_s = 60             # a pending series restored at start fires no sooner than this after
                                        # the start (default 60: four evaluations of fresh scrapes)
    history_max_series = 2000           # label sets one metric keeps for rate()/increase()/delta(); a new one
                                        # past it gets no history (counted, logged) (default 2000)
    regex_value_max = 4096              # the longest label value a regex matcher (=~, !~) runs on; a longer one
                                        # does not match it (counted, logged) (default 4096)

    [sources]                           # Prometheus text endpoints, by name
    learner = "http://127.0.0.1:9102/metrics"

    [sinks]
    log = true                          # one log line per alert (default true)
    kafka_topic = "alerts"              # optional: alerts to this topic, key = rule name
    webhook_url = "http://hooks.example/streamrec"   # optional: POST each alert as JSON (a user:password@
                                                     # in this or a source's URL is sent as Basic auth)
    kafka_timeout_s = 10                # one delivery attempt, in total (default 10)
    webhook_timeout_s = 5               # one POST, connect to answer, in total (default 5)
    queue_size = 1000                   # alerts waiting per sink; the oldest beyond it are dropped
    queue_max_bytes = 67108864          # the bytes they may hold, the same (default 64 MiB)
    retry_backoff_s = 0.5               # wait after a failed attempt, doubling per failure in a row,
    retry_backoff_max_s = 30            # up to this (undelivered alerts stay queued)
    close_timeout_s = 10                # at shutdown, keep delivering this long, then report the rest

    [run_log]                           # optional: record what the monitor saw (``streamrec report`` reads it)
    path = "run-log.jsonl"              # JSON lines: each scrape's streamrec_* samples per source, the rules'
                                        # states per evaluation, every alert sent
    max_bytes = 67108864                # rotate past this size (default 64 MiB) ...
    keep = 1                            # ... keeping this many older files, path.1 .. path.<keep> (default 1)

    [[rule]]
    name = "cold_start_share"           # unique; the alert's key
    expr = 'streamrec_learner_bucket_share{field="user_id"}'
    op = ">"                            # > >= < <= == != or isnan
    threshold = 0.5                     # not used with isnan
    for_s = 300                         # the condition must hold this long before firing (default 0)
    severity = "warning"                # info | warning | critical (default warning)
    description = "Most user lookups fall back to hash buckets"
    labels = { team = "ranking" }       # optional, added to the alert's labels
    absent_for_s = 600                  # optional: fire when expr has had no data this long
    keep_firing_for_s = 300             # optional: a firing series resolves only after not holding this long

NaN: comparisons with NaN are false (IEEE, as in Prometheus), so a ``>`` rule never fires on a NaN
value (an AUC without both classes yet is NaN and must not page anyone). To alert on NaN, use
``op = "isnan"``, which holds exactly when the value is NaN (``streamrec_learner_progressive_logloss``
turns NaN when the model diverges), or count NaN losses with a counter and alert on
``increase(streamrec_learner_nan_losses_total[5m]) > 0``.

:func:`loads_rules` promises: any text gives either a :class:`RulesConfig` or a :class:`RulesError`
with a message, never another exception (fuzzed in tests/unit/monitor/test_fuzz_rules.py).
"""

from __future__ import annotations

import enum
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from monitor.alerts import Severity, SinkSettings
from monitor.expr import REGEX_VALUE_MAX, ExprError, Node, longest_range, parse
from monitor.http_deadline import check_http_url
from stream.config import TOPIC_RULE, topic_problem
from stream.errors import ConfigError, quoted
from stream.files import MAX_SETTINGS_FILE_BYTES, read_regular
from stream.secrets import RedactingRepr, hide_url_path, redact_for_cut
from stream.setting_values import unknown_key_hint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_RULES = "default_rules.toml"  # packaged in monitor/, the same file as compose/alert-rules.toml
# label sets one metric keeps in the rates' history (monitor.rule_engine.MetricHistory); the stages export tens per
# metric, so more is a label that churns (an id, a timestamp) or a misconfigured source, not a series to watch
HISTORY_MAX_SERIES = 2_000


class RulesError(ConfigError):
    """An alert rules file that cannot be used; the message names the file, rule and field."""


# the shortest evaluation interval: every interval scrapes every source and evaluates every rule; below this the loop
# ran without pause (interval_s = 1e-9 pinned a core and flooded the sources with scrapes)
MIN_INTERVAL_S = 0.1


def check_interval(interval_s: float, origin: str) -> None:
    """:class:`RulesError` unless ``interval_s`` is at least :data:`MIN_INTERVAL_S`: the one check the rules
    file's ``interval_s``, ``streamrec monitor --interval`` (through :class:`RulesConfig`) and
    ``Monitor.run(interval_s=...)`` all go through."""
    if not interval_s >= MIN_INTERVAL_S:
        raise RulesError(f"alert rules file {origin}: field \"interval_s\" (or --interval): expected at least "
                         f"{MIN_INTERVAL_S:g} seconds between evaluations, got {interval_s:g}")


class Op(str, enum.Enum):
    GT = ">"
    GE = ">="
    LT = "<"
    LE = "<="
    EQ = "=="
    NE = "!="
    ISNAN = "isnan"

    def holds(self, value: float, threshold: float | None) -> bool:
        if self is Op.ISNAN:
            return math.isnan(value)
        assert threshold is not None
        if math.isnan(value):  # IEEE: every comparison with NaN is false, != included (documented above)
            return False
        return {
            Op.GT: value > threshold,
            Op.GE: value >= threshold,
            Op.LT: value < threshold,
            Op.LE: value <= threshold,
            Op.EQ: value == threshold,
            Op.NE: value != threshold,
        }[self]


@dataclass(frozen=True)
class Rule:
    name: str
    expr: str
    op: Op
    threshold: float | None
    for_s: float = 0.0
    severity: Severity = Severity.WARNING
    description: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    absent_for_s: float | None = None
    # a firing series resolves only once its condition has not held for this long (Prometheus' keep_firing_for): a
    # rule flapping at every evaluation sent a firing and a resolved per flap, an alert storm at every receiver
    keep_firing_for_s: float = 0.0
    tree: Node | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tree is None:
            object.__setattr__(self, "tree", parse(self.expr))

    @property
    def condition(self) -> str:
        return f"{self.expr} {self.op.value}" + ("" if self.op is Op.ISNAN else f" {self.threshold:g}")


@dataclass(frozen=True)
class RunLogSettings:
    """``[run_log]``: where the monitor appends what it saw (``monitor.run_log.RunLog``); no path, no log.
    At most ``max_bytes * (keep + 1)`` on disk: past ``max_bytes`` the file becomes ``path.1`` (``path.1``
    becomes ``path.2``, ... up to ``keep``; 0 keeps none) and a new one starts."""

    path: Path | None = None
    max_bytes: int = 64 * 1024 * 1024
    keep: int = 1


@dataclass(frozen=True)
class RulesConfig:
    origin: str  # the file, for messages
    rules: tuple[Rule, ...]
    sources: Mapping[str, str]  # name -> URL of a Prometheus text endpoint
    sinks: SinkSettings = SinkSettings()
    interval_s: float = 15.0
    scrape_timeout_s: float = 5.0
    run_log: RunLogSettings = RunLogSettings()
    scrape_error_hold_s: float = 60.0  # see monitor.rule_engine.RuleEngine: a failed scrape is unknown, not false
    state_path: Path | None = None  # the firing series over a restart (monitor.state_file.FiringStateFile)
    for_grace_period_s: float = 60.0  # a restored pending series fires no sooner after a start (RuleEngine)
    history_max_series: int = HISTORY_MAX_SERIES  # label sets per metric in the rates' history (MetricHistory)
    regex_value_max: int = REGEX_VALUE_MAX  # the longest label value a regex matcher runs on (monitor.expr)
    sample_max_age_s: float = 300.0  # a timestamped sample older than this is no data (monitor.scrape.Snapshot)

    def __post_init__(self) -> None:
        check_interval(self.interval_s, self.origin)  # also where --interval replaces it

    @property
    def history_s(self) -> float:
        """How long the engine must keep scraped samples for the longest range in the rules."""
        return longest_range(r.tree for r in self.rules if r.tree is not None)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")
_RULE_KEYS = ("name", "expr", "op", "threshold", "for_s", "severity", "description", "labels", "absent_for_s",
              "keep_firing_for_s")
_TOP_KEYS = ("interval_s", "scrape_timeout_s", "scrape_error_hold_s", "sample_max_age_s", "state_path",
             "for_grace_period_s", "history_max_series", "regex_value_max", "sources", "sinks", "run_log", "rule")
_RUN_LOG_KEYS = tuple(f.name for f in fields(RunLogSettings))
_SINK_KEYS = tuple(f.name for f in fields(SinkSettings))
# [sinks] keys of earlier versions: a file that still has one gets this hint instead of "unknown field"
_REMOVED_SINK_KEYS = {
    "webhook_retries": "undelivered alerts now stay queued and are retried until delivered; remove it "
                       "(queue_size bounds how many wait)",
    "webhook_backoff_s": "the backoff is now the same for every sink; rename it retry_backoff_s",
}
_SHOW = RedactingRepr()  # its strings scrubbed of credentials before they are cut
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 80, 80, 40


def _shown(v: Any, limit: int = 120) -> str:
    """``v`` for a message: JSON where it can, bounded in depth and length, and never an exception."""
    try:
        if isinstance(v, float):
            text = repr(v)  # inf, nan, 0.5: as TOML writes them
        elif isinstance(v, str | bool | int) or v is None:  # a string scrubbed before quoted cuts it
            text = json.dumps(redact_for_cut(v) if isinstance(v, str) else v)
        else:
            text = _SHOW.repr(v)
    except (TypeError, ValueError, RecursionError):  # an int too long to print, say
        text = _SHOW.repr(v) if not isinstance(v, int) else f"an integer of {v.bit_length()} bits"
    return quoted(text, limit)  # (JSON escaped a string's control characters; reprlib's text of a table may hold one)


class _Where:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, where: str, msg: str) -> RulesError:
        return RulesError(f"alert rules file {self.origin}: {where}{msg}")


_MAX_SECONDS = 365 * 86_400  # a duration's bound: Python's waits refuse timeouts past ~9.2e9 s (OverflowError)


def _number(where: _Where, ctx: str, key: str, v: Any, *, minimum: float | None = None,
            positive: bool = False, finite: bool = True) -> float:
    """``v`` as a float; ``finite``: also reject +-inf and anything over a year (every duration and timeout: one of
    1e10 s loaded, then the monitor's first wait and its ``close()`` raised OverflowError)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise where.error(ctx, f'field "{key}": expected a number, got {_shown(v)}')
    try:
        x = float(v)
    except OverflowError:
        raise where.error(ctx, f'field "{key}": {_shown(v)} is too large for a number') from None
    if math.isnan(x) or (finite and math.isinf(x)):
        raise where.error(ctx, f'field "{key}": expected a finite number, got {_shown(v)}')
    if finite and x > _MAX_SECONDS:
        raise where.error(ctx, f'field "{key}": expected at most {_MAX_SECONDS} (seconds: a year), got {_shown(v)}')
    if positive and x <= 0:
        raise where.error(ctx, f'field "{key}": expected a number > 0, got {_shown(v)}')
    if minimum is not None and x < minimum:
        raise where.error(ctx, f'field "{key}": expected a number >= {minimum:g}, got {_shown(v)}')
    return x


def _string(where: _Where, ctx: str, key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise where.error(ctx, f'field "{key}": expected a string, got {_shown(v)}')
    return v


def _rule(where: _Where, i: int, raw: Any, seen: set[str]) -> Rule:
    if not isinstance(raw, dict):
        raise where.error(f"rule #{i + 1}: ", f"expected a [[rule]] table, got {_shown(raw)}")
    name = raw.get("name")
    ctx = f'rule "{name}": ' if isinstance(name, str) and name else f"rule #{i + 1}: "
    unknown = sorted(set(raw) - set(_RULE_KEYS))
    if unknown:
        raise where.error(ctx, _unknown("field", unknown[0], _RULE_KEYS))
    for key in ("name", "expr", "op"):
        if key not in raw:
            raise where.error(ctx, f'field "{key}": missing (required)')
    name = _string(where, ctx, "name", raw["name"])
    if not _NAME.fullmatch(name):
        raise where.error(ctx, f'field "name": expected letters, digits, _ . : - (starting with a letter or _), '
                          f"got {_shown(name)}")
    if name in seen:
        raise where.error(ctx, 'field "name": duplicate rule name (each rule needs its own: it is the alert key)')
    seen.add(name)
    expr = _string(where, ctx, "expr", raw["expr"])
    try:
        tree = parse(expr)
    except ExprError as exc:
        raise where.error(ctx, f'field "expr": {exc} in {_shown(expr)}') from None
    ops = [o.value for o in Op]
    try:
        op = Op(raw["op"])
    except (ValueError, TypeError):
        raise where.error(ctx, f'field "op": expected one of {" ".join(ops)}, got {_shown(raw["op"])}') from None
    threshold: float | None = None
    if op is Op.ISNAN:
        if "threshold" in raw:
            raise where.error(ctx, 'field "threshold": op "isnan" takes no threshold; remove it')
    elif "threshold" not in raw:
        raise where.error(ctx, f'field "threshold": missing (required with op "{op.value}")')
    else:
        threshold = _number(where, ctx, "threshold", raw["threshold"], finite=False)
    for_s = _number(where, ctx, "for_s", raw.get("for_s", 0), minimum=0)
    absent = raw.get("absent_for_s")
    absent_for_s = None if absent is None else _number(where, ctx, "absent_for_s", absent, minimum=0)
    keep_firing_for_s = _number(where, ctx, "keep_firing_for_s", raw.get("keep_firing_for_s", 0), minimum=0)
    sev = raw.get("severity", Severity.WARNING.value)
    try:
        severity = Severity(sev)
    except (ValueError, TypeError):
        raise where.error(ctx, f'field "severity": expected one of {" ".join(s.value for s in Severity)}, '
                          f"got {_shown(sev)}") from None
    description = _string(where, ctx, "description", raw.get("description", ""))
    labels = raw.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise where.error(ctx, f'field "labels": expected a table of strings, e.g. {{ team = "ranking" }}, '
                          f"got {_shown(labels)}")
    return Rule(name=name, expr=expr, op=op, threshold=threshold, for_s=for_s, severity=severity,
                description=description, labels=dict(labels), absent_for_s=absent_for_s,
                keep_firing_for_s=keep_firing_for_s, tree=tree)


def _shown_webhook(v: Any) -> str:
    """A value that may hold a webhook URL as a message shows it: a string as its scheme and host (its path may be its
    token: ``stream.secrets.hide_url_path``), anything else by its type only (an array of URLs quoted them whole)."""
    return _shown(hide_url_path(v)) if isinstance(v, str) else f"a value of type {type(v).__name__}"


def _sinks(where: _Where, raw: Any) -> SinkSettings:
    if not isinstance(raw, dict):
        raise where.error("", f"[sinks]: expected a table, got {_shown_webhook(raw)}")
    ctx = "[sinks]: "
    unknown = sorted(set(raw) - set(_SINK_KEYS))
    for key in unknown:
        if key in _REMOVED_SINK_KEYS:
            raise where.error(ctx, f'field "{key}" is no longer used: {_REMOVED_SINK_KEYS[key]}')
    if unknown:
        raise where.error(ctx, _unknown("field", unknown[0], _SINK_KEYS))
    kw: dict[str, Any] = {}
    if "log" in raw:
        if not isinstance(raw["log"], bool):
            raise where.error(ctx, f'field "log": expected true or false, got {_shown(raw["log"])}')
        kw["log"] = raw["log"]
    if "webhook_url" in raw and not isinstance(raw["webhook_url"], str):
        raise where.error(ctx, f'field "webhook_url": expected a string, got {_shown_webhook(raw["webhook_url"])}')
    for key in ("kafka_topic", "webhook_url"):
        if key in raw:
            kw[key] = _string(where, ctx, key, raw[key]) or None
    if kw.get("webhook_url") and (problem := check_http_url(kw["webhook_url"])):
        raise where.error(ctx, f'field "webhook_url": {problem}, got {_shown(hide_url_path(kw["webhook_url"]))}; e.g. '
                          '"http://alertmanager:9093/hook"')
    if kw.get("kafka_topic") and (problem := topic_problem(kw["kafka_topic"])):
        raise where.error(ctx, f'field "kafka_topic": {_shown(kw["kafka_topic"])} {problem}; {TOPIC_RULE}')
    for key in ("kafka_timeout_s", "webhook_timeout_s", "retry_backoff_s", "retry_backoff_max_s"):
        if key in raw:
            kw[key] = _number(where, ctx, key, raw[key], positive=True)
    if "close_timeout_s" in raw:
        kw["close_timeout_s"] = _number(where, ctx, "close_timeout_s", raw["close_timeout_s"], minimum=0)
    if "queue_size" in raw:
        v = raw["queue_size"]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10_000_000:
            raise where.error(ctx, f'field "queue_size": expected an integer from 1 to 10000000 (alerts waiting '
                              f"per sink), got {_shown(v)}")
        kw["queue_size"] = v
    if "queue_max_bytes" in raw:
        v = raw["queue_max_bytes"]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 40:
            raise where.error(ctx, f'field "queue_max_bytes": expected an integer from 1 to {1 << 40} (bytes the '
                              f"alerts waiting per sink may hold), got {_shown(v)}")
        kw["queue_max_bytes"] = v
    settings = SinkSettings(**kw)
    if settings.retry_backoff_max_s < settings.retry_backoff_s:
        raise where.error(ctx, f'field "retry_backoff_max_s": {settings.retry_backoff_max_s:g} is below '
                          f"retry_backoff_s = {settings.retry_backoff_s:g}; raise it or lower retry_backoff_s")
    return settings


def _sources(where: _Where, raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise where.error("", f"[sources]: expected a table of name = URL, got {_shown(raw)}")
    for k, v in raw.items():
        shown = _shown(hide_url_path(v) if isinstance(v, str) and "@" in v else v)  # a user-info: its password hidden
        if not isinstance(v, str) or not re.match(r"https?://", v):
            raise where.error("[sources]: ", f'field "{k}": expected an http:// or https:// URL of a Prometheus '
                              f"/metrics endpoint, got {shown}")
        if problem := check_http_url(v):
            raise where.error("[sources]: ", f'field "{k}": {problem}, got {shown}; e.g. "http://127.0.0.1:9102/metrics"')
    return dict(raw)


def _run_log(where: _Where, raw: Any) -> RunLogSettings:
    if not isinstance(raw, dict):
        raise where.error("", f"[run_log]: expected a table (path, max_bytes, keep), got {_shown(raw)}")
    ctx = "[run_log]: "
    unknown = sorted(set(raw) - set(_RUN_LOG_KEYS))
    if unknown:
        raise where.error(ctx, _unknown("field", unknown[0], _RUN_LOG_KEYS))
    path = _string(where, ctx, "path", raw.get("path", ""))
    if "\0" in path:
        raise where.error(ctx, 'field "path": a file name cannot hold a NUL character')
    limits = {"max_bytes": (4096, 2**40), "keep": (0, 100)}
    kw: dict[str, Any] = {}
    for key, (lo, hi) in limits.items():
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise where.error(ctx, f'field "{key}": expected an integer from {lo} to {hi}, got {_shown(v)}')
            kw[key] = v
    return RunLogSettings(path=Path(path) if path else None, **kw)


def loads_rules(text: str, origin: str = "<string>") -> RulesConfig:
    where = _Where(origin)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise where.error("", f"not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays / inline tables
        raise where.error("", "not usable TOML: arrays or inline tables nested too deeply") from None
    except ValueError as exc:  # int() of an integer with more than sys.get_int_max_str_digits() digits
        raise where.error("", f"not usable TOML: a number too long to read ({str(exc).split(';')[0]})") from None
    return rules_from_dict(data, origin)


def _unknown(what: str, key: str, known: tuple[str, ...], hint: str = "") -> str:
    """The error of an unknown ``key``, naming the closest known one (a typo: ``treshold``), else ``hint``."""
    hint = hint or unknown_key_hint(key, "", known, dict, lambda _, k: f'"{k}"')
    return f'unknown {what} "{key}"{hint}; known: {", ".join(known)}'


def rules_from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> RulesConfig:
    """The rules of an already parsed rules file (TOML types: tables are dicts with string keys);
    :class:`RulesError` for anything else, as :func:`loads_rules`."""
    where = _Where(origin)
    if not isinstance(data, Mapping):
        raise where.error("", f"expected a table at the top level, got {_shown(data)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        hint = " (a rule is written [[rule]], not [[rules]])" if "rules" in unknown else ""
        raise where.error("", _unknown("top-level key", unknown[0], _TOP_KEYS, hint))
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise where.error("", "rules are written as [[rule]] tables (an array of tables)")
    seen: set[str] = set()
    rules = tuple(_rule(where, i, r, seen) for i, r in enumerate(raw_rules))
    return RulesConfig(
        origin=origin,
        rules=rules,
        sources=_sources(where, data.get("sources", {})),
        sinks=_sinks(where, data.get("sinks", {})),
        interval_s=_number(where, "", "interval_s", data.get("interval_s", 15.0), positive=True),
        scrape_timeout_s=_number(where, "", "scrape_timeout_s", data.get("scrape_timeout_s", 5.0), positive=True),
        run_log=_run_log(where, data.get("run_log", {})),
        scrape_error_hold_s=_number(where, "", "scrape_error_hold_s", data.get("scrape_error_hold_s", 60.0),
                                    minimum=0),
        state_path=_state_path(where, data.get("state_path", "")),
        for_grace_period_s=_number(where, "", "for_grace_period_s", data.get("for_grace_period_s", 60.0),
                                   minimum=0),
        sample_max_age_s=_number(where, "", "sample_max_age_s", data.get("sample_max_age_s", 300.0), positive=True),
        history_max_series=_count(where, "history_max_series", data.get("history_max_series", HISTORY_MAX_SERIES)),
        regex_value_max=_count(where, "regex_value_max", data.get("regex_value_max", REGEX_VALUE_MAX)),
    )


_MAX_COUNT = 10_000_000  # history_max_series, regex_value_max: past this a value is a typo


def _count(where: _Where, key: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= _MAX_COUNT:
        raise where.error("", f'field "{key}": expected a whole number from 1 to {_MAX_COUNT}, got {_shown(raw)}')
    return raw


def _state_path(where: _Where, raw: Any) -> Path | None:
    path = _string(where, "", "state_path", raw)
    if "\0" in path:
        raise where.error("", 'field "state_path": a file name cannot hold a NUL character')
    return Path(path) if path else None


def default_rules_text() -> str:
    return resources.files("monitor").joinpath(DEFAULT_RULES).read_text(encoding="utf-8")


def load_rules(path: str | Path | None = None) -> RulesConfig:
    """The rules in ``path``, or the packaged default rules when ``path`` is None."""
    if path is None:
        return loads_rules(default_rules_text(), f"(packaged default) monitor/{DEFAULT_RULES}")
    p = Path(path)
    try:  # a FIFO or a device would hang the monitor or read without end: refused unread
        text = read_regular(p, MAX_SETTINGS_FILE_BYTES).decode("utf-8-sig")  # a byte order mark (Notepad's) dropped
    except OSError as exc:
        raise RulesError(f"alert rules file {p}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RulesError(f"alert rules file {p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return loads_rules(text, str(p))
