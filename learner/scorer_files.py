"""The scorer's files: one scorer written and read back in each artifact format (``SCORER_FILES``).

``save_scorer`` / ``load_scorer`` dispatch on the format: TorchScript (``torch.jit``; its deprecation warnings
silenced around these calls only), ``torch.export``, a weights-only state dict (``eager``), safetensors, and the
ONNX Runtime formats (``learner/onnx_scorer.py``, imported only for them). Apart from ``learner/scorer.py`` (what a
scorer is) so that the ONNX scorer, a kind of scorer, and the dispatch over every kind import in one direction.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from learner.features import FeatureConfig
from learner.scorer import (
    CALIBRATED_FORMATS,
    FORMATS,
    INT8_FORMATS,
    ONNX_FORMATS,
    SCORER_FILES,
    Bf16Scorer,
    Scorer,
    ScorerSpec,
)
from stream.files import write_synced


# -- TorchScript deprecation warnings ------------------------------------------------------------
@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Silence exactly torch 2.13's "`torch.jit.<fn>` is deprecated" warnings around our own calls.

    They repeat on every script/save/load and carry no news for an operator (the export format is the
    migration path, documented above); every other warning still shows. Only used around build/load,
    never around scoring (``warnings.catch_warnings`` is process-wide while it is active).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        yield


# -- storage -------------------------------------------------------------------------------------
def _export_inputs(spec: ScorerSpec, cfg: FeatureConfig) -> tuple[torch.Tensor, ...]:
    """An example request-layout input (the user row's F bags, then F*B candidate bags) for ``torch.export``."""
    b = 3
    lengths = torch.ones(spec.num_fields * (b + 1), dtype=torch.int64)  # (F + F*B,)
    lengths[0] = 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])  # (F + F*B + 1,)
    n = int(offsets[-1])
    values = torch.randint(0, cfg.num_rows, (n,), dtype=torch.int64)
    return (values, offsets, torch.zeros(b, spec.num_dense), torch.zeros(n, spec.dim + 1),
            torch.zeros(n, dtype=torch.bool))


def save_scorer(scorer: Scorer, fmt: str, path: Path, spec: ScorerSpec, cfg: FeatureConfig,
                calibration: list[dict[str, Any]] | None = None) -> None:
    """Write ``path`` (``SCORER_FILES[fmt]``) and, in its directory, the format's ``SCORER_EXTRA_FILES``.
    ``calibration``: an ``onnx_int8_static`` graph's calibration feeds (``onnx_scorer.calibration_feeds``)."""
    if fmt in ONNX_FORMATS:
        from learner import onnx_scorer  # only these formats need torch.onnx and onnxruntime

        onnx_scorer.save(scorer, path, int8=fmt in INT8_FORMATS,
                         calibration=calibration if fmt in CALIBRATED_FORMATS else None)
    elif fmt == "torchscript":
        with _quiet_torchscript():
            scripted = torch.jit.script(scorer)
            write_synced(path, lambda fh: torch.jit.save(scripted, fh))
    elif fmt == "export":
        n, b = torch.export.Dim("n", min=1), torch.export.Dim("b", min=1)
        dynamic = ({0: n}, {0: spec.num_fields * b + spec.num_fields + 1}, {0: b}, {0: n}, {0: n})  # (F + F*B + 1,)
        # Size-oblivious shape reasoning: without it the export specializes B away from 1 (its 0/1 specialization of
        # the views of the pooled bags), and a request with a single candidate failed a guard ("Guard failed: ...").
        with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]  # install_config_module
            ep = torch.export.export(scorer, _export_inputs(spec, cfg), dynamic_shapes=dynamic)
        write_synced(path, lambda fh: torch.export.save(ep, fh))
    elif fmt == "eager":
        write_synced(path, lambda fh: torch.save(scorer.state_dict(), fh))
    elif fmt in ("safetensors", "safetensors_bf16"):  # the same fp32 tensors (bf16: the MLP copied at load)
        import safetensors.torch  # only this format needs it

        state = {k: v.detach().cpu().contiguous() for k, v in scorer.state_dict().items()}
        data = safetensors.torch.save(state, metadata={"streamrec": "scorer"})
        write_synced(path, lambda fh: fh.write(data))
    else:
        raise ValueError(f"unknown artifact format {fmt!r}; expected one of {', '.join(FORMATS)}")


class OpenFiles(Protocol):
    """An artifact's listed files, opened once and checked (``learner.artifact.ArtifactFiles``): ``files[name]`` is
    the open file at its start, ``files.path(name)`` where it was opened (for messages only)."""

    def __getitem__(self, name: str) -> BinaryIO: ...

    def path(self, name: str) -> Path: ...


def load_scorer(fmt: str, files: OpenFiles, spec: ScorerSpec, device: str) -> nn.Module:
    """The scorer of a ``fmt`` artifact, read from ``files`` (``SCORER_FILES[fmt]`` and the format's
    ``SCORER_EXTRA_FILES``): the very files that were checked, never opened again by path."""
    name = SCORER_FILES.get(fmt)
    if name is None:
        raise ValueError(f"unknown artifact format {fmt!r}; this streamrec reads {', '.join(FORMATS)}")
    path = files.path(name)
    if fmt in ONNX_FORMATS:
        from learner import onnx_scorer  # imports onnxruntime: only when an ONNX artifact is loaded

        return onnx_scorer.load(files[name].read(), files[onnx_scorer.STATE_FILE].read(), path, spec, device,
                                int8=fmt in INT8_FORMATS, static=fmt in CALIBRATED_FORMATS)
    if fmt == "torchscript":
        with _quiet_torchscript():
            return torch.jit.load(files[name], map_location=device).eval()
    if fmt == "export":
        return torch.export.load(files[name]).module().to(device)
    # eager, safetensors, safetensors_bf16
    if fmt == "eager":
        state = torch.load(files[name], map_location=device, weights_only=True)
    else:  # a JSON header and raw bytes: nothing is unpickled
        import safetensors.torch  # only these formats need it

        state = safetensors.torch.load(files[name].read())
    cls = Bf16Scorer if fmt == "safetensors_bf16" else Scorer
    scorer = cls(spec, state["hot_ids"], state["hot_vectors"])
    scorer.load_state_dict(state)  # strict: every name and shape of the spec's Scorer
    scorer = scorer.to(device).eval()
    if isinstance(scorer, Bf16Scorer):
        scorer.rebuild_session()  # the MLP's bf16 copy, on the device
    return scorer
