"""GrantSegments decoded in C (``exchange.protocol.segment_grants``): the daemon's
canonical msgpack body is read straight into the indices, and every other body, valid or
not, decodes exactly as the general msgpack path does (same indices, or a ProtocolError
with the same message). Checked against that path over crafted bodies and mutations."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest

from exchange.errors import ProtocolError
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, encode
from exchange.protocol.frame_parser import InPlaceFrameDecoder
from exchange.protocol.local_messages import (
    _MAX_GRANT,
    GrantSegments,
    _dec_grant,
    _segments,
    _unpack_map,
)
from exchange.protocol.segment_grants import grant_indices

KEY = b"\x81\xa8segments"


def general(body: bytes) -> GrantSegments:
    """The msgpack path every grant took before (and every non-canonical body takes)."""
    return GrantSegments(
        _segments(_unpack_map(memoryview(body), ("segments",))["segments"], "segments")
    )


def outcome(decode: object, body: bytes) -> object:
    try:
        return decode(memoryview(body))  # type: ignore[operator]
    except ProtocolError as e:
        return ("ProtocolError", str(e))


CANONICAL = [
    [0],
    [127],
    [128, 255],
    [256, 65535],
    [65536, 2**32 - 1],
    list(range(15)),
    list(range(16)),  # array 16
    list(range(_MAX_GRANT)),
    [7, 3, 2**20, 0, 99],
]


@pytest.mark.parametrize("segments", CANONICAL, ids=lambda s: f"{len(s)}")
def test_the_daemons_grants_are_read_in_c(segments: list[int]) -> None:
    body = msgpack.packb({"segments": segments})
    assert grant_indices(body, _MAX_GRANT) == tuple(segments)  # the C path took it
    assert _dec_grant(memoryview(body)) == general(body) == GrantSegments(tuple(segments))
    frame = b"".join(bytes(p) for p in encode(GrantSegments(tuple(segments))))
    assert frame[FRAME_HEADER_SIZE:] == body  # the wire bytes of docs/protocol.md
    assert InPlaceFrameDecoder().feed(frame) == [GrantSegments(tuple(segments))]


OTHER = [
    KEY + b"\x91\xce\x00\x00\x00\x05",  # valid, not the smallest form
    KEY + b"\xdc\x00\x01\x05",
    KEY + b"\xdd\x00\x00\x00\x01\x05",
    b"\x81\xd9\x08segments\x91\x05",
    msgpack.packb({"segments": []}),
    msgpack.packb({"segments": [-1]}),
    msgpack.packb({"segments": [2**32]}),
    msgpack.packb({"segments": [2**64 - 1]}),
    msgpack.packb({"segments": [1.5]}),
    msgpack.packb({"segments": [True]}),
    msgpack.packb({"segments": ["1"]}),
    msgpack.packb({"segments": list(range(_MAX_GRANT + 1))}),
    msgpack.packb({"segments": [1], "more": 1}),
    msgpack.packb({"segment": [1]}),
    msgpack.packb([1]),
    msgpack.packb({"segments": [1, 2]}) + b"\x00",
    msgpack.packb({"segments": [1, 70000]})[:-1],
    KEY + b"\x92\x01",
    KEY,
    b"",
]


@pytest.mark.parametrize("body", OTHER, ids=range(len(OTHER)))
def test_other_bodies_decode_as_the_general_path_does(body: bytes) -> None:
    fast = grant_indices(body, _MAX_GRANT)  # None: the C path left it to the general one
    assert fast is None or GrantSegments(fast) == general(body)
    assert outcome(_dec_grant, body) == outcome(general, body)


def test_mutated_grants_decode_as_the_general_path_does() -> None:
    rng = random.Random(20)
    bodies = [msgpack.packb({"segments": s}) for s in CANONICAL[:-2]]
    for _ in range(3000):
        body = bytearray(rng.choice(bodies))
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(3)
            at = rng.randrange(len(body) + 1)
            if op == 0 and at < len(body):
                body[at] = rng.randrange(256)
            elif op == 1:
                body[at:at] = bytes([rng.randrange(256)])
            elif at < len(body):
                del body[at]
        assert outcome(_dec_grant, bytes(body)) == outcome(general, bytes(body)), body.hex()


def test_a_bad_grant_in_a_frame_is_a_protocol_error_naming_it() -> None:
    body = msgpack.packb({"segments": [2**32]})
    frame = struct.pack(">IIB", FRAME_HEADER_SIZE + len(body), MAGIC, 81) + body
    with pytest.raises(ProtocolError, match="segments must be an int"):
        InPlaceFrameDecoder().feed(frame)
