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
    LimitExceededError,
    PartitionDataLostError,
    SpillError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.partition import BoundedData, create_bounded_data
from exchange.partition.bounded_data import (
    HEADER,
    MAX_READ_SEGMENTS,
    READ_SEGMENTS,
    _FileReader,
)
from exchange.partition.reader_budget import ReaderAccount, ReaderBudget

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


def _write_many(path: Path, n: int) -> BoundedData:
    data = create_bounded_data("file", path, SEGMENT)
    for i in range(n):
        buf = Buffer.wrap(bytes([i]) * SEGMENT, DataType.DATA_BUFFER)
        data.write_buffer(buf)
        buf.release()
    data.finish_write()
    return data


def _open(data: BoundedData, account: ReaderAccount) -> _FileReader:
    """A file reader charged its base segments first, as create_read_view does."""
    account.acquire(data.reader_memory)
    reader = data.create_reader(account=account)
    assert isinstance(reader, _FileReader)
    return reader


def _take(reader: _FileReader) -> list[Buffer]:
    """Every buffer the reader gives now, none released."""
    out = []
    while (buf := reader.next_buffer()) is not None:
        out.append(buf)
    return out


def test_file_reader_reads_into_a_bounded_number_of_segments(tmp_path: Path) -> None:
    # an account with room for the base segments only: the reader stays at two
    budget = ReaderBudget(max_memory=READ_SEGMENTS * SEGMENT)
    account = budget.account("app")
    data = _write("file", tmp_path / "sub.bin")
    reader = _open(data, account)
    calls: list[int] = []
    reader.set_on_memory_available(lambda: calls.append(1))
    first, second = reader.next_buffer(), reader.next_buffer()
    assert first is not None and second is not None
    assert reader.next_buffer() is None  # both read segments are out
    assert not reader.at_end and reader.num_segments == READ_SEGMENTS
    first.release()
    assert calls == [1]  # memory is back: the reader can go on
    third = reader.next_buffer()
    assert third is not None and third.data_type is DataType.DATA_BUFFER
    second.release()
    third.release()
    reader.close()
    account.release(data.reader_memory)
    assert budget.usage("app") == (0, 0)
    data.close()


def test_file_reader_grows_to_max_segments_while_its_account_has_room(tmp_path: Path) -> None:
    budget = ReaderBudget(max_memory=64 * SEGMENT)
    account = budget.account("app")
    data = _write_many(tmp_path / "sub.bin", 3 * MAX_READ_SEGMENTS)
    reader = _open(data, account)
    calls: list[int] = []
    reader.set_on_memory_available(lambda: calls.append(1))
    out = _take(reader)
    assert len(out) == reader.num_segments == MAX_READ_SEGMENTS  # grown, then no more
    assert reader.grown_memory == (MAX_READ_SEGMENTS - READ_SEGMENTS) * SEGMENT
    assert budget.usage("app") == (1, MAX_READ_SEGMENTS * SEGMENT)  # each extra one charged
    assert calls == []
    out.pop().release()
    assert calls == [1]
    out += _take(reader)
    assert len(out) == MAX_READ_SEGMENTS and reader.num_segments == MAX_READ_SEGMENTS
    reader.close()  # buffers still out: their segments are freed as they come back
    assert budget.usage("app") == (1, READ_SEGMENTS * SEGMENT)  # the growth given back
    for buf in out:
        buf.release()
    account.release(data.reader_memory)
    assert budget.usage("app") == (0, 0)
    # no account (no limit): the reader grows to MAX_READ_SEGMENTS all the same
    free = data.create_reader()
    assert isinstance(free, _FileReader)
    got = _take(free)
    assert len(got) == MAX_READ_SEGMENTS
    free.close()
    for buf in got:
        buf.release()
    data.close()


def test_file_reader_stays_at_its_base_when_another_reader_holds_the_rest(
    tmp_path: Path,
) -> None:
    budget = ReaderBudget(max_memory=(2 * READ_SEGMENTS + 1) * SEGMENT)
    account = budget.account("app")
    data = _write_many(tmp_path / "sub.bin", 3 * MAX_READ_SEGMENTS)
    a, b = _open(data, account), _open(data, account)
    got_a = _take(a)  # the one segment of room left
    assert len(got_a) == a.num_segments == READ_SEGMENTS + 1
    calls: list[int] = []
    b.set_on_memory_available(lambda: calls.append(1))
    got_b = _take(b)  # none: b reads with its two, never fails
    assert len(got_b) == b.num_segments == READ_SEGMENTS and b.grown_memory == 0
    assert budget.usage("app") == (2, (2 * READ_SEGMENTS + 1) * SEGMENT)
    got_b.pop(0).release()
    assert calls == [1]
    got_b += _take(b)
    assert [buf.to_bytes()[0] for buf in got_b] == [1, 2]  # in order, none lost
    a.close()
    for buf in got_a:
        buf.release()
    account.release(data.reader_memory)
    got_b += _take(b)  # a's room is back: b grows into it
    assert b.num_segments == 2 * READ_SEGMENTS + 1  # the whole budget: a's part too
    assert [buf.to_bytes()[0] for buf in got_b] == list(range(1, 1 + len(got_b)))
    b.close()
    for buf in got_b:
        buf.release()
    account.release(data.reader_memory)
    assert budget.usage("app") == (0, 0)
    data.close()


def test_growth_never_refuses_a_reader_and_shrinks_when_over_the_limit(tmp_path: Path) -> None:
    budget = ReaderBudget(max_memory=2 * READ_SEGMENTS * SEGMENT)
    account = budget.account("app")
    data = _write_many(tmp_path / "sub.bin", 3 * MAX_READ_SEGMENTS)
    a = _open(data, account)
    got_a = _take(a)  # a alone: it grows into the whole budget
    assert a.num_segments == 2 * READ_SEGMENTS
    b = _open(data, account)  # admitted on the base charges, as without growth
    assert account.over_limit
    with pytest.raises(LimitExceededError, match="max_reader_memory_per_app"):
        _open(data, account)  # a third is refused, as without growth
    assert budget.usage("app") == (2, 3 * READ_SEGMENTS * SEGMENT)
    for buf in got_a[:READ_SEGMENTS]:  # a's segments come back: grown ones are freed
        buf.release()
    assert a.num_segments == READ_SEGMENTS and not account.over_limit
    assert budget.usage("app") == (2, 2 * READ_SEGMENTS * SEGMENT)
    assert _take(a) == []  # at its base: no room to grow again
    got_b = _take(b)
    assert len(got_b) == READ_SEGMENTS
    for reader in (a, b):
        reader.close()
        account.release(data.reader_memory)
    for buf in got_a[READ_SEGMENTS:] + got_b:
        buf.release()
    assert budget.usage("app") == (0, 0)
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
