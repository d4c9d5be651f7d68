"""The compiled outbound batch (exchange/network/outbound.pyx): its BufferResponse header
is the codec's, and its SharedBufferResponse the local protocol's, byte for byte, and it
refuses what the codec refuses with the same error."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import UsageError
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.network.outbound import OutboundBatch, buffer_response_header
from exchange.protocol.codec import encode_buffer_response_header
from exchange.protocol.local_messages import (
    MAX_SHARED_BUFFERS,
    encode_shared_buffers,
    pack_shared_buffer,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    receiver=u64,
    seq=u32,
    backlog=u32,
    data_type=st.sampled_from(list(DataType)),
    compressed=st.booleans(),
    size=st.integers(0, 2**32 - 1 - 31),
)
def test_the_compiled_header_is_the_codecs(
    receiver: int, seq: int, backlog: int, data_type: DataType, compressed: bool, size: int
) -> None:
    args = (receiver, seq, backlog, data_type, compressed, size)
    assert buffer_response_header(*args) == encode_buffer_response_header(*args)


def test_the_compiled_header_layout() -> None:
    assert buffer_response_header(
        0x0102030405060708, 9, 10, DataType.EVENT_BUFFER, True, 3
    ) == bytes.fromhex("00000022 badc0ffe 0b 0102030405060708 00000009 0000000a 01 01 00000003")


@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 0, DataType.DATA_BUFFER, False, 1),
        (2**64, 0, 0, DataType.DATA_BUFFER, False, 1),
        (1, -1, 0, DataType.DATA_BUFFER, False, 1),
        (1, 2**32, 0, DataType.DATA_BUFFER, False, 1),
        (1, 0, -1, DataType.DATA_BUFFER, False, 1),
        (1, 0, 2**32, DataType.DATA_BUFFER, False, 1),
        (1, 0, 0, len(DataType), False, 1),
        (1, 0, 0, DataType.DATA_BUFFER, False, -1),
        (1, 0, 0, DataType.DATA_BUFFER, False, 2**32 - 31),  # the frame length overflows
        (1, 0, 0, DataType.DATA_BUFFER, False, 2**70),
    ],
)
def test_fields_out_of_their_wire_width_are_usage_errors_as_in_the_codec(
    args: tuple[int, int, int, int, bool, int],
) -> None:
    with pytest.raises(UsageError):
        encode_buffer_response_header(*args)
    with pytest.raises(UsageError):
        buffer_response_header(*args)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(
        st.tuples(u64, u32, u32, st.booleans(), st.integers(0, 2048), st.integers(0, 2048)),
        min_size=1,
        max_size=MAX_SHARED_BUFFERS - 1,
    )
)
def test_the_compiled_descriptors_are_the_local_protocols(
    entries: list[tuple[int, int, int, bool, int, int]],
) -> None:
    """Buffers of the consumer's arena, sent in one callback: the SharedBufferResponse
    framed by C is ``encode_shared_buffers`` of ``pack_shared_buffer``'s entries, byte for
    byte; each buffer held by its segment index until given back."""
    arena = NetworkBufferPool(len(entries), 4096)
    ob = OutboundBatch(object(), None, 1 << 20)
    ob.established, ob.arena, ob.corked = True, arena, 1  # inside a callback: no flush
    expected, sent = [], []
    for receiver, seq, backlog, compressed, offset, size in entries:
        segment = arena.request_memory_segment()
        assert segment is not None
        whole = Buffer(segment, arena, 4096, DataType.DATA_BUFFER)
        buf = whole.read_only_slice(offset, size)
        whole.release()  # the slice holds the segment
        buf.compressed = compressed
        ob.send_buffer(receiver, seq, backlog, buf)
        expected.append(
            pack_shared_buffer(receiver, seq, backlog, compressed, segment.index, offset, size)
        )
        sent.append((segment.index, receiver, buf))
    assert ob.num_held == len(entries) and ob.bytes_shared == sum(e[5] for e in entries)
    assert ob.out == []  # nothing framed before the callback's end
    ob.frame_descriptors()
    assert ob.out == [encode_shared_buffers(expected)]
    assert ob.out_bytes == len(ob.out[0]) and ob.descriptors == []
    assert {i: [(r, b)] for i, r, b in sent} == ob.held
    for _, _, buf in sent:
        buf.release()
    assert arena.is_whole()
    arena.destroy()


def test_descriptor_fields_out_of_their_wire_width_are_usage_errors() -> None:
    arena = NetworkBufferPool(1, 4096)
    ob = OutboundBatch(object(), None, 1 << 20)
    ob.established, ob.arena, ob.corked = True, arena, 1
    segment = arena.request_memory_segment()
    assert segment is not None
    buf = Buffer(segment, arena, 8, DataType.DATA_BUFFER)
    for args in ((-1, 0, 0), (2**64, 0, 0), (1, 2**32, 0), (1, 0, -1)):
        with pytest.raises(UsageError):
            ob.send_buffer(*args, buf)
    assert ob.num_held == 0 and ob.descriptors == []
    buf.release()
    assert arena.is_whole()
    arena.destroy()
