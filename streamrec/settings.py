"""Typed settings, built once at the process edge.

Every component gets one frozen dataclass. Values come from, in increasing precedence:

1. the defaults of each stage's own config type (``stream/config.py``, ``stream/joiner/config.py``,
   ``stream/replay/config.py``, ``learner/config.py``, ``cache_refresh/settings.py``,
   ``serving/settings.py``, ``streamrec/stack.py``: the embedded defaults, a local stack on loopback);
2. a TOML file given with ``--config FILE``, one table per section (``[kafka]``, ``[redis]``, ...);
3. environment variables ``STREAMREC_<SECTION>_<FIELD>`` (``STREAMREC_KAFKA_BOOTSTRAP_SERVERS``);
4. command-line flags.

Nothing below the CLI reads ``os.environ``; components receive the dataclass they need. Only commands
import this module."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from learner.config import LearnerSettings
from stream import setting_values
from stream.config import KafkaSettings, RedisSettings
from stream.errors import quoted, shown
from stream.joiner.config import JoinerSettings
from stream.replay.config import ClickDelay, DelayKind, ReplaySettings, SyntheticSettings
from stream.setting_values import SettingsError, check_environment_sections, coerce_field, read_toml, resolve_secrets
from streamrec.stack import StackSettings

# The stages' own config types, re-exported for the commands that build them.
__all__ = ["ClickDelay", "DelayKind", "JoinerSettings", "KafkaSettings", "LearnerSettings", "RedisSettings",
           "ReplaySettings", "SettingsError", "Sources", "StackSettings", "SyntheticSettings", "build",
           "read_config_file"]

ENV_PREFIX = "STREAMREC_"
# Every table a --config file may hold: the sections some command builds settings from (Sources.build). A table
# not listed here is a typo ([kafak]) that would otherwise be ignored silently.
SECTIONS = ("kafka", "redis", "stack", "replay", "synthetic", "joiner", "learner", "serve", "refresh", "limits",
            "evaluate")

T = TypeVar("T")


def read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not str(path).strip():  # Path("") is ".": the error named the working directory, not the empty value
        raise SettingsError("--config was given an empty path (an unset variable?): name a TOML file, or leave "
                            "--config out")
    p = Path(path)
    data = read_toml(p, "config file", "given with --config")
    setting_values.check_file_sections(data, SECTIONS, f"config file {p}")
    return data


def _section_keys() -> dict[str, set[str]]:
    """Each section's keys (imported here only when a STREAMREC_ variable names no section: they cost 0.3 s)."""
    from cache_refresh.settings import RefreshSettings
    from learner.evaluation.config import EvalOverrides
    from serving.settings import ServeSettings
    from stream.limits import EventLimits

    classes = (KafkaSettings, RedisSettings, StackSettings, ReplaySettings, SyntheticSettings, JoinerSettings,
               LearnerSettings, ServeSettings, RefreshSettings, EventLimits, EvalOverrides)
    return {s: {f.name for f in dataclasses.fields(c)} for s, c in zip(SECTIONS, classes, strict=True)}


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
    never silently falls back to a default."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    environ = environ if environ is not None else os.environ  # origin: key -> where its value came from (construct)
    values, origin = setting_values.inherited(cls, file_data or {}, environ, ENV_PREFIX, hints)  # cls.INHERITS

    table = (file_data or {}).get(section, {})
    if not isinstance(table, Mapping):
        raise SettingsError(f"config file: [{section}] must be a table, got {shown(table)}")
    for key, raw in table.items():
        if key not in names:
            hint = setting_values.unknown_key_hint(
                key, section, names, _section_keys, lambda s, k: repr(k) if s == section else f"[{s}] {k}")
            raise SettingsError(f"config file: unknown key {shown(key)} in [{section}]{hint}; known keys: "
                                f"{', '.join(sorted(names))}")
        where = f"config file [{section}].{key}"
        values[key], origin[key] = coerce_field(key, hints[key], raw, where), where

    prefix, layer = f"{ENV_PREFIX}{section.upper()}_", {}
    for env_key, raw in environ.items():
        if not env_key.startswith(prefix):
            continue
        key = env_key[len(prefix) :].lower()
        if key not in names:
            hint = setting_values.unknown_key_hint(key, section, names, _section_keys,
                                                   lambda s, k: f"{ENV_PREFIX}{s.upper()}_{k.upper()}")
            raise SettingsError(f"environment: {quoted(env_key, 80)} does not name a [{section}] setting{hint}; "
                                f"known: {', '.join(prefix + n.upper() for n in sorted(names))}")
        where = f"environment {env_key}"
        layer[key], origin[key] = coerce_field(key, hints[key], raw, where), where
    values, layer = setting_values.overlay_layer(values, layer, hints, origin), {}  # its secret replaces the file's

    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in names:
            raise SettingsError(f"internal: {key!r} is not a [{section}] setting")
        flag = (flag_names or {}).get(key) or f"--{key.replace('_', '-')}"
        layer[key], origin[key] = coerce_field(key, hints[key], raw, flag), flag
    values = setting_values.overlay_layer(values, layer, hints, origin)
    resolve_secrets(cls, section, hints, values, environ)
    # the class's own checks (one error type, naming sources); then a TLS private key others can read is warned of
    return setting_values.warn_loose_key_files(setting_values.construct(cls, values, origin), section)


@dataclass(frozen=True)
class Sources:
    """Where settings come from in this process: the parsed ``--config`` file and the environment."""

    file_data: dict[str, Any] = field(default_factory=dict)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def __post_init__(self) -> None:  # STREAMREC_KAFAK_* would never be read: an error, as [kafak] in the file is
        check_environment_sections(self.environ, ENV_PREFIX, SECTIONS, _section_keys)

    def build(self, cls: type[T], section: str, *, flag_names: Mapping[str, str] | None = None,
              **overrides: Any) -> T:
        """``flag_names``: the flag of an override whose flag is not ``--<key with dashes>``, for error lines."""
        return build(cls, section, self.file_data, self.environ, overrides, flag_names)
