"""Raw setting values (a TOML value, an environment variable's text, a flag) -> the typed value a settings dataclass's
field takes: the conversions and their checks, one definition for every source (``streamrec/settings.py`` reads the
sources and builds the dataclasses; this module only converts). Errors name where the value came from."""

from __future__ import annotations

import difflib
import enum
import logging
import math
import re
import stat
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stream.errors import ConfigError, quoted, shown
from stream.files import MAX_SETTINGS_FILE_BYTES, open_regular, read_regular, read_regular_stat
from stream.secrets import TIGHTEN_MODE, Secret, loose_mode, names_credential, secret_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)
T = TypeVar("T")


class SettingsError(ConfigError):
    """A setting has a value that cannot be used; the message names the source, key and fix."""


def read_toml(path: Path, what: str, given: str) -> dict[str, Any]:
    """The TOML document of ``path`` (``what``: "config file"; ``given``: how it was named, "given with --config"),
    or a :class:`SettingsError` that says what is wrong with it. Read with :func:`~stream.files.read_regular`: a FIFO
    (``<(...)`` in a shell) or a device would hang the process or read without end, refused unread. A leading byte
    order mark (Notepad saves one) is dropped: tomllib refused it as "Invalid statement" at line 1."""
    try:
        return tomllib.loads(read_regular(path, MAX_SETTINGS_FILE_BYTES).decode("utf-8-sig"))
    except FileNotFoundError:
        raise SettingsError(f"{what} {path} does not exist ({given})") from None
    except OSError as exc:  # a directory, a FIFO, a device, no permission, too large
        raise SettingsError(f"{what} {path} cannot be read: {exc.strerror or exc} ({given})") from None
    # TOMLDecodeError, and the ValueErrors tomllib lets through: not UTF-8, an integer of over 4300 digits
    except ValueError as exc:
        raise SettingsError(f"{what} {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise SettingsError(f"{what} {path} is not valid TOML: arrays or tables nested too deeply") from None


def _secret_ways(hints: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The three ways each :class:`~stream.secrets.Secret` field ``x`` may be given: ``x``, ``x_file``, ``x_env``."""
    return [(name, f"{name}_file", f"{name}_env") for name, tp in hints.items() if tp is Secret]


def overlay_layer(values: dict[str, Any], layer: Mapping[str, Any], hints: Mapping[str, Any],
                  origin: dict[str, str]) -> dict[str, Any]:
    """``values`` (what earlier sources gave) updated with ``layer`` (one later source's), where a secret the layer
    gives in any of its ways replaces the earlier sources' secret in every way: the environment's
    ``STREAMREC_REDIS_PASSWORD`` over the file's ``password_file`` (which was read and used, the variable ignored).
    The replaced ways leave ``origin`` too."""
    values = dict(values)
    for ways in _secret_ways(hints):
        if any(way in layer for way in ways):
            for way in ways:
                if way not in layer:
                    values.pop(way, None)
                    origin.pop(way, None)
    values.update(layer)
    return values


def inherited(cls: type, file_data: Mapping[str, Any], environ: Mapping[str, str], prefix: str,
              hints: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The values (and their origins) of ``cls``'s settings that another command's section owns (``cls.INHERITS``:
    key -> the ``(section, key)`` settings it falls back to, first given wins), from the file or the environment
    (``<prefix><SECTION>_<KEY>``; the environment first, as in :func:`streamrec.settings.build`). A command's own
    setting (file, environment or flag) replaces them. Why: one file configures every command, and the refresh read
    its own default checkpoint directory while ``[learner] checkpoint_dir`` named where the learner writes."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, owners in getattr(cls, "INHERITS", {}).items():
        for section, owner_key in owners:
            var, table = f"{prefix}{section.upper()}_{owner_key.upper()}", file_data.get(section, {})
            if var in environ:
                raw, where = environ[var], f"environment {var}"
            elif isinstance(table, Mapping) and owner_key in table:
                raw, where = table[owner_key], f"config file [{section}].{owner_key}"
            else:
                continue
            values[key], origin[key] = coerce_field(key, hints[key], raw, where), where
            break
    return values, origin


def resolve_secrets(cls: type, section: str, hints: dict[str, Any], values: dict[str, Any],
                     environ: Mapping[str, str]) -> None:
    """Fill each :class:`~stream.secrets.Secret` field ``x`` from ``x_file`` (a mounted secret) or ``x_env``
    (the name of an environment variable), when the dataclass has those fields and one is set (two ways at once are an
    error), each read by :func:`~stream.secrets.secret_text` (trailing line endings dropped). An empty file is an
    error (a secret that was never filled in), as is a variable that is not set or is empty."""
    for ways in _secret_ways(hints):
        given = [way for way in ways if values.get(way)]  # (one source's: overlay_layer keeps the latest source's)
        if len(given) > 1:  # the file's content won over the value beside it, silently
            raise SettingsError(f"[{section}] {' and '.join(given)} are both set: give the secret one way")
        name = ways[0]
        path, var = values.get(f"{name}_file"), values.get(f"{name}_env")
        if path:
            try:  # a FIFO or a device in place of a mounted secret would hang the process: refused unread
                raw, st = read_regular_stat(Path(path), MAX_SETTINGS_FILE_BYTES)
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise SettingsError(f"[{section}] {name}_file: cannot read {path}: "
                                    f"{getattr(exc, 'strerror', None) or exc}") from None
            if not secret_text(text):  # an unfilled secret template: not "no password", which is leaving it out
                raise SettingsError(f"[{section}] {name}_file: {path} is empty: put the {name} in it, or leave "
                                    f"{name}_file out when there is none")
            _warn_loose_mode(f"[{section}] {name}_file", Path(path), st.st_mode)
            values[name] = Secret(secret_text(text))
        elif var:
            if var not in environ:
                raise SettingsError(f"[{section}] {name}_env names {var}, which is not set in the environment")
            if not secret_text(environ[var]):  # an unfilled variable (REDIS_PW= in an env file), as an empty file
                raise SettingsError(f"[{section}] {name}_env: the variable {var} is set but empty: put the {name} in "
                                    f"it, or leave {name}_env out when there is none")
            values[name] = Secret(secret_text(environ[var]))


def _warn_loose_mode(setting: str, path: Path, mode: int,
                     gives: tuple[str, str] = (" (and log in as this service)",
                                               " (and choose the credential it sends)")) -> None:
    """A WARNING (once per file and mode in a process: settings are built more than once) when the secret file
    ``setting`` names lets users other than its owner read or write it (:func:`~stream.secrets.loose_mode`, with
    ``gives``: what reading and writing it give them). Used all the same: a secret volume mounted 0644 must still
    start, as a signing key file on one does."""
    risks = loose_mode(mode, *gives)
    if risks and (str(path), mode) not in _LOOSE_WARNED:
        _LOOSE_WARNED.add((str(path), mode))
        log.warning("%s: %s has mode %04o: %s; %s", setting, path, stat.S_IMODE(mode), " and ".join(risks),
                    TIGHTEN_MODE)


_LOOSE_WARNED: set[tuple[str, int]] = set()
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")  # PEM: PKCS#8, RSA, EC, ENCRYPTED


def warn_loose_key_files(settings: T, section: str) -> T:
    """:func:`_warn_loose_mode` for the TLS files of ``settings`` (its class's ``KEY_FILES``: the settings that name a
    client's private key, or a certificate file that may hold it too) that hold a PEM private key: a credential as a
    password file is (whoever reads it is this service to the broker or Redis). A file that cannot be read is left
    to the client's build, which names it (:func:`stream.tls.check_file`). The ``extra`` properties its class's
    ``KEY_FILE_PROPERTIES`` names (a PKCS#12 keystore) too, whatever the file holds. Returns ``settings``."""
    for name in getattr(type(settings), "KEY_FILES", ()):
        path = getattr(settings, name)
        if path is None:
            continue
        try:
            raw, st = read_regular_stat(Path(path), MAX_SETTINGS_FILE_BYTES, "a TLS key file")
        except OSError:
            continue
        if _PRIVATE_KEY.search(raw):
            _warn_loose_mode(f"[{section}] {name}", Path(path), st.st_mode, _KEY_GIVES)
    extra = getattr(settings, "extra", None) or {}
    for key, value in extra.items():  # KEY_FILE_PROPERTIES: a key file by its property, whatever it holds
        if key.strip().lower() not in getattr(type(settings), "KEY_FILE_PROPERTIES", ()):
            continue
        try:
            with open_regular(Path(value)) as (_, st):
                pass
        except OSError:
            continue
        _warn_loose_mode(f"[{section}.extra] {key}", Path(value), st.st_mode, _KEY_GIVES)
    return settings


_KEY_GIVES = (" (and present this service's client certificate as its own)",
              " (and replace the key this service presents)")


def coerce_field(key: str, tp: Any, raw: Any, where: str) -> Any:
    """:func:`coerce` plus the checks that need the setting's name: an empty host (``host``, ``*_host``) is an
    error, not "every interface" (bind("") listens on 0.0.0.0) or a lookup failure at bind time; so is one holding
    white space or a control character, which no host name or address holds (it failed a lookup at start, and reached
    the local stack's broker and redis-server command lines)."""
    value = coerce(tp, raw, where)
    if (key == "host" or key.endswith("_host")) and isinstance(value, str) and not value.strip():
        raise SettingsError(f"{where}: cannot use {shown(raw)}: an empty host is not an address; give one "
                            f"(127.0.0.1: this machine only; 0.0.0.0: every interface) or leave it out for the default")
    if (key == "host" or key.endswith("_host")) and isinstance(value, str) and any(
            c.isspace() or not c.isprintable() for c in value):
        raise SettingsError(f"{where}: cannot use {shown(raw)}: a host holds no white space or a control character")
    return value


def _cannot(where: str, raw: Any, why: object, secret: bool) -> SettingsError:
    """The error of a value that cannot be used; a credential's value is not quoted (one given as an array or a
    table is no Secret yet, registered nowhere, so redact would not scrub it from the line)."""
    if secret:
        return SettingsError(f"{where} (a credential, its value not shown): {why}")
    # ``why`` may be a library's error quoting the value whole (float(): 100 kB for a 100 kB value): bounded too
    return SettingsError(f"{where}: cannot use {shown(raw)}: {quoted(str(why), 300)}")


def coerce(tp: Any, raw: Any, where: str, secret: bool = False) -> Any:
    """``raw`` as a value of type ``tp``; ``secret``: ``raw`` is a credential (also any :class:`Secret` field and
    any table entry whose key names one), never quoted in an error."""
    secret = secret or tp is Secret
    if isinstance(raw, str) and "\x00" in raw:  # TOML's "\u0000": no path, name, address or secret holds one (the OS,
        # librdkafka and Redis end the text there or raise "embedded null byte" when it is used, a traceback)
        raise _cannot(where, raw, "holds a NUL character (\\u0000), which no setting can hold", secret)
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
        return coerce(inner[0], raw, where, secret)
    if origin in (dict, Mapping) or tp in (dict, Mapping):  # a table: [kafka.extra] in TOML, or "k=v,k2=v2"
        if isinstance(raw, str):
            pairs = [x.split("=", 1) for x in raw.split(",") if x.strip()]
            if any(len(kv) != 2 or not kv[0].strip() for kv in pairs):
                raise _cannot(where, raw, "expected key=value pairs separated by commas",
                              secret or any(names_credential(kv[0].strip()) for kv in pairs))
            raw = {k.strip(): v.strip() for k, v in pairs}
        if not isinstance(raw, Mapping):
            raise _cannot(where, raw, "expected a table of key = value", secret)
        key_t, value_t = args if len(args) == 2 else (str, str)
        return {coerce(key_t, k, f"{where}.{k}"): coerce(value_t, v, f"{where}.{k}", secret or names_credential(str(k)))
                for k, v in raw.items()}
    if origin is tuple and args[-1:] == (Ellipsis,):  # tuple[int, ...]: a TOML array, or "a,b,c"
        if isinstance(raw, str):
            raw = [x for x in raw.replace(" ", "").split(",") if x]
        if not isinstance(raw, (list, tuple)):
            raise _cannot(where, raw, "expected a list like 400,400,400", secret)
        return tuple(coerce(args[0], x, where, secret) for x in raw)
    if isinstance(raw, Mapping | list):  # a table or an array where one value belongs
        raise _cannot(where, raw, f"expected one value, got {'a table' if isinstance(raw, Mapping) else 'an array'}",
                      secret)
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
            if str(raw) and not secret_text(str(raw)):  # "\n" read as no secret would log in as the default user
                raise ValueError("only a line ending: give the secret, or leave it out when there is none")
            return Secret(secret_text(str(raw)))
        if tp is str:
            return ("true" if raw else "false") if isinstance(raw, bool) else str(raw)  # TOML true: librdkafka's "true"
        if tp is Path:
            if not str(raw).strip():  # Path("") is ".": checkpoints or artifacts would land in the working directory
                raise ValueError("an empty path is not a path: give one, or leave the setting out for its default")
            if str(raw) != str(raw).strip():  # "dir\n" (a variable filled from a file) is another directory than "dir"
                raise ValueError("it has a space or a line ending around it (a variable filled from a file?): remove "
                                 "it")
            return Path(str(raw))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(raw)
            except ValueError:
                raise ValueError(f"expected one of {', '.join(m.value for m in tp)}") from None
    # TypeError: a date for a number; OverflowError: an integer too large for a float
    except (ValueError, TypeError, OverflowError) as exc:
        raise _cannot(where, raw, exc, secret) from None
    raise SettingsError(f"{where}: unsupported setting type {tp!r}")


def construct(cls: Callable[..., Any], values: Mapping[str, Any], origin: Mapping[str, str]) -> Any:
    """``cls(**values)``; a :class:`ConfigError` of the class's own checks (a count, a duration, a combination), which
    name the setting but cannot know its source, as a :class:`SettingsError` that adds where each setting it names came
    from (``origin``: key -> "environment STREAMREC_...", "config file [section].key", "--flag")."""
    try:
        return cls(**values)
    except SettingsError:
        raise
    except ConfigError as exc:
        text = str(exc)
        named = [where for key, where in origin.items() if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", text)]
        raise SettingsError(text + (f" (set by {'; '.join(named)})" if named else "")) from None


def check_file_sections(data: Mapping[str, Any], sections: Sequence[str], what: str) -> None:
    """Refuse a table of a settings file (``what``: "config file streamrec.toml") that is no section: a typo
    (``[kafak]``) that every command would otherwise ignore silently, its settings left at their defaults."""
    unknown = [key for key in data if key not in sections]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sections, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        raise SettingsError(f"{what}: unknown section [{quoted(unknown[0], 80)}]{hint} (known sections: "
                            f"{', '.join(f'[{s}]' for s in sections)})")


def unknown_key_hint(key: str, section: str, names: Collection[str],
                     fields: Callable[[], Mapping[str, Collection[str]]], spell: Callable[[str, str], str]) -> str:
    """What an unknown ``key`` of ``section`` most likely meant, as ``spell(section, key)`` writes a setting: the
    same key of the sections that have it (``fields()``: each section's keys; put under the wrong table), else the
    closest of ``names`` (a typo). "" when nothing is like it."""
    meant = [(s, key) for s, keys in fields().items() if s != section and key in keys]
    meant = meant or [(section, k) for k in difflib.get_close_matches(key, names, n=1)]
    return f"; did you mean {' or '.join(spell(s, k) for s, k in meant)}?" if meant else ""


def check_environment_sections(environ: Mapping[str, str], prefix: str, sections: Sequence[str],
                               fields: Callable[[], Mapping[str, Collection[str]]], cutoff: float = 0.75) -> None:
    """Refuse a ``<prefix><WORD>_...`` variable that settings will never read because WORD misspells a section
    (``STREAMREC_KAFAK_BOOTSTRAP_SERVERS``), or that leaves the section out (``STREAMREC_BOOTSTRAP_SERVERS``).
    ``fields()`` (called only for a variable that names no section) gives each section's keys. Other variables
    under the prefix (``STREAMREC_TEST_KILL_AT``: nothing like a section, at most 0.5 similar) are not settings
    and stay allowed."""
    known = {s.upper() for s in sections}
    for var in sorted(environ):
        if not var.startswith(prefix) or var[len(prefix):].split("_", 1)[0] in known:
            continue
        word, _, rest = var[len(prefix):].partition("_")
        close = difflib.get_close_matches(word.lower(), sections, n=1, cutoff=cutoff)
        if close and rest:
            raise SettingsError(f"environment: {var} is not read: {word} is not a settings section; did you mean "
                                f"{prefix}{close[0].upper()}_{rest}? (sections: {', '.join(map(str.upper, sections))})")
        owners = [s for s, keys in fields().items() if var[len(prefix):].lower() in keys]
        if owners:
            raise SettingsError(f"environment: {var} is not read: it names no section; did you mean "
                                + " or ".join(f"{prefix}{s.upper()}_{var[len(prefix):]}" for s in owners) + "?")
