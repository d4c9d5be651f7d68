"""BoundedData: where a blocking subpartition keeps its buffers once written.

Written once, sequentially; read any number of times, by several readers at once. Each
buffer is stored as a 6-byte header (``u8 data type | u8 flags | u32 size``, big endian,
Flink's BufferReaderWriterUtil layout in spirit) followed by its bytes.

* ``FileBoundedData`` reads with plain file reads into a few read segments per reader.
* ``MmapBoundedData`` maps the finished file and hands out zero-copy slices of the map.

Files live in the spill directory and are deleted by ``close`` (unless ``keep_file`` was
called: a daemon shutting down leaves finished partitions for its successor). The writer
keeps a CRC-32 of everything it wrote (``crc32``) for the partition's manifest;
``create_bounded_data(..., existing=(size, crc32))`` opens a finished file again.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Final, Protocol

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import CorruptRecordError, IllegalStateError
from exchange.memory.memory_segment import MemorySegment

__all__ = [
    "BoundedData",
    "BoundedDataReader",
    "FileBoundedData",
    "MmapBoundedData",
    "create_bounded_data",
]

HEADER: Final = struct.Struct(">BBI")
FLAG_COMPRESSED: Final = 0x01


class BoundedDataReader(Protocol):
    """Sequential reader; ``next_buffer`` returns None when no read memory is free
    right now (``at_end`` tells the two cases apart)."""

    @property
    def at_end(self) -> bool: ...

    def next_buffer(self) -> Buffer | None: ...

    def set_on_memory_available(self, callback: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class BoundedData(Protocol):
    path: Path

    def write_buffer(self, buffer: Buffer) -> None: ...

    def finish_write(self) -> None: ...

    def create_reader(self) -> BoundedDataReader: ...

    @property
    def size(self) -> int: ...

    @property
    def crc32(self) -> int: ...

    def keep_file(self) -> None: ...

    def close(self) -> None: ...


class _FileWriterBase:
    """Writes buffers into a file in the spill directory (or, given ``existing`` =
    ``(size, crc32)``, takes a finished file over)."""

    def __init__(self, path: Path, existing: tuple[int, int] | None = None) -> None:
        self.path = path
        self._keep = False
        self._closed = False
        if existing is not None:
            self._file: BinaryIO | None = None
            self._size, self._crc = existing
            self._finished = True
            return
        self._file = open(path, "xb", buffering=1 << 16)  # noqa: SIM115
        self._size = 0
        self._crc = 0
        self._finished = False

    def write_buffer(self, buffer: Buffer) -> None:
        f = self._file
        if f is None or self._finished:
            raise IllegalStateError(f"bounded data {self.path} is no longer writable")
        n = buffer.size
        flags = FLAG_COMPRESSED if buffer.compressed else 0
        header = HEADER.pack(buffer.data_type, flags, n)
        f.write(header)
        crc = zlib.crc32(header, self._crc)
        if n:
            view = buffer.memoryview()
            f.write(view)
            crc = zlib.crc32(view, crc)
        self._crc = crc
        self._size += HEADER.size + n

    def _finish_file(self) -> None:
        if self._finished:
            return
        self._finished = True
        f = self._file
        if f is not None:
            f.flush()
            f.close()
            self._file = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def crc32(self) -> int:
        """CRC-32 of the file's bytes as written."""
        return self._crc

    def keep_file(self) -> None:
        """``close`` leaves the file on disk (for the next daemon)."""
        self._keep = True

    def _delete(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._keep:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _parse_header(header: bytes | memoryview, path: Path) -> tuple[DataType, bool, int]:
    dt, flags, n = HEADER.unpack(header)
    try:
        data_type = DataType(dt)
    except ValueError:
        raise CorruptRecordError(f"{path}: bad data type {dt} in spilled buffer header") from None
    return data_type, bool(flags & FLAG_COMPRESSED), n


class _FileReader:
    """Reads buffers with plain file reads into ``num_segments`` recycled read segments."""

    def __init__(self, path: Path, segment_size: int, num_segments: int = 2) -> None:
        self._path = path
        self._file: io.FileIO | None = open(path, "rb", buffering=0)  # noqa: SIM115
        self._segment_size = segment_size
        self._free: list[MemorySegment] = []
        self._num_allocated = 0
        self._max_segments = num_segments
        self._at_end = False
        self._closed = False
        self._callback: Callable[[], None] | None = None

    @property
    def at_end(self) -> bool:
        return self._at_end

    def set_on_memory_available(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    def _segment(self) -> MemorySegment | None:
        if self._free:
            return self._free.pop()
        if self._num_allocated < self._max_segments:
            self._num_allocated += 1
            return MemorySegment.allocate_unpooled(self._segment_size)
        return None

    def recycle(self, segment: MemorySegment) -> None:
        if self._closed:
            segment.free()
            return
        was_empty = not self._free and self._num_allocated >= self._max_segments
        self._free.append(segment)
        if was_empty and self._callback is not None and not self._at_end:
            self._callback()

    def next_buffer(self) -> Buffer | None:
        f = self._file
        if f is None or self._at_end:
            return None
        seg = self._segment()
        if seg is None:
            return None
        header = f.read(HEADER.size)
        if not header:
            self._at_end = True
            self._free.append(seg)
            return None
        if len(header) != HEADER.size:
            self._free.append(seg)
            raise CorruptRecordError(f"{self._path}: truncated buffer header")
        data_type, compressed, n = _parse_header(header, self._path)
        if n > seg.size:
            self._free.append(seg)
            raise CorruptRecordError(f"{self._path}: spilled buffer of {n} bytes > {seg.size}")
        view = seg.view()[:n]
        got = f.readinto(view) if n else 0
        view.release()
        if got != n:
            self._free.append(seg)
            raise CorruptRecordError(f"{self._path}: truncated buffer ({got} of {n} bytes)")
        buf = Buffer(seg, self, n, data_type)
        buf.compressed = compressed
        return buf

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        for seg in self._free:
            seg.free()
        self._free.clear()


class FileBoundedData(_FileWriterBase):
    """Blocking-partition storage in a file, read with plain reads."""

    def __init__(
        self, path: Path, segment_size: int, existing: tuple[int, int] | None = None
    ) -> None:
        super().__init__(path, existing)
        self._segment_size = segment_size

    def finish_write(self) -> None:
        self._finish_file()

    def create_reader(self) -> _FileReader:
        if not self._finished:
            raise IllegalStateError("bounded data is still being written")
        return _FileReader(self.path, self._segment_size)

    def close(self) -> None:
        self._delete()


class _NoopRecycler:
    __slots__ = ()

    def recycle(self, segment: MemorySegment) -> None:
        pass


_NOOP = _NoopRecycler()


class _MmapReader:
    """Zero-copy reader: buffers are slices of the shared read-only-in-practice mapping."""

    def __init__(self, owner: MmapBoundedData) -> None:
        self._owner = owner
        self._pos = 0
        self._at_end = False

    @property
    def at_end(self) -> bool:
        return self._at_end

    def set_on_memory_available(self, callback: Callable[[], None]) -> None:
        pass  # never short of memory

    def next_buffer(self) -> Buffer | None:
        view = self._owner._view
        if view is None or self._at_end:
            return None
        pos = self._pos
        if pos >= len(view):
            self._at_end = True
            return None
        if pos + HEADER.size > len(view):
            raise CorruptRecordError(f"{self._owner.path}: truncated buffer header")
        data_type, compressed, n = _parse_header(view[pos : pos + HEADER.size], self._owner.path)
        start = pos + HEADER.size
        if start + n > len(view):
            raise CorruptRecordError(f"{self._owner.path}: truncated buffer")
        self._pos = start + n
        seg = MemorySegment(view[start : start + max(n, 0)])
        buf = Buffer(seg, _NOOP, n, data_type)
        buf.compressed = compressed
        return buf

    def close(self) -> None:
        self._at_end = True


class MmapBoundedData(_FileWriterBase):
    """Blocking-partition storage in a file, read through one private memory map."""

    def __init__(
        self, path: Path, segment_size: int, existing: tuple[int, int] | None = None
    ) -> None:
        super().__init__(path, existing)
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        if existing is not None:
            self._map_file()

    def finish_write(self) -> None:
        self._finish_file()
        self._map_file()

    def _map_file(self) -> None:
        if self._size:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._view = memoryview(self._map)
        else:
            self._view = memoryview(bytearray(0))

    def create_reader(self) -> _MmapReader:
        if not self._finished:
            raise IllegalStateError("bounded data is still being written")
        return _MmapReader(self)

    def close(self) -> None:
        view, self._view = self._view, None
        mp, self._map = self._map, None
        try:
            if view is not None:
                view.release()
            if mp is not None:
                mp.close()
        except BufferError:
            pass  # a buffer slice is still alive; the mapping goes when it is collected
        self._delete()


def create_bounded_data(
    kind: str, path: Path, segment_size: int, *, existing: tuple[int, int] | None = None
) -> BoundedData:
    """``kind`` is ``"file"`` or ``"mmap"``; ``existing`` = ``(size, crc32)`` of a finished
    file to read again (a restored partition) instead of a new file to write."""
    if kind == "file":
        return FileBoundedData(path, segment_size, existing)
    if kind == "mmap":
        return MmapBoundedData(path, segment_size, existing)
    raise IllegalStateError(f"unknown bounded data kind {kind!r} (use 'file' or 'mmap')")
