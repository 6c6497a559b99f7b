"""Alert rules files (TOML): what ``streamrec monitor`` scrapes, which conditions it watches, where
alerts go. Loaded once at the process edge into frozen dataclasses; every mistake is a
:class:`RulesError` naming the file, the rule and the field.

::

    interval_s = 15                     # evaluate every 15 s (default 15)
    scrape_timeout_s = 5                # per source (default 5)

    [sources]                           # Prometheus text endpoints, by name
    learner = "http://127.0.0.1:9102/metrics"

    [sinks]
    log = true                          # one log line per alert (default true)
    kafka_topic = "alerts"              # optional: alerts to this topic, key = rule name
    webhook_url = "http://hooks.example/streamrec"   # optional: POST each alert as JSON

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

NaN: comparisons with NaN are false (IEEE, as in Prometheus), so a ``>`` rule never fires on a NaN
value (an AUC without both classes yet is NaN and must not page anyone). To alert on NaN, use
``op = "isnan"``, which holds exactly when the value is NaN (``streamrec_learner_progressive_logloss``
turns NaN when the model diverges), or count NaN losses with a counter and alert on
``increase(streamrec_learner_nan_losses_total[5m]) > 0``.
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

from streamrec.alert_expr import ExprError, Node, longest_range, parse
from streamrec.alerts import Severity, SinkSettings
from streamrec.settings import SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_RULES = "default_alert_rules.toml"  # packaged in streamrec/, the same file as compose/alert-rules.toml


class RulesError(SettingsError):
    """An alert rules file that cannot be used; the message names the file, rule and field."""


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
    tree: Node | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tree is None:
            object.__setattr__(self, "tree", parse(self.expr))

    @property
    def condition(self) -> str:
        return f"{self.expr} {self.op.value}" + ("" if self.op is Op.ISNAN else f" {self.threshold:g}")


@dataclass(frozen=True)
class RulesConfig:
    origin: str  # the file, for messages
    rules: tuple[Rule, ...]
    sources: Mapping[str, str]  # name -> URL of a Prometheus text endpoint
    sinks: SinkSettings = SinkSettings()
    interval_s: float = 15.0
    scrape_timeout_s: float = 5.0

    @property
    def history_s(self) -> float:
        """How long the engine must keep scraped samples for the longest range in the rules."""
        return longest_range(r.tree for r in self.rules if r.tree is not None)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")
_RULE_KEYS = ("name", "expr", "op", "threshold", "for_s", "severity", "description", "labels", "absent_for_s")
_TOP_KEYS = ("interval_s", "scrape_timeout_s", "sources", "sinks", "rule")
_SINK_KEYS = tuple(f.name for f in fields(SinkSettings))


def _shown(v: Any) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


class _Where:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, where: str, msg: str) -> RulesError:
        return RulesError(f"alert rules file {self.origin}: {where}{msg}")


def _number(where: _Where, ctx: str, key: str, v: Any, *, minimum: float | None = None,
            positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
        raise where.error(ctx, f'field "{key}": expected a number, got {_shown(v)}')
    if positive and v <= 0:
        raise where.error(ctx, f'field "{key}": expected a number > 0, got {_shown(v)}')
    if minimum is not None and v < minimum:
        raise where.error(ctx, f'field "{key}": expected a number >= {minimum:g}, got {_shown(v)}')
    return float(v)


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
        raise where.error(ctx, f'unknown field "{unknown[0]}"; known fields: {", ".join(_RULE_KEYS)}')
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
        threshold = _number(where, ctx, "threshold", raw["threshold"])
    for_s = _number(where, ctx, "for_s", raw.get("for_s", 0), minimum=0)
    absent = raw.get("absent_for_s")
    absent_for_s = None if absent is None else _number(where, ctx, "absent_for_s", absent, minimum=0)
    sev = raw.get("severity", Severity.WARNING.value)
    try:
        severity = Severity(sev)
    except (ValueError, TypeError):
        raise where.error(ctx, f'field "severity": expected one of {" ".join(s.value for s in Severity)}, '
                          f"got {_shown(sev)}") from None
    description = _string(where, ctx, "description", raw.get("description", ""))
    labels = raw.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise where.error(ctx, f'field "labels": expected a table of strings, e.g. {{ team = "ranking" }}, '
                          f"got {_shown(labels)}")
    return Rule(name=name, expr=expr, op=op, threshold=threshold, for_s=for_s, severity=severity,
                description=description, labels=dict(labels), absent_for_s=absent_for_s, tree=tree)


def _sinks(where: _Where, raw: Any) -> SinkSettings:
    if not isinstance(raw, dict):
        raise where.error("", f"[sinks]: expected a table, got {_shown(raw)}")
    unknown = sorted(set(raw) - set(_SINK_KEYS))
    if unknown:
        raise where.error("[sinks]: ", f'unknown field "{unknown[0]}"; known fields: {", ".join(_SINK_KEYS)}')
    ctx = "[sinks]: "
    kw: dict[str, Any] = {}
    if "log" in raw:
        if not isinstance(raw["log"], bool):
            raise where.error(ctx, f'field "log": expected true or false, got {_shown(raw["log"])}')
        kw["log"] = raw["log"]
    for key in ("kafka_topic", "webhook_url"):
        if key in raw:
            kw[key] = _string(where, ctx, key, raw[key]) or None
    if kw.get("webhook_url") and not re.match(r"https?://", kw["webhook_url"]):
        raise where.error(ctx, f'field "webhook_url": expected an http:// or https:// URL, got '
                          f"{_shown(kw['webhook_url'])}")
    for key in ("kafka_timeout_s", "webhook_timeout_s", "webhook_backoff_s"):
        if key in raw:
            kw[key] = _number(where, ctx, key, raw[key], positive=True)
    if "webhook_retries" in raw:
        v = raw["webhook_retries"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise where.error(ctx, f'field "webhook_retries": expected an integer >= 0, got {_shown(v)}')
        kw["webhook_retries"] = v
    return SinkSettings(**kw)


def _sources(where: _Where, raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise where.error("", f"[sources]: expected a table of name = URL, got {_shown(raw)}")
    for k, v in raw.items():
        if not isinstance(v, str) or not re.match(r"https?://", v):
            raise where.error("[sources]: ", f'field "{k}": expected an http:// or https:// URL of a Prometheus '
                              f"/metrics endpoint, got {_shown(v)}")
    return dict(raw)


def loads_rules(text: str, origin: str = "<string>") -> RulesConfig:
    where = _Where(origin)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise where.error("", f"not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        hint = " (a rule is written [[rule]], not [[rules]])" if "rules" in unknown else ""
        raise where.error("", f'unknown top-level key "{unknown[0]}"{hint}; known: {", ".join(_TOP_KEYS)}')
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
    )


def default_rules_text() -> str:
    return resources.files("streamrec").joinpath(DEFAULT_RULES).read_text(encoding="utf-8")


def load_rules(path: str | Path | None = None) -> RulesConfig:
    """The rules in ``path``, or the packaged default rules when ``path`` is None."""
    if path is None:
        return loads_rules(default_rules_text(), f"(packaged default) streamrec/{DEFAULT_RULES}")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RulesError(f"alert rules file {p}: cannot read it: {exc.strerror or exc}") from None
    return loads_rules(text, str(p))
