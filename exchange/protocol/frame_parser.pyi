# Types of the compiled frame parser (exchange/protocol/frame_parser.pyx), for mypy --strict.
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

from exchange.errors import ProtocolError
from exchange.protocol.codec import DataFrameSpec
from exchange.protocol.messages import DataType, Message

DEFAULT_READ_AHEAD: Final[int]

class BufferResponseHeader:
    """The fixed fields of a ``BufferResponse``, checked; ``size`` is the payload's."""

    @property
    def receiver_id(self) -> int: ...
    @property
    def sequence_number(self) -> int: ...
    @property
    def backlog(self) -> int: ...
    @property
    def data_type(self) -> DataType: ...
    @property
    def compressed(self) -> bool: ...
    @property
    def size(self) -> int: ...
    def __init__(
        self,
        receiver_id: int,
        sequence_number: int,
        backlog: int,
        data_type: DataType,
        compressed: bool,
        size: int,
    ) -> None: ...

def parse_buffer_response(prefix: memoryview, payload_size: int) -> BufferResponseHeader: ...

class PayloadReceived:
    """A data frame whose payload landed in the view its body sink returned."""

    @property
    def header(self) -> Any: ...
    @property
    def payload(self) -> memoryview: ...
    def __init__(self, header: Any, payload: memoryview) -> None: ...

class InPlaceFrameDecoder:
    def __init__(
        self,
        max_frame_size: int = ...,
        *,
        body_sink: Callable[[Any], memoryview | None] | None = None,
        data_frames: Mapping[int, DataFrameSpec] | None = None,
        accept: Collection[int] | None = None,
        read_ahead: int = ...,
    ) -> None: ...
    @property
    def bytes_received(self) -> int: ...
    @property
    def max_frame_size(self) -> int: ...
    @property
    def error(self) -> ProtocolError | None: ...
    @property
    def buffered(self) -> int: ...
    @property
    def landing(self) -> bool: ...
    def get_buffer(self, sizehint: int = -1) -> memoryview: ...
    def buffer_updated(self, nbytes: int) -> list[Message | PayloadReceived]: ...
    def feed(self, data: bytes | bytearray | memoryview) -> list[Message | PayloadReceived]: ...
    def abort(self, error: ProtocolError | None = None) -> None: ...
