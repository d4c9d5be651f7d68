"""What a LocalBufferPool reports (``stats``) and the check of its overdraft limit.

Plain Python beside the compiled pool (``local_buffer_pool.pyx``), which re-exports both.
"""

from __future__ import annotations

from typing import NamedTuple

from exchange.errors import UsageError

__all__ = ["LocalBufferPoolStats", "check_overdraft_limit"]


class LocalBufferPoolStats(NamedTuple):
    num_required: int
    max_segments: int
    current_pool_size: int
    num_requested: int
    num_available: int
    num_listeners: int
    #: segments taken beyond the pool's size to finish a record, now in use
    num_overdraft: int = 0
    max_overdraft: int = 0
    #: overdraft segments taken since the pool was created
    overdraft_taken: int = 0

    @property
    def usage(self) -> float:
        """Segments in use / current size (Flink's in/outPoolUsage)."""
        in_use = self.num_requested - self.num_available
        return in_use / self.current_pool_size if self.current_pool_size else 0.0


def check_overdraft_limit(max_overdraft_buffers: object) -> None:
    """UsageError unless ``max_overdraft_buffers`` is an int >= 0."""
    if (
        not isinstance(max_overdraft_buffers, int)
        or isinstance(max_overdraft_buffers, bool)
        or max_overdraft_buffers < 0
    ):
        raise UsageError(
            f"max_overdraft_buffers must be an int >= 0, got {max_overdraft_buffers!r}"
        )
