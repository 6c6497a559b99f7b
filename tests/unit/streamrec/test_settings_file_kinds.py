"""A settings or secret file that is not a regular file (a FIFO, a device, a directory) or is far too large is refused
unread with a ConfigError naming the setting and the path (exit 2 from the CLI): opening a FIFO waited for a writer
for good, ``/dev/zero`` was read until memory ran out. Every read of a file a setting names goes through
``stream.files.read_regular``: ``--config``, the ``*_file`` secrets of the settings loader, ``[redis] password_file``
read by ``connect`` for settings built in code, ``signing_key_file``, ``--rules``.

The FIFOs here are fed by a writer thread, so that a reader that opens them (the defect) reads a valid file and the
test fails on its assertion instead of hanging."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from learner.tensorpack import load_signing_key
from monitor.rules import load_rules
from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError
from stream.files import MAX_SETTINGS_FILE_BYTES
from stream.redis_client import connect
from streamrec.cli import main
from streamrec.settings import build, read_config_file
from tests.fifos import fed_fifo

VALID = b'[redis]\nprefix = "fed"\n'  # valid as a config file; as a secret, a password or a 16+ byte key


@contextlib.contextmanager
def not_regular(kind: str, tmp_path: Path) -> Iterator[Path]:
    if kind == "fifo":
        with fed_fifo(tmp_path / "fifo", VALID) as p:
            yield p
    elif kind == "directory":
        yield tmp_path
    else:
        yield Path(kind)


KINDS = ["fifo", "/dev/null", "/dev/zero", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_file_that_is_no_regular_file_is_refused_unread_with_exit_2(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with not_regular(kind, tmp_path) as path:
        assert main(["stack", "status", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config file {path} cannot be read" in err and "not a regular file" in err
    assert "--config" in err


def test_a_config_file_over_the_size_bound_is_refused_unparsed(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with open(big, "wb") as fh:
        fh.truncate(MAX_SETTINGS_FILE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ConfigError, match=rf"config file {big} cannot be read: .*more than {MAX_SETTINGS_FILE_BYTES}"):
        read_config_file(big)


def _loader_secret(section: str, key: str) -> Callable[[Path], object]:
    cls = {"redis": RedisSettings, "kafka": KafkaSettings}[section]
    extra = {"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u"} if section == "kafka" else {}
    return lambda p: build(cls, section, {section: {**extra, key: str(p)}}, environ={})


# every reader of a file a setting names: (its name in the error, the call)
READERS: dict[str, tuple[str, Callable[[Path], object]]] = {
    "redis password_file (loader)": ("[redis] password_file", _loader_secret("redis", "password_file")),
    "kafka sasl_password_file (loader)": ("[kafka] sasl_password_file", _loader_secret("kafka", "sasl_password_file")),
    "redis password_file (connect)": ("password_file", lambda p: connect(RedisSettings(password_file=p))),
    "signing_key_file": ("signing_key_file", load_signing_key),
    "monitor --rules": ("alert rules file", load_rules),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_secret_or_settings_file_that_is_no_regular_file_is_a_config_error_naming_it(
        reader: str, kind: str, tmp_path: Path) -> None:
    setting, read = READERS[reader]
    with not_regular(kind, tmp_path) as path, pytest.raises(ConfigError) as info:
        read(path)
    assert setting in str(info.value) and str(path) in str(info.value)
    assert "not a regular file" in str(info.value)
