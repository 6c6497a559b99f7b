"""The Prometheus text exposition format (version 0.0.4), as the monitor reads a scraped answer.

https://prometheus.io/docs/instrumenting/exposition_formats/ : one sample per line,
``metric_name [ "{" label_name "=" '"' label_value '"' { "," ... } [ "," ] "}" ] value [ timestamp ]``, blanks and
tabs between the tokens; ``#`` lines are comments, of which ``# HELP name text`` and ``# TYPE name type`` must
name a metric (and a type: counter, gauge, histogram, summary, untyped). A label value unescapes ``\\\\``,
``\\"`` and ``\\n`` and keeps any other backslash pair as written (``\\q`` is those two characters, as the
Prometheus server reads it: promparse.go's lvalReplacer; expfmt's TextParser refuses it); the value is a float as
the Prometheus server reads it (``NaN``, ``+Inf``, ``-Inf`` included; no ``_``, no hex: see :func:`_value`); the
timestamp is whole milliseconds since the epoch.

:func:`parse` refuses everything else with an :class:`ExpositionError` naming the line, as Prometheus does,
rather than read a value out of a line that does not say one (``m 1 2 3`` was read as 1). A sample or blank line
ending ``\\r\\n`` is refused too, saying so: Prometheus' lexer reads ``1\\r`` as the value and fails, its
maintainers declined ``\\r`` (prometheus/common#132) and OpenMetrics forbids it, so an answer the monitor read
would be one the Prometheus beside it drops. A comment runs to the ``\\n`` in that lexer, so a ``\\r`` ending a
comment or a HELP line is read (as text), and one ending a TYPE line is refused (Prometheus: invalid metric type
``"gauge\\r"``). Quoted (UTF-8) metric and label names, which Prometheus 3 reads (``{"my.metric", le="1"} 3``,
``# HELP "my.metric" text``, ``m{"my.label"="x"} 1``), are refused saying so: the monitor watches streamrec's own
metrics, whose names are plain, and its rules can name no other.
A raw newline inside a quoted label value is refused, saying so: promlex.l reads it as part of the value (its
label value is ``"(\\\\.|[^\\\\"])*"``), expfmt refuses it, and the monitor splits the answer into lines first (the
README says why).
Bytes that are not UTF-8 reach the parser as lone surrogates (:func:`monitor.http_deadline.get_text`) and are refused
where the server refuses them, naming the line: in a label value (promparse.go: invalid UTF-8 label value) and in
HELP text (not a valid utf8 string; that text starts one *byte* after the name, as the server slices it, so
``# HELP mé x`` is refused and ``# HELP m\\xffx`` read); a comment may hold them, as there.
Where expfmt's TextParser and the server differ the monitor reads as the server does: a HELP text's escapes are
not checked (``\\x`` is text), and a second HELP or TYPE of a family, or a TYPE after its samples, is read (the
server's scrape cache keeps the last; expfmt refuses them).

One compiled regular expression per line (and one per label set): the monitor parses every source every
interval, and on a learner-sized answer (1,000 lines) this is 3 to 4 times as fast as ``prometheus_client``'s
parser, which it replaces (and which read a series given twice as its first value).
"""

from __future__ import annotations

import re

from stream.errors import StreamrecError, quoted, shown

Labels = tuple[tuple[str, str], ...]  # sorted by name (``monitor.expr.labels_of``)
Sample = tuple[str, Labels, float, int | None]  # name, labels, value, timestamp (ms) or None

# a quoted label value, or a UTF-8 name as Prometheus 3 writes one; no NUL byte (promlex.l.go ends the token there)
_QSTRING = r'"(?:[^"\\\n\x00]|\\[^\n\x00])*"'
_LABEL = rf'[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*{_QSTRING}'
# No two blank runs meet without a token between them: one run of blanks split two ways was tried every way before a
# garbled line failed, quadratic in its length (a 16 MiB line stalled the loop for days).
_SAMPLE = re.compile(
    r"[ \t]*(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:[ \t]*\{{[ \t]*(?P<labels>{_LABEL}(?:[ \t]*,[ \t]*{_LABEL})*[ \t]*(?:,[ \t]*)?)?\}}[ \t]*|[ \t]+)"
    r"(?P<value>[^\s{}]+)(?:[ \t]+(?P<ts>-?[0-9]+))?[ \t]*")
# a quoted string where a line names its metric or a label: {"my.metric"} 1, m{a="b","my.label"="c"} 1
_QUOTED = re.compile(rf'[ \t]*(?:[a-zA-Z_:][a-zA-Z0-9_:]*[ \t]*)?\{{(?:[ \t]*{_LABEL}[ \t]*,)*[ \t]*(?P<q>{_QSTRING})')
# a sample line that ends inside a quoted label value: the value went on past a raw newline
_OPEN_VALUE = re.compile(rf'[ \t]*[a-zA-Z_:][a-zA-Z0-9_:]*[ \t]*\{{(?:[ \t]*{_LABEL}[ \t]*,)*[ \t]*'
                         r'(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"(?:[^"\\\n\x00]|\\[^\n\x00])*')
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}  # any other pair is kept as written (\q is \q)
_META = re.compile(r"#[ \t]+(HELP|TYPE)[ \t]+(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)?(?P<rest>.*)")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as surrogateescape keeps it
_TYPES = frozenset(("counter", "gauge", "histogram", "summary", "untyped"))


class ExpositionError(StreamrecError, ValueError):
    """A scraped answer that is not the text exposition format; the message names the line."""


def _unescaped(e: re.Match[str]) -> str:
    return _UNESCAPED.get(e.group(1), e.group(0))


def _value(token: str) -> float:
    """``token`` as the Prometheus server reads a sample value: its text parser (promparse.go's ``parseFloat``,
    "keep to pre-Go 1.13 float formats") refuses any value with a ``p``, ``P`` or ``_`` and hands the rest to Go's
    ParseFloat. So no hex float is read: Go's ParseFloat alone reads ``0x1p3`` as 8, but a
    hex float needs its ``p`` exponent in Go (``0x10`` is a syntax error), and the ``p`` is refused first; Python's
    float() refuses hex too. Python's float() also takes ``1_000``, any Unicode decimal digit (``١`` is 1.0) and a
    signed NaN (``+NaN``), which Prometheus (and, for the last two, Go) refuses."""
    if "_" in token or not token.isascii() or (token[0] in "+-" and token[1:].lower() == "nan"):
        raise ValueError(token)
    return float(token)


def parse(text: str, declared: set[str] | None = None) -> list[Sample]:
    """Every sample of ``text``, in order; :class:`ExpositionError` at the first line that is not the format, or
    that repeats a series (name and labels, in any order) of an earlier line: "each line must have a unique
    combination of a metric name and labels" (Prometheus refuses the scrape: "duplicate sample for timestamp").
    ``declared``, when given, gets the metric names of the ``# HELP`` / ``# TYPE`` lines: a family exported before
    its first sample (a labelled counter that has not counted yet) is declared, though it has none."""
    out: list[Sample] = []
    seen: dict[tuple[str, Labels], int] = {}  # series -> its line
    append, sample, pairs = out.append, _SAMPLE.fullmatch, _PAIR.findall
    invalid = _NOT_UTF8.search(text) is not None  # any byte get_text could not decode: look for it per label
    for number, line in enumerate(text.split("\n"), 1):
        m = sample(line)
        if m is None:
            stripped = line.lstrip(" \t")
            if stripped[:1] == "#":  # a comment runs to the \n: a \r before it is text (Prometheus' lexer: [^\n]*)
                name = _comment(stripped, number, line)
                if name is not None and declared is not None:
                    declared.add(name)
                continue
            if line.endswith("\r"):
                raise _crlf(number)
            if not stripped:
                continue  # a blank line
            quoted = _QUOTED.match(line)
            if quoted is not None:
                after = line[quoted.end():].lstrip(" \t")[:1]  # a quoted label name has its = after it
                raise _quoted(number, "label" if after == "=" else "metric", quoted.group("q"), line)
            if (unclosed := _OPEN_VALUE.fullmatch(line)) is not None:
                raise ExpositionError(f"line {number}: a raw newline inside the quoted value of label "
                                      f"{unclosed.group('label')}: the Prometheus server reads it as part of the "
                                      "value, the monitor reads an answer line by line and refuses it (README: "
                                      "Scraping and time); have the source escape it as \\n: " + shown(line))
            raise ExpositionError(f"line {number}: not a sample (metric_name [{{labels}}] value [timestamp]): "
                                  f"{shown(line)}")
        name, block, token, ts = m.group("name", "labels", "value", "ts")
        labels: dict[str, str] = {}
        if block:
            found = pairs(block)
            for k, v in found:
                if invalid and _NOT_UTF8.search(v):
                    raise _not_utf8(number, f"the value of label {shown(k)}", line)
                labels[k] = _ESCAPE.sub(_unescaped, v) if "\\" in v else v
            if len(labels) < len(found):
                raise ExpositionError(f"line {number}: a label name given twice: {shown(line)}")
        key = tuple(sorted(labels.items())) if labels else ()
        if (name, key) in seen:
            lbl = ",".join(f'{k}="{v}"' for k, v in key)  # the values unescaped: shown escapes and cuts them
            raise ExpositionError(f"line {number}: series {shown(f'{name}{{{lbl}}}')} given twice (first at line "
                                  f"{seen[name, key]}): which value is current is undefined")
        seen[name, key] = number
        try:
            value = _value(token)
        except ValueError:
            raise ExpositionError(f"line {number}: {shown(token)} is not a number (a float, NaN, +Inf or -Inf): "
                                  f"{shown(line)}") from None
        append((name, key, value, None if ts is None else _timestamp(ts, number, line)))
    return out


_INT64_DIGITS = 19  # 2**63 - 1 has 19 digits: a longer one is refused unread (int() raises past 4,300 digits)


def _timestamp(token: str, number: int, line: str) -> int:
    """``token`` (``-?[0-9]+``) as the Prometheus server reads a timestamp, ParseInt(token, 10, 64); an
    :class:`ExpositionError` naming the line where that refuses it (the scrape fails there too)."""
    digits = token.lstrip("-").lstrip("0")  # (leading zeros read, as ParseInt does: int() counts them to its limit)
    if len(digits) <= _INT64_DIGITS and -2**63 <= (ts := int(token[:token.startswith("-")] + (digits or "0"))) < 2**63:
        return ts
    raise ExpositionError(f"line {number}: timestamp {shown(token)} is not a 64-bit integer (milliseconds since the "
                          f"epoch): {shown(line)}")


def _crlf(number: int) -> ExpositionError:
    return ExpositionError(f"line {number} ends with \\r\\n (a Windows line end, from the exporter or a proxy): the "
                           "text format ends lines with \\n only, and Prometheus refuses this answer too; have the "
                           "source write \\n line ends")


def _not_utf8(number: int, what: str, line: str) -> ExpositionError:
    shown = line.encode("utf-8", "surrogateescape")
    return ExpositionError(f"line {number}: {what} is not valid UTF-8, and Prometheus refuses this answer too; have "
                           f"the source export UTF-8 text: {shown if len(shown) <= 80 else shown[:77] + b'...'!r}")


def _quoted(number: int, what: str, name: str, line: str) -> ExpositionError:
    return ExpositionError(f"line {number}: a quoted {what} name {quoted(name, 80)}: the monitor does not read "
                           "quoted (UTF-8) names, which Prometheus 3 reads; it watches streamrec's own metrics, whose "
                           "names are plain (unquoted, as text format 0.0.4 has them); have the source export plain "
                           "names: " + shown(line))


def _comment(stripped: str, number: int, line: str) -> str | None:
    """A ``#`` line: HELP and TYPE must name a metric (TYPE also a type), which is returned; any other comment is
    ignored (None). As Prometheus' scrape parser reads them (model/textparse/promlex.l): the keyword is ``HELP`` or
    ``TYPE`` and a blank (``# HELP`` alone is a comment); the text is what follows the one character after the
    name, up to the \\n (a \\r included), "" where only blanks follow; a TYPE's text must be a type exactly
    (``gauge`` with a blank or \\r after it is not)."""
    m = _META.match(stripped)
    if m is None:
        return None
    kind, name, rest = m.group(1, "name", "rest")
    if name is None and (quoted := re.match(_QSTRING, rest)) is not None:
        raise _quoted(number, "metric", quoted.group(), line)
    if name is None:
        raise ExpositionError(f"line {number}: # {kind} without a metric name: {shown(line)}")
    if kind == "HELP" and not rest.isascii():
        try:  # the server's text: the bytes after the one byte after the name
            rest.encode("utf-8", "surrogateescape")[1:].decode("utf-8")
        except UnicodeDecodeError:
            raise _not_utf8(number, f"the HELP text of {shown(name)}", line) from None
    if kind == "TYPE" and (rest[1:] if rest.strip(" \t") else "") not in _TYPES:
        if line.endswith("\r"):  # Prometheus: invalid metric type "gauge\r"
            raise _crlf(number)
        raise ExpositionError(f"line {number}: # TYPE of {shown(name)} is not one of {', '.join(sorted(_TYPES))}: "
                              f"{shown(line)}")
    return name


# the sample names of a family: a counter's <name>_total and _created, a histogram's _bucket, _sum and _count ...
_FAMILY_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count", "_info")


def families_of(sample_name: str) -> set[str]:
    """The family names whose ``# TYPE`` line may declare ``sample_name``: itself, and itself less a suffix of the
    family's samples (prometheus_client declares a counter as ``<name>_total``, a histogram as ``<name>``)."""
    return {sample_name} | {sample_name[:-len(x)] for x in _FAMILY_SUFFIXES if sample_name.endswith(x)}
