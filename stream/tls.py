"""The TLS files a setting names (a CA bundle, a client certificate and its key), checked and loaded in one place.

:func:`client_context` is the one place Python's ``ssl`` loads them: the faust join driver uses the context it returns,
and ``stream.redis_client.connect`` builds one only to check the files when a client is built (redis-py loads them
itself at its first connection, where a bad file failed each command late, with an obscure error, retried as an
outage). Whatever is wrong with a file is a :class:`~stream.errors.ConfigError` naming the setting and the file, never
ssl's raw ``SSLError`` / ``OSError``: missing or unreadable, not a regular file (a FIFO would hang the loader), no PEM
certificate in a CA bundle, a key that does not belong to the certificate, an encrypted key without its password.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from stream.errors import ConfigError
from stream.files import open_regular

# OpenSSL's reasons, in words an operator acts on (any other reason is shown as OpenSSL gives it)
_REASONS = {
    "NO_CERTIFICATE_OR_CRL_FOUND": "it holds no PEM certificate",
    "KEY_VALUES_MISMATCH": "the key does not belong to the certificate",
    "BAD_DECRYPT": "the key is encrypted and its password is missing or wrong",
    "BAD_PASSWORD_READ": "the key is encrypted and no password was given for it",
    "NO_START_LINE": "it is not in PEM format",
}


def _why(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        return _REASONS.get(reason, f"{reason or exc}")
    return exc.strerror or str(exc)


def check_file(section: str, setting: str, path: Path) -> None:
    """``path`` exists, is a regular file and can be opened for reading (checked on the open file, unread: a FIFO or a
    device is refused, not waited on); a ConfigError naming ``[section] setting`` and ``path`` otherwise."""
    try:
        with open_regular(Path(path)):
            pass
    except FileNotFoundError:
        raise ConfigError(f"[{section}] {setting}: {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"[{section}] {setting}: {path} cannot be read: {exc.strerror or exc}") from None


def client_context(section: str, ca: tuple[str, Path | None], cert: tuple[str, Path | None] = ("", None),
                   key: tuple[str, Path | None] = ("", None), key_password: str | None = "") -> ssl.SSLContext:
    """A client's TLS context that trusts the CA bundle ``ca`` (``(setting, path)``; the system's CAs when the path is
    None) and presents the certificate ``cert`` with its private key ``key`` (default: inside the certificate file)
    when ``cert`` names one; ``key_password`` for an encrypted key (None: ``section`` has no setting for one, and
    the error of an encrypted key says to decrypt it). A ConfigError naming the setting and the file for anything
    that cannot be used (module docstring)."""
    for setting, path in (ca, cert, key):
        if path is not None:
            check_file(section, setting, path)
    ca_setting, ca_path = ca
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None if ca_path is None else str(ca_path))
    except OSError as exc:  # ssl.SSLError is one
        raise ConfigError(f"[{section}] {ca_setting}: {ca_path} cannot be used as the CA bundle: {_why(exc)} (give "
                          "the PEM file of the CA that signed the server's certificate)") from None
    cert_setting, cert_path = cert
    key_setting, key_path = key
    if cert_path is not None:
        names = f"{cert_setting} / {key_setting}" if key_path is not None else cert_setting
        files = f"{cert_path}" + (f" and {key_path}" if key_path is not None else "")
        try:
            # a callback, never None: without one OpenSSL asks for an encrypted key's password on the terminal
            ctx.load_cert_chain(str(cert_path), None if key_path is None else str(key_path),
                                password=lambda: (key_password or "").encode())
        except (OSError, ValueError) as exc:  # ValueError: a password over OpenSSL's limit
            why = _why(exc) if isinstance(exc, OSError) else str(exc)
            if "PEM lib" in why:  # OpenSSL does not say which file: the certificate, if it holds none, else the key
                try:
                    ssl.create_default_context(cafile=str(cert_path))
                except ssl.SSLError:
                    raise ConfigError(f"[{section}] {cert_setting}: {cert_path} holds no PEM certificate") from None
                key_named = (key_setting, key_path) if key_path is not None else (cert_setting, cert_path)
                if key_password is None:  # no setting gives one: "its password is missing" sent operators looking
                    raise ConfigError(f"[{section}] {key_named[0]}: {key_named[1]} holds no usable private key: not "
                                      f"PEM, or encrypted, which [{section}] cannot use (no setting gives a key's "
                                      f"password): give the key unencrypted (openssl pkey -in {key_named[1]} -out "
                                      "PLAIN.key; readable by this service's user only)") from None
                raise ConfigError(f"[{section}] {key_named[0]}: {key_named[1]} holds no usable private key: not PEM, "
                                  "or encrypted and its password is missing or wrong") from None
            raise ConfigError(f"[{section}] {names}: cannot load the client certificate and key ({files}): "
                              f"{why}") from None
    return ctx
