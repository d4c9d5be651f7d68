"""Output channel state of unaligned checkpoints, as the producer task receives it.

Who persists it: the **producer task**, with its own snapshot. An unaligned barrier the
task broadcasts overtakes, in each pipelined subpartition on the daemon, the buffers still
queued there (``PipelinedSubpartition``): they are still sent after the barrier, and the
daemon hands a copy of each back over the task's local connection (``OutputChannelState``
per buffer, then ``OutputChannelStateComplete`` per subpartition with the counts). This
collector gathers them per checkpoint; once every subpartition reported, the task stores
the ``CheckpointOutputState`` in checkpoint storage with the rest of its snapshot, and
acknowledges the checkpoint only then. So the daemon never needs to know where checkpoints
are stored, and nothing is lost halfway: if the daemon dies before every subpartition
reported, the task's connection fails, the state never completes and neither does the
checkpoint; if the task dies, it never acknowledges. On restore the task re-emits the
persisted buffers, per subpartition and in order, before any new record (the writer's
``restore_output_state``).

The barrier also overtakes the buffers the task cut but has not pushed yet (waiting for
producer credit): it is written on the local connection at once, and those buffers, sent
after it, are added to the state after the daemon's (``add_local``). So the state of a
subpartition ends where the barrier was broadcast: at a record boundary (the writer
flushes before an event).

Sans I/O: the connection feeds the messages in, the writer resolves its futures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exchange.errors import ProtocolError, UsageError
from exchange.protocol.local_messages import OutputChannelState, OutputChannelStateComplete

__all__ = ["CheckpointOutputState", "OutputChannelStateCollector"]


@dataclass(frozen=True, slots=True)
class CheckpointOutputState:
    """The output channel state of one checkpoint: per subpartition, the bytes of each
    buffer its barrier overtook, in order (no entry: it overtook nothing)."""

    checkpoint_id: int
    buffers: dict[int, tuple[bytes, ...]] = field(default_factory=dict)

    @property
    def num_buffers(self) -> int:
        return sum(len(b) for b in self.buffers.values())

    @property
    def num_bytes(self) -> int:
        return sum(len(x) for b in self.buffers.values() for x in b)


@dataclass(slots=True)
class _Pending:
    buffers: dict[int, list[bytes]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    local: dict[int, list[bytes]] = field(default_factory=dict)


class OutputChannelStateCollector:
    """Gathers the daemon's OutputChannelState messages into one state per checkpoint.

    ``expect(id)`` when the task broadcasts an unaligned barrier; ``on_buffer`` and
    ``on_complete`` for the messages; ``on_complete`` returns the checkpoint's state once
    every subpartition completed. Messages for a checkpoint not expected, for a
    subpartition out of range or already complete, buffers larger than a segment, counts
    that do not match: ProtocolError (the daemon misbehaved).
    """

    def __init__(self, num_subpartitions: int, max_buffer_size: int) -> None:
        if num_subpartitions < 1 or max_buffer_size < 1:
            raise UsageError(
                f"need num_subpartitions >= 1 and max_buffer_size >= 1, got "
                f"{num_subpartitions}, {max_buffer_size}"
            )
        self.num_subpartitions = num_subpartitions
        self.max_buffer_size = max_buffer_size
        self._pending: dict[int, _Pending] = {}
        self._last_expected = -1
        self.buffers_received = 0
        self.bytes_received = 0

    def expect(self, checkpoint_id: int) -> None:
        if checkpoint_id <= self._last_expected:
            raise UsageError(
                f"unaligned checkpoint {checkpoint_id} after {self._last_expected}: "
                "checkpoint ids must increase"
            )
        self._last_expected = checkpoint_id
        self._pending[checkpoint_id] = _Pending()

    @property
    def pending(self) -> list[int]:
        """Checkpoints whose state is still arriving."""
        return sorted(self._pending)

    def _get(self, checkpoint_id: int, subpartition: int) -> _Pending:
        p = self._pending.get(checkpoint_id)
        if p is None:
            raise ProtocolError(f"channel state for checkpoint {checkpoint_id}, not expected")
        if not 0 <= subpartition < self.num_subpartitions:
            raise ProtocolError(
                f"channel state for subpartition {subpartition} of {self.num_subpartitions}"
            )
        if subpartition in p.done:
            raise ProtocolError(
                f"channel state of checkpoint {checkpoint_id}, subpartition {subpartition} "
                "after its completion"
            )
        return p

    def add_local(self, checkpoint_id: int, buffers: dict[int, list[bytes]]) -> None:
        """Buffers the barrier overtook in the task itself (cut, not pushed yet): they
        follow the daemon's, per subpartition, in the state."""
        p = self._pending.get(checkpoint_id)
        if p is None:
            raise UsageError(f"checkpoint {checkpoint_id} is not expected")
        for index, bufs in buffers.items():
            if not 0 <= index < self.num_subpartitions:
                raise UsageError(f"subpartition {index} of {self.num_subpartitions}")
            p.local.setdefault(index, []).extend(bufs)

    def on_buffer(self, msg: OutputChannelState) -> None:
        p = self._get(msg.checkpoint_id, msg.subpartition)
        n = len(msg.payload)
        if n > self.max_buffer_size:
            raise ProtocolError(
                f"channel state buffer of {n} bytes exceeds the {self.max_buffer_size}-byte segment"
            )
        p.buffers.setdefault(msg.subpartition, []).append(bytes(msg.payload))
        p.sizes[msg.subpartition] = p.sizes.get(msg.subpartition, 0) + n
        self.buffers_received += 1
        self.bytes_received += n

    def on_complete(self, msg: OutputChannelStateComplete) -> CheckpointOutputState | None:
        p = self._get(msg.checkpoint_id, msg.subpartition)
        got = len(p.buffers.get(msg.subpartition, ()))
        size = p.sizes.get(msg.subpartition, 0)
        if (got, size) != (msg.buffers, msg.num_bytes):
            raise ProtocolError(
                f"channel state of checkpoint {msg.checkpoint_id}, subpartition "
                f"{msg.subpartition}: {got} buffers / {size} bytes received, "
                f"{msg.buffers} / {msg.num_bytes} announced"
            )
        p.done.add(msg.subpartition)
        if len(p.done) < self.num_subpartitions:
            return None
        del self._pending[msg.checkpoint_id]
        for index, bufs in p.local.items():
            p.buffers.setdefault(index, []).extend(bufs)
        return CheckpointOutputState(
            msg.checkpoint_id, {i: tuple(b) for i, b in sorted(p.buffers.items()) if b}
        )
