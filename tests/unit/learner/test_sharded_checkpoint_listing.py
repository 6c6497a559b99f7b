"""The ranks' listings of the checkpoint directory, which may differ (a shared mount across hosts): a sharded
checkpoint whose name rank 0 cannot make (its listing fails: EIO, ESTALE, EACCES on a directory it cannot enter)
fails on every rank alike, as a full disk does, so the ranks go on in step (the daemon's ``_try_save``: every rank
trains on and tries again); ranks that do not list the same newest checkpoint all refuse to resume."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit.learner.gloo_ranks import run_gloo_ranks


def _rank_0_cannot_list(rank: int, world: int, directory: str, out: str) -> None:
    """One of 2 gloo ranks: a checkpoint, then one whose listing fails on rank 0 (EIO), then one more; what each
    rank's second save raised, and the checkpoints after each, in ``out``-<rank>.json."""
    from learner import sharded_checkpoint

    def save(samples: int) -> Path:
        return sharded_checkpoint.save(Path(directory), {"model": {f"w{rank}": torch.full((8,), float(samples))}},
                                       {}, {"samples_trained": samples, "world_size": world}, rank)

    first = save(100)
    real = sharded_checkpoint.list_complete

    def unlistable(path: Path) -> list[Path]:
        raise OSError(errno.EIO, "Input/output error", str(path))

    if rank == 0:
        sharded_checkpoint.list_complete = unlistable  # type: ignore[assignment]
    try:
        save(200)
        raised = ""
    except OSError as exc:
        raised = f"{exc.errno} {exc}"
    finally:
        sharded_checkpoint.list_complete = real  # type: ignore[assignment]
    # the daemon's next round: a collective of every rank (LockStep.agree's all-gather)
    seen = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(seen, torch.tensor([rank + 7], dtype=torch.int64))
    after_failure = [p.name for p in sharded_checkpoint.list_complete(Path(directory))]
    third = save(300)
    Path(f"{out}-{rank}.json").write_text(json.dumps({
        "first": first.name, "raised": raised, "round": [int(t) for t in seen], "after_failure": after_failure,
        "third": third.name}))


def test_a_checkpoint_whose_directory_rank_0_cannot_list_fails_on_every_rank_and_the_ranks_stay_in_step(
        tmp_path: Path) -> None:
    """Rank 0 listed the directory (the new checkpoint's name) before the name's broadcast: its OSError was raised on
    rank 0 alone, which the daemon took for a failed checkpoint and went on to the next round's all-gather while the
    other ranks waited in the broadcast: the ranks' collectives out of step (a hang until collective_timeout_s, or
    one collective's bytes read as another's). Now every rank raises the same OSError, naming rank 0's error, and the
    next round and checkpoint go on together."""
    exits = run_gloo_ranks(2, str(tmp_path / "store"), _rank_0_cannot_list,
                           lambda r: (str(tmp_path / "ckpt"), str(tmp_path / "out")))
    assert exits == [0, 0]
    got = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        assert g["raised"].startswith(f"{errno.EIO} ") and "rank 0: OSError" in g["raised"]
        assert "Input/output error" in g["raised"]
        assert g["round"] == [7, 8]
        assert g["after_failure"] == [g["first"]]
        assert g["third"].startswith("dcp-000000000000300-")
    assert got[0]["third"] == got[1]["third"]


def _one_rank_lists_late(rank: int, world: int, directory: str, out: str) -> None:
    """One of 2 gloo ranks: two checkpoints, then each rank's ``latest`` while rank 1's listing lacks the newest (its
    host's mount lags), then while it lists none; what each raised in ``out``-<rank>.json."""
    from learner import sharded_checkpoint

    def save(samples: int) -> Path:
        return sharded_checkpoint.save(Path(directory), {"model": {f"w{rank}": torch.full((8,), float(samples))}},
                                       {}, {"samples_trained": samples, "world_size": world}, rank)

    older, newest = save(100), save(200)
    real = sharded_checkpoint.list_complete
    got = {"older_name": older.name, "newest_name": newest.name}
    for case, lagging in (("older", lambda d: [older]), ("none", lambda d: [])):
        if rank == 1:
            sharded_checkpoint.list_complete = lagging  # type: ignore[assignment]
        try:
            found = sharded_checkpoint.latest(Path(directory))
            got[case] = f"resumed {found[0].name}" if found is not None else "resumed none"
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            got[case] = f"{type(exc).__name__}: {exc}"
        finally:
            sharded_checkpoint.list_complete = real  # type: ignore[assignment]
    Path(f"{out}-{rank}.json").write_text(json.dumps(got))


def test_ranks_that_do_not_list_the_same_newest_checkpoint_all_refuse_to_resume_naming_each_ranks(
        tmp_path: Path) -> None:
    """A rank whose host's shared mount lagged (the newest checkpoint not listed yet) took its own newest: it resumed
    another checkpoint than the others, or none (a fresh model, in collectives the others never entered). Now every
    rank raises the same CheckpointError naming each rank's newest and the fix."""
    exits = run_gloo_ranks(2, str(tmp_path / "store"), _one_rank_lists_late,
                           lambda r: (str(tmp_path / "ckpt"), str(tmp_path / "out")))
    assert exits == [0, 0]
    got = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        for case, rank_1 in (("older", g["older_name"]), ("none", "none")):
            assert g[case].startswith("CheckpointError: the ranks do not list the same newest sharded checkpoint")
            assert f"rank 0 {g['newest_name']}, rank 1 {rank_1}." in g[case] and "actimeo" in g[case]
    assert got[0] == got[1]
