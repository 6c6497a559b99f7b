"""The joiner's state chunks (stream/joiner/state_log.py): what a chunk carries of its added impressions."""

from __future__ import annotations

import dataclasses

from stream.joiner.engine import Pending, StateChunk
from stream.joiner.state_log import decode_chunk, encode_chunk


def pending(i: int, history: list[int]) -> Pending:
    p = Pending(f"imp-{i}", 1_700_000_000_000 + i, 11 + i, 22 + i, {"genres": [5, 6], "age": 25}, {"price": 1.5}, 3)
    p.history = history
    return p


def test_a_chunk_leaves_the_histories_out_and_keeps_everything_else() -> None:
    # Under fake_negative every added impression has had its sample's history attached before the chunk is written;
    # a history is read from Redis whenever a sample goes out, so the state must not carry (and grow with) it.
    with_history = [pending(i, list(range(1_000, 1_050))) for i in range(200)]
    without = [pending(i, []) for i in range(200)]
    chunk = StateChunk(3, with_history, [("imp-1", 1_700_000_000_500)], [], 1_700_000_000_000, (5, 7),
                       1_700_000_000_199)
    encoded = encode_chunk(chunk)
    assert [len(v) for v in encoded] == [len(v) for v in encode_chunk(dataclasses.replace(chunk, added=without))]
    back = decode_chunk(encoded)
    assert [p.history for p in back.added] == [[]] * 200
    assert [dataclasses.replace(p, history=[]) for p in back.added] == without
    assert (back.seq, back.joined, back.offsets, back.max_ts) == (3, [("imp-1", 1_700_000_000_500)], (5, 7),
                                                                  1_700_000_000_000)
