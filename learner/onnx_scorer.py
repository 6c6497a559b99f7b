"""The ``onnx`` artifact format: the scorer's pooling, FM and MLP run by ONNX Runtime, one call per request.

Measured and chosen (torch 2.13, onnxruntime 1.32): the whole :class:`learner.scorer.Scorer` does not export
cleanly (``searchsorted`` has no ONNX operator; ``embedding_bag`` with offsets becomes a ``Loop``), so what does not
export is done in numpy before the call and everything else is in the graph (:class:`RequestHead`, input layout 3,
:data:`learner.scorer.POOLING_GRAPH_LAYOUT`)::

    RequestHead.forward(table (H + 1, D + 1) float32    the scorer's hot rows: a graph INPUT, not a weight
                        pos (N,) int64                  each value's position among the hot rows (searchsorted)
                        given (N, D + 1) float32        the rows the caller gives (cold rows, delta overrides)
                        given_mask (N,) bool            use ``given`` (else ``table[pos]``)
                        seg (N,) int64                  each value's bag (the request layout's bags, user row first)
                        inv_len (F + F*B,) float32      1 / each bag's length (1 for an empty bag)
                        dense (B, Dd) float32) -> (B,) probabilities

gather, mean pooling (a ScatterND add of each bag's rows: :class:`_BagSum`), the user row broadcast to the
candidates, bias + first order + FM + MLP + calibration + sigmoid: what :meth:`Scorer.forward` computes, in one ONNX
Runtime call per request instead of ~10 torch calls plus one ONNX Runtime call (bench/serving_threads.py measures
both). The hot table is fed at every
call (ONNX Runtime reads the numpy buffer in place: no copy, measured with a 1 M-row table), so the graph holds only
the dense weights: a learner delta's rows need no re-export, and a delta with dense weights re-exports the graph
from the updated weights (:meth:`OnnxScorer.rebuild_session`, about 0.1 s for a 400-400-400 MLP) before the new
snapshot is swapped in. Exported with dynamic sizes by the TorchScript based exporter (``dynamo=False``: no
onnxscript needed; opset 17).

Versions: artifacts written before this graph (manifest ``scorer.input_layout`` 2) hold :class:`DenseHead`'s graph
(``pooled (B, F, D + 1), dense (B, Dd) -> (B,)``, the pooling in torch); they keep loading and scoring (the graph's
input names say which it is), and a dense delta re-exports such a scorer as a :class:`RequestHead` graph. Artifacts
written by this code say ``input_layout`` 3, which a server from before it refuses when it reads the manifest ("scorer
input_layout 3, this streamrec reads 1, 2"), so the old server keeps serving its loaded version: upgrade serving
before the refresh job that writes the new graph.

The artifact holds two files, both listed in the manifest with their sha256: ``scorer.onnx`` (the graph, what
scores) and ``scorer.safetensors`` (the scorer's tensors, as the safetensors format stores them: the hot rows fed to
the graph, and the dense weights a learner delta replaces; nothing is unpickled).

The scores equal the eager fp32 model's to ~1e-7 on probabilities (ONNX Runtime fuses Gemm + bias and sums in
another order; tests/unit/learner/test_onnx_scorer.py bounds it by 1e-6 on several batch sizes).

INT8 (the ``onnx_int8`` format, ``scorer_int8.onnx``): ONNX Runtime's ``quantize_dynamic`` of the exported graph
(int8 weights of every Gemm, activations quantized per batch; the gather and pooling stay fp32); its accuracy cost on
a holdout is measured by ``bench/onnx_int8.py``. Its scores differ from fp32 by far more than the refresh's probe
tolerance, so the refresh probes its fp32 path (:meth:`OnnxScorer.torch_forward`: the same tensors in torch) against
the learner, and refuses it when its holdout AUC falls more than ``[refresh] max_int8_auc_drop`` below that fp32
path's (``cache_refresh/validate.py``).

Static INT8 (the ``onnx_int8_static`` format, ``scorer_int8_static.onnx``): ``quantize_static`` of the same graph
(QOperator: ``QGemm`` with fixed activation scales, the ReLUs folded into them), the scales the min/max of each
activation over calibration requests (:func:`calibration_feeds`: samples scored as the graph is fed them, their cold
rows from the checkpoint's table; the refresh job's older holdout samples). ~50 us cheaper per call than the dynamic
graph (no per-batch scale computation; bench/README.md, forty-fourth session), its scores differ from it (another
rounding), so it is a format of its own, gated like ``onnx_int8``. A learner delta with dense weights cannot be
recalibrated in serving (no samples there): such a scorer's graph is re-exported dynamically quantized, with a warning
(:meth:`OnnxScorer.rebuild_session`), until the next refresh publishes a recalibrated artifact.

TensorRT (issue 17): where ``onnxruntime-gpu`` with its TensorRT execution provider is installed and the scorer is
loaded on a CUDA device, the same graph runs on TensorRT (fp16 allowed) as far as it takes its nodes, the rest on
CUDA/CPU, built by ONNX Runtime on first use and cached (:func:`providers`); the hot table is then put on the device
once (an ``OrtValue``), not fed from host memory per call. ``bench/gpu_check.py`` builds and times it on a GPU; on a
CPU machine it says that TensorRT was not checked and why.

onnxruntime (and ``onnx``, for quantization and for refusing a graph with external data: :func:`session`) are
imported lazily, only when an ONNX artifact is built or loaded: ``pip install 'streamrec[onnx]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from learner.calibration import calibrated
from learner.scorer import POOLING_GRAPH_LAYOUT, Held, Scorer, ScorerSpec
from stream.files import write_synced

ONNX_FILE = "scorer.onnx"
STATE_FILE = "scorer.safetensors"  # the scorer's tensors (hot rows, dense weights), as the safetensors format
OPSET = 17
INSTALL_HINT = "pip install 'streamrec[onnx]'"

log = logging.getLogger("streamrec.onnx")
Feeds = dict[str, Any]  # one call's inputs of the pooling graph, by name (REQUEST_INPUTS)


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


class _BagSum(torch.autograd.Function):
    """Each bag's sum of its rows, exported as one ``ScatterND`` with an add of whole rows.

    Why not the torch ops that export by themselves: ``scatter_add`` over an expanded index exports as an ``Expand``
    (an (N, D + 1) int64 index made per call) and a ``ScatterElements`` add walking the rows element by element,
    ~40% of the INT8 graph's node time at B = 100 (ONNX Runtime's profile, bench/README.md, forty-third session);
    ``index_put(accumulate=True)`` exports as a ``ScatterND`` without the add (repeated bags overwrite: wrong
    scores). The same sums in the same order: the scores are equal bit for bit."""

    @staticmethod
    def forward(ctx: Any, zeros: torch.Tensor, seg: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # zeros (bags, D + 1), seg (N,) each row's bag, rows (N, D + 1) -> (bags, D + 1)
        return zeros.index_add(0, seg, rows)

    @staticmethod
    def symbolic(g: Any, zeros: Any, seg: Any, rows: Any) -> Any:
        index = g.op("Unsqueeze", seg, g.op("Constant", value_t=torch.tensor([1])))  # (N, 1)
        return g.op("ScatterND", zeros, index, rows, reduction_s="add")


class RequestHead(nn.Module):
    """One request from the hot table, the values' positions in it, the given rows and the bags to the probabilities
    (module docstring): :meth:`Scorer.pool` without ``searchsorted`` (done by the caller), then :class:`DenseHead`."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__()
        self.num_fields, self.dim = scorer.num_fields, scorer.dim
        self.head = DenseHead(scorer)

    def forward(self, table: torch.Tensor, pos: torch.Tensor, given: torch.Tensor, given_mask: torch.Tensor,
                seg: torch.Tensor, inv_len: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        rows = torch.where(given_mask.unsqueeze(1), given, table[pos])  # (N, D + 1)
        summed = _BagSum.apply(torch.zeros(inv_len.shape[0], self.dim + 1), seg, rows)  # (F + F*B, D + 1)
        pooled = summed * inv_len.unsqueeze(1)  # (F + F*B, D + 1); an empty bag: 0
        user = pooled[: self.num_fields].unsqueeze(0)  # (1, F, D + 1)
        cand = pooled[self.num_fields:].reshape(self.num_fields, -1, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)
        return self.head(cand + user, dense)  # (B,)


REQUEST_INPUTS = ("table", "pos", "given", "given_mask", "seg", "inv_len", "dense")
DENSE_INPUTS = ("pooled", "dense")  # DenseHead's graph: artifacts of input layout 2


def export_request(scorer: Scorer, int8: bool = False, calibration: list[Feeds] | None = None) -> bytes:
    """``scorer`` as a :class:`RequestHead` ONNX graph (dynamic sizes), optionally quantized to INT8: dynamically
    (``int8``), or statically with the activation scales calibrated on ``calibration`` (:func:`calibration_feeds`)."""
    head = RequestHead(scorer).eval().cpu()
    f, d = scorer.num_fields, scorer.dim
    b, n = 3, 5
    example = (torch.zeros(4, d + 1), torch.zeros(n, dtype=torch.int64), torch.zeros(n, d + 1),
               torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int64), torch.ones(f + f * b),
               torch.zeros(b, _num_dense(scorer)))
    dynamic = {"table": {0: "hot"}, "pos": {0: "n"}, "given": {0: "n"}, "given_mask": {0: "n"}, "seg": {0: "n"},
               "inv_len": {0: "bags"}, "dense": {0: "batch"}, "prob": {0: "batch"}}
    buf = io.BytesIO()
    with _quiet_export(), torch.no_grad():
        torch.onnx.export(head, example, buf,  # type: ignore[arg-type]  # the legacy exporter writes to a file object
                          dynamo=False, opset_version=OPSET, input_names=list(REQUEST_INPUTS),
                          output_names=["prob"], dynamic_axes=dynamic)
    data = buf.getvalue()
    if calibration is not None:
        return quantize_int8_static(data, calibration)
    return quantize_int8(data) if int8 else data


def _num_dense(scorer: Scorer) -> int:
    first_layer = scorer.dense_arch.mlp[0]
    assert isinstance(first_layer, nn.Linear)
    return first_layer.in_features - scorer.num_fields * scorer.dim


def export_dense(scorer: Scorer, int8: bool = False) -> bytes:
    """The dense part of ``scorer`` as a :class:`DenseHead` graph (dynamic batch), optionally quantized to INT8: the
    graph of artifacts of input layout 2 (this code writes :func:`export_request`'s; tests write this one to check
    that such artifacts keep loading)."""
    head = DenseHead(scorer).eval().cpu()
    example = (torch.zeros(2, scorer.num_fields, scorer.dim + 1), torch.zeros(2, _num_dense(scorer)))
    buf = io.BytesIO()
    with _quiet_export(), torch.no_grad():
        torch.onnx.export(head, example, buf,  # type: ignore[arg-type]  # the legacy exporter writes to a file object
                          dynamo=False, opset_version=OPSET, input_names=["pooled", "dense"],
                          output_names=["prob"], dynamic_axes={"pooled": {0: "batch"}, "dense": {0: "batch"},
                                                               "prob": {0: "batch"}})
    data = buf.getvalue()
    return quantize_int8(data) if int8 else data


class _QuantizerAdvice(logging.Filter):
    """Drops what ONNX Runtime's quantizers log on the root logger on every call: their advice to pre-process the
    graph ("Please consider (to run) pre-processing before quantization": for conv nets, not an MLP) and their INFO
    lines (each activation without quantization parameters); their other warnings pass. A filter of the root logger
    sees only the records logged on it, not those of named loggers (``streamrec.*``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and (record.levelno < logging.WARNING
                                               or "pre-processing before quantization" in str(record.msg)))


_ADVICE = _QuantizerAdvice()
_advice_lock = threading.Lock()
_advice_users = 0  # quantizations running (threads): the filter is on the root logger while any is


@contextlib.contextmanager
def _advice_kept_out() -> Iterator[None]:
    """The quantizer's advice kept out of the log for the duration, and nothing else: not the root logger's level
    (process-wide: every thread's warnings, e.g. serving's request threads' during a delta's re-quantization, were
    dropped, and two overlapping quantizations could leave it at ERROR for good)."""
    global _advice_users
    root = logging.getLogger()
    with _advice_lock:
        _advice_users += 1
        root.addFilter(_ADVICE)
    try:
        yield
    finally:
        with _advice_lock:
            _advice_users -= 1
            if not _advice_users:
                root.removeFilter(_ADVICE)


def _quantized(model: bytes, quantize: Callable[[str, str], object]) -> bytes:
    """``quantize(src, dst)`` (one of ONNX Runtime's quantizers, which read and write files) run on ``model``,
    its advice to pre-process the graph kept out of the log (:func:`_advice_kept_out`)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        src.write_bytes(model)
        with _advice_kept_out():
            quantize(str(src), str(dst))
        return dst.read_bytes()


def quantize_int8(model: bytes) -> bytes:
    """ONNX Runtime's dynamic quantization of ``model``: int8 weights (per tensor, signed), activations per batch."""
    _ort()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    return _quantized(model, lambda src, dst: quantize_dynamic(src, dst, weight_type=QuantType.QInt8))


def quantize_int8_static(model: bytes, calibration: list[Feeds]) -> bytes:
    """ONNX Runtime's static quantization of the pooling graph ``model`` (QOperator: QGemm with fixed activation
    scales, the ReLUs folded; int8 weights, uint8 activations), each activation's range the min/max over the
    ``calibration`` feeds (:func:`calibration_feeds`). ValueError without any."""
    if not calibration:
        raise ValueError("static INT8 quantization needs calibration requests (samples scored as the graph is fed "
                         "them); none were given")
    _ort()
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calibration)

        def get_next(self) -> Feeds | None:
            return next(self.it, None)

    return _quantized(model, lambda src, dst: quantize_static(
        src, dst, Reader(), quant_format=QuantFormat.QOperator, activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm", "Relu"]))


def request_feeds(table: Any, pos: np.ndarray, given: np.ndarray, given_mask: np.ndarray, offsets: np.ndarray,
                  dense: np.ndarray) -> Feeds:
    """The pooling graph's feeds (:data:`REQUEST_INPUTS`) for one request: ``table`` the hot rows as the graph is fed
    them, the rest as :meth:`OnnxScorer.score_rows` takes them."""
    lengths = offsets[1:] - offsets[:-1]  # (F + F*B,)
    return {"table": table, "pos": pos, "given": np.ascontiguousarray(given), "given_mask": given_mask,
            "seg": np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),  # (N,) each value's bag
            "inv_len": 1.0 / np.maximum(lengths, 1).astype(np.float32),  # (F + F*B,)
            "dense": np.ascontiguousarray(dense)}


def calibration_feeds(scorer: Scorer, table: np.ndarray,
                      requests: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[Feeds]:
    """The feeds ``scorer``'s pooling graph gets for ``requests`` (values (N,) global rows, offsets (F + F*B + 1,) in
    the user-row layout, dense (B, Dd)), every row that is not hot given from ``table`` (the whole fused table,
    (rows, D + 1) float32): what serving feeds it for them (``serving.model.ScoringModel``, before any delta)."""
    hot_ids = scorer.hot_ids
    assert isinstance(hot_ids, torch.Tensor)
    ids = hot_ids.cpu().numpy()
    vectors = scorer.hot_vectors
    assert isinstance(vectors, torch.Tensor)
    hot_table = vectors.detach().cpu().float().contiguous().numpy()
    out = []
    for values, offsets, dense in requests:
        pos = np.searchsorted(ids, values)  # (N,) in [0, H]: the sentinel is last
        cold = ids[pos] != values
        given = np.zeros((len(values), table.shape[1]), np.float32)
        given[cold] = table[values[cold]]
        out.append(request_feeds(hot_table, pos, given, cold, offsets, dense.astype(np.float32, copy=False)))
    return out


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


def _external_data(model: bytes) -> list[str]:
    """The names of the tensors of ``model`` (initializers, constants, subgraphs and functions included) whose bytes
    are not in it but in an external-data file."""
    try:
        import onnx
        from onnx.external_data_helper import uses_external_data
    except ImportError as exc:
        raise OnnxUnavailable(f"ONNX artifacts need onnx, which is not installed ({exc}): {INSTALL_HINT}") from None
    proto = onnx.load_model_from_string(model)  # parses only: reads no external file
    found: list[str] = []

    def tensors(ts: Any) -> None:
        found.extend(t.name or "(unnamed)" for t in ts if uses_external_data(t))

    def nodes(ns: Any) -> None:
        for node in ns:
            for a in node.attribute:
                tensors([a.t, *a.tensors, *(st.values for st in [a.sparse_tensor, *a.sparse_tensors])])
                for g in [a.g, *a.graphs]:
                    graph(g)

    def graph(g: Any) -> None:
        tensors([*g.initializer, *(st.values for st in g.sparse_initializer)])
        nodes(g.node)

    graph(proto.graph)
    for fn in proto.functions:
        nodes(fn.node)
    return found


def session(model: bytes, threads: int | None = None, device: str = "cpu") -> Any:
    """An ONNX Runtime session for ``model`` on :func:`providers` for ``device``; ``threads`` intra-op threads
    (default torch's).

    A graph with external data is refused (ValueError): this code exports every weight into the graph, and ONNX
    Runtime resolves the external files of a graph loaded from bytes against the process's working directory, so
    such a graph read whatever file under it the reference names (a key, a config) into its weights."""
    external = _external_data(model)
    if external:
        raise ValueError(f"the ONNX graph keeps tensors {', '.join(external[:5])} in external data files; an "
                         "artifact's graph holds all its weights (streamrec never writes external data)")
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
    """A :class:`Scorer` run by ONNX Runtime (on :func:`providers` for ``device``: the CPU, or TensorRT/CUDA where
    installed): a :class:`RequestHead` graph (pooling included), or an older artifact's :class:`DenseHead` graph
    (the pooling in torch). ``pools`` says which (True: the pooling graph)."""

    def __init__(self, spec: ScorerSpec, hot_ids: torch.Tensor, hot_vectors: torch.Tensor, model: bytes,
                 int8: bool = False, device: str = "cpu", static: bool = False) -> None:
        super().__init__(spec, hot_ids, hot_vectors)
        self.int8 = int8 or static
        self.static = static  # statically quantized (calibrated at build time)
        self.ort_device = str(device)
        self._box = Held(self._session(model))
        self.pools = self._box.value.get_inputs()[0].name == REQUEST_INPUTS[0]
        self._table = Held(None)  # the hot rows as the graph is fed them, made on first use (after .to(device))

    def _session(self, model: bytes) -> Any:
        sess = session(model, device=self.ort_device)
        names = tuple(i.name for i in sess.get_inputs())
        if names not in (REQUEST_INPUTS, DENSE_INPUTS):
            raise ValueError(f"the ONNX graph takes {', '.join(names)}; this streamrec runs graphs taking "
                             f"{', '.join(REQUEST_INPUTS)} (input layout 3) or {', '.join(DENSE_INPUTS)} (layout 2)")
        return sess

    @property
    def execution_providers(self) -> list[str]:
        """The providers ONNX Runtime actually runs this graph on, best first (e.g. for ``/v1/model``)."""
        return list(self._box.value.get_providers())

    def torch_forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                      given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        """The same scores in torch fp32 from the stored tensors (an INT8 artifact's reference)."""
        return Scorer.forward(self, values, offsets, dense, given_rows, given_mask)

    def rebuild_session(self) -> None:
        """Re-export the graph from this module's (updated) weights: a learner delta's dense weights. Always a
        :class:`RequestHead` graph (an older artifact's scorer too: the same scores, one call). A statically
        quantized scorer has no samples here to recalibrate on: its new graph is dynamically quantized (warned)."""
        if self.static:
            log.warning("a dense delta on a statically quantized INT8 scorer (onnx_int8_static): its graph is "
                        "re-exported dynamically quantized (no calibration samples in serving); the next refresh "
                        "publishes a recalibrated artifact")
            self.static = False
        self._box = Held(self._session(export_request(self, self.int8)))
        self.pools = True

    def _hot_table(self) -> Any:
        """The hot rows as the graph is fed them: a numpy view on the CPU (read in place), an ``OrtValue`` on a
        CUDA device (copied there once)."""
        table = self._table.value
        if table is None:
            vectors = self.hot_vectors
            assert isinstance(vectors, torch.Tensor)
            host = vectors.detach().cpu().float().contiguous().numpy()
            if self.ort_device.startswith("cuda") and self.execution_providers[0] != "CPUExecutionProvider":
                index = torch.device(self.ort_device).index or 0
                table = _ort().OrtValue.ortvalue_from_numpy(host, "cuda", index)
            else:
                table = host
            self._table = Held(table)
        return table

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        sess = self._box.value
        if not self.pools:  # an artifact from before the pooling graph
            pooled = self.pool(values, offsets, given_rows, given_mask)  # (B, F, D + 1)
            feeds = {"pooled": pooled.detach().cpu().float().contiguous().numpy(),
                     "dense": dense.detach().cpu().float().contiguous().numpy()}
            return torch.from_numpy(sess.run(None, feeds)[0]).to(pooled.device)  # (B,)
        hot_ids = self.hot_ids
        assert isinstance(hot_ids, torch.Tensor)
        pos = np.searchsorted(hot_ids.cpu().numpy(), values.detach().cpu().numpy())  # (N,) in [0, H]: the sentinel
        prob = self.score_rows(pos, given_rows.detach().cpu().float().numpy(), given_mask.detach().cpu().numpy(),
                               offsets.detach().cpu().numpy(), dense.detach().cpu().float().numpy())
        return torch.from_numpy(prob).to(values.device)  # (B,)

    def score_rows(self, pos: np.ndarray, given: np.ndarray, given_mask: np.ndarray, offsets: np.ndarray,
                   dense: np.ndarray) -> np.ndarray:
        """The pooling graph's call in numpy (serving's request path: no torch call around it): ``pos`` (N,) each
        value's position among the hot rows (``searchsorted`` of the sorted ``hot_ids``; any value where
        ``given_mask``), ``given`` (N, D + 1) float32, ``given_mask`` (N,) bool, ``offsets`` (F + F*B + 1,) int64,
        ``dense`` (B, Dd) float32 -> probabilities (B,) float32. Only for a graph that :attr:`pools`."""
        feeds = request_feeds(self._hot_table(), pos, given, given_mask, offsets, dense)
        return self._box.value.run(None, feeds)[0]  # (B,)


def save(scorer: Scorer, path: Path, int8: bool = False, calibration: list[Feeds] | None = None) -> list[str]:
    """Write ``path`` (the :class:`RequestHead` graph, INT8 with ``int8``, statically quantized on ``calibration``
    where given) and its sibling :data:`STATE_FILE`; returns both names."""
    import safetensors.torch

    model = export_request(scorer, int8, calibration)
    write_synced(path, lambda fh: fh.write(model))
    state = {k: v.detach().cpu().contiguous() for k, v in scorer.state_dict().items()}
    data = safetensors.torch.save(state, metadata={"streamrec": "scorer", "format": "onnx"})
    write_synced(path.parent / STATE_FILE, lambda fh: fh.write(data))
    return [path.name, STATE_FILE]


def load(graph: bytes, state_bytes: bytes, path: Path, spec: ScorerSpec, device: str,
         int8: bool = False, static: bool = False) -> OnnxScorer:
    """The scorer of an ``onnx`` artifact from the bytes of ``path`` (the graph) and of its sibling
    :data:`STATE_FILE` (``state_bytes``; nothing is unpickled), as the loader read them from the files it checked
    (``learner.scorer_files.load_scorer``). OnnxUnavailable without onnxruntime; ValueError for a graph that does not
    take the inputs of the manifest's input layout (3: :class:`RequestHead`'s; 2: :class:`DenseHead`'s)."""
    import safetensors.torch

    _ort()  # the clear error first, before anything is decoded
    state = safetensors.torch.load(state_bytes)
    scorer = OnnxScorer(spec, state["hot_ids"], state["hot_vectors"], graph, int8=int8, device=device, static=static)
    if scorer.pools != (spec.input_layout == POOLING_GRAPH_LAYOUT):
        raise ValueError(f"{path}: the manifest says scorer input layout {spec.input_layout} but the graph takes "
                         f"{', '.join(i.name for i in scorer._box.value.get_inputs())}")
    scorer.load_state_dict(state)  # strict: every name and shape of the spec's Scorer
    log.info("%s: ONNX Runtime runs the %s graph on %s", path, "pooling" if scorer.pools else "dense",
             ", ".join(scorer.execution_providers))
    return scorer.to(device).eval()
