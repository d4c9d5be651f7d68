# Types of the compiled outbound batch (exchange/network/outbound.pyx), for mypy --strict.
from collections import deque
from collections.abc import Iterable
from typing import Any

from exchange.buffers.buffer import Buffer
from exchange.memory.network_buffer_pool import NetworkBufferPool

__all__ = ["OutboundBatch", "buffer_response_header"]

def buffer_response_header(
    receiver_id: int,
    sequence_number: int,
    backlog: int,
    data_type: int,
    compressed: bool,
    payload_size: int,
) -> bytes: ...

class OutboundBatch:
    """The output of one connection's current callback, and its buffers in flight."""

    out: list[bytes | memoryview]
    out_bytes: int
    buffers: list[tuple[int, int, Buffer]]
    bytes_written: int
    corked: int
    descriptors: list[bytes]
    established: bool
    arena: NetworkBufferPool | None
    held: dict[int, list[tuple[int, Buffer]]]
    num_held: int
    bytes_shared: int
    @property
    def in_flight(self) -> deque[tuple[int, int, Buffer]]: ...
    def __init__(self, conn: Any, transport: Any, batch_bytes: int) -> None: ...
    def send_buffer(
        self, receiver_id: int, sequence_number: int, backlog: int, buf: Buffer
    ) -> None: ...
    def frame_descriptors(self) -> None: ...
    def give_back(self, segments: Iterable[int]) -> None: ...
    def recycle(self, buffers: list[tuple[int, int, Buffer]]) -> None: ...
    def reap(self, sent: int) -> bool: ...
