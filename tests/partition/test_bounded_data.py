"""BoundedData: file and mmap storage of a blocking subpartition's buffers."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from exchange.buffers import Buffer, DataType
from exchange.errors import (
    CorruptRecordError,
    IllegalStateError,
    PartitionDataLostError,
    SpillError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.partition import BoundedData, create_bounded_data
from exchange.partition.bounded_data import HEADER, READ_SEGMENTS

SEGMENT = 4096
KINDS = ["file", "mmap"]


def _payloads() -> list[tuple[DataType, bytes, bool]]:
    return [
        (DataType.DATA_BUFFER, b"a" * SEGMENT, False),
        (DataType.EVENT_BUFFER, b"\x02" + b"\x00" * 8, False),
        (DataType.DATA_BUFFER, bytes(range(256)) * 3, True),
        (DataType.ALIGNED_CHECKPOINT_BARRIER, b"\x01" * 19, False),
        (DataType.DATA_BUFFER, b"z", False),
    ]


def _write(kind: str, path: Path) -> BoundedData:
    data = create_bounded_data(kind, path, SEGMENT)
    for data_type, payload, compressed in _payloads():
        buf = Buffer.wrap(payload, data_type)
        buf.compressed = compressed
        data.write_buffer(buf)
        buf.release()
    data.finish_write()
    return data


def _read_all(data: BoundedData) -> list[tuple[DataType, bytes, bool]]:
    reader = data.create_reader()
    out = []
    while (buf := reader.next_buffer()) is not None:
        out.append((buf.data_type, buf.to_bytes(), buf.compressed))
        buf.release()
    assert reader.at_end
    reader.close()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_any_number_of_times(kind: str, tmp_path: Path) -> None:
    data = _write(kind, tmp_path / "sub.bin")
    expected = _payloads()
    assert data.size == sum(HEADER.size + len(p) for _, p, _ in expected)
    assert (tmp_path / "sub.bin").stat().st_size == data.size
    assert _read_all(data) == expected
    assert _read_all(data) == expected
    data.close()
    assert not (tmp_path / "sub.bin").exists()
    data.close()  # idempotent


@pytest.mark.parametrize("kind", KINDS)
def test_readers_interleave_independently(kind: str, tmp_path: Path) -> None:
    data = _write(kind, tmp_path / "sub.bin")
    a, b = data.create_reader(), data.create_reader()
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    for _ in range(len(_payloads())):
        for reader, got in ((a, got_a), (b, got_b)):
            buf = reader.next_buffer()
            assert buf is not None
            got.append(buf.to_bytes())
            buf.release()
    assert got_a == got_b == [p for _, p, _ in _payloads()]
    assert a.next_buffer() is None and b.next_buffer() is None
    a.close()
    b.close()
    data.close()


def test_file_reader_reads_into_a_bounded_number_of_segments(tmp_path: Path) -> None:
    data = _write("file", tmp_path / "sub.bin")
    reader = data.create_reader()
    calls: list[int] = []
    reader.set_on_memory_available(lambda: calls.append(1))
    first, second = reader.next_buffer(), reader.next_buffer()
    assert first is not None and second is not None
    assert reader.next_buffer() is None  # both read segments are out
    assert not reader.at_end
    first.release()
    assert calls == [1]  # memory is back: the reader can go on
    third = reader.next_buffer()
    assert third is not None and third.data_type is DataType.DATA_BUFFER
    second.release()
    third.release()
    reader.close()
    data.close()


@pytest.mark.parametrize("kind", KINDS)
def test_mmap_slice_outliving_close_is_safe(kind: str, tmp_path: Path) -> None:
    data = _write(kind, tmp_path / "sub.bin")
    reader = data.create_reader()
    buf = reader.next_buffer()
    assert buf is not None
    data.close()  # a buffer is still out
    assert not (tmp_path / "sub.bin").exists()
    assert buf.to_bytes() == b"a" * SEGMENT
    buf.release()
    reader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_lifecycle_errors(kind: str, tmp_path: Path) -> None:
    data = create_bounded_data(kind, tmp_path / "sub.bin", SEGMENT)
    with pytest.raises(IllegalStateError, match="still being written"):
        data.create_reader()
    data.finish_write()
    buf = Buffer.wrap(b"late", DataType.DATA_BUFFER)
    with pytest.raises(IllegalStateError, match="no longer writable"):
        data.write_buffer(buf)
    buf.release()
    assert _read_all(data) == []  # an empty file reads as nothing
    data.close()


def test_unknown_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IllegalStateError, match="unknown bounded data kind"):
        create_bounded_data("tape", tmp_path / "x.bin", SEGMENT)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_existing_file_is_never_overwritten_nor_deleted(tmp_path: Path, kind: str) -> None:
    (tmp_path / "taken.bin").write_bytes(b"precious")
    (tmp_path / "link.bin").symlink_to(tmp_path / "elsewhere")
    for name in ("taken.bin", "link.bin"):
        data = create_bounded_data(kind, tmp_path / name, SEGMENT)  # files open lazily
        with pytest.raises(SpillError, match="cannot create") as info:
            data.write_buffer(EventSerializer.to_buffer(EndOfPartitionEvent.INSTANCE))
        assert info.value.errno == errno.EEXIST and info.value.directory == str(tmp_path)
        data.close()  # deletes only what it created
    assert (tmp_path / "taken.bin").read_bytes() == b"precious"
    assert (tmp_path / "link.bin").is_symlink() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_spill_files_are_private_and_a_swapped_file_is_refused(tmp_path: Path, kind: str) -> None:
    old = os.umask(0)  # the daemon's umask does not widen them
    try:
        data = create_bounded_data(kind, tmp_path / "p.0.bin", SEGMENT)
        assert list(tmp_path.iterdir()) == []  # nothing opened before the first write
        data.write_buffer(EventSerializer.to_buffer(EndOfPartitionEvent.INSTANCE))
        data.finish_write()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "p.0.bin").st_mode) == 0o600
    data.create_reader().close()
    # someone replaces the finished file by one of the same size
    (tmp_path / "evil").write_bytes(b"x" * data.size)
    os.replace(tmp_path / "evil", tmp_path / "p.0.bin")
    if kind == "file":  # mmap mapped the written file at finish: it reads that one
        with pytest.raises(PartitionDataLostError, match="was replaced"):
            data.create_reader()
    data.close()
    assert (tmp_path / "p.0.bin").exists()  # not ours: left alone


def _written_with_tail(kind: str, path: Path, tail: bytes) -> BoundedData:
    """A finished file whose writer wrote ``tail`` after a valid buffer (a writer bug or
    a damaged disk: the file is the one written, of the size written)."""
    data = create_bounded_data(kind, path, SEGMENT)
    buf = Buffer.wrap(b"ok", DataType.DATA_BUFFER)
    data.write_buffer(buf)
    buf.release()
    os.write(data._fd, tail)  # type: ignore[attr-defined]
    data._size += len(tail)  # type: ignore[attr-defined]
    data.finish_write()
    return data


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"\x00\x00", "truncated buffer header"),
        (HEADER.pack(7, 0, 1) + b"x", "bad data type"),
        (HEADER.pack(0, 0, 100) + b"short", "truncated buffer"),
    ],
)
def test_corrupt_file_is_a_typed_error(
    kind: str, tail: bytes, message: str, tmp_path: Path
) -> None:
    data = _written_with_tail(kind, tmp_path / "sub.bin", tail)
    reader = data.create_reader()
    with pytest.raises(CorruptRecordError, match=message):
        while (polled := reader.next_buffer()) is not None:
            polled.release()
    reader.close()
    data.close()


def test_oversized_buffer_in_file_is_a_typed_error(tmp_path: Path) -> None:
    tail = HEADER.pack(0, 0, SEGMENT + 1) + b"x" * (SEGMENT + 1)
    data = _written_with_tail("file", tmp_path / "sub.bin", tail)
    reader = data.create_reader()
    with pytest.raises(CorruptRecordError, match="spilled buffer of"):
        while (buf := reader.next_buffer()) is not None:
            buf.release()
    reader.close()
    data.close()


def _reads_by_this_thread() -> int:
    """Read system calls (read, readv, pread...) this thread made so far (/proc)."""
    with open("/proc/thread-self/io", "rb") as f:
        fields = dict(line.split(b": ") for line in f.read().splitlines())
    return int(fields[b"syscr"])


def test_file_reader_reads_each_buffer_and_the_next_header_in_one_system_call(
    tmp_path: Path,
) -> None:
    data = create_bounded_data("file", tmp_path / "sub.bin", SEGMENT)
    payloads = [bytes([i]) * (SEGMENT - i) for i in range(40)]
    for payload in payloads:
        buf = Buffer.wrap(payload, DataType.DATA_BUFFER)
        data.write_buffer(buf)
        buf.release()
    data.finish_write()
    reader = data.create_reader()
    got = []
    proc_read = -_reads_by_this_thread() + _reads_by_this_thread()  # reading /proc itself
    before = _reads_by_this_thread()
    while (buf := reader.next_buffer()) is not None:
        got.append(buf.to_bytes())
        buf.release()
    reads = _reads_by_this_thread() - before - proc_read
    assert got == payloads and reader.at_end
    # the first header alone, then one readv per buffer (body + next header): 41 here,
    # was two per buffer (81); a margin for a read this thread might make otherwise
    assert 1 + len(payloads) <= reads <= 4 + len(payloads)
    reader.close()
    data.close()


def test_mmap_storage_that_cannot_be_mapped_is_read_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon out of mappings (``vm.max_map_count``: one per finished subpartition)
    serves that subpartition with file reads, logged, instead of failing its job."""
    import mmap as mmap_module

    def out_of_mappings(*args: object, **kwargs: object) -> mmap_module.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap_module, "mmap", out_of_mappings)
    with caplog.at_level("WARNING", logger="exchange.partition.bounded_data"):
        data = _write("mmap", tmp_path / "sub.bin")
    assert "cannot be mapped" in caplog.text and "sub.bin" in caplog.text
    assert data.reader_memory == READ_SEGMENTS * SEGMENT  # a file reader's, budgeted
    assert _read_all(data) == _payloads()
    assert _read_all(data) == _payloads()
    data.close()
    assert not (tmp_path / "sub.bin").exists()
