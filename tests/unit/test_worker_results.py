"""Step results always fit the ledger: bounded text and bounded results."""

import json

from retex.ledger import RESULT_LIMIT_BYTES
from retex.worker.outcomes import bounded_result, head_text, tail_text


def test_text_within_the_limit_is_kept_whole():
    assert tail_text(b"hello", 100) == ("hello", False)
    assert head_text(b"hello", 100) == ("hello", False)


def test_tail_keeps_the_end_and_head_keeps_the_beginning():
    data = b"".join(f"{i:04d}\n".encode() for i in range(1000))
    tail, cut = tail_text(data, 100)
    head, _ = head_text(data, 100)
    assert cut and tail.endswith("0999\n") and len(json.dumps(tail)) <= 100
    assert head.startswith("0000\n") and len(json.dumps(head)) <= 100


def test_invalid_utf8_is_replaced_not_fatal():
    assert tail_text(b"ok \xff\xfe", 100)[0] == "ok \ufffd\ufffd"


def test_a_result_that_fits_is_unchanged():
    assert bounded_result({"a": [1, 2]}) == {"a": [1, 2]}


def test_an_oversized_result_becomes_a_marked_preview_that_fits_the_ledger():
    result = bounded_result({"blob": "x" * (2 * RESULT_LIMIT_BYTES)})
    assert result["truncated"] is True and result["bytes"] > RESULT_LIMIT_BYTES
    assert result["preview"].startswith('{"blob": "xxx')
    assert len(json.dumps(result).encode()) <= RESULT_LIMIT_BYTES
