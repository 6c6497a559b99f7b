"""A settings file as operators write it: an editor that saves UTF-8 with a byte order mark (Notepad) made every
command refuse a valid file with "Invalid statement (at line 1, column 1)", not a word of the mark; a misspelt key
or a key under another section's table was refused with the whole list of the section's keys, the one meant not
named."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.config import LearnerSettings
from monitor.rules import load_rules
from stream.config import KafkaSettings, RedisSettings
from stream.joiner.config import JoinerSettings
from streamrec.settings import SettingsError, build, read_config_file

BOM = b"\xef\xbb\xbf"


def test_a_config_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    f = tmp_path / "streamrec.toml"
    f.write_bytes(BOM + b'[kafka]\r\nbootstrap_servers = "broker:9092"\r\n')
    data = read_config_file(f)
    assert build(KafkaSettings, "kafka", data, {}).bootstrap_servers == "broker:9092"


def test_a_rules_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    f = tmp_path / "rules.toml"
    f.write_bytes(BOM + b"interval_s = 30\r\n")
    assert load_rules(f).interval_s == 30


def test_a_misspelt_key_in_the_file_names_the_closest_known_key() -> None:
    with pytest.raises(SettingsError, match=r"unknown key 'bootstrap_server' in \[kafka\]; did you mean "
                                            r"'bootstrap_servers'\?"):
        build(KafkaSettings, "kafka", {"kafka": {"bootstrap_server": "h:1"}}, {})


def test_a_misspelt_environment_variable_names_the_closest_known_one() -> None:
    with pytest.raises(SettingsError, match="STREAMREC_LEARNER_CHECKPOINT_EVERY does not name a \\[learner\\] "
                                            "setting; did you mean STREAMREC_LEARNER_CHECKPOINT_EVERY_S\\?"):
        build(LearnerSettings, "learner", {}, {"STREAMREC_LEARNER_CHECKPOINT_EVERY": "5"})


def test_a_key_under_another_sections_table_names_every_section_it_belongs_to() -> None:
    with pytest.raises(SettingsError, match=r"unknown key 'embedding_dim' in \[kafka\]; did you mean "
                                            r"\[learner\] embedding_dim or \[evaluate\] embedding_dim\?"):
        build(KafkaSettings, "kafka", {"kafka": {"embedding_dim": 16}}, {})


def test_a_variable_of_another_section_names_every_variable_it_belongs_to() -> None:
    with pytest.raises(SettingsError, match="STREAMREC_KAFKA_EMBEDDING_DIM does not name a \\[kafka\\] setting; "
                                            "did you mean STREAMREC_LEARNER_EMBEDDING_DIM or "
                                            "STREAMREC_EVALUATE_EMBEDDING_DIM\\?"):
        build(KafkaSettings, "kafka", {}, {"STREAMREC_KAFKA_EMBEDDING_DIM": "16"})


def test_a_key_like_no_known_one_is_refused_without_a_guess() -> None:
    with pytest.raises(SettingsError, match=r"unknown key 'x' in \[learner\]; known keys: ") as err:
        build(LearnerSettings, "learner", {"learner": {"x": 1}}, {})
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize(("section", "cls", "var", "raw"), [
    ("learner", LearnerSettings, "STREAMREC_LEARNER_GROUP_ID", "streamrec-learner\n"),
    ("joiner", JoinerSettings, "STREAMREC_JOINER_APP_ID", " streamrec-joiner"),
    ("redis", RedisSettings, "STREAMREC_REDIS_PREFIX", "streamrec\n"),
])
def test_a_group_or_key_prefix_with_space_around_it_is_refused_not_a_new_group_or_keyspace(
        section: str, cls: type, var: str, raw: str) -> None:
    """A variable filled from a file (a trailing line ending) named another consumer group than the one that holds
    the committed offsets (the learner re-read the topic from its reset point, silently), or another Redis keyspace
    than the other stages' (serving read none of the learner's rows)."""
    with pytest.raises(SettingsError, match=f"space or a line ending around it.*set by environment {var}"):
        build(cls, section, {}, {var: raw})
