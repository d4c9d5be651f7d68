"""CachedBufferBlocker and BufferSpiller: parking, roll-over, replay, corruption, cleanup."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from exchange.checkpointing import BufferBlocker, BufferSpiller, CachedBufferBlocker
from exchange.checkpointing.buffer_blocker import HEADER
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.errors import CorruptRecordError, IllegalStateError, UsageError
from exchange.events.events import EventSerializer
from exchange.memory import NetworkBufferPool
from tests.checkpointing.conftest import barrier, cancel, data, eop


def replay_all(blocker: BufferBlocker) -> list[tuple[int, object]]:
    seq = blocker.roll_over()
    assert seq is not None
    out: list[tuple[int, object]] = []
    while (boe := seq.get_next()) is not None:
        assert boe.more_available
        if boe.buffer is not None:
            out.append((boe.channel_index, boe.buffer.to_bytes()))
            boe.buffer.release()
        else:
            out.append((boe.channel_index, boe.event))
    assert seq.get_next() is None
    seq.cleanup()
    return out


@pytest.fixture(params=["cached", "spilled"])
def blocker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BufferBlocker]:
    b: BufferBlocker = (
        CachedBufferBlocker() if request.param == "cached" else BufferSpiller(tmp_path, 4096)
    )
    yield b
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_round_trip_in_arrival_order_with_sizes(
    blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    assert blocker.roll_over() is None  # nothing parked
    items = [data(1, b"hello", pool), barrier(0, 3), data(0, b"", pool), cancel(2, 4)]
    items += [data(2, bytes(range(256)) * 16, pool), eop(1)]
    sizes = [blocker.add(boe) for boe in items]
    assert sizes == [5, 19, 0, 9, 4096, 1]
    assert blocker.bytes_blocked == sum(sizes)
    out = replay_all(blocker)
    assert out == [
        (1, b"hello"),
        (0, items[1].event),
        (0, b""),
        (2, items[3].event),
        (2, bytes(range(256)) * 16),
        (1, items[5].event),
    ]
    assert blocker.bytes_blocked == 0 and blocker.roll_over() is None


def test_every_roll_over_is_its_own_sequence(blocker: BufferBlocker) -> None:
    blocker.add(data(0, b"first"))
    first = blocker.roll_over()
    blocker.add(data(1, b"second"))
    second = blocker.roll_over()
    assert first is not None and second is not None
    assert (first.size, second.size) == (5, 6)
    b2 = second.get_next()
    assert b2 is not None and b2.buffer is not None and b2.buffer.to_bytes() == b"second"
    b2.buffer.release()
    second.cleanup()
    b1 = first.get_next()
    assert b1 is not None and b1.buffer is not None and b1.buffer.to_bytes() == b"first"
    b1.buffer.release()
    first.cleanup()
    first.cleanup()  # idempotent


def test_cleanup_and_close_release_what_was_not_replayed(
    blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    blocker.add(data(0, b"a", pool))
    blocker.add(data(0, b"b", pool))
    seq = blocker.roll_over()
    assert seq is not None
    blocker.add(data(1, b"c", pool))  # never rolled over: close releases it
    seq.cleanup()
    blocker.close()
    with pytest.raises(IllegalStateError):
        blocker.add(data(0, b"late", pool))  # refused and released
    with pytest.raises(IllegalStateError):
        blocker.roll_over()


def test_spiller_releases_buffers_at_once_and_rolls_files(
    tmp_path: Path, pool: NetworkBufferPool
) -> None:
    s = BufferSpiller(tmp_path, 4096)
    s.add(data(0, b"x" * 100, pool))
    assert pool.num_in_use == 0  # the segment went back as soon as it was written
    assert len(list(tmp_path.iterdir())) == 1
    seq1 = s.roll_over()
    s.add(data(0, b"y", pool))
    assert len(list(tmp_path.iterdir())) == 2  # a new file per roll-over
    assert seq1 is not None
    boe = seq1.get_next()
    assert boe is not None and boe.buffer is not None and boe.buffer.segment.is_pooled is False
    boe.buffer.release()
    assert seq1.get_next() is None  # consumed: its file is gone
    assert len(list(tmp_path.iterdir())) == 1
    s.close()
    assert list(tmp_path.iterdir()) == []


def test_spiller_refuses_a_buffer_larger_than_a_page(
    tmp_path: Path, pool: NetworkBufferPool
) -> None:
    s = BufferSpiller(tmp_path, 16)
    with pytest.raises(UsageError, match="page size"):
        s.add(data(0, b"z" * 17, pool))
    s.close()
    with pytest.raises(UsageError):
        BufferSpiller(tmp_path, 0)


@pytest.mark.parametrize(
    ("tail", "what"),
    [
        (b"\x01\x00", "truncated header"),
        (HEADER.pack(0, 10, 0) + b"abc", "truncated buffer"),
        (HEADER.pack(0, 65, 0), "bad record header"),
        (HEADER.pack(0, -1, 0), "bad record header"),
        (HEADER.pack(-2, 1, 0) + b"a", "bad record header"),
        (HEADER.pack(0, 1, 7) + b"a", "bad record header"),
        (HEADER.pack(0, 9, 1) + b"\x02", "truncated event"),
        (HEADER.pack(0, 2, 1) + b"\xee\x00", "unknown or malformed event"),
    ],
)
def test_spilled_garbage_is_a_corrupt_record(tmp_path: Path, tail: bytes, what: str) -> None:
    s = BufferSpiller(tmp_path, 64)
    s.add(data(3, b"ok"))
    seq = s.roll_over()
    assert seq is not None
    path = next(tmp_path.iterdir())
    with open(path, "ab") as f:
        f.write(tail)
    first = seq.get_next()
    assert first is not None and first.buffer is not None and first.channel_index == 3
    first.buffer.release()
    with pytest.raises(CorruptRecordError, match=what):
        seq.get_next()
    seq.cleanup()
    s.close()
    assert list(tmp_path.iterdir()) == []


def test_spill_record_format(tmp_path: Path) -> None:
    """channel i32 | length i32 | is_buffer u8 (little endian), then the payload."""
    s = BufferSpiller(tmp_path, 64)
    ev = barrier(2, 9).event
    assert ev is not None
    s.add(BufferOrEvent(None, ev, 2, True))
    s.add(data(1, b"abc"))
    seq = s.roll_over()
    assert seq is not None
    raw = next(tmp_path.iterdir()).read_bytes()
    ev_bytes = EventSerializer.to_bytes(ev)
    assert raw == (
        HEADER.pack(2, len(ev_bytes), 1) + ev_bytes + b"\x01\x00\x00\x00\x03\x00\x00\x00\x00abc"
    )
    assert seq.get_next() == BufferOrEvent(None, ev, 2, True)
    seq.cleanup()
    s.close()


# -- the job's alignment setting -----------------------------------------------------------


def test_private_spiller_files_are_0600_in_a_0700_dir_removed_when_consumed_and_closed(
    tmp_path: Path, pool: NetworkBufferPool
) -> None:
    """``BufferSpiller.private``: the spill directory is the spiller's own (0700, new),
    its files 0600 whatever the umask; a consumed sequence deletes its file and ``close``
    removes the directory with anything left in it (a sequence never replayed)."""
    import os
    import stat

    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        sp = BufferSpiller.private(tmp_path, 4096)
        sp.add(data(0, b"secret", pool))
    finally:
        os.umask(old)
    (d,) = tmp_path.iterdir()
    assert d == sp.spill_dir and d.name.startswith("exchange-align-")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (f,) = d.iterdir()
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == os.geteuid()
    assert replay_all(sp) == [(0, b"secret")]
    assert list(d.iterdir()) == []  # consumed: gone
    sp.add(data(1, b"left", pool))
    left = sp.roll_over()  # rolled over, never replayed
    assert left is not None and len(list(d.iterdir())) == 1
    left.cleanup()
    sp.add(data(1, b"open", pool))  # still being written
    sp.close()
    assert list(tmp_path.iterdir()) == []


def test_spiller_never_follows_a_planted_symlink(tmp_path: Path, pool: NetworkBufferPool) -> None:
    """A spill file name taken (a symlink planted there) fails the park instead of
    writing through it."""
    target = tmp_path / "victim"
    target.write_bytes(b"")
    sp = BufferSpiller(tmp_path, 4096)
    (tmp_path / f"{sp._prefix}.0.spill").symlink_to(target)
    with pytest.raises(FileExistsError):
        sp.add(data(0, b"x", pool))
    assert target.read_bytes() == b""
    sp.close()


def test_alignment_mode_selects_the_handler_strategy(tmp_path: Path) -> None:
    import time

    from exchange.checkpointing import (
        AlignedBarrierHandler,
        AlignmentMode,
        AlignmentStrategy,
        CheckpointingMode,
        create_barrier_handler,
    )
    from exchange.errors import ConfigError

    class Listener:
        def trigger_checkpoint(self, *a: object) -> None: ...
        def abort_checkpoint(self, *a: object) -> None: ...

    want = {
        "block_upstream": AlignmentStrategy.BLOCKING_UPSTREAM,
        "buffer": AlignmentStrategy.PARKING,
        "spill": AlignmentStrategy.PARKING,
    }
    for name, strategy in want.items():
        h = create_barrier_handler(
            CheckpointingMode.EXACTLY_ONCE,
            2,
            Listener(),
            time.monotonic,
            lambda ch: None,
            alignment=AlignmentMode.parse(name),
            spill_dir=tmp_path,
            page_size=4096,
        )
        assert isinstance(h, AlignedBarrierHandler) and h.strategy is strategy
        assert len(list(tmp_path.iterdir())) == (1 if name == "spill" else 0)
        h.close()
        assert list(tmp_path.iterdir()) == []  # the private spill directory went with it
    for bad in ("blocking", "SPILL", None, 1):
        with pytest.raises(ConfigError, match=r"alignment.*block_upstream"):
            AlignmentMode.parse(bad)
