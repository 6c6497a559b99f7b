"""The TLS files a setting names (a CA bundle, a client certificate and its key), checked and loaded in one place.

:func:`client_context` is the one place Python's ``ssl`` loads them: the faust join driver uses the context it returns,
and ``stream.redis_client.connect`` builds one only to check the files when a client is built (redis-py loads them
itself at its first connection, where a bad file failed each command late, with an obscure error, retried as an
outage). Whatever is wrong with a file is a :class:`~stream.errors.ConfigError` naming the setting and the file, never
ssl's raw ``SSLError`` / ``OSError``: missing or unreadable, not a regular file (a FIFO would hang the loader), no PEM
certificate in a CA bundle, a key that does not belong to the certificate, an encrypted key without its password.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path

from stream.errors import ConfigError, quoted
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


# -- why a server's certificate is refused ------------------------------------------------------------------------
# A client library (librdkafka) may say only "certificate verify failed", and its caller's advice ("check the CA
# file") misleads when the CA is right and the certificate names another host or is out of date. One handshake with
# Python's ssl says which (its verify code); for those two a second one, unverified, reads the certificate's names or
# dates for the message. Any other outcome (an unknown CA, a handshake that works or fails otherwise) says nothing.
REFUSAL_TIMEOUT_S = 3.0  # each step of certificate_refusal's handshakes, where its callers have no bound of their own
_HOST_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_OUT_OF_DATE = (9, 10)  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
_SAN_OID = bytes.fromhex("0603551d11")  # the DER of OID 2.5.29.17, subjectAltName
# A server's certificate may hold thousands of names, and a name may hold any byte: the message shows this many, each
# escaped and clipped, then how many more (a hostile certificate cannot flood the line or forge a log line)
_NAMES_SHOWN, _NAME_CHARS = 8, 80


def certificate_refusal(ctx: ssl.SSLContext, host: str, port: int, timeout_s: float) -> str | None:
    """Why ``ctx`` refuses the certificate of the TLS server at ``host``:``port`` and what to fix, when it is a name the
    certificate does not hold or its validity dates; None otherwise (comment above). Every step is bounded by
    ``timeout_s``; nothing of the context's key or password is shown."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        code, message = exc.verify_code, str(exc.verify_message).rstrip(".")
    except (OSError, ValueError):  # not reached, not TLS, refused otherwise: not this function's to say
        return None
    if code not in _HOST_MISMATCH + _OUT_OF_DATE:
        return None
    names, dates = _certificate_facts(_peer_certificate(host, port, timeout_s))
    if code in _HOST_MISMATCH:
        return (f"the server's certificate does not name {host} ({message}): connect by a host name the certificate "
                f"lists (its names: {_shown_names(names)}) or reissue it for {host}")
    valid = f"valid from {dates[0]} to {dates[1]} UTC" if dates else "its validity dates could not be read"
    return (f"the server's certificate (or a CA's above it) is out of date ({message}): renew it ({valid}) and check "
            "the clocks of this machine and of the server")


def _shown_names(names: list[str]) -> str:
    """A certificate's ``names`` for a message: the first :data:`_NAMES_SHOWN`, each escaped and clipped, then "and N
    more" (comment above)."""
    shown = ", ".join(quoted(name, _NAME_CHARS) for name in names[:_NAMES_SHOWN]) or "none found"
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _peer_certificate(host: str, port: int, timeout_s: float) -> bytes:
    """The DER certificate the server at ``host``:``port`` presents (b"" if it cannot be read), unverified."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            return tls.getpeercert(binary_form=True) or b""
    except (OSError, ValueError):
        return b""


def _der(buf: bytes, pos: int) -> tuple[int, int, int]:
    """The DER element at ``pos``: (its tag, where its content starts, where it ends)."""
    tag, length, pos = buf[pos], buf[pos + 1], pos + 2
    if length & 0x80:
        n = length & 0x7F
        length, pos = int.from_bytes(buf[pos:pos + n], "big"), pos + n
    return tag, pos, pos + length


def _children(buf: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    out = []
    while start < end:
        out.append(_der(buf, start))
        start = out[-1][2]
    return out


def _certificate_facts(der: bytes) -> tuple[list[str], tuple[str, str] | None]:
    """A DER certificate's subject alternative names (DNS names and IP addresses) and validity dates
    (``YYYY-MM-DD HH:MM:SS``); ([], None) for what cannot be read."""
    try:
        _, start, end = _der(der, 0)
        _, start, end = _der(der, start)  # tbsCertificate
        fields = _children(der, start, end)
        fields = fields[1:] if fields[0][0] == 0xA0 else fields  # [0] version, when present
        validity = [der[s:e].decode("ascii") for _, s, e in _children(der, fields[3][1], fields[3][2])]
        dates = tuple(_when(v) for v in validity[:2])
        names: list[str] = []
        for tag, s, _ in fields[6:]:
            if tag != 0xA3:  # [3] extensions
                continue
            for _, es, ee in _children(der, *_der(der, s)[1:]):
                parts = _children(der, es, ee)
                if der[parts[0][1] - 2:parts[0][2]] == _SAN_OID:
                    _, vs, ve = _der(der, parts[-1][1])  # the OCTET STRING holds the GeneralNames SEQUENCE
                    for gtag, gs, ge in _children(der, vs, ve):
                        if gtag == 0x82:  # dNSName
                            names.append(der[gs:ge].decode("ascii", "replace"))
                        elif gtag == 0x87:  # iPAddress
                            names.append(str(ipaddress.ip_address(der[gs:ge])))
        return names, (dates[0], dates[1]) if len(dates) == 2 else None
    except (IndexError, ValueError, UnicodeDecodeError):
        return [], None


def _when(text: str) -> str:
    """A DER UTCTime (YYMMDDHHMMSSZ) or GeneralizedTime (YYYYMMDDHHMMSSZ) as ``YYYY-MM-DD HH:MM:SS``."""
    digits = text.rstrip("Z")
    if len(digits) == 12:
        digits = ("19" if int(digits[:2]) >= 50 else "20") + digits
    return f"{digits[:4]}-{digits[4:6]}-{digits[6:8]} {digits[8:10]}:{digits[10:12]}:{digits[12:14]}"
