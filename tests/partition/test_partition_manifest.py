"""ResultPartition(keep_manifest=True) and its manifest, in process (no daemon).

The manifest exists from creation on (state writing), is rewritten at finish with each
spill file's size and CRC-32 (which ``verify_spilled_data`` checks against the file),
goes at release (before the files), and stays with the files after
``keep_spilled_data``; ``ResultPartition.restore`` serves the kept files again, buffer for
buffer. Damaged files are refused with PartitionDataLostError naming the file and what is
wrong; manifests that are not ones are CorruptRecordErrors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from exchange.buffers.buffer import Buffer
from exchange.errors import CorruptRecordError, PartitionDataLostError, UsageError
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionType
from exchange.partition.bounded_data import (
    BOUNDED_DATA_KINDS,
    DEFAULT_BOUNDED_DATA_KIND,
    FileBoundedData,
    MmapBoundedData,
)
from exchange.partition.partition_manifest import (
    ManifestState,
    decode_manifest,
    encode_manifest,
    read_manifest,
    verify_spilled_data,
)
from tests.conformance.partition_fill import add_raw_bytes

PID = ResultPartitionID("manifest", 2, 5)


class _Listener:
    def notify_data_available(self) -> None:
        pass


def _partition(
    nbp: NetworkBufferPool,
    spill: Path,
    ptype: ResultPartitionType,
    n: int = 2,
    kind: str = DEFAULT_BOUNDED_DATA_KIND,
) -> ResultPartition:
    return ResultPartition(
        PID,
        ptype,
        n,
        nbp.create_buffer_pool(n, 2 * n + 2),
        spill_dir=spill,
        keep_manifest=True,
        bounded_data_kind=kind,
    )


def _payloads(part: ResultPartition, sub: int) -> list[bytes]:
    view = part.create_subpartition_view(sub, _Listener())
    out = []
    try:
        while (nxt := view.get_next_buffer()) is not None:
            buf: Buffer = nxt.buffer
            out.append(bytes(buf.memoryview()) if buf.is_buffer else b"<event>")
            buf.release()
    finally:
        view.release_all_resources()
    return out


def _manifest(spill: Path) -> Path:
    (path,) = spill.glob("*.manifest")
    return path


def test_blocking_lifecycle(nbp: NetworkBufferPool, tmp_path: Path) -> None:
    part = _partition(nbp, tmp_path, ResultPartitionType.BLOCKING)
    path = _manifest(tmp_path)
    assert read_manifest(path).state is ManifestState.WRITING
    add_raw_bytes(part, 0, b"a" * 5000)
    add_raw_bytes(part, 1, b"b" * 70)
    part.finish()
    m = read_manifest(path)
    assert m.state is ManifestState.FINISHED and m.partition_id == PID
    assert [s.size for s in m.subpartitions] == [
        (tmp_path / s.file).stat().st_size for s in m.subpartitions
    ]
    verify_spilled_data(m, tmp_path)  # the recorded checksums are the files'
    part.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", BOUNDED_DATA_KINDS)
def test_kept_partition_restored_buffer_for_buffer(
    nbp: NetworkBufferPool, tmp_path: Path, kind: str
) -> None:
    """Restored with the storage it was written with (the manifest says which), whatever
    the restoring daemon's own ``blocking_shuffle_type``."""
    part = _partition(nbp, tmp_path, ResultPartitionType.BLOCKING, kind=kind)
    add_raw_bytes(part, 0, bytes(range(256)) * 40)
    add_raw_bytes(part, 1, b"z" * 3)
    part.finish()
    before = [_payloads(part, i) for i in range(2)]
    part.keep_spilled_data()
    part.release()
    path = _manifest(tmp_path)
    m = read_manifest(path)
    verify_spilled_data(m, tmp_path)
    assert m.bounded_data_kind == kind
    again = ResultPartition.restore(path, m, nbp.create_buffer_pool(2, 6))
    assert again.is_finished and again.partition_id == PID
    storage = {"file": FileBoundedData, "mmap": MmapBoundedData}[kind]
    assert all(isinstance(s.data, storage) for s in again.subpartitions)  # type: ignore[attr-defined]
    assert [_payloads(again, i) for i in range(2)] == before
    assert [_payloads(again, i) for i in range(2)] == before  # any number of times
    again.release()
    assert list(tmp_path.iterdir()) == []


def test_pipelined_manifest_until_release(nbp: NetworkBufferPool, tmp_path: Path) -> None:
    part = _partition(nbp, tmp_path, ResultPartitionType.PIPELINED)
    m = read_manifest(_manifest(tmp_path))
    assert m.state is ManifestState.WRITING and m.partition_type.is_pipelined
    part.finish()
    part.keep_spilled_data()  # no effect: pipelined data dies with its daemon
    part.release()
    assert list(tmp_path.iterdir()) == []


def test_damaged_files_refused(nbp: NetworkBufferPool, tmp_path: Path) -> None:
    part = _partition(nbp, tmp_path, ResultPartitionType.BLOCKING, n=1)
    add_raw_bytes(part, 0, b"q" * 1000)
    part.finish()
    part.keep_spilled_data()
    part.release()
    m = read_manifest(_manifest(tmp_path))
    data = tmp_path / m.subpartitions[0].file
    original = data.read_bytes()
    data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(PartitionDataLostError, match="corrupt"):
        verify_spilled_data(m, tmp_path)
    data.write_bytes(original + b"x")
    with pytest.raises(PartitionDataLostError, match="longer than written"):
        verify_spilled_data(m, tmp_path)
    data.write_bytes(original[:10])
    with pytest.raises(PartitionDataLostError, match="truncated"):
        verify_spilled_data(m, tmp_path)
    data.unlink()
    with pytest.raises(PartitionDataLostError, match="missing"):
        verify_spilled_data(m, tmp_path)
    # a writing manifest, or another segment size, is not restored
    with pytest.raises(UsageError, match="segment size"):
        ResultPartition.restore(_manifest(tmp_path), m, _other_pool())


def _other_pool() -> object:
    pool = NetworkBufferPool(16, 8192)
    local = pool.create_buffer_pool(1, 4)
    local.destroy()
    pool.destroy()
    return local


@pytest.mark.parametrize(
    "data",
    [b"", b"{}", b"[1]", b'{"body": 1, "crc32": 0}', b'{"body": "{}", "crc32": 0}', b"\xff"],
)
def test_not_a_manifest(data: bytes) -> None:
    with pytest.raises(CorruptRecordError):
        decode_manifest(data, Path("x.manifest"))


def test_manifest_roundtrip_and_bit_flip(nbp: NetworkBufferPool, tmp_path: Path) -> None:
    part = _partition(nbp, tmp_path, ResultPartitionType.BLOCKING)
    part.finish()
    m = read_manifest(_manifest(tmp_path))
    raw = encode_manifest(m)
    assert decode_manifest(raw, Path("x")) == m
    flipped = raw.replace(b"manifest", b"manifesT")
    with pytest.raises(CorruptRecordError, match="checksum"):
        decode_manifest(flipped, Path("x"))
    part.release()


def test_a_manifest_naming_an_unknown_storage_kind_is_refused(
    nbp: NetworkBufferPool, tmp_path: Path
) -> None:
    part = _partition(nbp, tmp_path, ResultPartitionType.BLOCKING)
    part.finish()
    m = read_manifest(_manifest(tmp_path))
    part.release()
    raw = encode_manifest(dataclasses.replace(m, bounded_data_kind="tape"))
    with pytest.raises(CorruptRecordError, match="bounded_data_kind 'tape'"):
        decode_manifest(raw, Path("x"))


def test_an_unknown_storage_kind_is_a_usage_error(nbp: NetworkBufferPool, tmp_path: Path) -> None:
    pool = nbp.create_buffer_pool(1, 4)
    try:
        with pytest.raises(UsageError, match="bounded_data_kind must be one of file, mmap"):
            ResultPartition(
                PID,
                ResultPartitionType.BLOCKING,
                1,
                pool,
                spill_dir=tmp_path,
                bounded_data_kind="tape",
            )
    finally:
        pool.destroy()  # the caller's, as in the daemon
    assert list(tmp_path.iterdir()) == []  # refused before anything was created
