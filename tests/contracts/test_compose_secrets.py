"""Contract: the compose deployment hands the streamrec services their secrets as files (docker secrets), as the
top-level README's "Security" section and ``[kafka]``/``[redis]`` ``*_file`` settings promise, never in an
environment variable (``docker inspect`` shows a container's environment to anyone with the docker socket, and a
URL's password travels through every setting that copies the URL).

The Redis password was the exception: every app service got it inside ``STREAMREC_REDIS_URL``
(``redis://:${REDIS_PASSWORD}@redis:6379/0``) and the redis container in ``REDIS_PASSWORD``/``REDISCLI_AUTH``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from stream.config import RedisSettings
from streamrec.settings import Sources

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
APP_IMAGE = "streamrec:latest"


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    return services


def _secret_paths(spec: dict[str, Any]) -> dict[str, str]:
    """/run/secrets/<name> -> name, for every docker secret a service mounts."""
    return {f"/run/secrets/{s if isinstance(s, str) else s['source']}": s if isinstance(s, str) else s["source"]
            for s in spec.get("secrets", [])}


def _interpolated(value: object) -> str:
    """``value`` as compose hands it over, with every ``${VAR...}`` replaced by a stand-in password."""
    return re.sub(r"\$\{[^}]*\}", "stand-in-password", str(value))


def test_no_app_service_gets_a_password_in_its_environment() -> None:
    apps = {name: spec for name, spec in _services().items() if spec.get("image") == APP_IMAGE}
    assert {"joiner", "learner", "refresh", "serving", "monitor"} <= set(apps), "the parser misses app services"
    for name, spec in apps.items():
        env = {k: _interpolated(v) for k, v in spec["environment"].items()}
        url = env.get("STREAMREC_REDIS_URL", "")
        assert urlsplit(url).password is None, f"{name}: STREAMREC_REDIS_URL carries the Redis password: {url}"
        for key, value in env.items():
            assert not re.search(r"PASSWORD$|AUTH$", key), f"{name}: {key} puts a secret in the environment"
            if key.endswith("_FILE"):
                assert value in _secret_paths(spec), f"{name}: {key}={value} is no docker secret the service mounts"
        assert env.get("STREAMREC_REDIS_PASSWORD_FILE") in _secret_paths(spec), (
            f"{name}: Redis requires a password and the service gets none as a file (STREAMREC_REDIS_PASSWORD_FILE)")


def test_the_app_services_redis_settings_take_the_password_from_the_secret(tmp_path: Path) -> None:
    spec = _services()["serving"]
    (tmp_path / "pw").write_text("from-the-secret\n")
    env = {k: _interpolated(v) for k, v in spec["environment"].items() if k.startswith("STREAMREC_REDIS_")}
    env["STREAMREC_REDIS_PASSWORD_FILE"] = str(tmp_path / "pw")  # the secret, mounted here instead of /run/secrets
    rs = Sources(environ=env).build(RedisSettings, "redis")
    assert rs.password.reveal() == "from-the-secret"


def test_redis_reads_its_password_from_the_same_secret_file() -> None:
    services = _services()
    redis = services["redis"]
    env = {k: _interpolated(v) for k, v in (redis.get("environment") or {}).items()}
    assert not any(re.search(r"PASSWORD|AUTH", k) for k in env), f"redis gets its password in its environment: {env}"
    app_secret = _secret_paths(services["serving"])[services["serving"]["environment"]["STREAMREC_REDIS_PASSWORD_FILE"]]
    path = f"/run/secrets/{app_secret}"
    assert _secret_paths(redis).get(path) == app_secret, f"redis does not mount the {app_secret} secret"
    assert f"requirepass $$(cat {path})" in " ".join(redis["command"]), "redis-server's requirepass is not the secret"
    assert path in " ".join(redis["healthcheck"]["test"]), "the healthcheck's redis-cli does not log in with the secret"
    source = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["secrets"][app_secret]["file"]
    assert Path(source).name in (COMPOSE / "make-certs.sh").read_text(), f"make-certs.sh never writes {source}"


def test_grafana_reads_its_admin_password_from_a_secret_not_its_environment() -> None:
    # GF_SECURITY_ADMIN_PASSWORD held it in the container's environment, for anyone with `docker inspect`
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    env = {k: _interpolated(v) for k, v in grafana["environment"].items()}
    assert not [k for k in env if re.search(r"PASSWORD$", k)], f"grafana gets a password in its environment: {env}"
    secret = _secret_paths(grafana).get(env.get("GF_SECURITY_ADMIN_PASSWORD__FILE", ""))
    assert secret is not None, "GF_SECURITY_ADMIN_PASSWORD__FILE is no docker secret grafana mounts"
    assert compose["secrets"][secret] == {"environment": "GRAFANA_ADMIN_PASSWORD"}, (
        f"the {secret} secret is not GRAFANA_ADMIN_PASSWORD of compose/.env")


def test_the_grafana_admin_password_stays_required_with_no_default() -> None:
    # an environment secret whose variable is unset fails only when grafana's container is created; an empty one
    # passes: the file keeps the `:?` interpolation, which stops `up` and `config` first
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    required = [v for v in compose.values() if isinstance(v, str) and v.startswith("${GRAFANA_ADMIN_PASSWORD:?")]
    assert required == ["${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD in compose/.env}"]
