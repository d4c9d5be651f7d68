"""Server-side flow control, sans I/O: credit-based view readers, the request queue, and
the server connection that drives them."""

from __future__ import annotations

from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.network.partition_request_queue import OutboundChannel, PartitionRequestQueue
from exchange.network.server_connection import (
    DATA_PORT_MESSAGES,
    ServerConnection,
    ServerConnectionSettings,
    ServerConnectionState,
    ServerConnectionStatistics,
)

__all__ = [
    "DATA_PORT_MESSAGES",
    "CreditBasedSequenceNumberingViewReader",
    "OutboundChannel",
    "PartitionRequestQueue",
    "ServerConnection",
    "ServerConnectionSettings",
    "ServerConnectionState",
    "ServerConnectionStatistics",
]
