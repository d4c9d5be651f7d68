"""BufferBlocker: where the aligned handler parks input of channels that wait for others.

``add`` parks one buffer or event; ``roll_over`` ends the current alignment's parking and
returns what was parked as a ``BufferOrEventSequence`` to replay in arrival order (None if
nothing was parked); the blocker then parks into a fresh sequence. Two kinds:

* ``CachedBufferBlocker`` keeps the BufferOrEvent objects in memory (their buffers keep
  their segments until replayed or cleaned up);
* ``BufferSpiller`` writes each item to a spill file and releases the buffer at once (its
  segment goes back to its pool). Record: ``channel i32 | length i32 | is_buffer u8``
  (little endian; ``is_buffer`` 0 for a data buffer, 1 for an event) then the bytes. Every
  roll-over starts a new file; a sequence reads its file back with size checks (a short or
  malformed record raises CorruptRecordError), replays data as new unpooled buffers, and
  deletes the file once consumed or cleaned up. Spill files hold the job's records, so
  they are created 0600 with ``O_EXCL | O_NOFOLLOW``; ``BufferSpiller.private`` spills
  into a fresh 0700 directory of its own (``mkdtemp``) that ``close`` removes.

Replayed items carry ``more_available=True`` (the reader polls the handler until None
anyway). Sizes are payload bytes (a buffer's size, an event's serialized size) for both kinds, so
the alignment limit decides the same whichever kind parks.
"""

from __future__ import annotations

import abc
import io
import os
import shutil
import struct
import tempfile
from collections import deque
from pathlib import Path
from typing import Final

from exchange.buffers.buffer import Buffer, DataType, FreeingRecycler
from exchange.checkpointing.barrier_handler import payload_size
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.errors import CorruptRecordError, IllegalStateError, UsageError
from exchange.events.events import EventSerializer
from exchange.memory.memory_segment import MemorySegment

__all__ = [
    "HEADER",
    "BufferBlocker",
    "BufferOrEventSequence",
    "BufferSpiller",
    "CachedBufferBlocker",
    "CachedBufferOrEventSequence",
    "SpilledBufferOrEventSequence",
]

#: Spill record header: channel index, payload length, 0 = buffer / 1 = event.
HEADER: Final = struct.Struct("<iiB")


class BufferOrEventSequence(abc.ABC):
    """Parked input of one alignment, replayed once in arrival order."""

    def __init__(self, size: int) -> None:
        self.size = size

    @abc.abstractmethod
    def get_next(self) -> BufferOrEvent | None:
        """The next parked item (the caller owns its buffer); None at the end."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Release whatever was not replayed. Idempotent."""


class BufferBlocker(abc.ABC):
    """Parks input during an alignment."""

    def __init__(self) -> None:
        self.bytes_blocked = 0  # payload bytes parked since the last roll-over
        self._closed = False

    def add(self, boe: BufferOrEvent) -> int:
        """Park ``boe`` (taking ownership of its buffer); return its payload size."""
        if self._closed:
            if boe.buffer is not None:
                boe.buffer.release()
            raise IllegalStateError("the buffer blocker is closed")
        size = payload_size(boe)
        self._add(boe, size)
        self.bytes_blocked += size
        return size

    def roll_over(self) -> BufferOrEventSequence | None:
        """What was parked since the last roll-over, or None if nothing was."""
        if self._closed:
            raise IllegalStateError("the buffer blocker is closed")
        return self._roll_over()

    @abc.abstractmethod
    def _add(self, boe: BufferOrEvent, size: int) -> None: ...

    @abc.abstractmethod
    def _roll_over(self) -> BufferOrEventSequence | None: ...

    def close(self) -> None:
        """Release what is parked and not rolled over. Idempotent."""
        self._closed = True


# -- in memory -------------------------------------------------------------------------


class CachedBufferOrEventSequence(BufferOrEventSequence):
    """Parked items kept as they are."""

    def __init__(self, items: deque[BufferOrEvent], size: int) -> None:
        super().__init__(size)
        self._items = items

    def get_next(self) -> BufferOrEvent | None:
        # replayed items say more_available=True whichever blocker parked them
        return self._items.popleft()._replace(more_available=True) if self._items else None

    def cleanup(self) -> None:
        while self._items:
            buf = self._items.popleft().buffer
            if buf is not None:
                buf.release()


class CachedBufferBlocker(BufferBlocker):
    """Parks in memory: the buffers (and their segments) stay until replayed."""

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[BufferOrEvent] = deque()

    def _add(self, boe: BufferOrEvent, size: int) -> None:
        self._items.append(boe)

    def _roll_over(self) -> BufferOrEventSequence | None:
        if not self._items:
            return None
        seq = CachedBufferOrEventSequence(self._items, self.bytes_blocked)
        self._items = deque()
        self.bytes_blocked = 0
        return seq

    def close(self) -> None:
        CachedBufferOrEventSequence(self._items, 0).cleanup()
        super().close()


# -- on disk ---------------------------------------------------------------------------


class SpilledBufferOrEventSequence(BufferOrEventSequence):
    """Reads one spill file back; deletes it when consumed or cleaned up."""

    def __init__(self, path: Path, size: int, max_payload: int) -> None:
        super().__init__(size)
        self.path = path
        self._max_payload = max_payload
        self._file: io.BufferedReader | None = open(path, "rb")  # noqa: SIM115 - closed in cleanup

    def get_next(self) -> BufferOrEvent | None:
        f = self._file
        if f is None:
            return None
        header = f.read(HEADER.size)
        if not header:
            self.cleanup()
            return None
        if len(header) < HEADER.size:
            raise CorruptRecordError(
                f"spill file {self.path.name}: truncated header ({len(header)} of "
                f"{HEADER.size} bytes)"
            )
        channel, length, kind = HEADER.unpack(header)
        if channel < 0 or kind > 1 or not 0 <= length <= self._max_payload:
            raise CorruptRecordError(
                f"spill file {self.path.name}: bad record header (channel {channel}, "
                f"length {length} of at most {self._max_payload}, kind {kind})"
            )
        if kind == 0:
            segment = MemorySegment.allocate_unpooled(max(length, 1))
            n = f.readinto(segment.view()[:length])
            if n != length:
                segment.free()
                raise CorruptRecordError(
                    f"spill file {self.path.name}: truncated buffer ({n} of {length} bytes)"
                )
            buf = Buffer(segment, FreeingRecycler, length, DataType.DATA_BUFFER)
            return BufferOrEvent(buf, None, channel, True)
        data = f.read(length)
        if len(data) != length:
            raise CorruptRecordError(
                f"spill file {self.path.name}: truncated event ({len(data)} of {length} bytes)"
            )
        return BufferOrEvent(None, EventSerializer.from_bytes(data), channel, True)

    def cleanup(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.path.unlink(missing_ok=True)


class BufferSpiller(BufferBlocker):
    """Parks on disk under ``spill_dir``: one file per roll-over, buffers released at once.

    ``page_size`` bounds the payload of a record read back (anything longer is corrupt).
    """

    def __init__(self, spill_dir: str | os.PathLike[str], page_size: int) -> None:
        super().__init__()
        if page_size < 1:
            raise UsageError(f"page size must be positive, got {page_size}")
        self.spill_dir = Path(spill_dir)
        self.page_size = page_size
        self._prefix = f"barrier-spill-{os.urandom(8).hex()}"
        self._counter = 0
        self._path: Path | None = None
        self._file: io.BufferedWriter | None = None
        self._owns_dir = False

    @classmethod
    def private(cls, parent: str | os.PathLike[str] | None, page_size: int) -> BufferSpiller:
        """A spiller in a new private directory (0700, ``mkdtemp``) under ``parent`` (None:
        the temporary directory), removed with what is left in it by ``close``."""
        spiller = cls(tempfile.mkdtemp(prefix="exchange-align-", dir=parent), page_size)
        spiller._owns_dir = True
        return spiller

    def _add(self, boe: BufferOrEvent, size: int) -> None:
        try:
            if size > self.page_size:
                raise UsageError(f"cannot park {size} bytes: page size is {self.page_size}")
            f = self._file
            if f is None:
                self._path = self.spill_dir / f"{self._prefix}.{self._counter}.spill"
                self._counter += 1
                fd = os.open(
                    self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
                )
                f = self._file = os.fdopen(fd, "wb")
            if boe.buffer is not None:
                f.write(HEADER.pack(boe.channel_index, size, 0))
                f.write(boe.buffer.memoryview())
            else:
                assert boe.event is not None
                f.write(HEADER.pack(boe.channel_index, size, 1))
                f.write(EventSerializer.to_bytes(boe.event))
        finally:
            if boe.buffer is not None:
                boe.buffer.release()  # its segment goes back now, the bytes are on disk

    def _roll_over(self) -> BufferOrEventSequence | None:
        f, path = self._file, self._path
        if f is None or path is None:
            return None
        f.close()
        self._file = self._path = None
        seq = SpilledBufferOrEventSequence(path, self.bytes_blocked, self.page_size)
        self.bytes_blocked = 0
        return seq

    def close(self) -> None:
        if self._file is not None and self._path is not None:
            self._file.close()
            self._path.unlink(missing_ok=True)
            self._file = self._path = None
        self.bytes_blocked = 0
        if self._owns_dir:
            self._owns_dir = False
            shutil.rmtree(self.spill_dir, ignore_errors=True)
        super().close()
