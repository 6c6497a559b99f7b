"""learner/sharded_checkpoint.py: what the checks of a sharded checkpoint's parts read, and a ``meta.json`` whose
recorded checksums are not a mapping of file -> sha256 hex (hand-edited, written by another tool)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from learner import checkpoint, sharded_checkpoint


def _save(directory: Path, step: int) -> Path:
    """A one-process sharded checkpoint (no process group: DCP writes ``__0_0.distcp`` and ``.metadata``)."""
    return sharded_checkpoint.save(directory, {"model": {"w": torch.full((8,), float(step))}}, {"step": step},
                                   {"samples_trained": step, "world_size": 1}, 0)


def _with_sums(path: Path, sums: Any) -> None:
    meta = json.loads((path / sharded_checkpoint.META).read_text())
    meta["sha256"] = sums
    (path / sharded_checkpoint.META).write_text(json.dumps(meta))


WRONG_SHAPES: dict[str, Any] = {
    "list": [".metadata", "__0_0.distcp"],
    "list_of_pairs": [["__0_0.distcp", "0" * 64]],  # dict() of it would have made a mapping
    "string": "ab",  # dict("ab") raised ValueError
    "number": 5,
    "empty_list": [],  # (falsy: was read as no checksums at all)
    "zero": 0,
    "mapping_to_numbers": {".metadata": 5, "__0_0.distcp": 6},
    "mapping_to_lists": {".metadata": ["0" * 64]},
    "short_hex": {".metadata": "abc"},
    "long_hex": {".metadata": "0" * 65},
    "not_hex": {".metadata": "z" * 64},
    "outside_file": {"/etc/hostname": "0" * 64},  # not one of the checkpoint's files: never read
}


@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_recorded_checksums_of_the_wrong_shape_are_a_damaged_meta_named_with_the_reason(
        tmp_path: Path, shape: str) -> None:
    _save(tmp_path, 100)
    newer = _save(tmp_path, 200)
    _with_sums(newer, WRONG_SHAPES[shape])
    with pytest.raises(checkpoint.CheckpointError) as refused:
        sharded_checkpoint.latest(tmp_path)
    text = str(refused.value)
    assert str(newer) in text and "meta.json (its sha256 entry" in text and "the one before it" in text
    with pytest.raises(checkpoint.CheckpointError, match=r"meta\.json \(its sha256 entry"):
        sharded_checkpoint.unshard(tmp_path, tmp_path / "single")


def test_recorded_checksums_that_are_sound_still_load_and_none_at_all_is_a_checkpoint_from_before_them(
        tmp_path: Path) -> None:
    path = _save(tmp_path, 100)
    assert sharded_checkpoint.latest(tmp_path) is not None
    _with_sums(path, None)  # written before the checksums: sizes only
    assert sharded_checkpoint.latest(tmp_path) is not None


def test_train_status_checks_a_sharded_checkpoint_by_sizes_without_reading_its_data_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--status`` hashed every data file of the newest sharded checkpoint (about 1 s per 800 MiB) to print its
    metadata; restore and ``--unshard`` still check every sha256."""
    from streamrec.cli import main

    path = _save(tmp_path, 100)
    hashed: list[str] = []
    real = sharded_checkpoint.sha256_file
    monkeypatch.setattr(sharded_checkpoint, "sha256_file",
                        lambda p: hashed.append(Path(p).name) or real(p))  # type: ignore[func-returns-value]
    assert main(["train", "--status", "--json", "--checkpoint-dir", str(tmp_path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert hashed == []
    assert status["samples_trained"] == 100 and status["path"] == str(path)
    assert status["checksums"].startswith("not verified")
    assert main(["train", "--status", "--checkpoint-dir", str(tmp_path)]) == 0
    assert "checksums: not verified" in capsys.readouterr().out and hashed == []

    assert sharded_checkpoint.latest(tmp_path) is not None  # a restore's check: every file hashed
    assert sorted(hashed) == [".metadata", "__0_0.distcp"]
    hashed.clear()
    with open(path / "__0_0.distcp", "r+b") as fh:  # --status still sees a torn part, by its size
        fh.truncate(10)
    assert main(["train", "--status", "--checkpoint-dir", str(tmp_path)]) != 0
    assert "__0_0.distcp (10 of its" in capsys.readouterr().err and hashed == []


@pytest.mark.parametrize(("text", "reason"), [("[1, 2]", "holds a list, not a JSON object"),
                                              ("{torn", "is not JSON")])
def test_a_meta_json_that_is_not_a_json_object_is_a_damaged_checkpoint_named_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, reason: str) -> None:
    """``[1, 2]`` in meta.json raised a raw AttributeError (``list.get``) and ``{torn`` a raw JSONDecodeError from
    ``latest()``: the restore, ``--unshard`` and ``train --status`` each ended in a traceback."""
    from streamrec.cli import main

    _save(tmp_path, 100)
    newer = _save(tmp_path, 200)
    (newer / sharded_checkpoint.META).write_text(text)
    for refused in (lambda: sharded_checkpoint.latest(tmp_path),
                    lambda: sharded_checkpoint.unshard(tmp_path, tmp_path / "single")):
        with pytest.raises(checkpoint.CheckpointError) as caught:
            refused()
        said = str(caught.value)
        assert str(newer) in said and f"meta.json {reason}" in said and "the one before it" in said
    assert main(["train", "--status", "--checkpoint-dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert f"meta.json {reason}" in err and "Traceback" not in err


MISTYPED_FIELDS: dict[str, tuple[str, Any]] = {  # id -> (field, value; ... is the key left out)
    "world_size_text": ("world_size", "two"), "world_size_negative": ("world_size", -1),
    "world_size_zero": ("world_size", 0), "world_size_bool": ("world_size", True),
    "world_size_float": ("world_size", 2.5), "world_size_missing": ("world_size", ...),
    "format_version_text": ("format_version", "x"), "format_version_bool": ("format_version", True),
    "format_version_negative": ("format_version", -1),
    "samples_trained_text": ("samples_trained", "many"), "samples_trained_missing": ("samples_trained", ...),
    # what the restore and --unshard read besides (a raw ValueError, TypeError or AttributeError deep inside them)
    "steps_text": ("steps", "7"), "steps_negative": ("steps", -1), "duplicates_float": ("duplicates", 1.5),
    "metrics_window_text": ("metrics_window", "big"), "offsets_list": ("offsets", [5]),
    "offsets_text_offset": ("offsets", {"0": "x"}), "offsets_negative_partition": ("offsets", {"-1": 5}),
    "offsets_negative": ("offsets", {"0": -2}), "partition_rows_text": ("partition_rows", "all"),
    "partition_rows_float": ("partition_rows", {"0": 2.5}), "feature_config_list": ("feature_config", [1]),
    "feature_config_no_fields": ("feature_config", {"embedding_dim": 8}),
    "feature_config_bad_field": ("feature_config", {"fields": [{"name": "u", "num_buckets": "9"}], "embedding_dim": 8}),
    "model_text": ("model", "deepfm"), "model_no_rates": ("model", {"mlp": "8"}),
    "model_text_rate": ("model", {"mlp": "8", "lr_sparse": "fast", "lr_dense": 0.1}),
    "model_bad_mlp": ("model", {"mlp": "wide", "lr_sparse": 0.1, "lr_dense": 0.1}),
    "shape_list": ("shape", ["mlp"]), "topic_number": ("topic", 5), "lineage_number": ("lineage", 5),
    "lineage_not_an_id": ("lineage", "abc"),
    "delta_seq_text": ("delta_seq", "3"),
}

SOUND = {"steps": 3, "offsets": {"0": 10, "1": 0}, "partition_rows": {"0": 10}, "duplicates": 0, "metrics_window": 100,
         "model": {"mlp": "8", "lr_sparse": 0.05, "lr_dense": 0.001, "dropout": 0.0}, "shape": {"mlp": "8"},
         "topic": "samples", "lineage": "0123456789abcdef0123456789abcdef", "delta_seq": None}


def _sound_meta() -> dict[str, Any]:
    from learner.features import default_config

    return {**SOUND, "feature_config": default_config({"city": "single"}, buckets=10, ctx_buckets=4,
                                                      embedding_dim=4).to_dict()}


def _edit_meta(path: Path, **fields: Any) -> None:
    meta = json.loads((path / sharded_checkpoint.META).read_text())
    meta.update(fields)
    (path / sharded_checkpoint.META).write_text(json.dumps(meta))


@pytest.mark.parametrize("field", sorted([*SOUND, "feature_config"]))
def test_a_field_the_restore_reads_missing_is_a_damaged_checkpoint_at_restore_and_unshard_not_a_key_error(
        tmp_path: Path, field: str) -> None:
    """Every sharded checkpoint ever written records these (``git log -p learner/sharded_daemon.py``; ``delta_seq``
    and ``metrics_window`` may be absent: read as null and the default); one left out of a hand-edited meta.json
    ended ``--unshard`` (and the ranks' restore) in a raw KeyError. ``train --status`` prints what there is."""
    _save(tmp_path, 100)
    newer = _save(tmp_path, 200)
    _edit_meta(newer, **_sound_meta())
    assert sharded_checkpoint.latest(tmp_path, restore=True) is not None  # sound: passes
    raw = json.loads((newer / sharded_checkpoint.META).read_text())
    del raw[field]
    (newer / sharded_checkpoint.META).write_text(json.dumps(raw))
    if field in ("delta_seq", "metrics_window"):  # optional: a checkpoint from before them
        assert sharded_checkpoint.latest(tmp_path, restore=True) is not None
        return
    assert sharded_checkpoint.latest(tmp_path) is not None  # --status and the part checks: what there is
    for refused in (lambda: sharded_checkpoint.latest(tmp_path, restore=True),
                    lambda: sharded_checkpoint.unshard(tmp_path, tmp_path / "single")):
        with pytest.raises(checkpoint.CheckpointError) as caught:
            refused()
        said = str(caught.value)
        assert str(newer) in said and f'meta.json\'s "{field}" is missing' in said and "the one before it" in said


@pytest.mark.parametrize("case", sorted(MISTYPED_FIELDS))
def test_a_meta_json_field_of_the_wrong_type_or_missing_is_a_damaged_checkpoint_named_with_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    """``"world_size": "two"`` raised a raw ValueError from ``lost_parts``, ``"format_version": "x"`` one from
    ``latest()``, ``true`` passed as 1 rank, a negative or missing world_size checked no rank's file (and the restore
    then ended in a KeyError): each is a damaged ``meta.json`` that names the field, through ``latest()``,
    ``--unshard`` and ``train --status``."""
    from streamrec.cli import main

    field, value = MISTYPED_FIELDS[case]
    _save(tmp_path, 100)
    newer = _save(tmp_path, 200)
    meta = json.loads((newer / sharded_checkpoint.META).read_text())
    if value is ...:
        del meta[field]
    else:
        meta[field] = value
    (newer / sharded_checkpoint.META).write_text(json.dumps(meta))
    for refused in (lambda: sharded_checkpoint.latest(tmp_path),
                    lambda: sharded_checkpoint.unshard(tmp_path, tmp_path / "single")):
        with pytest.raises(checkpoint.CheckpointError) as caught:
            refused()
        said = str(caught.value)
        assert str(newer) in said and f'meta.json\'s "{field}"' in said and "the one before it" in said
    assert main(["train", "--status", "--checkpoint-dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert f'meta.json\'s "{field}"' in err and "Traceback" not in err
    assert "by 1 ranks" not in (sharded_checkpoint.describe_newest(tmp_path) or "")
