"""The ``onnx`` artifact format: the scorer's dense part (FM + MLP) run by ONNX Runtime.

Measured and chosen (torch 2.13, onnxruntime 1.32): the whole :class:`learner.scorer.Scorer` does not export
cleanly (``searchsorted`` has no ONNX operator; ``embedding_bag`` with offsets becomes a ``Loop``), so the
split is where the issue suggests it: the row gathering and mean pooling stay in torch (the same code as every
other format, :meth:`Scorer.pool`), and only what runs on the pooled embeddings goes to ONNX Runtime::

    DenseHead.forward(pooled (B, F, D + 1) float32, dense (B, Dd) float32) -> (B,) probabilities

(bias + first order + FM + MLP + calibration + sigmoid), exported with a dynamic batch axis by the TorchScript
based exporter (``dynamo=False``: no onnxscript needed; opset 17). The artifact holds two files, both listed in
the manifest with their sha256: ``scorer.onnx`` (the dense graph, what scores) and ``scorer.safetensors`` (the
scorer's tensors, as the safetensors format stores them: the hot rows the pooling reads, and the dense weights a
learner delta replaces; nothing is unpickled). A delta with dense weights re-exports the graph from the updated
weights (:meth:`OnnxScorer.rebuild_session`, about 0.1 s for a 400-400-400 MLP) before the new snapshot is
swapped in.

The scores equal the eager fp32 model's to ~1e-7 on probabilities (ONNX Runtime fuses Gemm + bias and sums in
another order; tests/unit/learner/test_onnx_scorer.py bounds it by 1e-6 on several batch sizes).

INT8 (the ``onnx_int8`` format, ``scorer_int8.onnx``): ONNX Runtime's ``quantize_dynamic`` of the exported graph
(int8 weights of every Gemm, activations quantized per batch); its accuracy cost on a holdout is measured by
``bench/onnx_int8.py``. Its scores differ from fp32 by far more than the refresh's probe tolerance, so the refresh
probes its fp32 path (:meth:`OnnxScorer.torch_forward`: the same tensors in torch) against the learner, and
refuses it when its holdout AUC falls more than ``[refresh] max_int8_auc_drop`` below that fp32 path's
(``cache_refresh/validate.py``).

TensorRT (issue 17): where ``onnxruntime-gpu`` with its TensorRT execution provider is installed and the scorer is
loaded on a CUDA device, the same graph runs as a TensorRT engine (fp16 allowed), built by ONNX Runtime on first use
and cached (:func:`providers`); nothing else changes (file, validation, publish flow). ``bench/gpu_check.py`` builds
and times it on a GPU; on a CPU machine it says that TensorRT was not checked and why.

onnxruntime (and ``onnx``, for quantization) are imported lazily, only when an ONNX artifact is built or
loaded: ``pip install 'streamrec[onnx]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.calibration import calibrated
from learner.scorer import Held, Scorer, ScorerSpec
from stream.files import write_synced

ONNX_FILE = "scorer.onnx"
STATE_FILE = "scorer.safetensors"  # the scorer's tensors (hot rows, dense weights), as the safetensors format
OPSET = 17
INSTALL_HINT = "pip install 'streamrec[onnx]'"

log = logging.getLogger("streamrec.onnx")


class OnnxUnavailable(RuntimeError):
    """onnxruntime (or onnx) is not installed."""


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise OnnxUnavailable(f"ONNX artifacts need onnxruntime, which is not installed ({exc}): "
                              f"{INSTALL_HINT}") from None
    return onnxruntime


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence torch's "legacy TorchScript-based ONNX export" deprecation around our own export only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"The feature will be removed", category=DeprecationWarning)
        yield


class DenseHead(nn.Module):
    """What runs on the pooled embeddings: ``Scorer.forward`` after :meth:`Scorer.pool` (shares its modules)."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        self.dim = scorer.dim
        self.fm, self.dense_arch = scorer.fm, scorer.dense_arch
        self.bias = scorer.bias
        cal = scorer.calibration
        assert isinstance(cal, torch.Tensor)
        self.register_buffer("calibration", cal.detach().clone())

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        cal = self.calibration
        assert isinstance(cal, torch.Tensor)
        emb, first = pooled[:, :, : self.dim], pooled[:, :, self.dim]  # (B, F, D), (B, F)
        x = torch.cat([emb.flatten(1), dense], dim=1)  # (B, F*D + Dd)
        logits = self.bias + first.sum(dim=1) + self.fm(emb) + self.dense_arch(x)  # (B,)
        return torch.sigmoid(calibrated(logits, cal))


def export_dense(scorer: Scorer, int8: bool = False) -> bytes:
    """The dense part of ``scorer`` as ONNX bytes (dynamic batch), optionally dynamically quantized to INT8."""
    head = DenseHead(scorer).eval().cpu()
    first_layer = head.dense_arch.mlp[0]
    assert isinstance(first_layer, nn.Linear)
    num_dense = first_layer.in_features - scorer.num_fields * scorer.dim
    example = (torch.zeros(2, scorer.num_fields, scorer.dim + 1), torch.zeros(2, num_dense))
    buf = io.BytesIO()
    with _quiet_export(), torch.no_grad():
        torch.onnx.export(head, example, buf,  # type: ignore[arg-type]  # the legacy exporter writes to a file object
                          dynamo=False, opset_version=OPSET, input_names=["pooled", "dense"],
                          output_names=["prob"], dynamic_axes={"pooled": {0: "batch"}, "dense": {0: "batch"},
                                                               "prob": {0: "batch"}})
    data = buf.getvalue()
    return quantize_int8(data) if int8 else data


def quantize_int8(model: bytes) -> bytes:
    """ONNX Runtime's dynamic quantization of ``model``: int8 weights (per tensor, signed), activations per batch."""
    _ort()
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        src.write_bytes(model)
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # "consider pre-processing": advice for conv nets, not for an MLP
        try:
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
        finally:
            root.setLevel(level)
        return dst.read_bytes()


def providers(device: str, available: list[str] | None = None,
              cache_dir: str | None = None) -> list[Any]:
    """ONNX Runtime's execution providers for a scorer on ``device``, best first.

    On a CUDA device: TensorRT (an engine built from the graph on first use, fp16 kernels allowed, the engine
    cached under ``cache_dir`` so a restart does not rebuild it), then CUDA, then the CPU, as far as the
    installed onnxruntime has them (``onnxruntime-gpu`` with TensorRT for the first; the CPU wheel has neither).
    Everywhere else the CPU provider. ONNX Runtime itself falls back along the list for nodes a provider cannot
    run. The INT8 graph (``quantize_dynamic``: integer matmuls with per-batch activation scales) is not one
    TensorRT builds; on TensorRT it runs in its CUDA/CPU fallbacks."""
    have = available if available is not None else _ort().get_available_providers()
    if not str(device).startswith("cuda"):
        return ["CPUExecutionProvider"]
    out: list[Any] = []
    if "TensorrtExecutionProvider" in have:
        trt: dict[str, Any] = {"trt_fp16_enable": True}
        if cache_dir:
            trt.update(trt_engine_cache_enable=True, trt_engine_cache_path=cache_dir)
        out.append(("TensorrtExecutionProvider", trt))
    if "CUDAExecutionProvider" in have:
        out.append("CUDAExecutionProvider")
    return [*out, "CPUExecutionProvider"]


def session(model: bytes, threads: int | None = None, device: str = "cpu") -> Any:
    """An ONNX Runtime session for ``model`` on :func:`providers` for ``device``; ``threads`` intra-op threads
    (default torch's)."""
    ort = _ort()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    # No spin-waiting: torch (the pooling) and ORT alternate on the same cores on every request; a spinning ORT
    # pool starves torch's threads (measured, 2 cores, B=100: p99 32 ms spinning vs 1.2 ms not).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    # One engine cache per graph (weights included): ORT's own cache key may not cover the weights, and a dense
    # delta re-exports the same graph with new weights.
    cache = (str(Path(tempfile.gettempdir()) / "streamrec-trt-engines" / hashlib.sha256(model).hexdigest()[:20])
             if str(device).startswith("cuda") else None)
    return ort.InferenceSession(model, sess_options=opts, providers=providers(device, cache_dir=cache))


class OnnxScorer(Scorer):
    """A :class:`Scorer` whose dense part runs in ONNX Runtime (on :func:`providers` for ``device``: the CPU, or
    TensorRT/CUDA where installed); the pooling runs in torch on its device."""

    def __init__(self, spec: ScorerSpec, hot_ids: torch.Tensor, hot_vectors: torch.Tensor, model: bytes,
                 int8: bool = False, device: str = "cpu") -> None:
        super().__init__(spec, hot_ids, hot_vectors)
        self.int8 = int8
        self.ort_device = str(device)
        self._box = Held(session(model, device=self.ort_device))

    @property
    def execution_providers(self) -> list[str]:
        """The providers ONNX Runtime actually runs this graph on, best first (e.g. for ``/v1/model``)."""
        return list(self._box.value.get_providers())

    def torch_forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                      given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        """The same scores in torch fp32 from the stored tensors (an INT8 artifact's reference)."""
        return Scorer.forward(self, values, offsets, dense, given_rows, given_mask)

    def rebuild_session(self) -> None:
        """Re-export the dense graph from this module's (updated) weights: a learner delta's dense weights."""
        self._box = Held(session(export_dense(self, self.int8), device=self.ort_device))

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(values, offsets, given_rows, given_mask)  # (B, F, D + 1)
        feeds = {"pooled": pooled.detach().cpu().float().contiguous().numpy(),
                 "dense": dense.detach().cpu().float().contiguous().numpy()}
        prob = self._box.value.run(None, feeds)[0]  # (B,)
        return torch.from_numpy(prob).to(pooled.device)


def save(scorer: Scorer, path: Path, int8: bool = False) -> list[str]:
    """Write ``path`` (the dense graph, INT8 with ``int8``) and its sibling :data:`STATE_FILE`; returns both names."""
    import safetensors.torch

    model = export_dense(scorer, int8)
    write_synced(path, lambda fh: fh.write(model))
    state = {k: v.detach().cpu().contiguous() for k, v in scorer.state_dict().items()}
    data = safetensors.torch.save(state, metadata={"streamrec": "scorer", "format": "onnx"})
    write_synced(path.parent / STATE_FILE, lambda fh: fh.write(data))
    return [path.name, STATE_FILE]


def load(path: Path, spec: ScorerSpec, device: str, int8: bool = False) -> OnnxScorer:
    """The scorer of an ``onnx`` artifact: ``path`` (the graph) and its sibling :data:`STATE_FILE` (nothing is
    unpickled). OnnxUnavailable without onnxruntime."""
    import safetensors.torch

    _ort()  # the clear error first, before anything is read
    state = safetensors.torch.load_file(str(path.parent / STATE_FILE), device="cpu")
    scorer = OnnxScorer(spec, state["hot_ids"], state["hot_vectors"], Path(path).read_bytes(), int8=int8,
                         device=device)
    scorer.load_state_dict(state)  # strict: every name and shape of the spec's Scorer
    log.info("%s: ONNX Runtime runs the dense graph on %s", path, ", ".join(scorer.execution_providers))
    return scorer.to(device).eval()
