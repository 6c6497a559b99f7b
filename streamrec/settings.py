"""Typed settings, built once at the process edge.

Every component gets one frozen dataclass. Values come from, in increasing precedence:

1. the defaults of each stage's own config type (``stream/config.py``, ``stream/joiner/config.py``,
   ``stream/replay/config.py``, ``learner/config.py``, ``cache_refresh/settings.py``,
   ``serving/settings.py``, ``streamrec/stack.py``: the embedded defaults, a local stack on loopback);
2. a TOML file given with ``--config FILE``, one table per section (``[kafka]``, ``[redis]``, ...);
3. environment variables ``STREAMREC_<SECTION>_<FIELD>`` (``STREAMREC_KAFKA_BOOTSTRAP_SERVERS``);
4. command-line flags.

Nothing below the CLI reads ``os.environ``; components receive the dataclass they need. Only commands
import this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from learner.config import LearnerSettings
from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError, shown
from stream.joiner.config import JoinerSettings
from stream.replay.config import ClickDelay, DelayKind, ReplaySettings, SyntheticSettings
from stream.secrets import Secret
from streamrec.stack import StackSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The stages' own config types, re-exported for the commands that build them.
__all__ = ["ClickDelay", "DelayKind", "JoinerSettings", "KafkaSettings", "LearnerSettings", "RedisSettings",
           "ReplaySettings", "SettingsError", "Sources", "StackSettings", "SyntheticSettings", "build",
           "read_config_file"]

ENV_PREFIX = "STREAMREC_"
# Every table a --config file may hold: the sections some command builds settings from (Sources.build). A table
# not listed here is a typo ([kafak]) that would otherwise be ignored silently.
SECTIONS = ("kafka", "redis", "stack", "replay", "synthetic", "joiner", "learner", "serve", "refresh", "limits",
            "evaluate")


class SettingsError(ConfigError):
    """A setting has a value that cannot be used; the message names the source, key and fix."""


T = TypeVar("T")


def read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"config file {p} does not exist (given with --config)") from None
    except OSError as exc:  # a directory, no permission
        raise SettingsError(f"config file {p} cannot be read: {exc.strerror or exc} (given with --config)") from None
    # TOMLDecodeError, and the ValueErrors tomllib lets through: not UTF-8, an integer of over 4300 digits
    except ValueError as exc:
        raise SettingsError(f"config file {p} is not valid TOML: {exc}") from None
    except RecursionError:
        raise SettingsError(f"config file {p} is not valid TOML: arrays or tables nested too deeply") from None
    unknown = [key for key in data if key not in SECTIONS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], SECTIONS, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        raise SettingsError(f"config file {p}: unknown section [{unknown[0]}]{hint} (known sections: "
                            f"{', '.join(f'[{s}]' for s in SECTIONS)})")
    return data


def build(
    cls: type[T],
    section: str,
    file_data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> T:
    """Build settings ``cls`` for ``section`` from defaults < file < environment < overrides.

    ``overrides`` entries whose value is ``None`` are ignored (an unset CLI flag). An error in one names its
    flag: ``flag_names[key]`` where the flag is not ``--<key with dashes>`` (``--window-s`` for
    ``attribution_window_s``).
    Unknown keys in the file's section or in ``STREAMREC_<SECTION>_*`` are errors, so a typo
    never silently falls back to a default.
    """
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}

    table = (file_data or {}).get(section, {})
    if not isinstance(table, Mapping):
        raise SettingsError(f"config file: [{section}] must be a table, got {shown(table)}")
    for key, raw in table.items():
        if key not in names:
            raise SettingsError(
                f"config file: unknown key {key!r} in [{section}]; known keys: {', '.join(sorted(names))}"
            )
        values[key] = _coerce_field(key, hints[key], raw, f"config file [{section}].{key}")

    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for env_key, raw in (environ if environ is not None else os.environ).items():
        if not env_key.startswith(prefix):
            continue
        key = env_key[len(prefix) :].lower()
        if key not in names:
            raise SettingsError(
                f"environment: {env_key} does not name a [{section}] setting; "
                f"known: {', '.join(prefix + n.upper() for n in sorted(names))}"
            )
        values[key] = _coerce_field(key, hints[key], raw, f"environment {env_key}")

    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in names:
            raise SettingsError(f"internal: {key!r} is not a [{section}] setting")
        flag = (flag_names or {}).get(key) or f"--{key.replace('_', '-')}"
        values[key] = _coerce_field(key, hints[key], raw, flag)
    _resolve_secrets(cls, section, hints, values, environ if environ is not None else os.environ)
    try:
        return cls(**values)
    except SettingsError:
        raise
    except ConfigError as exc:  # the dataclass's own checks (a choice, a combination): one error type from here
        raise SettingsError(str(exc)) from None


def _resolve_secrets(cls: type, section: str, hints: dict[str, Any], values: dict[str, Any],
                     environ: Mapping[str, str]) -> None:
    """Fill each :class:`~stream.secrets.Secret` field ``x`` from ``x_file`` (a mounted secret) or ``x_env``
    (the name of an environment variable), when the dataclass has those fields and one is set."""
    for name, tp in hints.items():
        if tp is not Secret:
            continue
        path, var = values.get(f"{name}_file"), values.get(f"{name}_env")
        if path and var:
            raise SettingsError(f"[{section}] {name}_file and {name}_env are both set: give the secret one way")
        if path:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise SettingsError(f"[{section}] {name}_file: cannot read {path}: "
                                    f"{getattr(exc, 'strerror', None) or exc}") from None
            values[name] = Secret(text.rstrip("\r\n"))
        elif var:
            if var not in environ:
                raise SettingsError(f"[{section}] {name}_env names {var}, which is not set in the environment")
            values[name] = Secret(environ[var])


def _coerce_field(key: str, tp: Any, raw: Any, where: str) -> Any:
    """:func:`_coerce` plus the checks that need the setting's name: an empty host (``host``, ``*_host``) is an
    error, not "every interface" (bind("") listens on 0.0.0.0) or a lookup failure at bind time."""
    value = _coerce(tp, raw, where)
    if (key == "host" or key.endswith("_host")) and isinstance(value, str) and not value.strip():
        raise SettingsError(f"{where}: cannot use {shown(raw)}: an empty host is not an address; give one "
                            f"(127.0.0.1: this machine only; 0.0.0.0: every interface) or leave it out for the default")
    return value


def _coerce(tp: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        # "" is unset for an optional setting, except a path: an empty key file or CA (an unsubstituted template
        # variable) must not turn signature checks or TLS verification off. Leave it out (or "none") for none.
        empty_path = inner[0] is Path and isinstance(raw, str) and not raw.strip()
        if not empty_path and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))):
            if type(None) in args:
                return None
        return _coerce(inner[0], raw, where)
    if origin in (dict, Mapping) or tp in (dict, Mapping):  # a table: [kafka.extra] in TOML, or "k=v,k2=v2"
        if isinstance(raw, str):
            pairs = [x.split("=", 1) for x in raw.split(",") if x.strip()]
            if any(len(kv) != 2 or not kv[0].strip() for kv in pairs):
                raise SettingsError(f"{where}: cannot use {shown(raw)}: expected key=value pairs separated by commas")
            raw = {k.strip(): v.strip() for k, v in pairs}
        if not isinstance(raw, Mapping):
            raise SettingsError(f"{where}: cannot use {shown(raw)}: expected a table of key = value")
        key_t, value_t = args if len(args) == 2 else (str, str)
        return {_coerce(key_t, k, f"{where}.{k}"): _coerce(value_t, v, f"{where}.{k}") for k, v in raw.items()}
    if origin is tuple and args[-1:] == (Ellipsis,):  # tuple[int, ...]: a TOML array, or "a,b,c"
        if isinstance(raw, str):
            raw = [x for x in raw.replace(" ", "").split(",") if x]
        if not isinstance(raw, (list, tuple)):
            raise SettingsError(f"{where}: cannot use {shown(raw)}: expected a list like 400,400,400")
        return tuple(_coerce(args[0], x, where) for x in raw)
    if isinstance(raw, Mapping | list):  # a table or an array where one value belongs
        raise SettingsError(f"{where}: cannot use {shown(raw)}: expected one value, "
                            f"got {'a table' if isinstance(raw, Mapping) else 'an array'}")
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected one of true/false/1/0/yes/no/on/off")
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(str(raw).replace("_", "")) if isinstance(raw, str) else int(raw)
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError("expected a number")
            value = float(raw)
            if not math.isfinite(value):  # nan compares false with every bound check; inf is no duration
                raise ValueError("expected a finite number")
            return value
        if tp is Secret:
            return Secret(str(raw))
        if tp is str:
            return ("true" if raw else "false") if isinstance(raw, bool) else str(raw)  # TOML true: librdkafka's "true"
        if tp is Path:
            if not str(raw).strip():  # Path("") is ".": checkpoints or artifacts would land in the working directory
                raise ValueError("an empty path is not a path: give one, or leave the setting out for its default")
            return Path(str(raw))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(raw)
            except ValueError:
                raise ValueError(f"expected one of {', '.join(m.value for m in tp)}") from None
    # TypeError: a date for a number; OverflowError: an integer too large for a float
    except (ValueError, TypeError, OverflowError) as exc:
        raise SettingsError(f"{where}: cannot use {shown(raw)}: {exc}") from None
    raise SettingsError(f"{where}: unsupported setting type {tp!r}")


@dataclass(frozen=True)
class Sources:
    """Where settings come from in this process: the parsed ``--config`` file and the environment."""

    file_data: dict[str, Any] = field(default_factory=dict)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def build(self, cls: type[T], section: str, *, flag_names: Mapping[str, str] | None = None,
              **overrides: Any) -> T:
        """``flag_names``: the flag of an override whose flag is not ``--<key with dashes>``, for error lines."""
        return build(cls, section, self.file_data, self.environ, overrides, flag_names)
