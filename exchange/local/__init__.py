"""The local endpoint's producer protocol, sans I/O (daemon side: ``ProducerSession``)."""

from __future__ import annotations

from exchange.local.producer_session import (
    DEFAULT_PRODUCER_CREDIT,
    ProducerSession,
    ProducerSessionState,
)

__all__ = ["DEFAULT_PRODUCER_CREDIT", "ProducerSession", "ProducerSessionState"]
