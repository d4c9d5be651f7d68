"""The lifecycle tables: every transition not listed raises, and the objects follow them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from itertools import product

import pytest

from exchange.errors import (
    ConsumerAlreadyAttachedError,
    IllegalStateError,
    PartitionReleasedError,
    WriterClosedError,
)
from exchange.partition import (
    ReaderState,
    ResultPartition,
    ResultPartitionState,
    ResultPartitionType,
    SubpartitionState,
)
from exchange.partition.pipelined_subpartition import PipelinedSubpartitionView
from exchange.partition.states import (
    PARTITION_TRANSITIONS,
    READER_TRANSITIONS,
    SUBPARTITION_TRANSITIONS,
    transition,
)

pytestmark = pytest.mark.timeout(10)

PartitionFactory = Callable[..., ResultPartition]
TABLES: list[Mapping[Enum, frozenset[Enum]]] = [
    PARTITION_TRANSITIONS,  # type: ignore[list-item]
    SUBPARTITION_TRANSITIONS,  # type: ignore[list-item]
    READER_TRANSITIONS,  # type: ignore[list-item]
]


class Listener:
    def notify_data_available(self) -> None:
        pass


@pytest.mark.parametrize("table", TABLES)
def test_every_pair_of_states_is_allowed_exactly_when_the_table_lists_it(
    table: Mapping[Enum, frozenset[Enum]],
) -> None:
    states = list(table)
    assert set(states) == set(type(states[0]))  # every state has a row
    for current, to in product(states, states):
        if to in table[current]:
            assert transition(table, current, to, "x") is to
        else:
            with pytest.raises(IllegalStateError, match=f"{current.value} -> {to.value}"):
                transition(table, current, to, "x")


@pytest.mark.parametrize("table", TABLES)
def test_no_state_goes_back_to_itself_and_terminal_states_are_final(
    table: Mapping[Enum, frozenset[Enum]],
) -> None:
    for state, targets in table.items():
        assert state not in targets
    terminal = [s for s, targets in table.items() if not targets]
    assert terminal  # every lifecycle ends


def test_partition_calls_map_onto_the_table(make_partition: PartitionFactory) -> None:
    part = make_partition("calls", ResultPartitionType.PIPELINED, 1)
    assert part.state is ResultPartitionState.WRITING
    part.finish()
    assert part.state is ResultPartitionState.FINISHED
    part.finish()  # repeated: no transition, no error
    with pytest.raises(WriterClosedError):
        part.check_writable()
    part.release()
    assert part.state is ResultPartitionState.RELEASED
    part.release()
    part.fail(None)  # the first end wins
    assert part.state is ResultPartitionState.RELEASED
    with pytest.raises(PartitionReleasedError):
        part.finish()  # RELEASED -> FINISHED is not a transition: the writer hears why
    with pytest.raises(IllegalStateError):
        part._transition(ResultPartitionState.WRITING)


def test_subpartition_and_view_states_follow_a_read(make_partition: PartitionFactory) -> None:
    part = make_partition("sub", ResultPartitionType.PIPELINED, 1)
    sub = part.subpartitions[0]
    view = part.create_subpartition_view(0, Listener())
    assert isinstance(view, PipelinedSubpartitionView)
    assert (sub.state, view.state) == (SubpartitionState.WRITING, ReaderState.READING)
    part.finish()
    assert sub.state is SubpartitionState.FINISHED
    nb = view.get_next_buffer()
    assert nb is not None
    nb.buffer.release()
    assert view.state is ReaderState.CONSUMED
    with pytest.raises(IllegalStateError):
        view._transition(ReaderState.READING)
    view.release_all_resources()
    view.release_all_resources()
    assert view.state is ReaderState.RELEASED
    assert part.state is ResultPartitionState.RELEASED
    assert sub.state is SubpartitionState.RELEASED
    with pytest.raises(ConsumerAlreadyAttachedError):
        sub.create_read_view(Listener())
    with pytest.raises(IllegalStateError):
        sub._transition(SubpartitionState.FINISHED)
    with pytest.raises(PartitionReleasedError):
        sub.finish()


@pytest.mark.parametrize("kind", ["file", "mmap"])
def test_blocking_reader_is_consumed_after_end_of_partition(
    make_partition: PartitionFactory, kind: str
) -> None:
    part = make_partition("blocking", ResultPartitionType.BLOCKING, 1, kind=kind)
    part.finish()
    sub = part.subpartitions[0]
    assert sub.state is SubpartitionState.FINISHED
    readers = [part.create_subpartition_view(0, Listener()) for _ in range(2)]
    for reader in readers:
        nb = reader.get_next_buffer()
        assert nb is not None and not nb.buffer.is_buffer
        nb.buffer.release()
        assert reader.state is ReaderState.CONSUMED  # type: ignore[attr-defined]
        assert reader.get_next_buffer() is None
        assert reader.get_availability_and_backlog(1) == (False, 0)
        reader.release_all_resources()
        assert reader.state is ReaderState.RELEASED  # type: ignore[attr-defined]
    assert not part.is_released  # blocking partitions are read any number of times
    part.release()
    assert sub.state is SubpartitionState.RELEASED
