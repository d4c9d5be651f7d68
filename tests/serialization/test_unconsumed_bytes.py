"""``RecordDecoder.unconsumed_bytes`` (Flink's ``getUnconsumedBuffer``): the bytes of the
incomplete record, exactly as fed. An unaligned checkpoint persists them at a channel's
cut; a restored decoder fed them first, then the rest of the stream, decodes the same
records, none torn, none twice."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.errors import UsageError
from exchange.serialization import BytesCodec, MsgpackCodec, PickleCodec, default_codec

RECORDS = [(i, bytes([i % 251]) * (i * 37 % 3000)) for i in range(60)]


def encoded(codec: Any) -> bytes:
    enc = codec.new_encoder()
    return b"".join(bytes(enc.encode_batch([r])) for r in RECORDS)


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10**9), piece=st.integers(1, 5000))
@pytest.mark.parametrize("make", [default_codec, PickleCodec], ids=["pickle_batch", "pickle"])
def test_a_decoder_restored_from_its_unconsumed_bytes_goes_on_where_it_was(
    make: Any, cut: int, piece: int
) -> None:
    codec = make()
    stream = encoded(codec)
    cut %= len(stream) + 1
    dec = codec.new_decoder()
    for at in range(0, cut, piece):  # fed in pieces, like buffers
        dec.feed(stream[at : min(at + piece, cut)])
    before = dec.take()
    head = dec.unconsumed_bytes()
    assert bool(head) == dec.has_partial_record
    assert stream[:cut].endswith(head)  # exactly the bytes fed since the last boundary
    restored = codec.new_decoder()
    restored.feed(head)
    assert restored.take() == []
    restored.feed(stream[cut:])
    assert before + restored.take() == RECORDS
    assert not restored.has_partial_record


def test_bytes_codec_hands_out_a_cut_header() -> None:
    codec = BytesCodec()
    dec = codec.new_decoder()
    dec.feed(b"\x00\x00")  # half a length header
    assert dec.unconsumed_bytes() == b"\x00\x00"
    dec.feed(b"\x00\x03ab")
    assert dec.unconsumed_bytes() == b"\x00\x00\x00\x03ab"
    dec.feed(b"c")
    assert [bytes(r) for r in dec.take()] == [b"abc"] and dec.unconsumed_bytes() == b""


def test_msgpack_refuses_inside_a_record() -> None:
    codec = MsgpackCodec()
    data = bytes(codec.new_encoder().encode_batch([[1, 2, 3], "x" * 100]))
    dec = codec.new_decoder()
    dec.feed(data[:5])
    assert dec.take() == [[1, 2, 3]]
    with pytest.raises(UsageError, match="framed codec"):
        dec.unconsumed_bytes()
    dec.feed(data[5:])
    assert dec.unconsumed_bytes() == b""
