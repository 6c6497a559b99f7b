"""learner/onnx_scorer.py ``_quantized``: ONNX Runtime's quantizers log an advice to pre-process the graph, and
INFO lines, on the root logger; only those are kept out of the log. Serving re-quantizes an INT8 scorer on every
dense delta (``OnnxScorer.rebuild_session``) while its request threads log: their warnings, and the quantizer's
other ones, still reach the handlers, and overlapping quantizations leave the root logger as they found it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from learner import onnx_scorer

ADVICE = ("Please consider to run pre-processing before quantization. Refer to example: "
          "https://github.com/microsoft/onnxruntime-inference-examples")


def _advising(also: str | None = None):  # a quantizer that logs as ONNX Runtime's do, then writes its output
    def quantize(src: str, dst: str) -> None:
        logging.warning(ADVICE)
        logging.info('Quantization parameters for tensor:"/head/Concat_output_0" not specified')
        if also is not None:
            logging.warning(also)
        Path(dst).write_bytes(Path(src).read_bytes())
    return quantize


def test_the_quantizers_pre_processing_advice_is_kept_out_of_the_log_and_nothing_else_is(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert onnx_scorer._quantized(b"graph", _advising(also="calibration range of 'dense' is empty")) == b"graph"
    assert "pre-processing" not in caplog.text and "Quantization parameters" not in caplog.text
    assert "calibration range of 'dense' is empty" in caplog.text


def test_another_threads_warning_logged_while_a_graph_is_quantized_reaches_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    inside, logged = threading.Event(), threading.Event()

    def quantize(src: str, dst: str) -> None:
        inside.set()
        assert logged.wait(30)
        Path(dst).write_bytes(b"")

    def request_thread() -> None:  # e.g. serving's request path while the delta updater rebuilds the scorer
        assert inside.wait(30)
        logging.getLogger("streamrec.serving").warning("a request's warning")
        logged.set()

    with caplog.at_level(logging.INFO):
        t = threading.Thread(target=request_thread)
        t.start()
        onnx_scorer._quantized(b"graph", quantize)
        t.join()
    assert "a request's warning" in caplog.text


def test_overlapping_quantizations_leave_the_root_logger_as_they_found_it() -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()

        def first(src: str, dst: str) -> None:
            a_inside.set()
            assert b_inside.wait(30)
            Path(dst).write_bytes(b"")

        def second(src: str, dst: str) -> None:
            b_inside.set()
            assert a_done.wait(30)  # the first one finishes while this one runs
            Path(dst).write_bytes(b"")

        def run_first() -> None:
            onnx_scorer._quantized(b"a", first)
            a_done.set()

        t = threading.Thread(target=run_first)
        t.start()
        assert a_inside.wait(30)
        onnx_scorer._quantized(b"b", second)
        t.join()
        assert root.level == logging.INFO
        assert root.filters == []
    finally:
        root.setLevel(before)
