"""Fixtures of the conformance suites: a real daemon in this process, the records.

``daemon``: an ``ExchangeDaemon`` started on the test's event loop (data port and HTTP on
port 0 of 127.0.0.1, its local Unix socket in a short temporary directory). Being in this
process, a test can reach its partitions directly (in-process writers and readers) and over
its data port and socket (the clients of ``client/``, as tasks use them). At teardown it
shuts down and must report its pool whole. Synchronous clients (``PartitionWriter``,
``PartitionReader``) run on a worker thread (``asyncio.to_thread``): they block, and the
daemon runs on the loop they would block.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator

import pytest_asyncio

from server.config import DaemonConfig
from server.daemon import ExchangeDaemon

#: Small segments, so that records span buffers and a few KiB of data fill a pool.
SEGMENT_SIZE = 4096
SEGMENTS = 512


@pytest_asyncio.fixture
async def daemon() -> AsyncIterator[ExchangeDaemon]:
    spill = tempfile.mkdtemp(prefix="xc-")  # short: a Unix socket path has ~100 bytes
    config = DaemonConfig(
        host="127.0.0.1",
        data_port=0,
        http_port=0,
        network_memory=SEGMENTS * SEGMENT_SIZE,
        segment_size=SEGMENT_SIZE,
        spill_dir=spill,
        log_level="WARNING",
        # readers here take these (ReaderOptions.from_daemon): partitions may be requested
        # before their producer registered them; a small first wait, and ~5 s in all (a
        # loaded machine can take more than 70 ms to connect a producer)
        partition_request_backoff_initial=0.01,
        partition_request_backoff_max=2.56,
    )
    d = ExchangeDaemon(config)
    try:
        await d.start()
        yield d
    finally:
        whole = await d.shutdown(grace=5.0)
        shutil.rmtree(spill, ignore_errors=True)
    assert whole, "the daemon's network pool was not whole at shutdown"


def daemon_pool_whole(d: ExchangeDaemon) -> bool:
    """Every segment back in the daemon's pool and no partition's pool left."""
    return d.network_pool.is_whole()
