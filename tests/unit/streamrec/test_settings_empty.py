"""An empty string is not a value: an empty host would bind every interface, an empty path is the working
directory, and an empty key file would turn signature checks off. Each is a config error (exit 2); only a
setting left out (or "none" for an optional one) means unset."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from serving.settings import ServeSettings
from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.replay.config import ReplaySettings
from streamrec.cli import main
from streamrec.settings import SettingsError, build
from streamrec.stack import StackSettings


@pytest.mark.parametrize("cls, section, key", [
    (ServeSettings, "serve", "host"), (LearnerSettings, "learner", "metrics_host"),
    (JoinerSettings, "joiner", "metrics_host"), (ReplaySettings, "replay", "metrics_host"),
    (StackSettings, "stack", "host"),
])
@pytest.mark.parametrize("raw", ["", "  "])
def test_an_empty_host_is_an_error_not_every_interface(cls: type, section: str, key: str, raw: str) -> None:
    env = {f"STREAMREC_{section.upper()}_{key.upper()}": raw}
    with pytest.raises(SettingsError, match=r"empty host"):
        build(cls, section, environ=env)
    with pytest.raises(SettingsError, match=r"empty host"):
        build(cls, section, {section: {key: raw}}, environ={})


@pytest.mark.parametrize("cls, section, key", [
    (ServeSettings, "serve", "host"), (LearnerSettings, "learner", "metrics_host"), (StackSettings, "stack", "host"),
])
@pytest.mark.parametrize("raw", ["127.0.0.1\nport 1", " 127.0.0.1", "127.0.0.1\t", "local host", "127.0.0.1\x1b"],
                         ids=["newline", "leading-space", "tab", "inner-space", "escape"])
def test_a_host_with_white_space_or_a_control_character_is_an_error_not_a_lookup_failure(
        cls: type, section: str, key: str, raw: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No host name or address holds one: ``stack up`` failed its first port check on a lookup (a gaierror: a
    traceback, or a line blaming the state directory), exit 1, naming no setting."""
    with pytest.raises(SettingsError, match=r"white space or a control character"):
        build(cls, section, {section: {key: raw}}, environ={})
    if cls is StackSettings:
        monkeypatch.setenv("STREAMREC_STACK_HOST", raw)
        assert main(["stack", "up", "--state-dir", "/nonexistent/never-made"]) == 2
        assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.parametrize("cls, section, key", [
    (LearnerSettings, "learner", "checkpoint_dir"), (LearnerSettings, "learner", "deltas_dir"),
    (ServeSettings, "serve", "publish_root"), (StackSettings, "stack", "state_dir"),
    (RefreshSettings, "refresh", "checkpoint_dir"), (RefreshSettings, "refresh", "publish_root"),
])
def test_an_empty_path_is_an_error_not_the_working_directory(cls: type, section: str, key: str) -> None:
    for kw in ({"environ": {f"STREAMREC_{section.upper()}_{key.upper()}": ""}},
               {"file_data": {section: {key: ""}}, "environ": {}}, {"overrides": {key: ""}, "environ": {}}):
        with pytest.raises(SettingsError, match="empty path"):
            build(cls, section, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls, section", [(ServeSettings, "serve"), (LearnerSettings, "learner"),
                                          (RefreshSettings, "refresh")])
def test_an_empty_signing_key_file_is_an_error_only_an_absent_one_means_unsigned(cls: type, section: str) -> None:
    with pytest.raises(SettingsError, match="(?i)signing_key_file.*empty path"):
        build(cls, section, environ={f"STREAMREC_{section.upper()}_SIGNING_KEY_FILE": ""})
    assert build(cls, section, environ={}).signing_key_file is None  # type: ignore[attr-defined]


def test_an_empty_ca_location_is_an_error_not_the_system_store() -> None:
    with pytest.raises(SettingsError, match="(?i)ssl_ca_location.*empty path"):
        build(KafkaSettings, "kafka", environ={"STREAMREC_KAFKA_SSL_CA_LOCATION": ""})


def test_an_empty_dataset_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"\[replay\] dataset is empty"):
        ReplaySettings(dataset="")


def test_the_cli_refuses_an_empty_path_flag_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["stack", "status", "--state-dir", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamrec stack: error: --state-dir: ") and "empty path" in err[0]


@pytest.mark.parametrize("raw", ["/var/lib/streamrec/checkpoints\n", " /var/lib/streamrec/checkpoints",
                                 "/var/lib/streamrec/checkpoints\r\n", "/var/lib/streamrec/checkpoints\t"])
@pytest.mark.parametrize("cls, section, key", [
    (LearnerSettings, "learner", "checkpoint_dir"), (RefreshSettings, "refresh", "checkpoint_dir"),
    (ServeSettings, "serve", "signing_key_file"), (KafkaSettings, "kafka", "ssl_ca_location"),
])
def test_a_path_with_whitespace_around_it_is_an_error_not_another_directory(
        cls: type, section: str, key: str, raw: str) -> None:
    """A variable filled from a file (a Kubernetes ConfigMap key) ends in a line ending: the learner wrote its
    checkpoints into "checkpoints\\n", a directory beside the one the refresh read, and found none there on restart."""
    for kw in ({"environ": {f"STREAMREC_{section.upper()}_{key.upper()}": raw}},
               {"file_data": {section: {key: raw}}, "environ": {}}, {"overrides": {key: raw}, "environ": {}}):
        with pytest.raises(SettingsError, match=rf"(?i){key.replace('_', '[-_]')}.*space or a line ending around it"):
            build(cls, section, **kw)  # type: ignore[arg-type]
