"""Output channel state, sans I/O: the daemon's ProducerSession hands the buffers an
unaligned barrier overtook back to the task as messages (wire round trip included), and
the task's OutputChannelStateCollector turns them into one state per checkpoint,
refusing whatever a misbehaving daemon could send."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from exchange.buffers.buffer import DataType
from exchange.checkpointing.output_channel_state import (
    CheckpointOutputState,
    OutputChannelStateCollector,
)
from exchange.errors import ProtocolError, UsageError
from exchange.events.events import CheckpointBarrier, CheckpointOptions, EventSerializer
from exchange.local import ProducerSession
from exchange.memory import NetworkBufferPool
from exchange.partition import ALL_SUBPARTITIONS, ResultPartition, ResultPartitionType
from exchange.protocol.codec import InPlaceFrameDecoder, encode
from exchange.protocol.local_messages import (
    OutputChannelState,
    OutputChannelStateComplete,
)
from exchange.protocol.messages import Message

PIPELINED = ResultPartitionType.PIPELINED


def _barrier(cid: int) -> memoryview:
    b = CheckpointBarrier(cid, 0, CheckpointOptions(unaligned=True))
    return memoryview(EventSerializer.to_bytes(b))


def _wire(messages: list[Message]) -> list[Message]:
    """Encode and decode, byte by byte: what the task receives."""
    data = b"".join(b"".join(bytes(p) for p in encode(m)) for m in messages)
    dec = InPlaceFrameDecoder()
    out: list[Message] = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))
    return out


def test_session_hands_overtaken_buffers_to_the_task_and_the_pool_stays_whole(
    make_partition: Callable[..., ResultPartition], nbp: NetworkBufferPool
) -> None:
    part = make_partition("st", PIPELINED, 2, pool_size=(2, 8))
    sent: list[Message] = []
    counted: list[tuple[int, int]] = []
    s = ProducerSession(
        part, sent.append, max_credit=4, on_output_state=lambda n, b: counted.append((n, b))
    )
    s.start()
    s.on_push(0, DataType.DATA_BUFFER, memoryview(b"a" * 10))
    s.on_push(1, DataType.DATA_BUFFER, memoryview(b"b" * 20))
    s.on_push(0, DataType.DATA_BUFFER, memoryview(b"c" * 30))
    sent.clear()
    s.on_push(ALL_SUBPARTITIONS, DataType.PRIORITIZED_EVENT_BUFFER, _barrier(4))
    msgs = _wire(sent)
    assert [type(m) for m in msgs] == [
        OutputChannelState,
        OutputChannelState,
        OutputChannelStateComplete,
        OutputChannelState,
        OutputChannelStateComplete,
    ]
    assert counted == [(2, 40), (1, 20)]
    assert (s.output_state_bytes, s.output_state_buffers, s.output_state_reports) == (60, 3, 2)
    collector = OutputChannelStateCollector(2, nbp.segment_size)
    collector.expect(4)
    done = [
        collector.on_buffer(m) if isinstance(m, OutputChannelState) else collector.on_complete(m)
        for m in msgs
    ]
    assert done[:-1] == [None] * 4
    assert done[-1] == CheckpointOutputState(4, {0: (b"a" * 10, b"c" * 30), 1: (b"b" * 20,)})
    assert done[-1].num_bytes == 60 and done[-1].num_buffers == 3
    part.release()


def test_a_session_no_longer_open_sends_nothing_and_releases(
    make_partition: Callable[..., ResultPartition],
) -> None:
    part = make_partition("st2", PIPELINED, 1, pool_size=(1, 4))
    sent: list[Message] = []
    s = ProducerSession(part, sent.append, max_credit=2)
    s.start()
    s.on_push(0, DataType.DATA_BUFFER, memoryview(b"a" * 10))
    polled = part.subpartitions[0].poll_buffer()  # type: ignore[union-attr]
    assert polled is not None
    slice_ = polled.buffer  # a slice holding its own reference, as the state's are
    s.fail("the task went away")
    sent.clear()
    s._on_output_channel_state(0, 9, [slice_])
    # nothing for a task that is gone, and the state's reference is released (the failed
    # partition dropped the queue's: the segment is back, the pool check at teardown)
    assert sent == [] and slice_.is_recycled
    part.release()


@pytest.mark.parametrize(
    "make",
    [
        lambda: OutputChannelState(-1, 0, b"x"),
        lambda: OutputChannelState(2**63, 0, b"x"),
        lambda: OutputChannelState(1, ALL_SUBPARTITIONS, b"x"),
        lambda: OutputChannelState(1, 0, b""),
        lambda: OutputChannelStateComplete(1, 0, -1, 0),
        lambda: OutputChannelStateComplete(1, 0, 0, True),
    ],
)
def test_messages_validate_their_fields(make: Callable[[], Message]) -> None:
    with pytest.raises(ProtocolError):
        make()


def test_collector_refuses_what_a_misbehaving_daemon_sends() -> None:
    c = OutputChannelStateCollector(2, 16)
    with pytest.raises(ProtocolError, match="not expected"):
        c.on_buffer(OutputChannelState(1, 0, b"x"))
    c.expect(1)
    with pytest.raises(UsageError, match="must increase"):
        c.expect(1)
    with pytest.raises(ProtocolError, match="subpartition 2 of 2"):
        c.on_buffer(OutputChannelState(1, 2, b"x"))
    with pytest.raises(ProtocolError, match="exceeds the 16-byte segment"):
        c.on_buffer(OutputChannelState(1, 0, b"x" * 17))
    c.on_buffer(OutputChannelState(1, 0, b"xy"))
    with pytest.raises(ProtocolError, match="1 buffers / 2 bytes received, 1 / 3 announced"):
        c.on_complete(OutputChannelStateComplete(1, 0, 1, 3))
    assert c.on_complete(OutputChannelStateComplete(1, 0, 1, 2)) is None
    with pytest.raises(ProtocolError, match="after its completion"):
        c.on_buffer(OutputChannelState(1, 0, b"z"))
    assert c.pending == [1]
    state = c.on_complete(OutputChannelStateComplete(1, 1, 0, 0))
    assert state == CheckpointOutputState(1, {0: (b"xy",)}) and c.pending == []
    with pytest.raises(UsageError):
        OutputChannelStateCollector(0, 16)
