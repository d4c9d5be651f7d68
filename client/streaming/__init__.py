"""The streaming runtime's driver-side pieces (checkpoint storage, ...)."""

from __future__ import annotations

from client.streaming.checkpoint_storage import CheckpointMetadata, CheckpointStorage

__all__ = ["CheckpointMetadata", "CheckpointStorage"]
