"""Record serialization: records to a byte stream spanning buffers, and back."""

from __future__ import annotations

from exchange.serialization.codec import (
    DEFAULT_MAX_RECORD_SIZE,
    BytesCodec,
    BytesLike,
    FramedCodec,
    MsgpackCodec,
    PickleCodec,
    RecordCodec,
    RecordDecoder,
    RecordEncoder,
    default_codec,
)
from exchange.serialization.pickle_batch import (
    PickleBatchCodec,
    PickleBatchDecoder,
    PickleBatchEncoder,
)
from exchange.serialization.record_deserializer import RecordDeserializer
from exchange.serialization.spanning_record_serializer import (
    DEFAULT_INITIAL_CAPACITY,
    SerializationResult,
    SpanningRecordSerializer,
)

__all__ = [
    "DEFAULT_INITIAL_CAPACITY",
    "DEFAULT_MAX_RECORD_SIZE",
    "BytesCodec",
    "BytesLike",
    "FramedCodec",
    "MsgpackCodec",
    "PickleBatchCodec",
    "PickleBatchDecoder",
    "PickleBatchEncoder",
    "PickleCodec",
    "RecordCodec",
    "RecordDecoder",
    "RecordDeserializer",
    "RecordEncoder",
    "SerializationResult",
    "SpanningRecordSerializer",
    "default_codec",
]
