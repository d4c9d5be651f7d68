"""Server-side flow control, sans I/O: credit-based view readers and the request queue."""

from __future__ import annotations

from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.network.partition_request_queue import OutboundChannel, PartitionRequestQueue

__all__ = [
    "CreditBasedSequenceNumberingViewReader",
    "OutboundChannel",
    "PartitionRequestQueue",
]
