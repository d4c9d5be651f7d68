"""BoundedData: where a blocking subpartition keeps its buffers once written.

Written once, sequentially; read any number of times, by several readers at once. Each
buffer is stored as a 6-byte header (``u8 data type | u8 flags | u32 size``, big endian,
Flink's BufferReaderWriterUtil layout in spirit) followed by its bytes.

* ``FileBoundedData`` reads with plain file reads into a few read segments per reader:
  ``READ_SEGMENTS`` charged to its application's ``ReaderAccount`` when it opens, then
  more, one at a time up to ``MAX_READ_SEGMENTS``, each charged when allocated and only
  while the account has room (more segments out: the data port writes more buffers per
  ``writelines``); all given back when the reader closes. No room: it reads on with what
  it has. Growth never refuses a reader: readers are admitted against the base charges,
  and a grown reader frees extra segments as they come back while its account is over
  the limit (``ReaderAccount.over_limit``).
* ``MmapBoundedData`` maps the finished file and hands out zero-copy slices of the map
  (Flink's ``taskmanager.network.blocking-shuffle.type: mmap``): the data port writes
  them to the socket straight from the page cache, one copy fewer than a read into a
  segment; a reader holds no read segments and no descriptor. Chosen by the daemon's
  ``blocking_shuffle_type`` (server/config.py; ``file`` by default, as Flink's);
  ``BOUNDED_DATA_KINDS`` lists the kinds, the default first.

Why ``file`` is the default: a mapped file must not shrink while mapped, and its pages
must be readable. A read of a page past the end of a truncated file, or of a page the
disk fails to read back (evicted, then an I/O error), is a SIGBUS that kills the whole
daemon, every job on it; ``file`` storage gets a typed error for that one channel
(``tests/integration/test_data_server.py::test_a_truncated_spill_file_fails_its_channel_only``).
The file is checked (inode, size) right before it is mapped, and the spill directory is
private to the daemon's user (server/spill_dir.py), so only that user could truncate it.
Each finished, non-empty subpartition file of ``mmap`` storage holds one mapping until
the partition is released; one that cannot be mapped (the kernel's ``vm.max_map_count``,
the address space) is read with file reads, logged.

A reader may be given ``read_memory`` (a consumer on this host that mapped its
application's shared arena: ``ReadMemory``): each data buffer is then read (``file``) or
copied (``mmap``) into a segment it lends, so that the buffer goes to the consumer as a
descriptor of that segment, not as bytes. When it has none free, that buffer is read as
without it (the reader's own read segments, or the map's slice): a reader never waits
for shared memory, so readers sharing one arena cannot deadlock on it.

Files live in the spill directory, are created on the first write, private (0600, never
over an existing file) and deleted by ``close`` (unless ``keep_file`` was called: a
daemon shutting down leaves finished partitions for its successor). A write that fails
(disk full, the application's spill quota) raises a SpillError naming the directory. The
writer keeps a CRC-32 of everything it wrote (``crc32``) for the partition's manifest;
``create_bounded_data(..., existing=(size, crc32))`` opens a finished file again. Readers
open the file only after checking it is the one written (inode and size).
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import (
    CorruptRecordError,
    IllegalStateError,
    PartitionDataLostError,
    SpillError,
)
from exchange.memory.memory_segment import MemorySegment
from exchange.partition.reader_budget import ReaderAccount
from exchange.partition.spill_space import SpillAccount, spill_error

__all__ = [
    "BOUNDED_DATA_KINDS",
    "DEFAULT_BOUNDED_DATA_KIND",
    "BoundedData",
    "BoundedDataReader",
    "FileBoundedData",
    "MmapBoundedData",
    "ReadMemory",
    "create_bounded_data",
]

#: The storage kinds of a blocking subpartition, the default first.
BOUNDED_DATA_KINDS: Final = ("file", "mmap")
DEFAULT_BOUNDED_DATA_KIND: Final = BOUNDED_DATA_KINDS[0]
_log = logging.getLogger(__name__)

HEADER: Final = struct.Struct(">BBI")
FLAG_COMPRESSED: Final = 0x01
_HEADER_SIZE: Final = HEADER.size
_unpack_header: Final = HEADER.unpack_from
_DATA_TYPES: Final[dict[int, DataType]] = {t.value: t for t in DataType}
#: Read segments (outside network memory) a reader of ``file`` storage is charged for when
#: it opens (``reader_memory``): it may always allocate these.
READ_SEGMENTS: Final = 2
#: Read segments a reader of ``file`` storage allocates at most: those past
#: ``READ_SEGMENTS`` only while its application's reader account has room for them.
MAX_READ_SEGMENTS: Final = 8
#: A spill file is new (never an existing file or a symlink planted there) and private.
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


class ReadMemory(Protocol):
    """Where a reader puts data buffers first (a local consumer's shared arena)."""

    def request_buffer(self) -> Buffer | None:
        """An empty data buffer of one segment, or None when none is free now."""
        ...


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

    def create_reader(
        self, read_memory: ReadMemory | None = None, account: ReaderAccount | None = None
    ) -> BoundedDataReader:
        """A reader from the start; a ``file`` reader charges its read segments past
        ``reader_memory`` to ``account`` (None: no limit) while it has room."""
        ...

    @property
    def reader_memory(self) -> int:
        """Bytes a reader allocates outside network memory when it opens (charged to its
        account by the caller); a ``file`` reader may grow past it (``MAX_READ_SEGMENTS``)."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def crc32(self) -> int: ...

    def keep_file(self) -> None: ...

    def close(self) -> None: ...


class _FileWriterBase:
    """Writes buffers into a file in the spill directory (or, given ``existing`` =
    ``(size, crc32)``, takes a finished file over).

    The file is created on the first write (a partition of many subpartitions holds no
    descriptor for those not written yet), with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode
    0600, and written with one ``writev`` per buffer: no write buffer outside network
    memory. Its identity (device, inode) is recorded; every later open for reading checks
    it and the size, so a file replaced or changed under a finished partition is refused
    with a PartitionDataLostError. ``account`` (a ``SpillAccount``) is charged with every
    byte before it is written and refunded when the file is deleted.
    """

    _segment_size: int  # set by each storage kind: the size of a file reader's segments

    def __init__(
        self,
        path: Path,
        existing: tuple[int, int] | None = None,
        account: SpillAccount | None = None,
    ) -> None:
        self.path = path
        self._keep = False
        self._fd = -1
        self._account = account
        self._charged = 0
        self._identity: tuple[int, int] | None = None
        if existing is not None:
            self._size, self._crc = existing
            self._finished = True
            try:
                st = os.lstat(path)
            except OSError as e:
                raise PartitionDataLostError(f"spill file {path} cannot be read: {e}") from None
            if not stat.S_ISREG(st.st_mode):
                raise PartitionDataLostError(f"spill file {path} is not a regular file")
            self._identity = (st.st_dev, st.st_ino)
            if account is not None:
                account.add_existing(self._size)
                self._charged = self._size
            return
        self._size = 0
        self._crc = 0
        self._finished = False

    def _open(self) -> int:
        try:
            fd = os.open(self.path, _CREATE_FLAGS, 0o600)
        except OSError as e:
            raise self._spill_error("create", e) from None
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._fd = fd
        return fd

    def _spill_error(self, what: str, e: OSError) -> SpillError:
        return spill_error(self.path.parent, f"{what} {self.path.name}", e)

    def write_buffer(self, buffer: Buffer) -> None:
        if self._finished:
            raise IllegalStateError(f"bounded data {self.path} is no longer writable")
        fd = self._fd
        if fd < 0:
            fd = self._open()
        n = buffer.size
        flags = FLAG_COMPRESSED if buffer.compressed else 0
        header = HEADER.pack(buffer.data_type, flags, n)
        total = HEADER.size + n
        account = self._account
        if account is not None:
            account.charge(total)  # SpillError: over the quota or below the free floor
            self._charged += total
        crc = zlib.crc32(header, self._crc)
        error: SpillError | None = None
        view: memoryview | None = None
        try:
            if n:
                view = buffer.memoryview()
                done = os.writev(fd, (header, view))
                if done != total:
                    _write_rest(fd, header, view, done)
                crc = zlib.crc32(view, crc)
            else:
                done = os.write(fd, header)
                if done != HEADER.size:
                    _write_rest(fd, header, memoryview(b""), done)
        except OSError as e:
            error = self._spill_error("write", e)
        if error is not None:
            # raised here, outside the handler and without the view: the error (kept as
            # the partition's failure cause) must not pin the segment's memory through
            # its traceback's frames (a shared arena would stay mapped, its fd open)
            view = None
            raise error
        self._crc = crc
        self._size += total

    def _finish_file(self) -> None:
        if self._finished:
            return
        fd = self._fd
        if fd < 0:
            fd = self._open()  # an empty file: nothing was ever written
        self._finished = True
        self._fd = -1
        try:
            os.close(fd)
        except OSError as e:
            raise self._spill_error("close", e) from None

    def open_checked(self) -> int:
        """A read-only descriptor of the finished file, after checking that it is still the
        file this object wrote (same inode, same size); PartitionDataLostError if not."""
        path = self.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise PartitionDataLostError(
                f"spill file {path} cannot be opened: {e.strerror or e}"
            ) from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._identity or not stat.S_ISREG(st.st_mode):
                raise PartitionDataLostError(
                    f"spill file {path} was replaced after it was written "
                    f"(inode {st.st_ino}, written as {self._identity and self._identity[1]})"
                )
            if st.st_size != self._size:
                raise PartitionDataLostError(
                    f"spill file {path} changed after it was written "
                    f"({st.st_size} bytes, written {self._size})"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _file_reader(
        self, read_memory: ReadMemory | None, account: ReaderAccount | None
    ) -> _FileReader:
        """A reader of the finished file with plain reads (checked: inode and size)."""
        return _FileReader(
            self.path,
            self.open_checked(),
            self._segment_size,
            READ_SEGMENTS,
            read_memory,
            MAX_READ_SEGMENTS,
            account,
        )

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
        """Close and (unless kept) unlink the file, and refund its bytes, whatever fails;
        the first OSError other than a missing file is raised after all of it."""
        error: OSError | None = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError as e:
                error = e
        if not self._keep and self._identity is not None:
            try:  # only the file this object created (or took over), never another one
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._identity:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                error = error or e
        charged, self._charged = self._charged, 0
        if charged and self._account is not None:
            self._account.refund(charged)
        if error is not None:
            raise error


def _write_rest(fd: int, header: bytes, view: memoryview, done: int) -> None:
    """Finish a ``writev`` of header + view that wrote only ``done`` bytes."""
    hs = len(header)
    while done < hs + len(view):
        rest: list[bytes | memoryview] = [header[done:], view] if done < hs else [view[done - hs :]]
        k = os.writev(fd, rest)
        if k <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += k


def _parse_header(header: bytes | bytearray | memoryview, path: Path) -> tuple[DataType, bool, int]:
    dt, flags, n = HEADER.unpack(header)
    data_type = _DATA_TYPES.get(dt)  # a dict lookup: DataType(dt) runs two Python frames
    if data_type is None:
        raise CorruptRecordError(f"{path}: bad data type {dt} in spilled buffer header")
    return data_type, bool(flags & FLAG_COMPRESSED), n


class _FileReader:
    """Reads buffers with plain file reads into recycled read segments (data buffers into
    ``read_memory`` first, when it lends a segment): ``num_segments`` always (charged by
    whoever opened it), up to ``max_segments`` while ``account`` has room for each one more
    (charged here when allocated, given back by ``close``; no account: no limit)."""

    def __init__(
        self,
        path: Path,
        fd: int,
        segment_size: int,
        num_segments: int = 2,
        read_memory: ReadMemory | None = None,
        max_segments: int | None = None,
        account: ReaderAccount | None = None,
    ) -> None:
        self._path = path
        self._file: io.FileIO | None = io.FileIO(fd, "rb", closefd=True)
        self._segment_size = segment_size
        self._free: list[MemorySegment] = []
        self._num_allocated = 0
        self._base_segments = num_segments
        self._max_segments = num_segments if max_segments is None else max_segments
        self._account = account
        #: bytes of the segments past ``num_segments``, charged to ``account``
        self.grown_memory = 0
        #: next_buffer found no segment: tell the callback when one comes back
        self._starved = False
        self._read_memory = read_memory
        # a buffer's header read while no segment was free: its bytes are read next time
        self._header: tuple[DataType, bool, int] | None = None
        # The next buffer's header, read with the body before it (one readv per buffer):
        # ``_ahead`` of its bytes are in ``_next_header`` (-1: not read yet; 0: end of file).
        self._next_header = bytearray(HEADER.size)
        self._ahead = -1
        self._at_end = False
        self._closed = False
        self._callback: Callable[[], None] | None = None

    @property
    def at_end(self) -> bool:
        return self._at_end

    def set_on_memory_available(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    @property
    def num_segments(self) -> int:
        """Read segments allocated so far (free or out in buffers)."""
        return self._num_allocated

    def _segment(self) -> MemorySegment | None:
        if self._free:
            return self._free.pop()
        n = self._num_allocated
        if n < self._base_segments or (n < self._max_segments and self._grow()):
            self._num_allocated = n + 1
            return MemorySegment.allocate_unpooled(self._segment_size)
        self._starved = True
        return None

    def _grow(self) -> bool:
        """Charge one more segment to the account, if it has room."""
        account = self._account
        if account is not None and not account.try_acquire_memory(self._segment_size):
            return False
        self.grown_memory += self._segment_size
        return True

    def recycle(self, segment: MemorySegment) -> None:
        if self._closed:
            segment.free()
            return
        account = self._account
        if self.grown_memory and account is not None and account.over_limit:
            # a reader admitted since this one grew: give a grown segment back
            segment.free()
            self._num_allocated -= 1
            self.grown_memory -= self._segment_size
            account.release_memory(self._segment_size)
            return  # starved or not: its other segments are out and come back
        self._free.append(segment)
        if self._starved:
            self._starved = False
            if self._callback is not None and not self._at_end:
                self._callback()

    def next_buffer(self) -> Buffer | None:
        f = self._file
        if f is None or self._at_end:
            return None
        header = self._header
        if header is None:
            ahead = self._ahead
            raw: bytes | bytearray = self._next_header if ahead >= 0 else f.read(HEADER.size)
            if ahead > 0 and ahead != HEADER.size:
                raw = raw[:ahead]
            self._ahead = -1
            if not raw or ahead == 0:
                self._at_end = True
                return None
            if len(raw) != HEADER.size:
                raise CorruptRecordError(f"{self._path}: truncated buffer header")
            header = _parse_header(raw, self._path)
        data_type, compressed, n = header
        lent = None
        if self._read_memory is not None and data_type is DataType.DATA_BUFFER:
            lent = self._read_memory.request_buffer()
        if lent is not None:
            seg = lent.segment
        else:
            own = self._segment()
            if own is None:
                self._header = header  # read on once a segment comes back
                return None
            seg = own
        self._header = None
        try:
            if n > seg.size:
                raise CorruptRecordError(f"{self._path}: spilled buffer of {n} bytes > {seg.size}")
            view = seg.view()[:n]
            try:  # the body and the next buffer's header, in one system call
                got = os.readv(f.fileno(), [view, self._next_header])
            finally:
                view.release()
            if got < n:
                raise CorruptRecordError(f"{self._path}: truncated buffer ({got} of {n} bytes)")
            self._ahead = got - n
        except BaseException:
            if lent is not None:
                lent.release()
            else:
                self._free.append(seg)
            raise
        if lent is not None:
            lent.set_size(n)
            buf = lent
        else:
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
        grown, self.grown_memory = self.grown_memory, 0
        if grown and self._account is not None:
            self._account.release_memory(grown)


class FileBoundedData(_FileWriterBase):
    """Blocking-partition storage in a file, read with plain reads."""

    def __init__(
        self,
        path: Path,
        segment_size: int,
        existing: tuple[int, int] | None = None,
        account: SpillAccount | None = None,
    ) -> None:
        super().__init__(path, existing, account)
        self._segment_size = segment_size

    @property
    def reader_memory(self) -> int:
        return READ_SEGMENTS * self._segment_size

    def finish_write(self) -> None:
        self._finish_file()

    def create_reader(
        self, read_memory: ReadMemory | None = None, account: ReaderAccount | None = None
    ) -> _FileReader:
        if not self._finished:
            raise IllegalStateError("bounded data is still being written")
        return self._file_reader(read_memory, account)

    def close(self) -> None:
        self._delete()


class _NoopRecycler:
    __slots__ = ()

    def recycle(self, segment: MemorySegment) -> None:
        pass


_NOOP = _NoopRecycler()


class _MmapReader:
    """Zero-copy reader: buffers are slices of the shared read-only-in-practice mapping
    (data buffers copied into ``read_memory`` instead, when it lends a segment)."""

    def __init__(self, owner: MmapBoundedData, read_memory: ReadMemory | None = None) -> None:
        self._owner = owner
        self._path = owner.path
        self._read_memory = read_memory
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
        start = pos + _HEADER_SIZE
        if start > len(view):
            raise CorruptRecordError(f"{self._path}: truncated buffer header")
        dt, flags, n = _unpack_header(view, pos)  # no slice, no tuple of the parse
        data_type = _DATA_TYPES.get(dt)
        if data_type is None:
            raise CorruptRecordError(f"{self._path}: bad data type {dt} in spilled buffer header")
        if start + n > len(view):
            raise CorruptRecordError(f"{self._path}: truncated buffer")
        self._pos = start + n
        data = view[start : start + n]
        lent = None
        if self._read_memory is not None and data_type is DataType.DATA_BUFFER:
            lent = self._read_memory.request_buffer()
        if lent is not None and n <= lent.segment.size:
            lent.segment.put(0, data)
            lent.set_size(n)
            buf = lent
        else:
            if lent is not None:
                lent.release()
            buf = Buffer(MemorySegment(data), _NOOP, n, data_type)
        buf.compressed = flags & FLAG_COMPRESSED != 0
        return buf

    def close(self) -> None:
        self._at_end = True


class MmapBoundedData(_FileWriterBase):
    """Blocking-partition storage in a file, read through one private memory map."""

    def __init__(
        self,
        path: Path,
        segment_size: int,
        existing: tuple[int, int] | None = None,
        account: SpillAccount | None = None,
    ) -> None:
        super().__init__(path, existing, account)
        self._segment_size = segment_size
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        #: the file could not be mapped (vm.max_map_count, address space): read it instead
        self._unmapped = False
        if existing is not None:
            self._map_file()

    @property
    def reader_memory(self) -> int:
        """Nothing while mapped (slices of the one mapping); a file reader's read
        segments when the mapping could not be made."""
        return READ_SEGMENTS * self._segment_size if self._unmapped else 0

    def finish_write(self) -> None:
        self._finish_file()
        self._map_file()

    def _map_file(self) -> None:
        if self._size:
            fd = self.open_checked()  # the inode and size written: no page past the end
            try:
                self._map = mmap.mmap(fd, self._size, access=mmap.ACCESS_COPY)
            except OSError as e:  # ENOMEM: vm.max_map_count or the address space
                # A job with many subpartitions per daemon can exhaust the mappings a
                # process may hold: its readers read the file, as `file` storage does.
                _log.warning("%s: cannot be mapped (%s); its readers read the file", self.path, e)
                self._unmapped = True
                return
            finally:
                os.close(fd)
            self._view = memoryview(self._map)
        else:
            self._view = memoryview(bytearray(0))

    def create_reader(
        self, read_memory: ReadMemory | None = None, account: ReaderAccount | None = None
    ) -> BoundedDataReader:
        if not self._finished:
            raise IllegalStateError("bounded data is still being written")
        if self._unmapped:
            return self._file_reader(read_memory, account)
        return _MmapReader(self, read_memory)

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
    kind: str,
    path: Path,
    segment_size: int,
    *,
    existing: tuple[int, int] | None = None,
    account: SpillAccount | None = None,
) -> BoundedData:
    """``kind`` is ``"file"`` or ``"mmap"``; ``existing`` = ``(size, crc32)`` of a finished
    file to read again (a restored partition) instead of a new file to write; ``account``
    is charged with the file's bytes."""
    if kind == "file":
        return FileBoundedData(path, segment_size, existing, account)
    if kind == "mmap":
        return MmapBoundedData(path, segment_size, existing, account)
    raise IllegalStateError(
        f"unknown bounded data kind {kind!r} (use one of {', '.join(BOUNDED_DATA_KINDS)})"
    )
