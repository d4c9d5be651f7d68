"""BoundedBlockingSubpartition: written once into BoundedData, then read many times.

Each finished buffer is written out at once and its segment recycled, so the partition's
memory stays at one buffer per subpartition however much is written. Readers may only
attach once the partition is finished (before that a request gets PartitionNotReadyError,
a per-channel error); each gets its own position in the data. The storage is deleted when
the partition is released and the last reader is gone.

Lifecycles (``states.py``): the subpartition WRITING -> FINISHED -> RELEASED, each reader
READING -> CONSUMED (returned EndOfPartition) -> RELEASED.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exchange.buffers.buffer_consumer import BufferConsumer
from exchange.errors import (
    PartitionDataLostError,
    PartitionNotReadyError,
    PartitionReleasedError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.partition.bounded_blocking_reader import BoundedBlockingSubpartitionReader
from exchange.partition.bounded_data import BoundedData, ReadMemory
from exchange.partition.states import (
    SUBPARTITION_TRANSITIONS,
    SubpartitionState,
    transition,
)
from exchange.partition.subpartition_view import BufferAvailabilityListener

if TYPE_CHECKING:
    from exchange.partition.result_partition import ResultPartition

__all__ = ["BoundedBlockingSubpartition", "BoundedBlockingSubpartitionReader"]


class BoundedBlockingSubpartition:
    """One blocking subpartition."""

    def __init__(self, index: int, parent: ResultPartition, data: BoundedData) -> None:
        self.index = index
        self._parent = parent
        self._data = data
        self.state = SubpartitionState.WRITING
        self._disposed = False  # the data's storage is closed (released, no reader left)
        self._failure: BaseException | None = None
        self._readers: set[BoundedBlockingSubpartitionReader] = set()
        self.num_data_buffers = 0
        self.total_bytes = 0
        self.total_buffers = 0
        self.buffer_size = parent.segment_size

    def _transition(self, to: SubpartitionState) -> None:
        self.state = transition(SUBPARTITION_TRANSITIONS, self.state, to, self)

    @property
    def is_finished(self) -> bool:
        return self.state is SubpartitionState.FINISHED

    @property
    def is_released(self) -> bool:
        return self.state is SubpartitionState.RELEASED

    @property
    def failure_cause(self) -> BaseException | None:
        return self._failure

    @property
    def data(self) -> BoundedData:
        return self._data

    # -- writing -------------------------------------------------------------------------

    def add(self, consumer: BufferConsumer) -> bool:
        """Write a complete buffer out (its segment is recycled at once); False (and the
        consumer closed) when finished or released."""
        if self.state is not SubpartitionState.WRITING:
            consumer.close()
            return False
        self._write_and_close(consumer)
        return True

    def flush(self) -> None:
        """Nothing to do: every buffer is written out as it is added."""

    def _write_and_close(self, consumer: BufferConsumer) -> None:
        try:
            buf = consumer.build()
            try:
                if buf.size > 0 or not buf.is_buffer:
                    self._data.write_buffer(buf)
                    self.total_bytes += buf.size
                    self.total_buffers += 1
                    if buf.is_buffer:
                        self.num_data_buffers += 1
            finally:
                buf.release()
        finally:
            consumer.close()

    def finish(self) -> None:
        if self.state is SubpartitionState.FINISHED:
            return
        if self.state is SubpartitionState.RELEASED:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        eop = EventSerializer.to_buffer(EndOfPartitionEvent.INSTANCE)
        try:
            self._data.write_buffer(eop)
        finally:
            eop.release()
        self._data.finish_write()
        self._transition(SubpartitionState.FINISHED)

    def restore_finished(self, total_bytes: int, total_buffers: int, data_buffers: int) -> None:
        """Take over data a previous daemon finished (its file is already complete)."""
        self.total_bytes = total_bytes
        self.total_buffers = total_buffers
        self.num_data_buffers = data_buffers
        self._transition(SubpartitionState.FINISHED)

    def keep_data(self) -> None:
        """Leave the data's file on disk when released (a daemon shutting down)."""
        self._data.keep_file()

    def release(self, cause: BaseException | None = None) -> None:
        if self.state is SubpartitionState.RELEASED:
            return
        self._transition(SubpartitionState.RELEASED)
        self._failure = cause
        readers = list(self._readers)
        for reader in readers:
            reader.notify_listener()  # it polls and finds the partition released
        if not self._readers:
            self._dispose()

    def _dispose(self) -> None:
        if not self._disposed:
            self._disposed = True
            self._data.close()

    # -- reading -------------------------------------------------------------------------

    def create_read_view(
        self, listener: BufferAvailabilityListener, read_memory: ReadMemory | None = None
    ) -> BoundedBlockingSubpartitionReader:
        """A new reader from the start of the data; its data buffers go into
        ``read_memory`` while it lends segments (``bounded_data``)."""
        if self.state is SubpartitionState.RELEASED:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        if self.state is not SubpartitionState.FINISHED:
            raise PartitionNotReadyError(
                f"blocking subpartition {self.index} of {self._parent.partition_id} is not "
                "finished yet; blocking partitions are read after they are fully written",
                self._parent.partition_id,
            )
        account = self._parent.reader_account
        memory = self._data.reader_memory
        if account is not None:  # LimitExceededError: the application's readers are at a limit
            account.acquire(memory, self._parent.partition_id)
        try:
            try:
                data_reader = self._data.create_reader(read_memory, account)
            except PartitionDataLostError as e:  # the file was replaced or changed
                raise PartitionDataLostError(str(e), self._parent.partition_id) from None
            try:  # it reads its first buffer at once: a corrupt file raises here
                reader = BoundedBlockingSubpartitionReader(self, data_reader, listener)
            except BaseException:
                data_reader.close()  # its descriptor and read segments
                raise
        except BaseException:
            if account is not None:
                account.release(memory)
            raise
        reader.memory = memory
        self._readers.add(reader)
        listener.notify_data_available()
        return reader

    def _on_reader_released(self, reader: BoundedBlockingSubpartitionReader) -> None:
        if reader in self._readers:
            self._readers.discard(reader)
            account = self._parent.reader_account
            if account is not None:
                account.release(reader.memory)
        if self.state is SubpartitionState.RELEASED and not self._readers:
            self._dispose()

    @property
    def num_readers(self) -> int:
        return len(self._readers)

    def __repr__(self) -> str:
        return (
            f"BoundedBlockingSubpartition(#{self.index}, buffers={self.total_buffers}, "
            f"readers={len(self._readers)}, {self.state.value})"
        )
