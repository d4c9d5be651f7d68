# Types of the compiled framing (exchange/serialization/framing.pyx), for mypy --strict.
from collections.abc import Iterator
from typing import Any, Final

from exchange.errors import CorruptRecordError

__all__ = [
    "ITEM_DATA",
    "ITEM_DRAINED",
    "ITEM_OVERTAKEN",
    "SCRATCH_KEEP",
    "DecoderBase",
    "LengthPrefixedDecoder",
    "feed_batch",
]

SCRATCH_KEEP: Final[int]

class DecoderBase:
    """Delivery of decoded records and of a deferred error."""

    _ready: list[Any]
    _error: CorruptRecordError | None
    def __init__(self) -> None: ...
    def take(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...
    def _fail(self, error: CorruptRecordError) -> None: ...

class LengthPrefixedDecoder(DecoderBase):
    """Frames of ``u32 length | payload``, each payload handed to ``_deliver``."""

    def __init__(self, max_record_size: int, *, int_pairs: bool = False) -> None: ...
    @property
    def _frame(self) -> bytearray | None: ...
    @property
    def _scratch(self) -> bytearray: ...
    @property
    def has_partial_record(self) -> bool: ...
    @property
    def buffered_bytes(self) -> int: ...
    def unconsumed_bytes(self) -> bytes: ...
    def feed(self, data: bytes | bytearray | memoryview) -> None: ...
    def clear(self) -> None: ...
    def _deliver(self, payload: memoryview) -> None: ...

ITEM_DATA: Final[int]
ITEM_OVERTAKEN: Final[int]
ITEM_DRAINED: Final[int]

def feed_batch(
    decoders: list[Any], ended: set[int], batch: list[tuple[int, int, Any]], out: list[Any]
) -> int: ...
