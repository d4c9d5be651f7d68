"""The exchange daemon: asyncio servers around the engine in ``exchange``."""
