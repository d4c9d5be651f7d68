"""The compiled outbound batch (exchange/network/outbound.pyx): its BufferResponse header
is the codec's, byte for byte, and refuses what the codec refuses with the same error."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.buffers.buffer import DataType
from exchange.errors import UsageError
from exchange.network.outbound import buffer_response_header
from exchange.protocol.codec import encode_buffer_response_header

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
