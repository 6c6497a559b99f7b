"""stream/events.py's duplicate-key check: its cheap bounds (colons, then quote-colon pairs when no whitespace follows a
quote) never let a repeated key through, whatever the strings hold, and never reject a clean event."""

from __future__ import annotations

import pytest

from stream.errors import BadMessage
from stream.events import decode_impression

BASE = b'"schema_version":1,"impression_id":"a","ts":5,"user_id":1,"item_id":2'


@pytest.mark.parametrize("raw", [
    b'{' + BASE + b',"context":{"title":"Alien: Resurrection","genres":["Sci-Fi"]}}',  # colons inside values
    b'{' + BASE + b',"context":{"title":"a\\":b","x":"c:d:e:f:g:h:i:j"}}',  # an escaped quote before a colon
    b'{ "schema_version" : 1 , "impression_id" : "a:b:c:d:e:f" , "ts" : 5 , "user_id" : 1 , "item_id" : 2 }',
])
def test_clean_events_with_colons_in_strings_pass(raw: bytes) -> None:
    assert decode_impression(raw).impression_id in ("a", "a:b:c:d:e:f")


@pytest.mark.parametrize("raw", [
    b'{' + BASE + b',"context":{"t":"x:y:z:w:v:u:s:r:q","t":"b"}}',  # compact, colons inside values
    b'{' + BASE + b',"ts":6,"context":{"t":"x:y:z:w:v:u:s:r:q"}}',
    b'{' + BASE + b',"context":{"t" :"x:y:z:w:v:u:s:r:q","t"\t:"b"}}',  # whitespace before the colons
    b'{' + BASE + b',"context":{"t":"a\\":b:c:d:e:f:g:h:i","t":"b"}}',
])
def test_a_repeated_key_is_rejected(raw: bytes) -> None:
    with pytest.raises(BadMessage) as err:
        decode_impression(raw)
    assert err.value.kind == "duplicate_key"
