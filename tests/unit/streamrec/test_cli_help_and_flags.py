"""Small command-line items of the CLI audit: ``serve --no-reuse-port`` overrides ``reuse_port = true`` of the
config file (``--reuse-port`` was store_true only), and every command's ``--config`` help names every section."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from serving.settings import ServeSettings
from streamrec.cli import build_parser, main
from streamrec.settings import SECTIONS, Sources


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--reuse-port"], True), (["--no-reuse-port"], False)])
def test_no_reuse_port_overrides_the_config_file(argv: list[str], expected: bool) -> None:
    args = build_parser().parse_args(["serve", *argv])
    src = Sources(file_data={"serve": {"reuse_port": True}}, environ={})
    assert src.build(ServeSettings, "serve", reuse_port=args.reuse_port).reuse_port is expected


def test_every_commands_config_help_names_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(f"[{s}]" in text for s in SECTIONS), name


def test_serve_help_names_every_serve_setting(capsys: pytest.CaptureFixture[str]) -> None:
    # max_request_values and signing_key_file were in no line of `streamrec serve --help`
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    unnamed = [f.name for f in fields(ServeSettings) if f.name not in text]
    assert unnamed == []


def test_data_without_an_action_names_only_the_action_as_required(capsys: pytest.CaptureFixture[str]) -> None:
    # `streamrec data` said "the following arguments are required: action, names", but names are optional
    # (default: all): argparse makes a nargs="*" positional without a default required
    with pytest.raises(SystemExit) as exc:
        main(["data"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("the following arguments are required: action")


def test_every_flag_with_a_built_in_value_names_it_in_its_help() -> None:
    # `streamrec audit --help` did not say that --group defaults to streamrec-audit (the group whose committed
    # offsets a first run starts from)
    import argparse

    silent = (argparse._HelpAction, argparse._SubParsersAction, argparse._StoreTrueAction,
              argparse._StoreFalseAction, argparse.BooleanOptionalAction)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    unnamed = [f"{name} {a.option_strings or a.dest}" for name, parser in sub.choices.items() for a in parser._actions
               if not isinstance(a, silent) and a.default not in (None, False, "", [], argparse.SUPPRESS)
               and "default" not in (a.help or "")]
    assert unnamed == []


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_stdout_whose_reader_left_is_exit_1_without_a_traceback(unbuffered: str) -> None:
    # `streamrec stack status --json | head -c 100`: a traceback ending in BrokenPipeError (PYTHONUNBUFFERED=1), or
    # "Exception ignored ... BrokenPipeError" and exit status 120 from Python's flush at exit (buffered stdout)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | (
        {"PYTHONUNBUFFERED": unbuffered} if unbuffered else {})
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the summary is written
    try:
        proc = subprocess.run([sys.executable, "-m", "streamrec.cli", "stack", "status", "--json"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


@pytest.mark.parametrize(("argv", "named"), [
    (["--cold-start", "--features", "paper"], "--features"),  # the cold-start comparison never read it
    (["--cold-start", "--history-delay-s", "60", "--epochs", "3"], "--history-delay-s, --epochs"),
    (["--protocol", "online", "--capacity", "5"], "--capacity"),  # nor the protocols the cold-start settings
    (["--protocol", "autoint", "--variants", "zero"], "--variants"),
])
def test_evaluate_refuses_a_flag_the_chosen_mode_does_not_read(argv: list[str], named: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``evaluate --cold-start --features paper`` ran the cold-start comparison on its own features and said nothing
    of the flag: a result the user took for the paper features'. A flag only the other mode reads is exit 2."""
    assert main(["evaluate", *argv]) == 2
    assert f"{named}: not read" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["join", "train", "serve", "report"])
def test_an_unknown_flag_of_a_subcommand_is_its_usage_error_naming_it(name: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """argparse reported a subcommand's unknown flag from the top parser: "streamrec: error:" and its usage, where
    every other usage error of the subcommand says "streamrec <command>: error:" with the subcommand's usage."""
    with pytest.raises(SystemExit) as exc:
        main([name, "--bogus", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: streamrec {name} ")
    assert err.splitlines()[-1] == f"streamrec {name}: error: unrecognized arguments: --bogus x"


def test_a_subcommands_flag_given_before_the_subcommand_is_the_top_parsers_error_not_blamed_on_the_subcommand(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``streamrec --json train``: train reads --json, the top parser does not. Every unknown argument was reported as
    the subcommand's ("streamrec train: error: unrecognized arguments: --json"), telling the user that train has no
    --json; it is the top parser's (as before that change)."""
    with pytest.raises(SystemExit) as exc:
        main(["--json", "train", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: streamrec [-h] COMMAND")
    assert err.splitlines()[-1] == "streamrec: error: unrecognized arguments: --json"


class _Built(Exception):
    """Raised by the stand-in service: ``streamrec serve`` got as far as building it."""


def test_serve_checks_requests_against_the_limits_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scoring service gets ``[limits]`` (the joiner's bounds on ids and context), not the built-in defaults."""
    import serving.service

    got: dict[str, Any] = {}

    def service(*args: Any, **kwargs: Any) -> None:
        got.update(kwargs)
        raise _Built

    monkeypatch.setattr(serving.service, "ScoringService", service)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STREAMREC_LIMITS_MAX_STR_LEN", "512")
    with pytest.raises(_Built):
        main(["serve", "--no-redis", "--publish-root", str(tmp_path)])
    assert got["limits"].max_str_len == 512


def test_replay_of_an_event_log_checks_rows_against_the_limits_section(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``streamrec replay --dataset FILE`` checks rows against ``[limits]`` (the joiner's), not the built-in defaults:
    with max_str_len raised to 512 a 300-char user id is published, not dead-lettered at the source."""
    import stream.replay.publisher

    got: dict[str, Any] = {}

    def publish(table: Any, *args: Any, **kwargs: Any) -> None:
        got["table"] = table
        raise _Built

    monkeypatch.setattr(stream.replay.publisher, "publish", publish)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log.csv").write_text(f"user_id,item_id,ts\n{'u' * 300},7,1000\n")
    monkeypatch.setenv("STREAMREC_LIMITS_MAX_STR_LEN", "512")
    with pytest.raises(_Built):
        main(["replay", "--dataset", str(tmp_path / "log.csv"), "--time-unit", "ms", "--clicked-col", "",
              "--no-progress"])
    assert got["table"].n_impressions == 1 and got["table"].stats["rejected_rows"] == 0


@pytest.mark.parametrize("argv", [
    ["counts", "top", "--kind", "item", "--redis-ulr", "redis://u:Sup3rSecretPW@127.0.0.1:1/0"],  # a mistyped flag
    ["counts", "top", "--kind", "item", "--k", "redis://u:Sup3rSecretPW@127.0.0.1:1/0"],  # a value in the wrong place
])
def test_a_usage_error_quoting_a_url_does_not_print_its_password(argv: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's usage errors quote what was typed ("unrecognized arguments: ...", "invalid int value: ..."): a
    Redis url's password reached stderr (and the journal or CI log collecting it) in clear, where every other CLI
    error line is scrubbed of credentials (README: Security)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Sup3rSecretPW" not in err
    assert "redis://***@127.0.0.1:1/0" in err  # still says which argument it was


def test_every_positional_and_flag_of_every_subcommand_says_what_it_does() -> None:
    # `streamrec stack --help` listed "{up,down,status}" with no word on it, as did data's and counts's action
    import argparse

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    silent = [f"{name} {a.option_strings or a.dest}" for name, parser in sub.choices.items() for a in parser._actions
              if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert silent == []
