"""RecordWriter: the one write path, sans I/O. Records in, finished buffers out.

Every producer drives this class: the PySpark task (``client.producer.PartitionWriter``),
the asyncio API (``client.producer.AsyncPartitionWriter``) and the tests' in-process
writer (``tests/kit/partition_writer.py``). It does no I/O and never waits; whoever drives it
takes the buffers it cut (``take_output``) and moves them (to the daemon, into a
partition's segments), waiting for credit or segments there: that is where backpressure
reaches the producer.

How a record travels:

1. **Routing**: a channel selector (hash of the key with the project's deterministic
   hash, a user's partitioner, round robin) picks the target subpartition; ``broadcast``
   sends to all.
2. **Batching**: records wait in a per-subpartition list; when the list holds about one
   buffer's worth (the count adapts to the records' encoded size) the codec encodes it
   in one call (``encode_batch``: one pickle of a list by default, several times faster
   than a pickle per record).
3. **Cutting**: the encoded chunks of a subpartition form its byte stream, which is cut
   into buffers of that subpartition's buffer size (a segment, or smaller once the
   consumer's debloater announced a new size). A buffer is a list of memoryview slices of
   the chunks: nothing is copied here; the bytes are copied once, into a segment or into
   the socket, by the driver. Records may span buffers; one larger than the buffer size
   spans several and still leaves at once.
4. **Flushing** (Flink's output flusher): ``buffer_timeout`` 0 flushes after every record,
   -1 only full buffers (and on ``flush``), N seconds: the driver's timer calls
   ``flush_if_due(now)``; the writer also checks as records arrive.

Events (EndOfPartition, checkpoint barriers, cancellation markers, user events) leave
after every record emitted before them, on every subpartition, which are flushed first.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from exchange.buffers.buffer import DataType
from exchange.errors import NotAPairError, RecordTooLargeError, UsageError, WriterClosedError
from exchange.events.events import (
    AbstractEvent,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    EventSerializer,
)
from exchange.partition.result_partition import ALL_SUBPARTITIONS
from exchange.serialization.record_codec import RecordCodec, default_codec
from exchange.writer.channel_selector import ChannelSelector
from exchange.writer.hashing import deterministic_hash
from exchange.writer.routing import partition_of, route

__all__ = [
    "ALL_SUBPARTITIONS",
    "DEFAULT_BUFFER_TIMEOUT",
    "OutputBuffer",
    "RecordWriter",
    "WriterStats",
]

#: Flink's default buffer timeout (100 ms).
DEFAULT_BUFFER_TIMEOUT: Final = 0.1
#: Smallest buffer size a consumer may announce (Flink's debloat minimum).
MIN_BUFFER_SIZE: Final = 256

_NO_KEY: Final[Any] = object()
#: Records per batch: the first batch of a subpartition, and the bounds of the adaptation.
_FIRST_BATCH: Final = 4
_MAX_BATCH: Final = 4096
#: Records ``emit_all`` routes between two checks for full batches.
_SLICE: Final = 2048


@dataclass(slots=True)
class OutputBuffer:
    """One buffer the writer cut: its target, its bytes (as slices) and data type.

    ``pieces`` are memoryviews (or bytes) that stay valid until the driver dropped them;
    their total length is ``size``. Events carry their serialized form as one piece.
    ``ends_mid_record``: the buffer ends inside an encoded batch, whose rest follows in
    the target's next buffer (a record spans them: the consumer decodes it only once that
    one arrives; a driver out of credit may ask for overdraft to send it).
    """

    target: int
    data_type: DataType
    size: int
    pieces: list[memoryview | bytes] = field(repr=False)
    ends_mid_record: bool = False

    @property
    def is_event(self) -> bool:
        return self.data_type is not DataType.DATA_BUFFER

    def to_bytes(self) -> bytes:
        """The buffer's bytes joined into one object (a copy: the data path sends
        ``pieces`` as they are; tests compare buffers with this)."""
        return b"".join(self.pieces)


class WriterStats:
    """Plain counters (a driver maps them to metrics)."""

    __slots__ = (
        "buffers_out",
        "bytes_out",
        "encoded_bytes",
        "encoded_records",
        "events_out",
        "flushes",
        "records_out",
    )

    def __init__(self) -> None:
        self.records_out = 0
        self.encoded_records = 0
        self.encoded_bytes = 0
        self.bytes_out = 0
        self.buffers_out = 0
        self.events_out = 0
        self.flushes = 0


class _Stream:
    """One subpartition's pending records and encoded, not yet cut, bytes."""

    __slots__ = ("batch", "buffer_size", "chunks", "head", "nbytes", "records")

    def __init__(self, buffer_size: int) -> None:
        self.records: list[Any] = []
        self.batch = _FIRST_BATCH
        self.chunks: deque[memoryview] = deque()
        self.head = 0  # bytes of chunks[0] already cut
        self.nbytes = 0  # encoded bytes not yet cut
        self.buffer_size = buffer_size


class RecordWriter:
    """Routes, batches, encodes and cuts records into buffers for ``num_subpartitions``.

    Not thread-safe: one driver at a time (the sync facade serializes its task thread and
    its flush timer with a lock).
    """

    def __init__(
        self,
        num_subpartitions: int,
        *,
        buffer_size: int,
        codec: RecordCodec | None = None,
        selector: ChannelSelector | None = None,
        buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            not isinstance(num_subpartitions, int)
            or isinstance(num_subpartitions, bool)
            or num_subpartitions <= 0
        ):
            raise UsageError(f"num_subpartitions must be a positive int, got {num_subpartitions!r}")
        if not isinstance(buffer_size, int) or buffer_size < MIN_BUFFER_SIZE:
            raise UsageError(
                f"buffer_size must be an int >= {MIN_BUFFER_SIZE}, got {buffer_size!r}"
            )
        if not isinstance(buffer_timeout, (int, float)) or (
            buffer_timeout != -1 and buffer_timeout < 0
        ):
            raise UsageError(f"buffer_timeout must be >= 0 or -1, got {buffer_timeout!r}")
        self.num_subpartitions = num_subpartitions
        self.max_buffer_size = buffer_size
        self.codec: RecordCodec = codec if codec is not None else default_codec()
        self._encoder = self.codec.new_encoder()
        self._encode_batch = self._encoder.encode_batch
        self.selector = selector
        if selector is not None:
            selector.setup(num_subpartitions)
        self.buffer_timeout = float(buffer_timeout)
        self._clock = clock
        self._streams = [_Stream(buffer_size) for _ in range(num_subpartitions)]
        # Broadcast records (Flink's BroadcastRecordWriter): one stream whose buffers every
        # subpartition reads (target ALL_SUBPARTITIONS), encoded and copied once. Switching
        # between unicast and broadcast cuts the other side's pending bytes first (order).
        self._bstream = _Stream(buffer_size)
        self._broadcasting = False
        # Records per batch that fill about one buffer, from the last encoded batch of any
        # subpartition: bounds the first batches of the others (large records, wide fan-out)
        self._batch_hint = _MAX_BATCH
        self._output: list[OutputBuffer] = []
        self._output_bytes = 0
        # emit_all's key -> target cache, and the partition function it holds targets of
        self._key_cache: dict[Any, int] = {}
        self._key_cache_func: Callable[[Any], int] | None = None
        self._last_flush = clock()
        self._dirty = False  # records emitted since the last flush
        self._closed = False
        self.stats = WriterStats()

    # -- configuration -------------------------------------------------------------------

    def set_buffer_size(self, target: int, size: int) -> None:
        """Cut every *new* buffer of ``target`` at ``size`` bytes (a debloater's
        NewBufferSize); clamped to [MIN_BUFFER_SIZE, the segment size]."""
        self._check_target(target)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise UsageError(f"buffer size must be a positive int, got {size!r}")
        self._streams[target].buffer_size = max(MIN_BUFFER_SIZE, min(size, self.max_buffer_size))
        # broadcast buffers go to every subpartition: the smallest size
        self._bstream.buffer_size = min(st.buffer_size for st in self._streams)

    def buffer_size(self, target: int) -> int:
        self._check_target(target)
        return self._streams[target].buffer_size

    @property
    def smallest_buffer_size(self) -> int:
        """The smallest size any subpartition cuts at now (broadcast buffers use it)."""
        return self._bstream.buffer_size

    # -- emitting ------------------------------------------------------------------------

    def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition the selector picks, or by ``key``'s hash (default
        ``record[0]`` when there is no selector)."""
        if key is _NO_KEY and self.selector is not None:
            if self.selector.is_broadcast:
                self.broadcast(record)
                return
            target = self.selector.select_channel(record)
        elif key is _NO_KEY:
            target = self._route(record, None, None)
        else:
            target = deterministic_hash(key) % self.num_subpartitions
        self.emit_to(record, target)

    def emit_to(self, record: Any, target: int) -> None:
        """Emit to subpartition ``target``."""
        self._check_open()
        self._check_target(target)
        if self._broadcasting:
            self._end_broadcast()
        stream = self._streams[target]
        stream.records.append(record)
        self.stats.records_out += 1
        self._dirty = True
        if len(stream.records) >= min(stream.batch, self._batch_hint):
            self._encode(target, stream)
        self._after_records()

    def emit_all(
        self,
        records: Iterable[Any],
        partition_func: Callable[[Any], int] | None = None,
        key_func: Callable[[Any], Any] | None = None,
    ) -> int:
        """Emit every record of ``records`` by key; returns how many.

        Each goes to ``partition_func(key) % n`` (default: the deterministic hash of the
        key), the key being ``key_func(record)`` or ``record[0]``; with a selector and no
        ``partition_func``/``key_func`` the selector decides. The hot loop of every PySpark
        producer: per record one key lookup (ints hashed inline, other keys through a
        bounded cache) and one list append.
        """
        self._check_open()
        if partition_func is not None and not callable(partition_func):
            raise UsageError("partition_func must be callable")
        if key_func is not None and not callable(key_func):
            raise UsageError("key_func must be callable")
        n = self.num_subpartitions
        streams = self._streams
        count = 0
        if self.selector is not None and self.selector.is_broadcast and partition_func is None:
            for record in records:
                self.broadcast(record)
                count += 1
            return count
        if self.buffer_timeout == 0:
            for record in records:
                self.emit_to(record, self._route(record, partition_func, key_func))
                count += 1
            return count
        if self._broadcasting:
            self._end_broadcast()
        if self.selector is not None and partition_func is None and key_func is None:
            select = self.selector.select_channel
            try:
                for record in records:
                    index = select(record)
                    stream = streams[index]
                    stream.records.append(record)
                    count += 1
                    if len(stream.records) >= stream.batch:
                        self._encode(index, stream)
            finally:
                # also when a record was refused: the others are pending, to be flushed
                self._account(count)
            return count
        if n == 1 and partition_func is None and key_func is None:
            # One subpartition and nothing to call: no key to look at, no routing.
            stream = streams[0]
            it = iter(records)
            try:
                while True:
                    pending = stream.records  # a new list after each _encode
                    before = len(pending)
                    pending.extend(itertools.islice(it, _SLICE))
                    taken = len(pending) - before
                    count += taken
                    if len(pending) >= min(stream.batch, self._batch_hint):
                        self._encode(0, stream)
                    if taken < _SLICE:
                        break
            finally:
                self._account(count)
            return count
        # the compiled loop (exchange/writer/routing.pyx) appends each record to its
        # subpartition's list, hashing int keys inline and other keys through the cache
        cache = self._key_cache
        if partition_func is not self._key_cache_func:
            cache.clear()
            self._key_cache_func = partition_func
        it = iter(records)
        try:
            while True:
                # A slice at a time: full batches are encoded between slices. What a slice
                # took is what the lists grew by (also when a record or the input failed:
                # the records before it are pending, to be flushed, and counted).
                lists = [s.records for s in streams]
                before = sum(map(len, lists))
                try:
                    route(it, lists, partition_func, key_func, cache, _SLICE)
                finally:
                    taken = sum(map(len, lists)) - before
                    count += taken
                hint = self._batch_hint
                for index, stream in enumerate(streams):
                    if len(stream.records) >= min(stream.batch, hint):
                        self._encode(index, stream)
                if taken < _SLICE:
                    break
        finally:
            self._account(count)
        return count

    def _route(
        self,
        record: Any,
        partition_func: Callable[[Any], int] | None,
        key_func: Callable[[Any], Any] | None,
    ) -> int:
        if self.selector is not None and partition_func is None and key_func is None:
            return self.selector.select_channel(record)
        if key_func is not None:
            return self._partition(key_func(record), partition_func)
        try:
            key = record[0]
        except (TypeError, IndexError, KeyError) as e:
            raise NotAPairError.for_record(record) from e
        return self._partition(key, partition_func)

    def _partition(self, key: Any, partition_func: Callable[[Any], int] | None) -> int:
        return partition_of(key, partition_func, self.num_subpartitions)

    def _account(self, count: int) -> None:
        if count:
            self.stats.records_out += count
            self._dirty = True
            self._after_records()

    def broadcast(self, record: Any) -> None:
        """Emit one record to every subpartition: encoded and copied once, into buffers
        that every subpartition reads."""
        self._check_open()
        if not self._broadcasting:
            self._cut_unicasts()
            self._broadcasting = True
        stream = self._bstream
        stream.records.append(record)
        self.stats.records_out += 1
        self._dirty = True
        if len(stream.records) >= stream.batch:
            self._encode(ALL_SUBPARTITIONS, stream)
        self._after_records()

    def _cut_unicasts(self) -> None:
        for i, stream in enumerate(self._streams):
            if stream.records:
                self._encode(i, stream)
            if stream.nbytes:
                self._cut(i, stream, partial=True)

    def _end_broadcast(self) -> None:
        stream = self._bstream
        if stream.records:
            self._encode(ALL_SUBPARTITIONS, stream)
        if stream.nbytes:
            self._cut(ALL_SUBPARTITIONS, stream, partial=True)
        self._broadcasting = False

    # -- events --------------------------------------------------------------------------

    def broadcast_event(self, event: AbstractEvent) -> None:
        """Send ``event`` to every subpartition after every record emitted so far."""
        self._check_open()
        payload = EventSerializer.to_bytes(event)
        self.flush()
        data_type = EventSerializer.to_buffer_data_type(event)
        self._output.append(OutputBuffer(ALL_SUBPARTITIONS, data_type, len(payload), [payload]))
        self._output_bytes += len(payload)
        self.stats.events_out += 1

    def broadcast_barrier(
        self, checkpoint_id: int, timestamp: int, *, aligned: bool = True
    ) -> CheckpointBarrier:
        """CheckpointBarrier(checkpoint_id) on every subpartition, after every record
        emitted before it (which are flushed). ``aligned``: exactly-once alignment (the
        barrier blocks its subpartition until the consumer resumes it)."""
        barrier = CheckpointBarrier(
            checkpoint_id, timestamp, CheckpointOptions(exactly_once=aligned)
        )
        self.broadcast_event(barrier)
        return barrier

    def broadcast_cancel(self, checkpoint_id: int) -> None:
        """CancelCheckpointMarker(checkpoint_id) on every subpartition."""
        self.broadcast_event(CancelCheckpointMarker(checkpoint_id))

    # -- flushing ------------------------------------------------------------------------

    def flush(self) -> None:
        """Cut everything emitted so far into buffers (the last ones partial)."""
        if self._broadcasting:
            self._end_broadcast()
        self._cut_unicasts()
        self._last_flush = self._clock()
        self._dirty = False
        self.stats.flushes += 1

    def flush_if_due(self, now: float | None = None) -> bool:
        """The output flusher's pass: flush if ``buffer_timeout`` passed since the last
        flush and something is pending. True if it flushed."""
        if self._closed or not self._dirty or self.buffer_timeout < 0:
            return False
        t = self._clock() if now is None else now
        if t < self._last_flush + self.buffer_timeout:  # the same sum as the deadline
            return False
        self.flush()
        return True

    @property
    def next_flush_deadline(self) -> float | None:
        """When ``flush_if_due`` will next flush (None: never, nothing pending)."""
        if self._closed or not self._dirty or self.buffer_timeout <= 0:
            return None
        return self._last_flush + self.buffer_timeout

    def _after_records(self) -> None:
        timeout = self.buffer_timeout
        if timeout == 0 or (timeout > 0 and self._clock() - self._last_flush >= timeout):
            self.flush()

    # -- output --------------------------------------------------------------------------

    @property
    def output_bytes(self) -> int:
        """Bytes of the buffers cut and not yet taken."""
        return self._output_bytes

    @property
    def has_output(self) -> bool:
        return bool(self._output)

    def take_output(self) -> list[OutputBuffer]:
        """The buffers cut so far, in order; the caller moves them on."""
        out, self._output = self._output, []
        self._output_bytes = 0
        return out

    @property
    def pending_bytes(self) -> int:
        """Encoded bytes not yet cut into buffers (records not yet encoded excluded)."""
        return sum(s.nbytes for s in self._streams) + self._bstream.nbytes

    @property
    def pending_records(self) -> int:
        return sum(len(s.records) for s in self._streams) + len(self._bstream.records)

    @property
    def mean_record_size(self) -> int | None:
        """Encoded bytes per record so far (None before the first batch)."""
        st = self.stats
        return st.encoded_bytes // st.encoded_records if st.encoded_records else None

    # -- closing -------------------------------------------------------------------------

    def close(self) -> list[OutputBuffer]:
        """Flush and close; returns the last buffers. Closing twice is an error."""
        self._check_open()
        self.flush()
        self._closed = True
        return self.take_output()

    def discard(self) -> None:
        """Drop everything pending (the producer failed); the writer is closed."""
        self._closed = True
        self._broadcasting = False
        for stream in [*self._streams, self._bstream]:
            stream.records.clear()
            stream.chunks.clear()
            stream.head = 0
            stream.nbytes = 0
        self._output.clear()
        self._output_bytes = 0

    @property
    def is_closed(self) -> bool:
        return self._closed

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError("the RecordWriter is closed")

    def _check_target(self, target: int) -> None:
        if (
            not isinstance(target, int)
            or isinstance(target, bool)
            or not 0 <= target < self.num_subpartitions
        ):
            raise UsageError(f"subpartition {target!r} out of range [0, {self.num_subpartitions})")

    def _encode(self, index: int, stream: _Stream) -> None:
        """Encode the subpartition's pending records as one chunk and cut full buffers."""
        records = stream.records
        stream.records = []
        refused: RecordTooLargeError | None = None
        try:
            try:
                chunk = self._encode_batch(records)
            except RecordTooLargeError:
                records, chunk, refused = self._encode_without_too_large(records)
        except BaseException:
            # the records are lost with the failed batch; the writer cannot go on safely
            self.discard()
            raise
        self._append_chunk(index, stream, records, chunk)
        if refused is not None:
            # Only the records over the limit are refused: the others are in the stream,
            # in order, and the writer goes on.
            raise refused

    def _encode_without_too_large(
        self, records: list[Any]
    ) -> tuple[list[Any], bytes | bytearray, RecordTooLargeError | None]:
        """Encode a batch that failed with RecordTooLargeError without the records over the
        limit (each record is encoded alone to find them): the records kept, their chunk
        and the first refused record's error (None: the batch, not a record, was over)."""
        encode = self._encode_batch
        kept: list[Any] = []
        singles: list[bytes | bytearray] = []
        refused: RecordTooLargeError | None = None
        for record in records:
            try:
                singles.append(encode([record]))
            except RecordTooLargeError as exc:
                refused = refused or exc
                self.stats.records_out -= 1
            else:
                kept.append(record)
        try:
            chunk = encode(kept)  # one batch again (one frame for the pickle codec)
        except RecordTooLargeError:
            chunk = b"".join(singles)  # a codec with a limit per batch
        return kept, chunk, refused

    def _append_chunk(
        self, index: int, stream: _Stream, records: list[Any], chunk: bytes | bytearray
    ) -> None:
        """Append an encoded batch to the stream and cut full buffers."""
        n = len(chunk)
        self.stats.encoded_records += len(records)
        self.stats.encoded_bytes += n
        if n:
            stream.chunks.append(memoryview(chunk))
            stream.nbytes += n
            # Adapt the batch so that one batch is about one buffer's worth of bytes,
            # growing at most twice the last batch (a flushed batch of one tiny record must
            # not make the next batch hold back thousands).
            per_record = n // len(records) or 1
            fill = max(1, min(_MAX_BATCH, stream.buffer_size // per_record))
            stream.batch = min(fill, 2 * len(records))
            self._batch_hint = fill
            if stream.nbytes >= stream.buffer_size:
                self._cut(index, stream, partial=False)

    def _cut(self, index: int, stream: _Stream, *, partial: bool) -> None:
        """Cut the stream into buffers of its buffer size (and a last partial one)."""
        size = stream.buffer_size
        chunks = stream.chunks
        out = self._output
        stats = self.stats
        while stream.nbytes >= size or (partial and stream.nbytes):
            want = min(size, stream.nbytes)
            pieces: list[memoryview | bytes] = []
            got = 0
            while got < want:
                chunk = chunks[0]
                start = stream.head
                take = min(len(chunk) - start, want - got)
                pieces.append(chunk[start : start + take])
                got += take
                if start + take == len(chunk):
                    chunks.popleft()
                    stream.head = 0
                else:
                    stream.head = start + take
            stream.nbytes -= got
            out.append(OutputBuffer(index, DataType.DATA_BUFFER, got, pieces, stream.head != 0))
            self._output_bytes += got
            stats.bytes_out += got
            stats.buffers_out += 1
