"""The expression language of alert rules: a small, safe subset of PromQL over scraped metrics.

Grammar (no ``eval``: a tokenizer and a recursive-descent parser build a tree of the nodes below)::

    expr      := term (('+' | '-') term)*
    term      := unary (('*' | '/') unary)*
    unary     := '-' unary | primary
    primary   := NUMBER | '(' expr ')' | call | aggregate | selector
    selector  := METRIC ['{' matcher (',' matcher)* '}']          instant vector
    matcher   := LABEL ('=' | '!=' | '=~' | '!~') "STRING"         regexes match the whole value; STRING's
                 escapes are Go's, as in PromQL (:func:`_unquote`: a regex's backslash is written doubled)
    call      := ('rate' | 'increase' | 'delta') '(' selector '[' DURATION ']' ')'
               | 'abs' '(' expr ')'
    aggregate := ('sum' | 'max' | 'min' | 'avg' | 'count') [grouping] '(' expr ')' [grouping]
    grouping  := ('by' | 'without') '(' LABEL (',' LABEL)* ')'
    DURATION  := NUMBER ('ms' | 's' | 'm' | 'h' | 'd')                e.g. 60s, 5m

Values are scalars or *vectors*: series keyed by their label set. Arithmetic between two vectors
matches series with identical label sets (one-to-one, as in Prometheus); a vector with a single
series without labels (an unlabelled gauge, an aggregate without ``by``) combines with every series
of the other side, like a scalar. The metric name is not a label: ``a - b`` matches ``a{x="1"}`` with
``b{x="1"}``. Division by zero gives +-Inf or NaN (IEEE), never an exception.

``rate``/``increase``/``delta`` read the monitor's own history of its scrapes (it keeps as much as the
longest range in its rules needs): ``increase`` is the sum of the rises between consecutive samples in
the range, a drop counting as a counter reset; ``rate`` is that divided by the seconds the samples
span; ``delta`` is last minus first (for gauges). A series with fewer than two samples in the range
has no value yet.

:func:`parse` promises: any string gives either a tree or an :class:`ExprError` with a message, never
another exception. Expressions deeper than :data:`MAX_DEPTH` (operators, functions, parentheses) are
refused, so neither parsing nor evaluating one can exhaust the stack (fuzzed in
tests/unit/monitor/test_fuzz_rules.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stream.errors import StreamrecError, quoted, shown

try:  # the regex parser's modules (for _slow_regex): private names since Python 3.11, deprecated aliases before
    import re._constants as _sre_constants  # type: ignore[import-not-found,unused-ignore]
    import re._parser as _sre_parser  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_constants  # type: ignore[no-redef,unused-ignore]
    import sre_parse as _sre_parser  # type: ignore[no-redef,unused-ignore]
sre: Any = _sre_constants
sre_parse: Any = _sre_parser
_ATOMIC = tuple(getattr(sre, name) for name in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT") if hasattr(sre, name))

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: a hashable label set
MAX_DEPTH = 64  # levels of nesting an expression may have; alert rules need a handful
# the longest label value a regex matcher (=~, !~) runs on (``regex_value_max`` of the rules file): a longer one does
# not match the regex (=~ leaves its series out, !~ keeps it), and the store counts and says it. _slow_regex refuses
# the exponential shapes only: ``.*a.*b`` still takes time quadratic in the value's length (a 40k-character value,
# two seconds; values may be as long as a scrape, 16 MiB), so one hostile label value stalled every evaluation
REGEX_VALUE_MAX = 4096


@dataclass(frozen=True, slots=True)
class Point:
    value: float
    sources: frozenset[str]  # the scrape sources the value was computed from


Vector = dict[Labels, Point]
Value = float | Vector
Window = tuple[Sequence[tuple[float, float]], frozenset[str]]  # (time, value) samples oldest first, sources


class ExprError(StreamrecError, ValueError):
    """An expression that does not parse; the message says where and what was expected."""


class MetricStore(Protocol):
    """What an expression reads: the latest scrape and the history of earlier ones."""

    def instant(self, metric: str) -> Mapping[Labels, Point]: ...

    def window(self, metric: str, range_s: float) -> Mapping[Labels, Window]:
        """Per series: the (time, value) samples of the last ``range_s`` seconds, oldest first."""
        ...

    @property
    def regex_value_max(self) -> int:
        """The longest label value a regex matcher runs on (:data:`REGEX_VALUE_MAX` by default)."""
        ...

    def regex_value_skipped(self, metric: str, label: str, length: int) -> None:
        """A value of ``label`` longer than :attr:`regex_value_max` that a regex did not run on (count it, say it)."""


def labels_of(d: Mapping[str, str]) -> Labels:
    return tuple(sorted(d.items()))


# -- tree -------------------------------------------------------------------------------------
class Node:
    text: str  # the source of this node, for messages

    def eval(self, store: MetricStore) -> Value:
        raise NotImplementedError

    def ranges(self) -> Iterable[float]:
        return ()


@dataclass(frozen=True)
class Number(Node):
    value: float
    text: str

    def eval(self, store: MetricStore) -> Value:
        return self.value


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def matches(self, labels: Labels, metric: str, store: MetricStore) -> bool:
        got = dict(labels).get(self.label, "")
        if self.op == "=":
            return got == self.value
        if self.op == "!=":
            return got != self.value
        if len(got) > store.regex_value_max:  # does not match: the regex never runs on it (REGEX_VALUE_MAX)
            store.regex_value_skipped(metric, self.label, len(got))
            hit = False
        else:
            hit = re.fullmatch(self.value, got) is not None
        return hit if self.op == "=~" else not hit


@dataclass(frozen=True)
class Selector(Node):
    metric: str
    matchers: tuple[Matcher, ...]
    text: str
    range_s: float | None = None

    def select(self, labels: Labels, store: MetricStore) -> bool:
        return all(m.matches(labels, self.metric, store) for m in self.matchers)

    def eval(self, store: MetricStore) -> Value:
        return {lb: p for lb, p in store.instant(self.metric).items() if self.select(lb, store)}


def counter_rise(prev: float, cur: float) -> float:
    """What a counter counted from ``prev`` to ``cur``: a drop is a reset (its process restarted from 0, as
    Prometheus reads it), so it counted ``cur``. The monitor's ``increase()`` and the report's averages."""
    return cur - prev if cur >= prev else cur


def _increase(samples: Sequence[tuple[float, float]]) -> float:
    return sum((counter_rise(prev, cur) for (_, prev), (_, cur) in zip(samples, samples[1:], strict=False)), 0.0)


@dataclass(frozen=True)
class RangeCall(Node):
    func: str  # rate | increase | delta
    arg: Selector
    text: str

    def eval(self, store: MetricStore) -> Value:
        assert self.arg.range_s is not None
        out: Vector = {}
        for lb, (samples, sources) in store.window(self.arg.metric, self.arg.range_s).items():
            if not self.arg.select(lb, store):
                continue
            pts = [(t, v) for t, v in samples if not math.isnan(v)]
            if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
                continue
            if self.func == "delta":
                value = pts[-1][1] - pts[0][1]
            else:
                value = _increase(pts)
                if self.func == "rate":
                    value /= pts[-1][0] - pts[0][0]
            out[lb] = Point(value, sources)
        return out

    def ranges(self) -> Iterable[float]:
        assert self.arg.range_s is not None
        return (self.arg.range_s,)


@dataclass(frozen=True)
class Abs(Node):
    arg: Node
    text: str

    def eval(self, store: MetricStore) -> Value:
        return _map(self.arg.eval(store), abs)

    def ranges(self) -> Iterable[float]:
        return self.arg.ranges()


def _agg_sum(xs: list[float]) -> float:
    return float(sum(xs))  # NaN if any is NaN, like Prometheus


def _agg_max(xs: list[float]) -> float:  # NaN is ignored unless every value is NaN (Prometheus)
    real = [x for x in xs if not math.isnan(x)]
    return max(real) if real else math.nan


def _agg_min(xs: list[float]) -> float:
    real = [x for x in xs if not math.isnan(x)]
    return min(real) if real else math.nan


AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "sum": _agg_sum,
    "max": _agg_max,
    "min": _agg_min,
    "avg": lambda xs: _agg_sum(xs) / len(xs),
    "count": lambda xs: float(len(xs)),
}


@dataclass(frozen=True)
class Aggregate(Node):
    func: str
    arg: Node
    by: tuple[str, ...] | None  # keep these labels (None: keep none) ...
    without: tuple[str, ...] | None  # ... or keep all but these
    text: str

    def eval(self, store: MetricStore) -> Value:
        val = self.arg.eval(store)
        if not isinstance(val, dict):
            return AGGREGATES[self.func]([val])
        groups: dict[Labels, list[Point]] = {}
        for lb, p in val.items():
            if self.by is not None:
                key = tuple((k, v) for k, v in lb if k in self.by)
            elif self.without is not None:
                key = tuple((k, v) for k, v in lb if k not in self.without)
            else:
                key = ()
            groups.setdefault(key, []).append(p)
        return {key: Point(AGGREGATES[self.func]([p.value for p in ps]), frozenset().union(*(p.sources for p in ps)))
                for key, ps in groups.items()}

    def ranges(self) -> Iterable[float]:
        return self.arg.ranges()


def _apply(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:  # IEEE: x/0 is +-Inf, 0/0 and NaN/0 are NaN
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _map(val: Value, f: Callable[[float], float]) -> Value:
    if isinstance(val, dict):
        return {lb: Point(f(p.value), p.sources) for lb, p in val.items()}
    return f(val)


def _as_scalar(v: Vector) -> Point | None:
    """A vector of one series without labels combines like a scalar."""
    if len(v) == 1 and () in v:
        return v[()]
    return None


@dataclass(frozen=True)
class Binary(Node):
    op: str
    left: Node
    right: Node
    text: str

    def eval(self, store: MetricStore) -> Value:
        a, b = self.left.eval(store), self.right.eval(store)
        op = self.op
        if not isinstance(a, dict) and not isinstance(b, dict):
            return _apply(op, a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            sa, sb = _as_scalar(a), _as_scalar(b)
            if sb is not None and sa is None:
                return {lb: Point(_apply(op, p.value, sb.value), p.sources | sb.sources) for lb, p in a.items()}
            if sa is not None and sb is None:
                return {lb: Point(_apply(op, sa.value, p.value), p.sources | sa.sources) for lb, p in b.items()}
            return {lb: Point(_apply(op, p.value, b[lb].value), p.sources | b[lb].sources)
                    for lb, p in a.items() if lb in b}
        if isinstance(a, dict):
            bs = float(b)  # type: ignore[arg-type]
            return {lb: Point(_apply(op, p.value, bs), p.sources) for lb, p in a.items()}
        sa_ = float(a)
        assert isinstance(b, dict)
        return {lb: Point(_apply(op, sa_, p.value), p.sources) for lb, p in b.items()}

    def ranges(self) -> Iterable[float]:
        return (*self.left.ranges(), *self.right.ranges())


@dataclass(frozen=True)
class Negate(Node):
    arg: Node
    text: str

    def eval(self, store: MetricStore) -> Value:
        return _map(self.arg.eval(store), lambda x: -x)

    def ranges(self) -> Iterable[float]:
        return self.arg.ranges()


def metrics_of(node: Node, ranged_only: bool = False) -> set[str]:
    """The metric names an expression reads; with ``ranged_only``, those it reads over a range (``rate(m[60s])``):
    the ones it needs a history of."""
    if isinstance(node, RangeCall):
        return {node.arg.metric}
    if isinstance(node, Selector):
        return set() if ranged_only else {node.metric}
    if isinstance(node, Abs | Negate | Aggregate):
        return metrics_of(node.arg, ranged_only)
    if isinstance(node, Binary):
        return metrics_of(node.left, ranged_only) | metrics_of(node.right, ranged_only)
    return set()


def ranged_metrics(node: Node) -> set[str]:
    """The metric names an expression reads over a range (``rate(m[60s])``): the ones it needs a history of."""
    return metrics_of(node, ranged_only=True)


# -- tokens -----------------------------------------------------------------------------------
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<duration>\d+(?:\.\d+)?(?:ms|s|m|h|d)(?![A-Za-z0-9_]))
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|[-+*/(){}\[\],=])
""", re.VERBOSE)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
RANGE_FUNCS = ("rate", "increase", "delta")
# The longest range: the rates' history keeps every sample of a ranged series that long (a [1000d] loaded, and the
# monitor's memory grew by a sample per series per scrape for ever); a year, as every other duration of the rules
MAX_RANGE_S = 365 * 86_400.0


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str
    text: str
    pos: int


def _tokenize(src: str) -> list[_Tok]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise ExprError(f"unexpected character {src[pos]!r} at column {pos + 1}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            out.append(_Tok(kind, m.group(), pos))
        pos = m.end()
    out.append(_Tok("end", "", len(src)))
    return out


_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
_ANYTHING = None  # a first-character set too large to list (., \\d, [^x], a back reference, ...): overlaps every other


def _first(items: Any, fold: bool) -> tuple[set[int] | None, bool]:
    """The characters a match of ``items`` (parsed regex) may begin with (None: any), and whether it may be empty.
    Over-approximated, never under: lookarounds and anchors consume nothing; unknown constructs may begin with anything
    and be empty."""
    chars: set[int] | None = set()
    for op, av in items:
        if op is sre.LITERAL:
            got: set[int] | None
            got, empty = {av}, False
        elif op is sre.IN:
            got, empty = set(), False
            for kind, x in av:
                if kind is sre.LITERAL:
                    got.add(x)
                elif kind is sre.RANGE and x[1] - x[0] < 4096:
                    got.update(range(x[0], x[1] + 1))
                else:  # NEGATE, CATEGORY (\d, \w ...), a wide range
                    got = _ANYTHING
                    break
        elif op is sre.BRANCH:
            got, empty = set(), False
            for b in av[1]:
                bc, be = _first(b.data, fold)
                got = None if got is None or bc is None else got | bc
                empty = empty or be
        elif op is sre.SUBPATTERN:
            got, empty = _first(av[3].data, fold)
        elif op in _REPEATS or op is getattr(sre, "POSSESSIVE_REPEAT", None):
            got, empty = _first(av[2].data, fold)
            empty = empty or av[0] == 0
        elif op is getattr(sre, "ATOMIC_GROUP", None):
            got, empty = _first(av.data, fold)
        elif op in (sre.AT, sre.ASSERT, sre.ASSERT_NOT):
            got, empty = set(), True
        else:  # ., NOT_LITERAL, a back reference, a conditional group ...
            got, empty = _ANYTHING, True
        if got is None or chars is None:
            chars = None
        else:
            chars |= {ord(f[0]) for c in map(chr, got)
                                           for f in (c, c.lower(), c.upper(), c.casefold())} if fold else got
        if not empty:
            return chars, False
    return chars, True


def _slow_regex(regex: str) -> str:
    """Why ``regex`` (one ``re`` compiles) is refused, or "". Two shapes backtrack in time exponential in the length of
    a value that almost matches, under a repeat that may run more than once (Python's ``re`` has no timeout, the label
    value comes from a scrape, and the loop evaluates every rule every interval; Prometheus' RE2 is linear):

    * a repeat of variable count (``+ * ? {m,n}``) inside it, ``(a+)+b``, ``(x|a*)*``: rewrite ``(a+)+b`` as ``a+b``;
    * an alternation whose branches may begin with the same character, or one of which may match nothing, ``(a|aa)+b``,
      ``(a|a)*c``, ``(.|a)*b``, ``(ab|)+``: the repeat can split one run of characters among the branches in
      exponentially many ways. ``(get|post)+``, ``(ab|cd)*``, ``(a|b)+`` (a character class) begin apart and load.

    Refused when the rules load. Possessive repeats (``a++``, ``(a|aa)++``) do not backtrack and are kept.
    Conservative: an unambiguous nesting such as ``[a-z]+(\\.[a-z]+)*`` is refused too, and so is ``(x|xz)+``
    (branches that share a first character, though xz never splits a run of x); the check looks at first characters
    only, case-folded (lower, upper and casefold: (?i) takes U+03D1 for U+03F4) anywhere ``(?i)`` is set."""
    parsed = sre_parse.parse(regex)
    fold = bool(parsed.state.flags & re.IGNORECASE) or re.search(r"\(\?[a-zA-Z-]*i", regex) is not None  # (?i:x)
    todo = [(parsed.data, False)]  # (items, inside a repeat that may run more than once)
    while todo:
        items, inside = todo.pop()
        for op, av in items:
            if op in _REPEATS:
                lo, hi, sub = av
                if inside and lo != hi:
                    return ("a repeat inside a repeat, such as (a+)+b, takes time exponential in the label value's "
                            "length in Python's re: write it without the nesting (a+b)")
                todo.append((sub.data, inside or hi > 1))
            elif op is sre.BRANCH:
                if inside and _overlapping(av[1], fold):
                    return ("an alternation under a repeat whose branches may begin with the same character or match "
                            "nothing, such as (a|aa)+b or (a|a)*c, takes time exponential in the label value's length "
                            "in Python's re: make the branches begin apart ((a|aa)+b is a+b) or the repeat possessive "
                            "((a|aa)++b)")
                todo.extend((b.data, inside) for b in av[1])
            elif op is sre.SUBPATTERN:
                todo.append((av[3].data, inside))
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                todo.append((av[1].data, inside))
            elif op is sre.GROUPREF_EXISTS:
                todo.extend((b.data, inside) for b in av[1:] if b is not None)
            elif op in _ATOMIC:  # (Python 3.11+ only)
                todo.append(((av if op is sre.ATOMIC_GROUP else av[2]).data, inside))
    return ""


def _overlapping(branches: Any, fold: bool) -> bool:
    """Whether two of ``branches`` may begin with the same character, or one may match nothing."""
    seen: set[int] = set()
    for b in branches:
        chars, empty = _first(b.data, fold)
        if empty or chars is None or seen & chars:
            return True
        seen |= chars
    return False


# Go's escapes in a double-quoted string (strconv.Unquote, which PromQL reads a matcher's value with): a byte (\x,
# octal), a code point (\u, \U) or one of these; any other backslash is an error there, and here
_GO_ESCAPE = re.compile(r'\\(?:([abfnrtv\\"])|x([0-9a-fA-F]{2})|([0-3][0-7]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))')
_GO_SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", '"': '"'}


def _unquote(body: str, pos: int) -> str:
    """The value of the PromQL string whose text between the quotes is ``body`` (at column ``pos`` + 1), as Go's
    strconv.Unquote reads it; :class:`ExprError` for an escape it refuses (``\\.``, ``\\d``: a regex's backslash is
    written doubled, ``"10\\\\.0"``; one was dropped, so ``=~"10\\.0\\.0\\.1"`` matched ``10a0b0c1``) or bytes that
    are not UTF-8 (a label value is UTF-8 text), or a raw line break (PromQL's lexer ends the string there:
    "unterminated quoted string"; Go's Unquote refuses it too)."""
    if "\n" in body:
        raise ExprError(f"unterminated quoted string at column {pos + 1}: a line break inside it (write \\n)")
    out, i = bytearray(), 0
    while (j := body.find("\\", i)) >= 0:
        out += body[i:j].encode("utf-8", "surrogatepass")
        m = _GO_ESCAPE.match(body, j)
        if m is None:
            raise ExprError(f"unknown escape sequence {shown(body[j:j + 2], 60)} in a quoted string at column "
                            f"{pos + 2 + j}: write a backslash as \\\\ (a regex's \\. is \"\\\\.\")")
        simple, hex2, octal, u4, u8 = m.groups()
        if simple is not None:
            out += _GO_SIMPLE[simple].encode()
        elif hex2 is not None or octal is not None:
            out.append(int(hex2, 16) if hex2 is not None else int(octal, 8))
        else:
            code = int(u4 or u8, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ExprError(f"escape sequence {m.group()!r} at column {pos + 2 + j} is not a Unicode character")
            out += chr(code).encode()
        i = m.end()
    out += body[i:].encode("utf-8", "surrogatepass")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise ExprError(f"the quoted string at column {pos + 1} is not UTF-8 text once its \\x or octal escapes are "
                        "read (a label value is UTF-8)") from None


class _Parser:
    """Recursive descent over the tokens; every node it builds is at most :data:`MAX_DEPTH` deep, and
    its own recursion (one ``expr()`` per parenthesis or function argument) stops at that depth too."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.toks = _tokenize(src)
        self.i = 0
        self.nesting = 0  # expr() calls in progress
        self.depths: dict[int, int] = {}  # id(node) -> depth of the subtree it roots (leaves: 1)

    def _deep(self, at: int) -> ExprError:
        return ExprError(f"expression nested more than {MAX_DEPTH} levels deep (operators, functions, "
                         f"parentheses) at column {at + 1}; split it into simpler rules")

    def made(self, node: Node, *children: Node) -> Node:
        """Record ``node``'s depth; :class:`ExprError` beyond :data:`MAX_DEPTH`."""
        depth = 1 + max((self.depths.get(id(c), 1) for c in children), default=0)
        if depth > MAX_DEPTH:
            raise self._deep(self.toks[max(0, self.i - 1)].pos)
        self.depths[id(node)] = depth
        return node

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def _fail(self, expected: str) -> ExprError:
        t = self.tok
        got = "the end" if t.kind == "end" else repr(t.text)
        return ExprError(f"expected {expected} at column {t.pos + 1}, got {got}")

    def take(self, text: str) -> _Tok:
        if self.tok.text != text or self.tok.kind in ("string", "end"):
            raise self._fail(repr(text))
        t = self.tok
        self.i += 1
        return t

    def peek(self, text: str, ahead: int = 0) -> bool:
        t = self.toks[min(self.i + ahead, len(self.toks) - 1)]
        return t.text == text and t.kind not in ("string", "end")

    def span(self, start: int) -> str:
        end = self.toks[self.i - 1]
        return self.src[start:end.pos + len(end.text)].strip()

    def parse(self) -> Node:
        node = self.expr()
        if self.tok.kind != "end":
            raise self._fail("an operator (+ - * /) or the end")
        return node

    def expr(self) -> Node:
        start = self.tok.pos
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise self._deep(start)
        try:
            node = self.term()
            while self.tok.text in ("+", "-") and self.tok.kind == "op":
                op = self.take(self.tok.text).text
                right = self.term()
                node = self.made(Binary(op, node, right, self.span(start)), node, right)
            return node
        finally:
            self.nesting -= 1

    def term(self) -> Node:
        start = self.tok.pos
        node = self.unary()
        while self.tok.text in ("*", "/") and self.tok.kind == "op":
            op = self.take(self.tok.text).text
            right = self.unary()
            node = self.made(Binary(op, node, right, self.span(start)), node, right)
        return node

    def unary(self) -> Node:
        starts = []  # a loop, not recursion: "- - - ... x" must not exhaust the stack
        while self.peek("-"):
            starts.append(self.take("-").pos)
            if len(starts) > MAX_DEPTH:
                raise self._deep(starts[-1])
        node = self.primary()
        for start in reversed(starts):
            node = self.made(Negate(node, self.span(start)), node)
        return node

    def primary(self) -> Node:
        t = self.tok
        if t.kind == "number":
            self.i += 1
            return Number(float(t.text), t.text)
        if t.kind == "duration":
            raise ExprError(f"a duration ({t.text}) belongs in a range selector like metric[{t.text}], "
                            f"at column {t.pos + 1}")
        if self.peek("("):
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        if t.kind != "ident":
            raise self._fail("a number, a metric name, a function or '('")
        name = t.text
        if name in RANGE_FUNCS and self.peek("(", 1):
            self.i += 2
            sel = self.selector(allow_range=True)
            if sel.range_s is None:
                raise ExprError(f"{name}() needs a range selector such as {sel.metric}[60s], "
                                f"at column {self.tok.pos + 1}")
            self.take(")")
            return self.made(RangeCall(name, sel, self.span(t.pos)), sel)
        if name == "abs" and self.peek("(", 1):
            self.i += 2
            arg = self.expr()
            self.take(")")
            return self.made(Abs(arg, self.span(t.pos)), arg)
        if name in AGGREGATES and (self.peek("(", 1) or self.toks[self.i + 1].text in ("by", "without")):
            self.i += 1
            by, without = self.grouping()
            self.take("(")
            arg = self.expr()
            self.take(")")
            if by is None and without is None:
                by, without = self.grouping()
            return self.made(Aggregate(name, arg, by, without, self.span(t.pos)), arg)
        if self.peek("(", 1):
            known = ", ".join([*RANGE_FUNCS, "abs", *AGGREGATES])
            raise ExprError(f"unknown function {name}() at column {t.pos + 1}; known: {known}")
        return self.selector(allow_range=False)

    def grouping(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        if self.tok.kind != "ident" or self.tok.text not in ("by", "without"):
            return None, None
        kw = self.tok.text
        self.i += 1
        self.take("(")
        names = [self.label()]
        while self.peek(","):
            self.take(",")
            names.append(self.label())
        self.take(")")
        return (tuple(names), None) if kw == "by" else (None, tuple(names))

    def label(self) -> str:
        if self.tok.kind != "ident":
            raise self._fail("a label name")
        self.i += 1
        return self.toks[self.i - 1].text

    def selector(self, allow_range: bool) -> Selector:
        t = self.tok
        if t.kind != "ident":
            raise self._fail("a metric name")
        self.i += 1
        matchers: list[Matcher] = []
        if self.peek("{"):
            self.take("{")
            while not self.peek("}"):
                label = self.label()
                if self.tok.text not in ("=", "!=", "=~", "!~") or self.tok.kind != "op":
                    raise self._fail("one of = != =~ !~")
                op = self.tok.text
                self.i += 1
                if self.tok.kind != "string":
                    raise self._fail('a quoted label value such as "user_id"')
                value = _unquote(self.tok.text[1:-1], self.tok.pos)
                if op in ("=~", "!~"):
                    try:
                        re.compile(value)
                        why = _slow_regex(value)
                    except (re.error, OverflowError, RecursionError) as exc:  # a{99999999999}, (((...)))
                        why = f"{exc or type(exc).__name__}"
                    if why:
                        raise ExprError(f"bad regular expression {shown(value, 60)} at column {self.tok.pos + 1}: "
                                        f"{why}")
                self.i += 1
                matchers.append(Matcher(label, op, value))
                if not self.peek("}"):
                    self.take(",")
            self.take("}")
        range_s = None
        if self.peek("["):
            if not allow_range:
                raise ExprError(f"a range selector [...] only goes inside {', '.join(RANGE_FUNCS)}(), "
                                f"at column {self.tok.pos + 1}")
            self.take("[")
            d = self.tok
            if d.kind != "duration":
                raise self._fail("a duration such as 60s or 5m")
            self.i += 1
            unit = re.search(r"[a-z]+$", d.text)
            assert unit is not None
            range_s = float(d.text[:unit.start()]) * _UNITS[unit.group()]
            if range_s <= 0:
                raise ExprError(f"range [{d.text}] must be positive, at column {d.pos + 1}")
            if not math.isfinite(range_s) or range_s > MAX_RANGE_S:  # the history keeps each series' samples so long
                raise ExprError(f"range [{quoted(d.text, 60)}] is too long, at column {d.pos + 1}: at most a year "
                                "([365d]), e.g. [1d]")
            self.take("]")
        return Selector(t.text, tuple(matchers), self.span(t.pos), range_s)


def parse(src: str) -> Node:
    """Parse an expression; :class:`ExprError` says where it went wrong."""
    if not src.strip():
        raise ExprError("empty expression")
    return _Parser(src).parse()


def longest_range(nodes: Iterable[Node]) -> float:
    return max((r for n in nodes for r in n.ranges()), default=0.0)
