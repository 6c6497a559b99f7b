"""Which context fields a fresh learner keeps (``learner.daemon.infer_fields``): a field absent from a row is not
present, whatever the joiner writes for it in the message's column."""

from __future__ import annotations

from learner.daemon import infer_fields
from stream.joiner.engine import Pending, Sample
from stream.joiner.sample_rows import to_batches
from stream.samples import SampleBatch


def _message(contexts: list[dict[str, object]]) -> SampleBatch:
    rows = [Sample(Pending(f"i{n}", 1_000, 1, 2, c, {}, 0, history=[]), 0, 0) for n, c in enumerate(contexts)]
    (message,) = to_batches(rows, 10_000)
    return SampleBatch.decode(message)


def test_a_list_field_on_one_row_in_ten_is_not_kept_at_a_half_share() -> None:
    # the joiner writes [MISSING] for the nine rows without "tags" (a list column): they do not carry it
    batch = _message([{"device": 3, "tags": [5, 6]}] + [{"device": 3}] * 9)
    ctx, _ = infer_fields([batch], min_share=0.5, max_fields=10)
    assert ctx == {"device": "single"}


def test_a_list_field_sent_empty_is_not_present_and_one_sent_is() -> None:
    batch = _message([{"tags": []}, {"tags": [7]}, {"tags": [8]}, {}])
    assert infer_fields([batch], min_share=0.5, max_fields=10)[0] == {"tags": "multi"}
    assert infer_fields([batch], min_share=0.6, max_fields=10)[0] == {}
