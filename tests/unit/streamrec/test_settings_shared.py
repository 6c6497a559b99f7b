"""Settings that one command owns and another reads (where the learner writes checkpoints and deltas, where the
refresh publishes, the signing key) come from the owner's section when the reader's own section does not give them:
one ``--config`` file configures every command, and the refresh read its built-in ``.streamrec/checkpoints`` while the
README's example file set ``[learner] checkpoint_dir`` only."""

from __future__ import annotations

import re
from pathlib import Path

from cache_refresh.settings import RefreshSettings
from serving.settings import ServeSettings
from streamrec.settings import build, read_config_file

README = Path(__file__).resolve().parents[3] / "README.md"


def test_the_readme_example_file_gives_the_refresh_and_serving_the_learners_directories(tmp_path: Path) -> None:
    found = re.search(r"```toml\n# streamrec.toml\n(.*?)```", README.read_text(), re.S)
    assert found, "README's example settings file (```toml # streamrec.toml) not found"
    (tmp_path / "streamrec.toml").write_text(found.group(1))
    example = read_config_file(tmp_path / "streamrec.toml")
    refresh = build(RefreshSettings, "refresh", example, {})
    serve = build(ServeSettings, "serve", example, {})
    assert refresh.checkpoint_dir == Path(example["learner"]["checkpoint_dir"])
    assert serve.publish_root == refresh.publish_root and serve.deltas_dir == Path(example["learner"]["deltas_dir"])


def test_a_commands_own_setting_file_environment_or_flag_replaces_the_owners() -> None:
    file = {"learner": {"checkpoint_dir": "/l/ckpt", "deltas_dir": "/l/deltas", "signing_key_file": "/l/key"},
            "refresh": {"publish_root": "/r/serving"}}
    refresh = build(RefreshSettings, "refresh", file, {})
    assert (refresh.checkpoint_dir, refresh.signing_key_file) == (Path("/l/ckpt"), Path("/l/key"))
    serve = build(ServeSettings, "serve", file, {})
    assert (serve.publish_root, serve.deltas_dir, serve.signing_key_file) == (
        Path("/r/serving"), Path("/l/deltas"), Path("/l/key"))
    # the owner's environment variable over its file, as for the owner itself
    env = {"STREAMREC_LEARNER_CHECKPOINT_DIR": "/env/ckpt"}
    assert build(RefreshSettings, "refresh", file, env).checkpoint_dir == Path("/env/ckpt")
    # the reader's own file, environment and flag over anything the owner gives
    own = {**file, "refresh": {"publish_root": "/r/serving", "checkpoint_dir": "/r/ckpt"}}
    assert build(RefreshSettings, "refresh", own, env).checkpoint_dir == Path("/r/ckpt")
    assert build(RefreshSettings, "refresh", file, {**env, "STREAMREC_REFRESH_CHECKPOINT_DIR": "/re"}
                 ).checkpoint_dir == Path("/re")
    assert build(RefreshSettings, "refresh", file, env, {"checkpoint_dir": "/flag"}).checkpoint_dir == Path("/flag")
    assert build(ServeSettings, "serve", {**file, "serve": {"deltas_dir": "none"}}, {}).deltas_dir is None


def test_without_the_owners_setting_the_built_in_default_stays() -> None:
    assert build(RefreshSettings, "refresh", {}, {}).checkpoint_dir == RefreshSettings().checkpoint_dir
    assert build(ServeSettings, "serve", {}, {}).deltas_dir is None
