"""What every subcommand shares: exit codes, the common flags, settings sources and summary output."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

from stream.config import KafkaSettings
from stream.files import finite_json
from stream.secrets import install_log_redaction, redact_obj
from streamrec.settings import SECTIONS, Sources, read_config_file

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BUSY = 3  # did nothing because another run holds what it needs (streamrec refresh --now)
MAX_SECONDS = 86_400.0  # the longest interval or timeout a duration flag may name (a day)


def count(text: str) -> int:
    """argparse ``type`` of a count flag such as ``--limit``: an integer >= 0 (a negative one would slice off the
    end: ``rows[:-5]`` is all but the last 5)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def tcp_port(text: str) -> int:
    """argparse ``type`` of a port flag: an integer 0-65535 (exit 2, one line, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return value


def start_metrics(port: int, host: str, setting: str, registry: Any = None) -> None:
    """Serve Prometheus /metrics (of ``registry``, default the process's) on ``host:port``; a failed bind (in use,
    a host that does not resolve, a port out of range) is one error line naming ``setting`` and the address
    (stream.errors.bind_error), not a traceback."""
    from prometheus_client import start_http_server

    from stream.errors import bind_error

    try:
        start_http_server(port, addr=host, **({} if registry is None else {"registry": registry}))
    except (OSError, OverflowError) as exc:
        raise bind_error(exc, setting, host, port) from None


def seconds(text: str) -> float:
    """argparse ``type`` of a duration flag: a finite number of seconds > 0 and at most a day (NaN, inf, 0 and
    negatives would pin a core or overflow a wait); anything else is a usage error (exit 2, one line)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0 and <= {MAX_SECONDS:g}, "
                                         f"got {text!r}")
    return value


def emit(args: argparse.Namespace, summary: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    """Print a command's summary, human-readable or as one JSON object; credentials scrubbed either way. Flushed: to a
    pipe or a file it sat in the buffer until the interpreter's exit, and a stop after the command put the process's
    own dispositions back (StopsTaken's end) killed the process with it, a summary printed but never written."""
    summary = redact_obj(summary)  # --json: strict JSON (finite_json: NaN and inf as null; the human text keeps "nan")
    print(json.dumps(finite_json(summary), default=str, sort_keys=True, allow_nan=False) if args.json
          else human(summary), flush=True)


def setup_logging(level: str) -> None:
    """Log lines to stderr (stdout stays for the summary), every one scrubbed of credentials."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()


def kv_lines(d: dict[str, Any], indent: str = "  ") -> str:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            lines += [f"{indent}{k}:", kv_lines(v, indent + "  ")]
        else:
            lines.append(f"{indent}{k}: {v if v != {} else 'none'}")
    return "\n".join(lines)


def default_help(cls: Any, section: str, key: str, builtin: str | None = None) -> str:
    """The ``default: ...`` of a flag's help where the flag overrides ``[section] key``: the effective default is that
    setting (--config, STREAMREC_<SECTION>_<KEY>), else the settings of other sections it inherits (``cls.INHERITS``),
    else the built-in value (the field's default, or ``builtin``)."""
    if builtin is None:
        value = next(f.default for f in dataclasses.fields(cls) if f.name == key)
        value = value.value if isinstance(value, enum.Enum) else value
        builtin = f"{value:g}" if isinstance(value, float) else str(value)
    owners = "".join(f"[{s}] {k}, else " for s, k in getattr(cls, "INHERITS", {}).get(key, ()))  # another command's
    return f"default: [{section}] {key}, else {owners}{builtin}"


def sources(args: argparse.Namespace) -> Sources:
    return Sources(file_data=read_config_file(args.config))


def kafka_settings(args: argparse.Namespace, src: Sources) -> KafkaSettings:
    return src.build(KafkaSettings, "kafka", bootstrap_servers=getattr(args, "bootstrap_servers", None))


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML settings file (tables: "
                   f"{', '.join(f'[{s}]' for s in SECTIONS)}); STREAMREC_<SECTION>_<KEY> environment variables "
                   "override it; a flag's \"default: [section] key, else X\" is the value set there, else X")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def add_kafka_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-servers", help="Kafka bootstrap servers "
                   f"({default_help(KafkaSettings, 'kafka', 'bootstrap_servers')}: the local stack)")

