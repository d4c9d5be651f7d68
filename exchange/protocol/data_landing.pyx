# cython: language_level=3
"""Where a data-port client's BufferResponse payloads land, and their hand-off, compiled.

``DataLanding`` is the receive path of ``PartitionRequestClientConnection``
(``exchange.protocol.client_connection``): ``sink`` is the frame parser's body sink (a data
payload lands straight in a buffer its channel has credit for) and ``deliver`` hands the
items of one read to their channels in order: each landed payload becomes its buffer
(size, compression flag) given to its channel's ``on_buffer``, each message goes to the
connection's ``on_message``. Both are C calls into the compiled channel
(``exchange.consumer.remote_input_channel``): no Python frame per buffer.

Buffers taken for payloads not handed on yet are held in frame order (one read may
complete several frames); ``release_landing`` gives them back if the connection dies
first. ``accepting`` is False before the handshake and once the connection failed or
closed: a data frame then is read through the parser's scratch and dropped (or refused
by the connection's state). There is no Python version of this module.
"""

from collections import deque

from exchange.buffers.buffer cimport Buffer
from exchange.consumer.remote_input_channel cimport RemoteInputChannel
from exchange.memory.memory_segment cimport MemorySegment
from exchange.protocol.frame_parser cimport BufferResponseHeader, PayloadReceived

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError

__all__ = ["DataLanding"]

cdef object _DATA_BUFFER = DataType.DATA_BUFFER


cdef class DataLanding:
    """The landing of one connection's data payloads (``channels``: receiver id ->
    channel, the connection's own dict)."""

    def __init__(self, address, dict channels):
        self.address = address
        self.channels = channels
        self._landing = deque()
        self.accepting = False

    def sink(self, BufferResponseHeader header):
        """The frame parser's body sink: where a BufferResponse payload lands (a credited
        buffer of its channel), or None (an event, or a receiver no longer here)."""
        if header.data_type is not _DATA_BUFFER or not self.accepting:
            return None  # events are decoded whole; a frame before the handshake is refused
        ch = self.channels.get(header.receiver_id)
        if ch is None:
            return None  # cancelled meanwhile: read through scratch, then dropped
        cdef RemoteInputChannel channel = ch
        cdef Buffer buf = channel.request_buffer()
        if buf is None:
            raise ProtocolError(
                f"daemon {self.address} sent a buffer to receiver {header.receiver_id} "
                "without credit"
            )
        cdef MemorySegment seg = <MemorySegment>buf._segment
        if header.size > seg._size:
            buf.release()
            raise ProtocolError(
                f"buffer of {header.size} bytes exceeds the receiver's {seg._size}-byte "
                "segments; all daemons and clients must use the same segment size"
            )
        self._landing.append((ch, buf))
        return seg.view()[: header.size]

    def deliver(self, list items, on_message):
        """Hand one read's items on in order: payloads to their channels, messages to
        ``on_message``. An error (raised by either) stops the delivery; what is left
        stays landed until ``release_landing``."""
        cdef RemoteInputChannel ch
        cdef Buffer buf
        cdef BufferResponseHeader h
        landing = self._landing
        for item in items:
            if type(item) is PayloadReceived:
                ch, buf = landing.popleft()
                h = <BufferResponseHeader>(<PayloadReceived>item).header
                buf._size = h.size  # checked against the segment by ``sink``
                buf.compressed = h.compressed
                ch.on_buffer(buf, h.sequence_number, h.backlog)
            else:
                on_message(item)

    @property
    def num_landing(self):
        """Buffers taken for payloads not handed to their channel yet."""
        return len(self._landing)

    def release_landing(self):
        """Give back the buffers of payloads not handed on (the connection died)."""
        landing = self._landing
        while landing:
            (<Buffer>landing.popleft()[1]).release()
