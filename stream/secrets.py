"""Credentials and their redaction: one home for "a secret is never printed".

A credential setting (a SASL password, a Redis password, an HMAC signing key) is a :class:`Secret`: its
``str``/``repr`` is ``***``, it compares by value, and the code that connects calls :meth:`Secret.reveal`.
Every Secret ever built registers its value, so :func:`redact` can scrub it from any text, even text a
library produced (an exception message quoting a URL, a log line). :func:`redact` also scrubs the
user-info of every URL (``redis://user:PASSWORD@host`` -> ``redis://***@host``, up to the last ``@``) and ``password=``,
``token=``, ``secret=`` style query or key-value pairs; :func:`redact_obj` does it through nested
summaries (``--json`` output, alerts) and masks values under keys that name a credential. The CLI
installs :class:`RedactingFilter` on every log handler, so log lines are scrubbed at the source.

Secrets in settings come from one of three places (the loader, ``streamrec/settings.py``, resolves the
last two at the process edge): the value itself (``password = "..."``, discouraged in a shared file; or
``STREAMREC_<SECTION>_<NAME>``), a file named by ``<name>_file`` (a mounted secret), or an environment
variable named by ``<name>_env``. Each is read the same way, :func:`secret_text`: line endings at its end are
dropped (an editor's or ``echo``'s in a file, ``PW="$(printf 'pw\n')"`` or a Kubernetes secret made from such
a file in a variable), and a byte order mark at its start (Notepad's), nothing else (a password may hold spaces).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import reprlib
import stat
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

MASK = "***"
_MIN_REGISTERED = 4  # shorter values are not scrubbed as free text (they would mask ordinary words)
_known: set[str] = set()
_known_lock = threading.Lock()
_pattern: re.Pattern[str] | None = None

# The whole userinfo of a URL: everything from ``scheme://`` to the LAST ``@`` of the same token (greedy), as
# ``urlsplit`` takes ``netloc.rpartition('@')``. It may hold ``@``, ``/``, ``:``, ``%`` (an unencoded password
# makes the URL unparseable, and the error quoting it must still not leak it). Only whitespace ends a token: a
# password may hold a quote (``'`` unencoded, RFC 3986) or ``"<>`` (urlsplit and redis-py take them), and a stop
# there showed it whole. A URL with no ``@`` is left as it is.
_URL_SCHEME = re.compile(r"\b[A-Za-z][A-Za-z0-9+._-]*://")
# (The scheme as _URL_SCHEME's, tried once from the start of its run of scheme characters, the run taken whole through
# a lookahead: tried at each \b in the run, 'a.' repeated cost its length squared. And redact applies it only to a
# token up to its last '@' (_AT_TOKEN), where its \S*@ scanned the rest of the token from each 'a://' in it.)
_URL_USERINFO = re.compile(r"(?P<scheme>(?<![A-Za-z0-9+._-])(?=[A-Za-z0-9+._-]*?\b[A-Za-z])"
                           r"(?=(?P<run>[A-Za-z0-9+._-]+))(?P=run)://)(?P<userinfo>\S*)@")
_AT_TOKEN = re.compile(r"(?<!\S)[^\s@]*@\S*")  # a whitespace-delimited token holding an '@', from its start
# A pair's key is a whole run of [\w.-] naming a credential: tried from the run's first character only, once (the run
# taken whole through a lookahead, as a possessive quantifier would), and its word found by one lazy scan. Tried at
# each \b in the run and backtracked over it, a run of key characters ('a.' repeated, from a bad message an error
# quotes) cost its length squared times the words: 1.3 s for 4096 characters, in every stream.errors.shown of it.
_KV_SECRET = re.compile(r"(?i)(?P<key>(?<![\w.-])(?=[\w.-]*?(?:password|passwd|passphrase|secret|token|api[_-]?key|"
                        r"signing[_-]?key|key[._-]?pem|sasl[._]password|oauthbearer[._-]config))(?=(?P<run>[\w.-]+))(?P=run))"
                        r"(?<!_file)(?<!_env)(?P<kq>['\"]?)(?P<sep>\s*[=:]\s*)(?P<q>['\"]?)(?P<val>[^\s'\"&,;}]+)")
# librdkafka's sensitive properties include a private key given inline (``ssl.key.pem``,
# ``sasl.oauthbearer.assertion.private.key.pem``) and its ``...passphrase``, which no other word here names, and
# ``sasl.oauthbearer.config`` (its extensions, an OAuth callback's settings), which librdkafka quotes in its errors.
_SECRET_KEY = re.compile(r"(?i)password|passwd|passphrase|secret|token|api[_-]?key|signing[_-]?key|key[._-]?pem|"
                         r"credential|oauthbearer[._-]config")


class Secret(str):
    """A credential. A ``str`` (so clients accept it after :meth:`reveal`) whose ``str``/``repr``/format is ``***``.

    Building one registers its value for :func:`redact`. ``Secret("")`` is "no secret" and is falsy.
    """

    __slots__ = ()

    def __new__(cls, value: str = "") -> Secret:
        obj = super().__new__(cls, value)
        if len(value) >= _MIN_REGISTERED:
            register(value)
        return obj

    def reveal(self) -> str:
        """The plain value, for the one call that connects (never for output)."""
        return str.__str__(self)

    def __str__(self) -> str:
        return MASK if self.reveal() else ""

    def __repr__(self) -> str:
        return f"Secret({MASK!r})" if self.reveal() else "Secret('')"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __reduce__(self) -> tuple[Any, ...]:  # pickling a secret (into a checkpoint, say) keeps it masked
        return (Secret, ("",))


def secret_text(text: str) -> str:
    """A secret's value as read from a setting, a file or an environment variable: without the line endings
    (``\n``, ``\r\n``) at its end, which no password means and ``$(cat file)`` strips only in a shell, and without
    a UTF-8 byte order mark at its start, which Windows editors (Notepad, PowerShell's ``Out-File -Encoding utf8``)
    write and no password means either (it was sent as the password's first character: a login refused with nothing
    to see in the file)."""
    return text.removeprefix("\ufeff").rstrip("\r\n")


# The way out of a loose secret file's warning (:func:`loose_mode`), the same for every secret file
TIGHTEN_MODE = "chmod 600 (640 or 440 to share it with a group of services), or mount the secret with defaultMode 0400"


def loose_mode(mode: int, read_gives: str, write_gives: str) -> list[str]:
    """What a secret file's ``mode`` lets users other than its owner do, each with what it gives them (``read_gives``,
    ``write_gives``: " (and ...)"): every local user reads it (o+r), or others write it (o+w, g+w); [] for a file
    only its owner (and a group reading it: the way to share one) can use. Loaded all the same by its readers (a
    secret volume is mounted 0644 by default), with a warning naming it, its mode and :data:`TIGHTEN_MODE`."""
    risks = ((stat.S_IROTH, f"every local user can read it{read_gives}"),
             (stat.S_IWOTH | stat.S_IWGRP, f"users other than its owner can write it{write_gives}"))
    return [why for bits, why in risks if mode & bits]


def register(value: str) -> None:
    """Scrub ``value`` from everything :func:`redact` sees from now on (a secret read outside settings)."""
    global _pattern
    if len(value) < _MIN_REGISTERED:
        return
    with _known_lock:
        if value in _known:
            return
        _known.add(value)
        _pattern = re.compile("|".join(re.escape(v) for v in sorted(_known, key=len, reverse=True)))


def hide_url_path(url: str) -> str:
    """``url`` as a webhook's is shown: its scheme and host, its user-info, path and query as ``***``. A receiver's
    path or query is often its credential (Slack's ``/services/T.../B.../<token>``, ``?token=...``), which
    :func:`redact` cannot tell from a path."""
    # the user-info as redact takes it (to the last "@" of its token: a password may hold "/?#", where urlsplit's netloc
    # ends), in the URL urlsplit reads (tab and line breaks dropped); an "@" still past the netloc may end a password
    # holding whitespace too: then no host is shown
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", re.sub(r"[\t\r\n]", "", url.strip()))
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        return MASK
    user, at, host = parts.netloc.rpartition("@")
    if "@" in text.partition("://")[2].replace(parts.netloc, "", 1):
        at, host = "", MASK
    return (f"{parts.scheme}://{MASK + '@' if at else ''}{host}"
            f"{'/' + MASK if parts.path.strip('/') or parts.query or parts.fragment else ''}")


def _userinfo_masked(token: re.Match[str]) -> str:
    """A token's URL user-info masked (:data:`_URL_USERINFO`): only its text up to its last '@' can hold one, and only
    where a '://' is in it; each match runs to that '@', so the token is scanned a bounded number of times."""
    text = token[0]
    end = text.rindex("@") + 1
    if "://" not in text[:end]:
        return text
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text[:end]) + text[end:]


def redact(text: str) -> str:
    """``text`` with every registered secret, URL password and ``password=...`` value replaced by ``***``."""
    if not text:
        return text
    pattern = _pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    text = _AT_TOKEN.sub(_userinfo_masked, text)
    return _KV_SECRET.sub(lambda m: f"{m['key']}{m['kq']}{m['sep']}{m['q']}{MASK}", text)


# The characters of a long text scrubbed at each end before a message cuts it (:func:`redact_for_cut`): more than any
# message shows of one value, few enough for redact, whose cost grows faster than the text (a URL scheme repeated)
_CUT_SCRUB = 4096


def redact_for_cut(text: str) -> str:
    """``text`` through :func:`redact` before a message cuts it short (to its head, or to reprlib's head and tail): the
    cut may drop the ``@`` that ends a URL's user-info, and the redaction after it saw no URL password and let its head
    through (``'redis://u:Pw0rdABCD...cluster.local:6379/0'``). A text longer than twice :data:`_CUT_SCRUB` is scrubbed
    at its two ends only (its middle is never shown), so a password crossing into the middle is not masked."""
    if len(text) <= 2 * _CUT_SCRUB:
        return redact(text)
    return redact(text[:_CUT_SCRUB]) + text[_CUT_SCRUB:-_CUT_SCRUB] + redact(text[-_CUT_SCRUB:])


class RedactingRepr(reprlib.Repr):
    """A bounded ``repr`` (:mod:`reprlib`: its depth and width limits) of a value an error quotes, each string in it
    scrubbed (:func:`redact_for_cut`) before reprlib cuts it to its head and tail."""

    def repr_str(self, x: str, level: int) -> str:
        return super().repr_str(redact_for_cut(x), level)


def redacted_repr(self: Any) -> str:
    """A dataclass's ``repr`` through :func:`redact`: settings classes whose plain ``str`` fields may carry a credential
    (a ``redis://user:password@host`` url, a ``[kafka.extra]`` secret) take it as their ``__repr__``, so a settings
    object in a traceback, a log line or an f-string's ``!r`` shows none. A table's credential-named values are
    masked whole first (:func:`redact_obj`): :func:`redact` masks a ``key: value`` only up to a space or a comma, and
    left an inline ``ssl.key.pem`` all but its first word."""
    body = ", ".join(f"{f.name}={(redact_obj(v) if isinstance(v := getattr(self, f.name), Mapping) else v)!r}"
                     for f in dataclasses.fields(self) if f.repr)
    return redact(f"{type(self).__qualname__}({body})")


def names_credential(key: str) -> bool:
    """Whether a setting or summary key names a credential whose value is never shown (``password``,
    ``sasl.oauthbearer.client.secret``, ``api_key``, ``ssl.key.pem``, ``...private.key.passphrase``,
    ``sasl.oauthbearer.config``);
    ``password_file`` / ``password_env`` name where one is."""
    return bool(_SECRET_KEY.search(key)) and not key.endswith(("_file", "_env"))


def redact_obj(obj: Any) -> Any:
    """A copy of a summary (dicts, lists, strings, numbers) safe to print: strings through :func:`redact`,
    values under credential-named keys masked, a webhook's URL (under a key naming one) as its scheme and host
    (:func:`hide_url_path`: its path may be its token), :class:`Secret` values masked."""
    if isinstance(obj, Secret):
        return str(obj)
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {k: (MASK if isinstance(k, str) and names_credential(k) and v not in (None, "", {}, [])
                    and not isinstance(v, (bool, int, float)) else
                    hide_url_path(v) if isinstance(k, str) and "webhook" in k.lower() and isinstance(v, str) and v
                    else redact_obj(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    if isinstance(obj, BaseException):
        return redact(str(obj))
    return obj


class RedactingFilter(logging.Filter):
    """Scrubs each record's message (and exception text) with :func:`redact` before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: leave the record as it is
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class RedactingArgumentParser(argparse.ArgumentParser):
    """The CLI's parser (and, by argparse's ``add_parser``, every subcommand's): its usage errors quote what was typed
    (``unrecognized arguments: --redis-ulr redis://u:PASSWORD@h``, ``invalid int value: '...'``), scrubbed here as
    every other CLI error line is."""

    def error(self, message: str) -> NoReturn:
        super().error(redact(message))


# Where a flag's credential is safer than on the command line, which every local user reads (ps, /proc/PID/cmdline)
_SAFER_THAN_ARGV = {
    "--redis-url": "[redis] password_file (a mounted secret) or password_env (a variable's name) in the --config file, "
                   "or STREAMREC_REDIS_PASSWORD / STREAMREC_REDIS_PASSWORD_FILE",
    "--source": "the rules file's [sources] (--rules FILE, readable by its owner only)",
}
_argv_warned = False


def _holds_password(value: str) -> bool:
    """Whether a command-line value carries a credential: a URL's ``user:PASSWORD@`` (a user alone is none) or a
    ``password=`` / ``token=`` style pair (a query parameter). The user-info is the authority's, before the host (up
    to its last '@', an unencoded one in a password kept): an '@' past the host (``http://h:9100/m?owner=ml@corp``)
    was read as ``user h, password 9100/m?owner=ml``. A pair is read from the URL on, if any: before it is a name
    (``--source token-service=http://h/m``: a ``token=`` pair whose value was the URL)."""
    scheme = _URL_SCHEME.search(value)
    if scheme is None:
        return bool(_KV_SECRET.search(value))
    try:
        password = urllib.parse.urlsplit(value[scheme.start():]).password  # the authority's, as a client reads it
    except ValueError:  # an unbalanced '[' of an IPv6 host: no URL a client takes
        password = None
    return bool(password) or bool(_KV_SECRET.search(value[scheme.start():]))  # a key may begin there


def command_line_secrets(argv: Sequence[str]) -> list[str]:
    """The flags of ``argv`` whose value holds a password (``--redis-url redis://u:PASSWORD@h``, ``--x=value``), each
    once, in order; a value after no flag is named ``an argument``."""
    found: dict[str, None] = {}
    for before, token in zip(["", *argv], argv, strict=False):
        flag, eq, value = token.partition("=") if token.startswith("--") else ("", "", token)
        if not eq and token.startswith("-"):
            continue
        if _holds_password(value):
            found[flag or (before if before.startswith("-") else "an argument")] = None
    return list(found)


def warn_command_line_secrets(argv: Sequence[str]) -> None:
    """A WARNING (once per process) naming each flag given a password on the command line, never the password: any
    local user reads it in ``ps`` for the life of the process (redis-cli and mysql warn likewise). Not refused: scripts
    that do it keep working. Logged before the command sets up logging, Python's last-resort handler writes it."""
    global _argv_warned
    flags = command_line_secrets(argv)
    if _argv_warned or not flags:
        return
    _argv_warned = True
    for flag in flags:
        safer = _SAFER_THAN_ARGV.get(flag, "a settings file (--config) or an environment variable (STREAMREC_...)")
        logging.getLogger("streamrec.secrets").warning(redact(
            f"{flag}: a password given on the command line can be read by every user of this machine (ps, "
            f"/proc/PID/cmdline) while the process runs; give it in {safer} instead (README, Security)"))


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add :class:`RedactingFilter` to every handler of ``logger`` (the root logger by default), once."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
