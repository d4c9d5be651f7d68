"""CreditBasedSequenceNumberingViewReader: credit accounting of one remote channel's reader.

Real pipelined partitions of the leak-checked ``nbp``; the reader's queue is a stub that
records notifications (the reader only calls ``notify_reader_non_empty`` on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from exchange.errors import IllegalStateError, UsageError
from exchange.events.events import CheckpointBarrier, EndOfPartitionEvent, EventSerializer
from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.partition import ResultPartition, ResultPartitionManager
from tests.conformance.partition_fill import add_full_buffers

PartitionFactory = Callable[..., ResultPartition]


class StubQueue:
    """Records which readers told the queue they have data."""

    def __init__(self) -> None:
        self.notified: list[CreditBasedSequenceNumberingViewReader] = []

    def notify_reader_non_empty(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        self.notified.append(reader)


def new_reader(
    manager: ResultPartitionManager, part: ResultPartition, credit: int, index: int = 0
) -> tuple[CreditBasedSequenceNumberingViewReader, StubQueue]:
    queue = StubQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, credit, queue)  # type: ignore[arg-type]
    reader.request_subpartition_view(manager, part.partition_id, index)
    return reader, queue


def test_negative_initial_credit_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        CreditBasedSequenceNumberingViewReader(1, -1, StubQueue())  # type: ignore[arg-type]


def test_without_a_view_nothing_is_available(manager: ResultPartitionManager) -> None:
    reader = CreditBasedSequenceNumberingViewReader(1, 5, StubQueue())  # type: ignore[arg-type]
    assert not reader.is_available()
    assert reader.get_next_buffer() is None
    assert reader.is_released
    assert reader.failure_cause is None
    reader.release_all_resources()  # idempotent without a view


def test_a_second_view_request_is_illegal(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 2)
    reader, _ = new_reader(manager, part, 2)
    with pytest.raises(IllegalStateError):
        reader.request_subpartition_view(manager, part.partition_id, 1)
    reader.release_all_resources()
    part.release()


def test_data_costs_one_credit_and_stops_at_zero(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader, queue = new_reader(manager, part, 2)
    add_full_buffers(part, 0, 4)
    assert set(queue.notified) == {reader}  # told when the first buffer was finished
    assert reader.is_available()

    first = reader.get_next_buffer()
    assert first is not None
    assert first.buffer.is_buffer and reader.credits == 1
    assert first.more_available  # credit left and data queued
    assert first.sequence_number == 0
    # Three finished buffers remain. Like Flink, the backlog may count one less while the
    # last queued buffer is a data buffer (it assumes the writer still fills it).
    assert first.buffers_in_backlog in (2, 3)
    first.buffer.release()

    second = reader.get_next_buffer()
    assert second is not None
    assert reader.credits == 0
    assert not second.more_available  # data queued but no credit
    assert second.sequence_number == 1
    second.buffer.release()

    assert not reader.is_available()
    reader.add_credit(1)
    assert reader.is_available()
    third = reader.get_next_buffer()
    assert third is not None and third.sequence_number == 2
    third.buffer.release()
    reader.release_all_resources()
    part.release()


def test_events_need_no_credit(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader, _ = new_reader(manager, part, 1)
    add_full_buffers(part, 0, 1)
    part.finish()

    data = reader.get_next_buffer()
    assert data is not None and data.buffer.is_buffer
    assert reader.credits == 0
    # The next buffer is EndOfPartition: more is available although credit is zero.
    assert data.more_available
    data.buffer.release()
    assert reader.is_available()

    end = reader.get_next_buffer()
    assert end is not None and not end.buffer.is_buffer
    assert EventSerializer.is_end_of_partition(end.buffer)
    assert reader.credits == 0
    assert not end.more_available
    end.buffer.release()
    reader.release_all_resources()
    assert part.is_released  # pipelined: released once its only subpartition was consumed


def test_barrier_blocks_until_resume(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader, _ = new_reader(manager, part, 0)  # zero initial credit: events only
    part.broadcast_event(CheckpointBarrier(1, 0))
    add_full_buffers(part, 0, 1)
    barrier = reader.get_next_buffer()
    assert barrier is not None and barrier.buffer.data_type.is_blocking_upstream
    barrier.buffer.release()
    reader.add_credit(3)
    assert not reader.is_available()  # blocked by the aligned barrier
    assert reader.get_next_buffer() is None
    # Flink: resuming a zero-initial-credit reader resets its credit to zero.
    reader.resume_consumption()
    assert reader.credits == 0
    assert not reader.is_available()
    reader.add_credit(1)
    assert reader.is_available()
    nxt = reader.get_next_buffer()
    assert nxt is not None and nxt.buffer.is_buffer
    nxt.buffer.release()
    reader.release_all_resources()
    part.release()


def test_resume_keeps_credit_of_a_reader_with_initial_credit(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader, _ = new_reader(manager, part, 2)
    part.broadcast_event(CheckpointBarrier(1, 0))
    barrier = reader.get_next_buffer()
    assert barrier is not None
    barrier.buffer.release()
    reader.resume_consumption()
    assert reader.credits == 2
    reader.release_all_resources()
    part.release()


def test_release_reports_producer_failure(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader, queue = new_reader(manager, part, 2)
    part.fail(RuntimeError("boom"))
    assert reader.is_released
    assert queue.notified == [reader]  # the release wakes the reader
    cause = reader.failure_cause
    assert cause is not None and "boom" in str(cause)
    reader.release_all_resources()
    reader.release_all_resources()


def test_end_of_partition_is_an_event_buffer() -> None:
    buf = EventSerializer.to_buffer(EndOfPartitionEvent.INSTANCE)
    try:
        assert not buf.is_buffer and EventSerializer.is_end_of_partition(buf)
    finally:
        buf.release()


class PythonView:
    """A view behind a Python object: the reader takes its generic path (the
    view's ``get_next_buffer`` and its ``BufferAndBacklog``), not the compiled poll."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


@pytest.mark.parametrize("ptype", ["pipelined", "blocking"])
def test_the_compiled_poll_of_a_view_reads_as_its_python_api(
    ptype: str,
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The data port polls a pipelined view and a blocking subpartition's reader in C
    (``c_poll``, no ``BufferAndBacklog``); every other view through ``get_next_buffer``.
    The same stream under the same credit gives the same buffers, sequence numbers,
    backlogs, "more" and credit both ways: data, an aligned barrier (pipelined: blocks
    until resumed), more data, EndOfPartition."""
    seen: list[list[tuple[Any, ...]]] = []
    for wrap in (False, True):
        part = make_partition(f"both-{ptype}-{wrap}", ptype, 1, (1, 12))
        add_full_buffers(part, 0, 3)
        if ptype == "pipelined":
            part.broadcast_event(CheckpointBarrier(1, 0))
        add_full_buffers(part, 0, 4, start=3)
        part.finish()
        queue = StubQueue()
        reader = CreditBasedSequenceNumberingViewReader(7, 2, queue)  # type: ignore[arg-type]
        if wrap:
            real = manager.create_subpartition_view
            monkeypatch.setattr(
                manager, "create_subpartition_view", lambda *a, real=real: PythonView(real(*a))
            )
        reader.request_subpartition_view(manager, part.partition_id, 0)
        monkeypatch.undo()
        got: list[tuple[Any, ...]] = []
        ended = False
        while not ended:
            if not reader.is_available():  # the queue polls only an available reader
                got.append(("none", reader.credits))
                if got[-2][0] == "barrier":  # blocked: the consumer resumes once aligned
                    reader.resume_consumption()
                else:  # out of credit: the consumer frees two buffers
                    reader.add_credit(2)
                continue
            nxt = reader.get_next_buffer()
            assert nxt is not None
            buf = nxt.buffer
            kind = "data" if buf.is_buffer else "event"
            if buf.data_type.is_blocking_upstream:
                kind = "barrier"
            ended = kind == "event" and EventSerializer.is_end_of_partition(buf)
            got.append(
                (
                    kind,
                    buf.to_bytes(),
                    nxt.more_available,
                    nxt.buffers_in_backlog,
                    nxt.sequence_number,
                    reader.credits,
                )
            )
            buf.release()
        assert reader.get_next_buffer() is None  # consumed: nothing after the end
        reader.release_all_resources()
        assert reader.is_released and reader.get_next_buffer() is None
        seen.append(got)
    compiled, python = seen
    assert compiled == python
    kinds = [g[0] for g in compiled]
    assert kinds.count("data") == 7 and kinds[-1] == "event"
    assert ("barrier" in kinds) == (ptype == "pipelined")
    sent = 7 + 1 + (ptype == "pipelined")  # data, EndOfPartition and the barrier
    assert [g[4] for g in compiled if g[0] != "none"] == list(range(sent))
