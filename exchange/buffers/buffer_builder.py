"""Old home of BufferConsumer (BufferBuilder went with the old write path).

Import ``BufferConsumer`` from ``exchange.buffers.buffer_consumer`` (or
``exchange.buffers``); this module only re-exports it for the modules not yet moved.
"""

from __future__ import annotations

from exchange.buffers.buffer_consumer import BufferConsumer

__all__ = ["BufferConsumer"]
