"""A URL's password in a setting of the wrong shape or type is not shown in part where the error cuts the value short.

The errors quote a bad value bounded (``stream.errors.shown``, the monitor rules' ``_shown``: reprlib keeps a long
string's head and tail, a long text is cut at its limit); the CLI's redaction came after the cut, and a cut that took
the ``@`` ending the user-info left the password's head unmasked (``'redis://u:Pw0rdABCD...cluster.local:6379/0'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from stream import secrets
from stream.secrets import _KV_SECRET, redact
from streamrec.cli import main
from tests.unit.stream.test_secrets import refused_settings_stderr

PASSWORD = "Pw0rdHEAD" + "x" * 150  # a long token (a JWT or an API key as the password)
HOST = "redis-0.redis.streamrec.svc.cluster.local:6379/0"  # a Kubernetes service name: longer than reprlib's tail
REDIS_URL = f"redis://streamrec:{PASSWORD}@{HOST}"
SOURCE_URL = f"https://monitor:{PASSWORD}@serving-0.serving.streamrec.svc.cluster.local:9102/metrics"


@pytest.mark.parametrize("toml", [
    f"[redis]\nurl = [{json.dumps(REDIS_URL)}]\n",  # an array where one value belongs: reprlib's head ... tail
    f"[redis]\nurl = {{ value = {json.dumps(REDIS_URL)} }}\n",  # a table
    f"[redis]\ncounts_ttl_days = {json.dumps(REDIS_URL)}\n",  # the url in a number's place: cut at its limit
], ids=["array", "table", "wrong-setting"])
def test_a_settings_error_quoting_a_url_of_the_wrong_shape_shows_no_part_of_its_password(
        toml: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused_settings_stderr(toml, tmp_path, monkeypatch, capsys)
    assert "Pw0rd" not in err and "xxxxx" not in err, err
    assert "[redis]" in err and "***@" in err, err  # still says which setting, and that a user-info was there


@pytest.mark.parametrize("rules", [
    f"[sources]\nserving = [{json.dumps(SOURCE_URL)}]\n",  # an array where one URL belongs
    f"sources = [\"http://learner:9101/metrics\", {json.dumps(SOURCE_URL)}]\n",  # [sources] not a table
    f"interval_s = {json.dumps(SOURCE_URL)}\n",  # a URL in a number's place
], ids=["source-array", "sources-array", "wrong-field"])
def test_a_rules_error_quoting_a_source_url_of_the_wrong_shape_shows_no_part_of_its_password(
        rules: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(rules)
    assert main(["monitor", "--check", "--rules", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Pw0rd" not in err and "xxxxx" not in err, err
    assert "alert rules file" in err and "***@" in err, err


@pytest.mark.parametrize("run", ["a." * 512 + "password", "a-" * 512 + "token", "x.password" * 100])
def test_a_long_run_of_key_characters_is_tried_as_a_credential_key_from_its_first_character_only(run: str) -> None:
    """shown() scrubs up to 8192 characters of a bad message's value per call (redact_for_cut), and the pair pattern
    was tried from every word boundary inside a run of [\\w.-], each try scanning the rest of the run: 'a.' * 2048
    took 1.3 s per scrub, so a flood of such messages held the decoder. A key is now the whole run, tried once from
    its first character: a try that begins inside the run (each '.' or '-' made one) finds no key."""
    text = f"{run}=hunter22"
    assert redact(text) == f"{run}=***"
    assert [i for i in range(1, len(run)) if _KV_SECRET.match(text, i) is not None] == []


@pytest.mark.parametrize("text", ["a.password=hunter22", "x-sasl.password: 'hunter22'", "1.token=abc&b=2",
                                  "db_password_file=/run/s", "my.api-key = 'k3y'", "PASSWORD=x,token:y"])
def test_a_key_naming_a_credential_anywhere_in_its_run_is_still_masked(text: str) -> None:
    assert redact(text) == {"a.password=hunter22": "a.password=***",
                            "x-sasl.password: 'hunter22'": "x-sasl.password: '***'",
                            "1.token=abc&b=2": "1.token=***&b=2",
                            "db_password_file=/run/s": "db_password_file=/run/s",
                            "my.api-key = 'k3y'": "my.api-key = '***'",
                            "PASSWORD=x,token:y": "PASSWORD=***,token:***"}[text]


def test_a_url_user_info_is_tried_from_the_start_of_its_scheme_characters_only() -> None:
    """The scheme (\\b then scheme characters, then '://') was tried at each word boundary of a run of scheme
    characters, each try scanning the rest of the run: 'a.' * 2048 cost its length squared in every scrub of a bad
    message's value (redact_for_cut). Tried from the run's first character only, the masking is the same."""
    text = "a." * 300 + "redis://u:pw0rdSECRET@h:6379"
    assert redact(text) == "a." * 300 + "redis://***@h:6379"
    assert [i for i in range(1, 600) if secrets._URL_USERINFO.match(text, i) is not None] == []


class _Recorded:
    """A stand-in for the user-info pattern that records the length of each text it is given to scrub."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.lengths: list[int] = []

    def sub(self, repl: Callable[[re.Match[str]], str], text: str) -> str:
        self.lengths.append(len(text))
        return self.pattern.sub(repl, text)


def test_a_url_user_info_is_searched_only_in_a_token_up_to_its_last_at_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its user-info runs to the last '@' of a whitespace-delimited token, and was searched from every '://' in the
    whole text, each try scanning the rest of the token: 'a://' * 1024 (no '@') cost its length squared per scrub.
    Only a token's text up to its last '@', and only one with a '://' in it, is searched now."""
    recorded = _Recorded(secrets._URL_USERINFO)
    monkeypatch.setattr(secrets, "_URL_USERINFO", recorded)
    assert redact("a://" * 1024) == "a://" * 1024
    assert redact("see redis://u:pw0rdSECRET@h/0" + "a://" * 1024) == "see redis://***@h/0" + "a://" * 1024
    assert recorded.lengths == [len("redis://u:pw0rdSECRET@")]
