"""The model updater at stop (serving/swap.py ``ModelUpdater``): a backlog of deltas ends at stop, and an artifact whose
deltas were cut short by it does not go live. Fakes for the model and the delta reader: the updater's loop alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from serving.metrics import ServingMetrics
from serving.swap import LiveModel, ModelHolder, ModelUpdater


class Model:
    """What _apply_deltas reads of a ScoringModel; ``on_apply`` runs after each delta goes live."""

    version, delta_seq, source_delta_seq, delta_samples, source_samples = "v1", 0, 0, 0, 10
    trained_at = 0.0  # (ScoringModel.trained_at: when the newest state it holds was written)

    def __init__(self, on_apply: Any) -> None:
        self.applied: list[int] = []
        self.on_apply = on_apply

    def apply_delta(self, rows: Any, vectors: Any, dense: Any, seq: int, **kw: Any) -> None:
        self.applied.append(seq)
        self.delta_seq = seq
        self.on_apply()


class Deltas:
    gaps = rewinds = retries = 0
    retrying = None

    def newer(self, after: int, *a: Any, **k: Any) -> Any:
        for seq in range(after + 1, after + 6):  # a backlog of five
            yield SimpleNamespace(seq=seq, rows=None, vectors=None, dense_state={}, id_maps=None, samples_trained=seq,
                                  created=0.0, path=Path(f"delta-{seq}"))

    def forget_unfit(self) -> None: ...


def _updater(tmp_path: Path) -> ModelUpdater:
    holder = ModelHolder()
    u = ModelUpdater(holder, ServingMetrics(holder.model), tmp_path, None, device="cpu")
    u.deltas = Deltas()  # type: ignore[assignment]
    return u


def test_a_backlog_of_deltas_ends_at_stop_with_each_applied_delta_whole(tmp_path: Path) -> None:
    # The loop never looked at the stop flag: a long backlog went on being applied after stop() had timed out and
    # returned, while the service closed the clients it uses.
    u = _updater(tmp_path)
    model = Model(on_apply=lambda: u._stop.set() if len(model.applied) == 2 else None)
    u._apply_deltas(LiveModel(model, None, 10))  # type: ignore[arg-type]
    assert model.applied == [1, 2]


def test_an_artifact_whose_deltas_a_stop_cut_short_does_not_go_live(tmp_path: Path, monkeypatch: Any) -> None:
    # A swap never makes scores staler than the deltas: a new artifact goes live only caught up with them.
    u = _updater(tmp_path)
    old_model = Model(on_apply=lambda: None)
    old_model.version_dir = tmp_path / "v1"  # type: ignore[attr-defined]
    old = LiveModel(old_model, None, 10)  # type: ignore[arg-type]
    u.holder.live = old
    (tmp_path / "v2").mkdir()
    new_model = Model(on_apply=lambda: u._stop.set())
    new_model.version = "v2"
    monkeypatch.setattr("serving.swap.current_version", lambda root: "v2")
    monkeypatch.setattr("serving.swap.version_path", lambda root, name: tmp_path / name)
    monkeypatch.setattr("serving.swap._live_model", lambda m: LiveModel(m, None, 10))  # type: ignore[arg-type]
    u._load = lambda path, device: new_model  # type: ignore[method-assign,assignment]
    u._maybe_swap()
    assert new_model.applied == [1]  # the stop came with its first delta
    assert u.holder.live is old  # not caught up: the artifact serving had keeps answering until the process ends
