"""Fill partitions synchronously through the one write path (tests only).

``RecordWriter`` cuts the buffers; ``queue_output`` does what ``ResultPartitionSink``
does with them (copy each into a segment of the partition's pool, then
``ResultPartition.add_buffer``; events through ``broadcast_event``), without awaiting a
segment: tests that need no backpressure stay free of an event loop. A pool that has no
free segment is a mistake in the test, reported at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from exchange.buffers.buffer import Buffer
from exchange.events.events import EventSerializer
from exchange.partition import ResultPartition
from exchange.serialization.record_codec import BytesCodec, RecordCodec
from exchange.writer.record_writer import OutputBuffer, RecordWriter

__all__ = [
    "add_full_buffers",
    "add_raw_bytes",
    "full_buffer_payload",
    "queue_output",
    "record_writer_for",
    "write_records",
]


def record_writer_for(part: ResultPartition, codec: RecordCodec | None = None) -> RecordWriter:
    """A RecordWriter cutting buffers of each subpartition's buffer size, flushing only
    when asked (``buffer_timeout=-1``)."""
    writer = RecordWriter(
        part.num_subpartitions, buffer_size=part.segment_size, codec=codec, buffer_timeout=-1
    )
    for i, sub in enumerate(part.subpartitions):
        writer.set_buffer_size(i, sub.buffer_size)
    return writer


def _pool_buffer(part: ResultPartition) -> Buffer:
    buf = part.buffer_pool.request_buffer()
    if buf is None:
        raise AssertionError(f"the pool of {part} has no free segment: too small for the test")
    return buf


def queue_output(part: ResultPartition, outputs: Iterable[OutputBuffer]) -> int:
    """Queue the writer's buffers and events in order; returns how many."""
    n = 0
    for out in outputs:
        n += 1
        if out.is_event:
            part.broadcast_event(EventSerializer.from_bytes(out.pieces[0]))
            continue
        buf = _pool_buffer(part)
        view = buf.segment.view()
        pos = 0
        for piece in out.pieces:
            view[pos : pos + len(piece)] = piece
            pos += len(piece)
        buf.set_size(pos)
        part.add_buffer(out.target, buf)
    return n


def write_records(
    part: ResultPartition,
    records: Iterable[tuple[int, Any]],
    codec: RecordCodec | None = None,
    *,
    finish: bool = False,
) -> int:
    """Emit each ``(target, record)``, flush, queue the buffers (and ``finish`` the
    partition if asked); returns the number of buffers queued."""
    writer = record_writer_for(part, codec)
    for target, record in records:
        writer.emit_to(record, target)
    n = queue_output(part, writer.close())
    if finish:
        part.finish()
    return n


def add_raw_bytes(part: ResultPartition, target: int, data: bytes) -> int:
    """Queue ``data`` as it is (a malformed stream, say), cut at the segment size."""
    n = 0
    size = part.segment_size
    for start in range(0, len(data), size):
        chunk = data[start : start + size]
        buf = _pool_buffer(part)
        buf.segment.view()[: len(chunk)] = chunk
        buf.set_size(len(chunk))
        part.add_buffer(target, buf)
        n += 1
    return n


def full_buffer_payload(segment_size: int, tag: int) -> bytes:
    """Buffer ``tag`` of ``add_full_buffers``, byte for byte: one BytesCodec record that
    fills the segment (length prefix, the tag, then ``tag % 251`` repeated)."""
    return (
        (segment_size - 4).to_bytes(4, "big")
        + tag.to_bytes(4, "big")
        + bytes([tag % 251]) * (segment_size - 8)
    )


def add_full_buffers(part: ResultPartition, target: int, n: int, start: int = 0) -> None:
    """Queue ``n`` full data buffers for ``target``, buffer ``i`` tagged ``start + i`` (big
    endian at offset 4, after the record's length prefix)."""
    size = part.segment_size
    records = (
        (target, i.to_bytes(4, "big") + bytes([i % 251]) * (size - 8))
        for i in range(start, start + n)
    )
    queued = write_records(part, records, BytesCodec())
    assert queued == n, f"{n} records of one segment each were cut into {queued} buffers"
