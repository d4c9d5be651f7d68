"""Record codecs: records to a byte stream spanning buffers (cut by the RecordWriter), and back."""

from __future__ import annotations

from exchange.serialization.pickle_batch import (
    PickleBatchCodec,
    PickleBatchDecoder,
    PickleBatchEncoder,
)
from exchange.serialization.record_codec import (
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

__all__ = [
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
    "RecordEncoder",
    "default_codec",
]
