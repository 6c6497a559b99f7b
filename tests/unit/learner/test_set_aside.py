"""``checkpoint.set_aside``: a checkpoint the learner's restore fell back past is never listed again, even when it
cannot be renamed, and the ones set aside are pruned by count."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner import checkpoint as ck


def test_a_checkpoint_that_cannot_be_renamed_aside_is_still_never_listed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename of the damaged newest checkpoint fails (EPERM: a sticky directory, a file of another owner); it was
    only logged, so every later restart fell back past it again and resent every row to serving."""
    good, bad = tmp_path / "ckpt-000000000000016-1.pt", tmp_path / "ckpt-000000000000024-2.pt"
    for p in (good, bad):
        p.write_bytes(b"x")
    real = Path.rename

    def refuse(self: Path, target: Path | str) -> Path:
        if self == bad:
            raise PermissionError(1, "Operation not permitted", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refuse)
    ck.set_aside([bad])
    assert bad.exists() and ck.list_checkpoints(tmp_path) == [good]


def test_save_keeps_the_newest_keep_checkpoints_set_aside_with_their_sidecars(tmp_path: Path) -> None:
    aside = [tmp_path / f"ckpt-{n:015d}-{n}.pt" for n in (100, 200, 300)]
    for p in aside:
        p.write_bytes(b"x")
        p.with_suffix(".json").write_text("{}")
    ck.set_aside(aside)
    ck.save(tmp_path, {"model": {}}, {"samples_trained": 5}, keep=2)
    left = sorted(p.name for p in tmp_path.glob(f"*{ck.DAMAGED}"))
    assert left == [p.name + ck.DAMAGED for p in aside[1:] for p in (p.with_suffix(".json"), p)]
