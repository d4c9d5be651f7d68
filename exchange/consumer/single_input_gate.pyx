"""SingleInputGate: one consumer's set of input channels, read as one stream.

Channels with data wait in ``inputChannelsWithData``, each at most once. A channel is put
there when its producer side says data became available (first finished buffer, flush,
event) and is re-queued after a poll that reported more data available, so a reader
never busy-polls an empty channel. Events are decoded here; EndOfPartition retires its
channel, and the gate ends once every channel did.

A channel that received a priority event (an unaligned checkpoint barrier) goes to the
head of the queue, behind channels queued for earlier priority events only (Flink's
``notifyPriorityEvent``), so the barrier is returned before anything else. The data
buffers it overtook in its channel come after it with ``BufferOrEvent.overtaken_by``
naming the checkpoints whose input channel state they belong to.

Debloating (Flink's ``SingleInputGate.triggerDebloating``): with a ``GateDebloater`` set,
the gate reports every buffer and event it returns, and when it runs empty and has data
again (time counts towards throughput only while data flows); ``trigger_debloating(now)``,
called by the reader's timer, announces a new buffer size to every open channel.

Compiled (a ``cdef class``, fields in ``single_input_gate.pxd``): a channel's queueing
(``notify_channel_non_empty``) and the pump's ``poll_data`` are C code calling the
compiled channels. ``single_input_gate.pyi`` types it for mypy. There is no Python version
of this module.
"""

import asyncio
from collections import deque, namedtuple

from exchange.consumer.input_channel cimport InputChannel

from exchange.errors import IllegalStateError, UsageError
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.memory.availability import AvailabilityHelper

__all__ = ["BufferOrEvent", "SingleInputGate"]


BufferOrEvent = namedtuple(
    "BufferOrEvent",
    ["buffer", "event", "channel_index", "more_available", "overtaken_by"],
    defaults=((),),
    module=__name__,  # (a compiled module runs no frame namedtuple could read it from)
)
BufferOrEvent.__doc__ = """A data buffer (``event`` None) or a decoded event (``buffer``
None).

``overtaken_by``: for a data buffer, the ids of the unaligned checkpoints whose barrier
(already returned) overtook it in its channel: it belongs to their input channel state.
"""


cdef class SingleInputGate:
    """Reads the channels of one consumer; owns the floating buffer pool (if any)."""

    def __init__(self, name="gate", buffer_pool=None):
        self.name = name
        self.buffer_pool = buffer_pool  # floating buffers for remote channels
        self.channels = []
        self._with_data = deque()
        self._num_priority_channels = 0  # the head of ``_with_data`` queued for priority
        self._num_finished = 0
        self._availability = AvailabilityHelper(available=False)
        self._requested = False
        self._closed = False
        self.debloater = None
        self._idle = True  # debloating: the gate has nothing to return (time stops)
        #: False when the reader reports idleness itself (a reader that hands buffers on
        #: to a task thread: the task is idle only when that hand-off is empty too).
        self.reports_idle = True

    def set_debloater(self, debloater):
        """Debloat this gate's channels (before or after partitions are requested)."""
        if self._closed:
            raise IllegalStateError(f"input gate {self.name} is closed")
        self.debloater = debloater
        debloater.set_open_channels(self.num_channels - self._num_finished)

    def trigger_debloating(self, now, extra_queued=0):
        """Run the debloater if due; a new size goes to every open channel and is returned.

        ``extra_queued``: buffers the gate returned that the task has not consumed yet
        (the synchronous reader's hand-off), counted as in use like queued ones.
        """
        d = self.debloater
        if d is None or self._closed:
            return None
        queued = extra_queued
        backlog = 0
        for ch in self.channels:
            if not ch.finished:
                queued += ch.num_queued_buffers
                backlog += ch.announced_backlog
        size = d.tick(now, queued, backlog)
        if size is not None:
            for ch in self.channels:
                if not ch.finished and not ch.is_released:
                    ch.notify_new_buffer_size(size)
        return size

    def set_input_channels(self, channels):
        if self._requested:
            raise IllegalStateError("channels must be set before partitions are requested")
        for i, ch in enumerate(channels):
            if ch.channel_index != i or ch.gate is not self:
                raise UsageError(f"channel {ch!r} is not channel {i} of this gate")
        self.channels = list(channels)

    @property
    def num_channels(self):
        return len(self.channels)

    async def request_partitions(self):
        """Request every channel's subpartition; on failure release everything and raise."""
        if self._requested:
            return
        self._requested = True
        if not self.channels:
            self._availability.set_available()
            return
        try:
            await asyncio.gather(*(ch.request_subpartition() for ch in self.channels))
        except BaseException:
            self.close()
            raise

    # -- availability --------------------------------------------------------------------

    def notify_channel_non_empty(self, InputChannel channel):
        if channel.queued or channel.finished or self._closed:
            return
        channel.queued = True
        self._with_data.append(channel)
        self._on_queued()

    def notify_priority_event(self, InputChannel channel):
        """The channel has a priority event at its head: queue it before the others."""
        if channel.queued_with_priority or channel.finished or self._closed:
            return
        if channel.queued:
            self._with_data.remove(channel)
        self._queue_priority(channel)
        self._on_queued()

    cdef void _queue_priority(self, InputChannel channel) except *:
        channel.queued = True
        channel.queued_with_priority = True
        self._with_data.insert(self._num_priority_channels, channel)
        self._num_priority_channels += 1

    cdef void _dequeued(self, InputChannel channel) except *:
        channel.queued = False
        if channel.queued_with_priority:
            channel.queued_with_priority = False
            self._num_priority_channels -= 1

    cdef void _on_queued(self) except *:
        if self._idle:
            self._idle = False
            if self.debloater is not None and self.reports_idle:
                self.debloater.on_gate_non_empty()
        self._availability.set_available()

    @property
    def is_finished(self):
        return self._num_finished == len(self.channels)

    def get_available_future(self):
        return self._availability.get_available_future()

    # -- reading -------------------------------------------------------------------------

    def poll_next(self):
        """The next buffer or event without waiting; None if nothing is ready."""
        if self._closed:
            raise IllegalStateError(f"input gate {self.name} is closed")
        cdef InputChannel ch
        queue = self._with_data
        while queue:
            ch = queue.popleft()
            self._dequeued(ch)
            result = ch.get_next_buffer()
            if result is None:
                continue
            more = result.more_available
            if more:
                if ch.has_priority_event:
                    self._queue_priority(ch)
                else:
                    ch.queued = True
                    queue.append(ch)
            buf = result.buffer
            if self.debloater is not None:
                self.debloater.on_data(buf.size)
            if buf.is_buffer:
                return BufferOrEvent(
                    buf, None, ch.channel_index, more or bool(queue), result.overtaken_by
                )
            try:
                event = EventSerializer.from_buffer(buf)
            finally:
                buf.release()
            if isinstance(event, EndOfPartitionEvent):
                self._retire(ch)
            return BufferOrEvent(None, event, ch.channel_index, bool(queue))
        if not self.is_finished:
            self._availability.set_unavailable()
        if not self._idle:
            self._idle = True
            if self.debloater is not None and self.reports_idle:
                self.debloater.on_gate_empty()
        return None

    def poll_data(self, Py_ssize_t limit):
        """Up to ``limit`` data buffers of the first channel with data, taken at once, and
        that channel's index: what ``poll_next`` would return for them one by one (a
        channel with more goes to the back of the queue). None when nothing is queued
        or the next thing must go through ``poll_next`` (an event, a priority event, a
        buffer a priority barrier overtook, nothing received)."""
        if self._closed:
            raise IllegalStateError(f"input gate {self.name} is closed")
        queue = self._with_data
        if not queue or self._num_priority_channels:
            return None
        cdef InputChannel ch = queue[0]
        taken, more = ch.take_data_buffers(limit)
        if not taken:
            return None
        if not more:
            self._dequeued(queue.popleft())
        elif len(queue) > 1:
            queue.rotate(-1)  # round robin, as poll_next re-queues a channel with more
        debloater = self.debloater
        if debloater is not None:
            for buf in taken:
                debloater.on_data(buf.size)
        return ch.channel_index, taken

    async def get_next(self):
        """The next buffer or event; None once every channel delivered EndOfPartition."""
        while True:
            boe = self.poll_next()
            if boe is not None:
                return boe
            if self.is_finished:
                return None
            await self._availability.get_available_future()

    cdef void _retire(self, InputChannel ch) except *:
        if not ch.finished:
            ch.finished = True
            self._num_finished += 1
            if ch.queued:
                self._dequeued(ch)
                self._with_data.remove(ch)
            ch.release_all_resources()
            if self.debloater is not None:
                self.debloater.set_open_channels(len(self.channels) - self._num_finished)
        if self.is_finished:
            self._availability.set_available()

    def resume_consumption(self, channel_index):
        """After an aligned barrier: let the channel's producer send again."""
        ch = self.channels[channel_index]
        if not ch.finished:
            ch.resume_consumption()

    def close(self):
        """Release every channel and the floating pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.debloater is not None:
            self.debloater.close()
        for ch in self.channels:
            ch.queued = False
            ch.queued_with_priority = False
            ch.release_all_resources()
        self._with_data.clear()
        self._num_priority_channels = 0
        if self.buffer_pool is not None:
            self.buffer_pool.destroy()
        self._availability.set_available()

    @property
    def is_closed(self):
        return self._closed

    def __repr__(self):
        return (
            f"SingleInputGate({self.name}, {len(self.channels)} channels, "
            f"finished={self._num_finished}, queued={len(self._with_data)})"
        )
