"""Overdraft buffers on a real daemon process: a producer task whose partition's pool is
exhausted (nobody reads) while it pushes a record that spans many buffers finishes that
record with overdraft segments (``--max-overdraft-buffers-per-partition``), shown in
/api/stats and /metrics, once no grant came for ``OVERDRAFT_ASK_DELAY``; the record reads
back whole and every segment comes back. With no overdraft (0), or before that delay
passed, the same producer waits for a consumer in the middle of its record."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from client import local_connection
from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(180)

SEGMENT = 4096
#: a partition of one subpartition gets a pool of at most 16 segments (server/daemon.py)
POOL = 16
#: one record of 20 segments and a bit: it spans 21 buffers, 5 beyond the pool
RECORD = b"r" * (20 * SEGMENT)


def _mine(st: dict[str, Any], dataset: str) -> dict[str, Any] | None:
    items = [p for p in st["partitions"]["items"] if p["dataset"] == dataset]
    return items[0] if items else None


def _produce(socket: str, pid: ResultPartitionID, done: threading.Event, errors: list[Any]) -> None:
    try:
        with PartitionWriter(pid, 1, blocking=False, daemon_socket=socket) as w:
            w.emit_to(0, 0)  # a small record first: the big one starts inside a buffer
            w.emit_to(RECORD, 0)
            w.flush()
        done.set()
    except BaseException as e:
        errors.append(e)


def _held_mid_record(d: Any, dataset: str) -> dict[str, Any]:
    """The stats once the pool is full of the record's first buffers (nobody reads)."""

    def held() -> dict[str, Any] | None:
        st = d.stats()
        p = _mine(st, dataset)
        return st if p is not None and p["backlog"] >= POOL else None

    st: dict[str, Any] = wait_for(held, 60, "the producer held mid-record by a full pool")
    return st


@pytest.mark.parametrize(
    ("overdraft", "ask_delay"),
    [(5, None), (0, None), (5, 3600.0)],
    ids=["overdraft", "no-overdraft", "grant-before-the-ask"],
)
def test_a_writer_with_an_exhausted_pool_finishes_its_record_via_overdraft(
    start_daemon: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    overdraft: int,
    ask_delay: float | None,
) -> None:
    """``grant-before-the-ask``: a push out of credit inside a record waits
    ``OVERDRAFT_ASK_DELAY`` for a grant before it asks for overdraft (a record is a whole
    encoded batch here, so nearly every stall is inside one). With the delay never passing
    the writer sits mid-record with overdraft available and takes none; the reader then
    frees segments and the record ends on their grants. (The old writer asked at once: it
    took overdraft before any reader came.)"""
    if ask_delay is not None:
        monkeypatch.setattr(local_connection, "OVERDRAFT_ASK_DELAY", ask_delay)
    takes_overdraft = overdraft > 0 and ask_delay is None
    d = start_daemon(
        "--segment-size", "4kb", "--max-overdraft-buffers-per-partition", str(overdraft)
    )
    dataset = f"overdraft-{overdraft}-{ask_delay}"
    pid = ResultPartitionID(dataset, 0, 0)
    done = threading.Event()
    errors: list[Any] = []
    producer = threading.Thread(
        target=_produce, args=(d.local_socket, pid, done, errors), daemon=True
    )
    producer.start()
    try:
        if takes_overdraft:
            # nobody reads, yet the whole record (and the writer's close) gets through
            assert done.wait(60) and not errors, errors
            st = d.wait_stats(lambda s: (p := _mine(s, dataset)) is not None and p["finished"], 30)
            item = _mine(st, dataset)
            assert item is not None
            over = st["network"]["overdraft_segments"]
            assert 0 < over <= overdraft
            assert item["buffers_out"] == POOL + over  # the pool's own and the overdraft
            assert st["local"]["overdraft_granted"] == over
            assert d.metric("exchange_network_segments_overdraft") == over
            assert d.metric("exchange_overdraft_buffers_total") == over
            assert (
                st["network"]["used_segments"] + st["network"]["available_segments"]
                == (st["network"]["total_segments"])
            )
        else:
            # the pool is full of the record's first buffers and the producer waits,
            # mid-record, for a consumer (no overdraft, or a grant it waits for first)
            st = _held_mid_record(d, dataset)
            item = _mine(st, dataset)
            assert item is not None and item["backlog"] == POOL
            assert st["network"]["overdraft_segments"] == 0
            assert st["local"]["overdraft_granted"] == 0
            assert not done.is_set() and producer.is_alive()
        loc = PartitionLocation(pid, 0, d.data_address)
        with PartitionReader([loc]) as reader:
            got = list(reader)
        assert done.wait(60) and not errors, errors
    finally:
        producer.join(30)
    assert got == [0, RECORD]
    st = d.wait_pool_whole(30)
    assert st["network"]["overdraft_segments"] == 0
    if not takes_overdraft:  # the reader's grants ended the record
        assert st["local"]["overdraft_granted"] == 0
