"""/metrics and /api/stats of a real daemon process (``python -m server``) that moved
known data: a producer task in this process wrote records into a pipelined partition
through the daemon's local endpoint, a consumer read them over TCP (the data port), late,
so the producer waited for buffers (back pressure). Every figure is checked against what
the tasks themselves counted, before and after the partition is released: a released
partition's bytes, buffers and back-pressure time stay in the totals (the daemon's
released-partitions bookkeeping), and /metrics says what /api/stats says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)

RECORDS = 3000
PAD = b"m" * 200


def _metrics(d: Any, **labels: str) -> dict[str, float]:
    """The samples of the daemon's /metrics with exactly these labels (none: unlabelled)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(d.http_get("/metrics").decode()):
        for s in family.samples:
            if s.labels == labels:
                out[s.name] = s.value
    return out


def _ours(st: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    return [p for p in st["partitions"]["items"] if p["dataset"] == dataset]


def test_a_real_daemon_reports_the_data_it_moved_and_keeps_it_after_the_release(
    start_daemon: Callable[..., Any],
) -> None:
    d = start_daemon("--segment-size", "4kb")
    dataset = "metrics-known"
    pid = ResultPartitionID(dataset, 0, 0)
    before = d.stats()
    assert before["totals"]["bytes_out"] == before["totals"]["bytes_in"] == 0
    assert before["data_port"]["connections"] == 0

    writers: list[PartitionWriter] = []
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket) as w:
                writers.append(w)
                # distinct payloads: a shared bytes object would be pickled once per batch
                w.emit_all((i, PAD + i.to_bytes(4, "big")) for i in range(RECORDS))
        except BaseException as e:
            errors.append(e)

    producer = threading.Thread(target=produce, name="producer", daemon=True)
    producer.start()
    try:
        # nobody reads yet: the partition's pool fills and the producer waits for credit.
        # Held for good once every segment in use is in the backlog: none is reserved for
        # the producer (credit it could still use), the pool is at its size.
        def held() -> dict[str, Any] | None:
            st = d.stats()
            mine = _ours(st, dataset)
            full = mine and mine[0]["out_pool_usage"] == 1.0
            return st if full and st["network"]["used_segments"] == mine[0]["backlog"] else None

        live = wait_for(held, 60, "the producer held: its partition's pool full of backlog")
        held_since = time.monotonic()
        (item,) = _ours(live, dataset)
        assert item["type"] == "pipelined" and not item["finished"]
        assert item["buffers_out"] == item["backlog"] > 0
        assert live["partitions"]["count"] == 1 and live["local"]["producers"] == 1
        assert live["totals"]["bytes_in"] == live["totals"]["bytes_out"] == item["bytes_out"]
        assert item["bytes_out"] < RECORDS * len(PAD)
        # /metrics while held (nothing moves): the partition's own series, by its labels
        part = _metrics(d, dataset=dataset, partition="0", attempt="0")
        assert part["exchange_partition_bytes_out_total"] == item["bytes_out"]
        assert part["exchange_partition_buffers_out_total"] == item["buffers_out"]
        assert part["exchange_out_pool_usage"] == 1.0
        assert part["exchange_backlog_buffers"] == item["backlog"]
        assert _metrics(d, type="pipelined")["exchange_partitions"] == 1
        assert producer.is_alive(), errors

        loc = PartitionLocation(pid, 0, d.data_address)  # over TCP, not the local socket
        with PartitionReader([loc]) as reader:
            held_for = time.monotonic() - held_since  # the producer waited at least this
            got = [tuple(r) for r in reader]
        producer.join(60)
        assert not producer.is_alive() and not errors, errors
    finally:
        producer.join(30)
    assert got == [(i, PAD + i.to_bytes(4, "big")) for i in range(RECORDS)]

    # what the producer task counted and what the consumer read
    (w,) = writers
    bytes_out, buffers_out = w.stats.bytes_out, w.stats.buffers_out
    assert bytes_out >= RECORDS * (len(PAD) + 4) and buffers_out > bytes_out // d.segment_size

    # a pipelined partition read to its end is released; its figures stay in the totals
    # (and the tasks' connections, which end on their own time, are gone)
    st = d.wait_stats(
        lambda s: (
            s["partitions"]["count"] == 0
            and s["data_port"]["connections"] == 0
            and s["local"]["producers"] == s["local"]["consumers"] == 0
        ),
        30,
    )
    totals = st["totals"]
    assert totals["bytes_in"] == bytes_out
    assert totals["bytes_out"] == bytes_out
    assert totals["buffers_out"] == buffers_out
    assert totals["partitions_created"] == 1 and totals["partitions_released"] == 1
    assert totals["partitions_failed"] == 0
    # the producer was held from before the pool was seen full until the reader read
    assert totals["back_pressured_seconds"] >= held_for > 0
    local = st["local"]
    assert (local["bytes_received"], local["buffers_received"]) == (bytes_out, buffers_out)
    assert local["producers"] == local["consumers"] == 0
    # every buffer went over TCP once, and the EndOfPartition event (one byte) after them
    port = st["data_port"]
    assert port["total_connections"] == 1 and port["rejected_connections"] == 0
    assert port["readers"] == 0
    assert port["buffers_sent_total"] == buffers_out + 1
    assert port["bytes_sent_total"] == bytes_out + 1

    # /metrics says the same
    m = _metrics(d)
    assert m["exchange_bytes_received_total"] == bytes_out
    assert m["exchange_buffers_received_total"] == buffers_out
    assert m["exchange_bytes_out_total"] == bytes_out
    assert m["exchange_buffers_out_total"] == buffers_out
    assert m["exchange_back_pressured_seconds_total"] == totals["back_pressured_seconds"]
    assert m["exchange_partitions_created_total"] == 1
    assert m["exchange_partitions_released_total"] == 1
    assert m["exchange_bytes_sent_total"] == bytes_out + 1
    assert m["exchange_buffers_sent_total"] == buffers_out + 1
    assert m["exchange_connections_accepted_total"] == 1
    assert m["exchange_connections"] == m["exchange_readers"] == 0
    assert m["exchange_producers"] == m["exchange_consumers"] == 0
    assert m["exchange_network_segments_used"] == 0
    d.wait_pool_whole()
