"""A flag that overrides a setting says where its default comes from: ``--redis-url`` said "default
redis://127.0.0.1:16379/0" while the effective value is ``[redis] url`` of --config or STREAMREC_REDIS_URL, and only
without those the built-in one. Every such flag now reads "default: [section] key, else <built-in>"."""

from __future__ import annotations

import re

import pytest

from stream.config import RedisSettings
from streamrec.cli import build_parser, main
from streamrec.settings import _section_keys

# Flags whose help names a default that no setting overrides (argparse defaults, a rules file, --run-dir, the
# cold-start comparison's own knobs): "default ..." in them is the whole truth.
NO_SETTING = {
    "replay": {"--user-col", "--item-col", "--time-col", "--time-unit", "--impression-id-col", "--clicked-col",
               "--csv-delimiter"},
    "audit": {"--idle-timeout", "--group"},
    "counts": {"--event", "--day", "--days", "--k"},
    "evaluate": {"--dataset", "--capacity", "--buckets", "--admit-after", "--boost", "--cold-k", "--init",
                 "--user-bucket-half-life-s", "--new-user-impressions", "--new-user-session-s", "--features", "--seed"},
    "monitor": {"--rules", "--interval", "--state-path", "--metrics-host", "--log-level"},
    "join": {"--log-level"}, "train": {"--log-level"}, "serve": {"--log-level"},
    "report": {"--out", "--pid"},
}
SETTING_DEFAULT = re.compile(r"default: \[(\w+)\] (\w+), else \S")


def helps() -> list[tuple[str, str, str]]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return [(name, a.option_strings[-1], " ".join(a.help.split()))
            for name, p in sub.choices.items() for a in p._actions
            if a.option_strings and a.help and a.dest not in ("config", "help")]


@pytest.mark.parametrize("command", ["counts", "join", "refresh", "serve"])
def test_redis_url_help_names_the_setting_before_the_built_in_default(command: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: [redis] url, else {RedisSettings.url}" in text


def test_every_flag_stating_a_default_names_its_setting_or_has_none() -> None:
    wrong = [f"{name} {flag}: {text}" for name, flag, text in helps()
             if "default" in text.lower() and not SETTING_DEFAULT.search(text)
             and flag not in NO_SETTING.get(name, set())]
    assert not wrong, "\n".join(wrong)


def test_the_settings_the_help_names_exist() -> None:
    keys = _section_keys()
    named = [(name, flag, m) for name, flag, text in helps() for m in SETTING_DEFAULT.findall(text)]
    assert len(named) > 40
    assert [x for x in named if x[2][1] not in keys.get(x[2][0], ())] == []


def test_every_option_of_every_command_has_a_help_text() -> None:
    """``--log-level`` of join, train and serve had none (their --help listed the choices and nothing else)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    bare = [f"{name} {a.option_strings[-1]}" for name, p in sub.choices.items() for a in p._actions
            if a.option_strings and not (a.help or "").strip()]
    assert not bare, bare
