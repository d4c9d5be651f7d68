"""What PySpark tasks use: producers, consumers, and the PySpark integration.

    from client import PartitionWriter, PartitionReader, PartitionLocation
    from client import exchange_shuffle, release_exchange, exchange_hash   # needs pyspark

Every error is an ``ExchangeError``; the classes are re-exported here so task code can
catch them without importing the engine.
"""

from __future__ import annotations

from typing import Any

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.producer import AsyncPartitionWriter, PartitionWriter
from exchange.errors import (
    AuthenticationError,
    ConfigError,
    CorruptRecordError,
    ExchangeError,
    LocalProtocolError,
    PartitionError,
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    TransportError,
    UsageError,
    WriterClosedError,
)
from exchange.partition.result_partition_id import ResultPartitionID

__all__ = [
    "AsyncPartitionReader",
    "AsyncPartitionWriter",
    "AuthenticationError",
    "ConfigError",
    "CorruptRecordError",
    "ExchangeError",
    "LocalProtocolError",
    "PartitionError",
    "PartitionLocation",
    "PartitionNotFoundError",
    "PartitionReader",
    "PartitionReleasedError",
    "PartitionWriter",
    "ProducerFailedError",
    "ProtocolError",
    "ResultPartitionID",
    "TransportError",
    "UsageError",
    "WriterClosedError",
    "exchange_hash",
    "exchange_shuffle",
    "release_exchange",
]

_SPARK_NAMES = {"exchange_shuffle", "release_exchange", "exchange_hash"}


def __getattr__(name: str) -> Any:
    # The PySpark integration is imported lazily: the rest works without pyspark.
    if name in _SPARK_NAMES:
        from client import spark

        return getattr(spark, name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
