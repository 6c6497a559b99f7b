"""A scrape source or webhook URL holding a control character or whitespace is refused where the rules load."""

import json
from pathlib import Path

import pytest

from monitor.rules import loads_rules
from stream.errors import ConfigError
from streamrec.cli import main

BAD = ["http://\x00/", "http://a\nb/metrics", "http://a b/metrics", "http://h:9102/met\x7frics", "http://h/\x85",
       "http://h/\u2028", "http://h/\t"]


@pytest.mark.parametrize("url", BAD)
@pytest.mark.parametrize("table, key", [("sources", "learner"), ("sinks", "webhook_url")])
def test_a_url_with_a_control_character_or_space_is_refused_escaped(table: str, key: str, url: str) -> None:
    with pytest.raises(ConfigError, match=rf'field "{key}": .*control character or space') as err:
        loads_rules(f"[{table}]\n{key} = {json.dumps(url)}\n")
    text = str(err.value)
    assert text.isprintable(), text  # every control character (and line break) escaped
    assert json.dumps(next(c for c in url if not c.isprintable() or c.isspace()))[1:-1] in text


@pytest.mark.parametrize("table, key", [("sources", "learner"), ("sinks", "webhook_url")])
def test_the_password_of_a_refused_url_is_not_shown(table: str, key: str) -> None:
    for url in ("http://user:pa ss-word@h/m", "http://user:s3cr3t-word@h\x01/m"):
        with pytest.raises(ConfigError) as err:
            loads_rules(f"[{table}]\n{key} = {json.dumps(url)}\n")
        assert "ss-word" not in str(err.value) and "s3cr3t" not in str(err.value), str(err.value)


def test_monitor_once_with_a_nul_in_a_source_url_is_exit_2_at_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it was accepted: every scrape failed, --once exited 1 and printed the NUL raw
    path = tmp_path / "rules.toml"
    path.write_text('[sources]\nlearner = "http://\\u0000/"\n[[rule]]\nname = "r"\nexpr = "up"\nop = ">"\n'
                    "threshold = 0.5\n")
    assert main(["monitor", "--once", "--rules", str(path)]) == 2
    err = capsys.readouterr().err
    assert "\x00" not in err and "\\u0000" in err
