"""The exchange engine: buffer pools, buffers, serialization, partitions, gates, protocol.

Sans-I/O: nothing in this package opens a socket. ``server`` and ``client`` drive it.
All engine objects are confined to one thread (one asyncio event loop); they take no locks.
"""

from __future__ import annotations

__version__ = "0.1.0"
