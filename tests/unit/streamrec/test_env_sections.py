"""A STREAMREC_ variable that misspells a section (STREAMREC_KAFAK_BOOTSTRAP_SERVERS) or leaves it out
(STREAMREC_BOOTSTRAP_SERVERS) was never read: the process ran on the default silently. Now it is an error naming
the spelling that would be read; variables that are no setting (the test hooks' STREAMREC_TEST_*) stay allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrec.cli import main
from streamrec.settings import KafkaSettings, SettingsError, Sources

# Variables the test suite and tools set under STREAMREC_ that are not settings: none may be refused.
NOT_SETTINGS = ["STREAMREC_TEST_KILL_AT", "STREAMREC_TEST_DELIVERY_LOG", "STREAMREC_TEST_PUBLISH_FAULT",
                "STREAMREC_TEST_FAIL_BATCH", "STREAMREC_TEST_DISK_FULL", "STREAMREC_FUZZ_SCALE",
                "STREAMREC_FUZZ_EXAMPLES", "STREAMREC_VARIANTS", "STREAMREC_T_EXTRA"]


@pytest.mark.parametrize(("var", "suggested"), [
    ("STREAMREC_KAFAK_BOOTSTRAP_SERVERS", "STREAMREC_KAFKA_BOOTSTRAP_SERVERS"),
    ("STREAMREC_REDDIS_URL", "STREAMREC_REDIS_URL"),
    ("STREAMREC_SERVER_PORT", "STREAMREC_SERVE_PORT"),
    ("STREAMREC_LERNER_CHECKPOINT_DIR", "STREAMREC_LEARNER_CHECKPOINT_DIR"),
])
def test_a_misspelled_section_is_an_error_with_the_spelling_that_is_read(var: str, suggested: str) -> None:
    with pytest.raises(SettingsError, match=rf"{var} is not read: .*did you mean {suggested}\?"):
        Sources(environ={var: "x"})


def test_a_setting_without_its_section_is_an_error_naming_the_sections_that_have_it() -> None:
    with pytest.raises(SettingsError, match=r"did you mean STREAMREC_KAFKA_BOOTSTRAP_SERVERS\?"):
        Sources(environ={"STREAMREC_BOOTSTRAP_SERVERS": "x:1"})
    with pytest.raises(SettingsError, match=r"STREAMREC_REPLAY_SEED or STREAMREC_LEARNER_SEED"):
        Sources(environ={"STREAMREC_SEED": "7"})


def test_variables_that_are_not_settings_stay_allowed() -> None:
    src = Sources(environ={**{v: "1" for v in NOT_SETTINGS}, "STREAMREC_KAFKA_BOOTSTRAP_SERVERS": "h:1",
                           "OTHER_KAFAK_X": "1"})
    assert src.build(KafkaSettings, "kafka").bootstrap_servers == "h:1"


def test_the_cli_exits_2_on_a_misspelled_section(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STREAMREC_KAFAK_BOOTSTRAP_SERVERS", "x:1")
    assert main(["stack", "status", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrec stack: error: environment: STREAMREC_KAFAK_BOOTSTRAP_SERVERS is not read")
    assert "STREAMREC_KAFKA_BOOTSTRAP_SERVERS" in err
