"""A typed error a task receives names its partition and its daemon once each, however
many hands its cause passed through (producer task -> daemon -> released partition ->
ErrorResponse -> reader)."""

from __future__ import annotations

from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.errors import ProducerFailedError
from exchange.partition import ResultPartitionID


def test_a_failed_producer_reaches_the_reader_named_once(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("named-once", partition_index=0, attempt_id=1)
    with (
        pytest.raises(RuntimeError, match="boom"),
        PartitionWriter(pid, 2, blocking=True, daemon_socket=d.local_socket) as w,
    ):
        w.emit((1, 2))
        raise RuntimeError("boom")
    with pytest.raises(ProducerFailedError) as info:
        list(PartitionReader([PartitionLocation(pid, 0, d.data_address)]))
    text = str(info.value)
    assert text.count(str(pid)) == 1, text
    assert text.count(d.data_address) == 1, text
    assert text.count("boom") == 1 and "[remote PRODUCER_FAILED]" in text, text
    assert info.value.partition_id == pid and info.value.address == d.data_address
    d.wait_pool_whole()
