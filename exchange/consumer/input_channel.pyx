# cython: language_level=3
"""InputChannel: one (partition, subpartition) a consumer reads, as seen by its gate.

Compiled (a ``cdef class``, fields in ``input_channel.pxd``): the remote channel
(``remote_input_channel.pyx``) extends it and its per-buffer receive path reads and
writes these fields at C speed. ``input_channel.pyi`` types it for mypy. There is no
Python version of this module.
"""

from collections import namedtuple

from exchange.errors import UsageError, fresh_error

__all__ = [
    "BATCH_FLOATING_BUFFERS",
    "DEFAULT_BACKOFF_INITIAL",
    "DEFAULT_BACKOFF_MAX",
    "STREAMING_FLOATING_BUFFERS",
    "BufferAndAvailability",
    "InputChannel",
    "backoff_delays",
]

DEFAULT_BACKOFF_INITIAL = 0.1
DEFAULT_BACKOFF_MAX = 10.0
#: Floating buffers per gate of a streaming reader (one with a checkpoint listener): Flink's
#: default. How a checkpoint aligns depends on the data in flight: the window stays Flink's.
STREAMING_FLOATING_BUFFERS = 8
#: Floating buffers per gate of a batch reader: a larger credit window, so the stream
#: arrives in larger bursts (fewer reads, AddCredit writes and hand-off wake-ups per
#: buffer: docs/architecture.md, "The consumer's CPU per 32 KiB").
BATCH_FLOATING_BUFFERS = 32


def backoff_delays(double initial, double maximum):
    """Flink's partition request backoff: initial, doubling, capped at max, then stop."""
    delay = initial
    while True:
        yield delay
        if delay >= maximum:
            return
        delay = min(delay * 2, maximum)


BufferAndAvailability = namedtuple(
    "BufferAndAvailability",
    ["buffer", "more_available", "buffers_in_backlog", "sequence_number", "overtaken_by"],
    defaults=((),),
    module=__name__,  # (a compiled module runs no frame namedtuple could read it from)
)
BufferAndAvailability.__doc__ = """``overtaken_by``: ids of the unaligned checkpoints whose
priority barrier overtook this data buffer in the channel (it is input channel state of
each; empty for most)."""


cdef class InputChannel:
    """Base of RemoteInputChannel (and of the test kit's in-process LocalInputChannel).

    Partition requests back off exponentially (``backoff_initial`` doubling up to
    ``backoff_max``) while the producer's partition is not registered yet, then fail.
    An error found asynchronously (from the network) is stored and the gate is told the
    channel has "data": the next ``get_next_buffer`` raises it.
    """

    def __init__(
        self,
        gate,
        channel_index,
        partition_id,
        subpartition_index,
        *,
        backoff_initial=DEFAULT_BACKOFF_INITIAL,
        backoff_max=DEFAULT_BACKOFF_MAX,
    ):
        if type(self) is InputChannel:
            raise TypeError("InputChannel is abstract: instantiate a subclass")
        if not isinstance(subpartition_index, int) or subpartition_index < 0:
            raise UsageError(f"subpartition_index must be an int >= 0, got {subpartition_index!r}")
        if backoff_initial <= 0 or backoff_max < backoff_initial:
            raise UsageError(
                f"need 0 < backoff_initial <= backoff_max, got {backoff_initial}, {backoff_max}"
            )
        self.gate = gate
        self.channel_index = channel_index
        self.partition_id = partition_id
        self.subpartition_index = subpartition_index
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._error = None
        self._released = False
        self.queued = False  # managed by the gate: in its channels-with-data queue
        self.queued_with_priority = False  # managed by the gate: in its priority prefix
        self.finished = False  # EndOfPartition seen
        self.bytes_in = 0
        self.buffers_in = 0

    async def request_subpartition(self):
        """Ask the producer's side for the subpartition (with backoff)."""
        raise NotImplementedError

    def get_next_buffer(self):
        """The next buffer, or None; raises the channel's error if it failed."""
        raise NotImplementedError

    def take_data_buffers(self, limit):
        """Up to ``limit`` data buffers from the head of what was received, taken at once,
        and whether anything is left after them: the gate's batch path (``poll_data``).
        Takes none when the head is an event or when anything received needs the
        one-by-one path of ``get_next_buffer`` (priority events, overtaken buffers); this
        base takes none: its channels go one by one."""
        return [], True

    def resume_consumption(self):
        """Unblock the subpartition after an aligned checkpoint barrier."""
        raise NotImplementedError

    def release_all_resources(self):
        """Give back every buffer and the subpartition view or request. Idempotent."""
        raise NotImplementedError

    def notify_new_buffer_size(self, size):
        """Debloating: the producer should use buffers of ``size`` bytes."""

    @property
    def num_queued_buffers(self):
        """Buffers received and not yet taken by the gate (debloating counts them in use)."""
        return 0

    @property
    def has_priority_event(self):
        """A priority event (unaligned barrier) is next to be taken."""
        return False

    @property
    def announced_backlog(self):
        """The producer's backlog as last announced (buffers not sent yet)."""
        return 0

    @property
    def is_released(self):
        return self._released

    def set_error(self, error):
        """Record an asynchronous failure and wake the gate so the reader sees it."""
        if self._error is None:
            self._error = error
        self.gate.notify_channel_non_empty(self)

    def check_error(self):
        if self._error is not None:
            raise fresh_error(self._error)

    def notify_channel_non_empty(self):
        self.gate.notify_channel_non_empty(self)

    def __repr__(self):
        return (
            f"{type(self).__name__}(#{self.channel_index}, {self.partition_id}"
            f"[{self.subpartition_index}])"
        )
