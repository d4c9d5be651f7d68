"""RecordDeserializer: buffers in, records out, every buffer released as it is consumed.

Records written by a RecordWriter and read back: test_spanning_records.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import CorruptRecordError, RecordTooLargeError, UsageError
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.serialization import (
    BytesCodec,
    MsgpackCodec,
    PickleCodec,
)
from tests.kit.record_deserializer import RecordDeserializer

SEGMENT = 4096


@contextmanager
def pools(
    total: int = 32, required: int = 1, max_segments: int = 32
) -> Iterator[tuple[NetworkBufferPool, LocalBufferPool]]:
    """A NetworkBufferPool with one LocalBufferPool; checks both are whole at the end."""
    nbp = NetworkBufferPool(total, SEGMENT)
    local = nbp.create_buffer_pool(required, max_segments)
    yield nbp, local
    nbp.check_consistency()
    local.destroy()
    nbp.check_consistency()
    assert nbp.is_whole(), nbp
    nbp.destroy()


def buffers_of(pool: LocalBufferPool, data: bytes, size: int) -> list[Buffer]:
    """``data`` cut into pooled data buffers of ``size`` bytes, all held."""
    out = []
    for start in range(0, len(data), size):
        buffer = pool.request_buffer()
        assert buffer is not None
        chunk = data[start : start + size]
        buffer.segment.view()[: len(chunk)] = chunk
        buffer.set_size(len(chunk))
        out.append(buffer)
    return out


def test_each_buffer_is_recycled_as_soon_as_it_is_consumed() -> None:
    records = [[i, "v" * (i % 50)] for i in range(300)]
    stream = b"".join(msgpack.packb(r) for r in records)
    with pools(total=128, max_segments=128) as (_, pool):
        buffers = buffers_of(pool, stream, 100)
        assert pool.num_in_use == len(buffers) > 50
        deser = RecordDeserializer(MsgpackCodec())
        got: list[Any] = []
        for i, buffer in enumerate(buffers):
            deser.set_next_buffer(buffer)
            assert buffer.is_recycled
            assert pool.num_in_use == len(buffers) - i - 1
            got += deser.records()
        assert got == records
        assert not deser.has_partial_record


def test_partial_record_waits_for_the_next_buffer() -> None:
    with pools() as (_, pool):
        deser = RecordDeserializer(BytesCodec())
        first, second = buffers_of(pool, b"\x00\x00\x00\x05abcde", 6)
        deser.set_next_buffer(first)
        assert deser.records() == []
        assert deser.has_partial_record
        assert deser.buffered_bytes == 6
        assert pool.num_in_use == 1  # only the second buffer
        deser.set_next_buffer(second)
        assert list(deser) == [b"abcde"]
        assert not deser.has_partial_record


def test_iteration_yields_what_records_would() -> None:
    with pools() as (_, pool):
        deser = RecordDeserializer(MsgpackCodec())
        for buffer in buffers_of(pool, b"\x01\x02\x03", 2):
            deser.set_next_buffer(buffer)
        assert list(deser) == [1, 2, 3]
        assert list(deser) == []


def test_event_buffers_are_refused_and_released() -> None:
    deser = RecordDeserializer(MsgpackCodec())
    event = Buffer.wrap(b"\x00", DataType.EVENT_BUFFER)
    with pytest.raises(UsageError):
        deser.set_next_buffer(event)
    assert event.is_recycled


def test_clear_forgets_the_partial_record() -> None:
    with pools() as (_, pool):
        deser = RecordDeserializer(MsgpackCodec())
        head, tail = buffers_of(pool, msgpack.packb("x" * 100), 60)
        deser.set_next_buffer(head)
        assert deser.has_partial_record
        deser.clear()
        assert not deser.has_partial_record
        tail.release()
        deser.set_next_buffer(buffers_of(pool, b"\x07", 1)[0])
        assert deser.records() == [7]


# -- hostile input -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 4096])
def test_corrupt_msgpack_raises_after_the_good_records(size: int) -> None:
    stream = msgpack.packb(1) + msgpack.packb("two") + b"\xc1" + msgpack.packb(3)
    with pools() as (_, pool):
        deser = RecordDeserializer(MsgpackCodec())
        got: list[Any] = []
        buffers = buffers_of(pool, stream, size)
        with pytest.raises(CorruptRecordError) as info:
            for buffer in buffers:
                deser.set_next_buffer(buffer)
                got += deser.records()
            deser.records()  # the good records came first, the error with the next call
        assert not isinstance(info.value, RecordTooLargeError)
        assert deser.has_partial_record  # an end-of-partition check would notice
        for buffer in buffers:
            if not buffer.is_recycled:
                buffer.release()
        assert got == [1, "two"]
        # A failed channel stays failed, and still releases what it is given.
        late = buffers_of(pool, b"\x01", 1)[0]
        with pytest.raises(CorruptRecordError):
            deser.set_next_buffer(late)
        assert late.is_recycled
        with pytest.raises(CorruptRecordError):
            deser.records()


@pytest.mark.parametrize("codec", [BytesCodec(), PickleCodec()], ids=["bytes", "pickle"])
@pytest.mark.parametrize("size", [1, 2, 64])
def test_corrupt_length_prefix_fails_at_once(codec: Any, size: int) -> None:
    head = codec.new_encoder().encode_batch([b"a"])
    stream = bytes(head) + b"\xff\xff\xff\xf0" + b"junk" * 10
    with pools(total=128, max_segments=128) as (_, pool):
        deser = RecordDeserializer(codec)
        buffers = buffers_of(pool, stream, size)
        got: list[Any] = []
        with pytest.raises(RecordTooLargeError) as info:
            for buffer in buffers[: (len(head) + 4 - 1) // size + 1]:  # up to the prefix's end
                deser.set_next_buffer(buffer)
                got += deser.records()
            deser.records()
        assert info.value.size == 0xFFFFFFF0
        assert info.value.limit == codec.max_record_size
        assert not info.value.at_least
        assert deser.buffered_bytes < 16  # nothing was allocated for the claimed size
        for buffer in buffers:
            if not buffer.is_recycled:
                buffer.release()
    assert got == [b"a"]


def test_corrupt_pickle_payload() -> None:
    with pools() as (_, pool):
        deser = RecordDeserializer(PickleCodec())
        for buffer in buffers_of(pool, b"\x00\x00\x00\x03abc", 64):
            deser.set_next_buffer(buffer)
        with pytest.raises(CorruptRecordError) as info:
            deser.records()
        assert info.value.__cause__ is not None
