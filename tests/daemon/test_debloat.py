"""Buffer debloating through a real daemon: the consumer's gate measures its throughput,
announces NewBufferSize, the daemon forwards it to the producer task, whose writer cuts
its new buffers at that size. A throttled consumer shrinks the buffers until the bytes in
flight are about throughput x target; lifting the throttle grows them back; with
debloating off nothing changes; tiny buffers still carry records of 1 MiB.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import fetch_daemon_info
from client.options import ReaderOptions
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)

SEG = 32 * 1024
TARGET = 0.2
DEADLINE = 60.0
DEBLOAT = ("--debloat", f"--debloat-target={int(TARGET * 1000)}ms", "--debloat-period=50ms")


class Producer(threading.Thread):
    """Streams (channel, seq, payload) records into one-subpartition pipelined partitions
    (one writer per partition) until stopped; counts the payload bytes emitted."""

    def __init__(self, d: Any, dataset: str, index: int, record_size: int) -> None:
        super().__init__(daemon=True, name=f"producer-{index}")
        self.d, self.dataset, self.index, self.size = d, dataset, index, record_size
        self.emitted = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.writer: PartitionWriter | None = None
        self.opened = threading.Event()

    def run(self) -> None:
        pad = b"p" * (self.size - 8)
        try:
            with PartitionWriter(
                ResultPartitionID(self.dataset, self.index, 0),
                1,
                daemon_socket=self.d.local_socket,
                buffer_timeout=0.01,
            ) as w:
                self.writer = w
                self.opened.set()
                seq = 0
                while not self.stop.is_set():
                    for _ in range(8):  # distinct payloads: pickle would memoize equal ones
                        w.emit_to((self.index, seq, pad + seq.to_bytes(8, "big")), 0)
                        seq += 1
                    self.emitted = seq * self.size
        except BaseException as e:
            self.error = e
        finally:
            self.opened.set()


def _reader(d: Any, dataset: str, n: int, **extra: Any) -> PartitionReader:
    info = get_runtime().run(fetch_daemon_info(d.local_socket))
    # over TCP (no local_daemon_id), as a remote reader
    options = ReaderOptions.from_daemon(
        info, local_daemon_id=None, backoff_initial=0.01, backoff_max=0.1, **extra
    )
    locations = [
        PartitionLocation(
            ResultPartitionID(dataset, i, 0), 0, d.data_address, d.daemon_id, d.local_socket
        )
        for i in range(n)
    ]
    return PartitionReader(locations, options)


class Consumer:
    """Reads records at ``rate`` bytes/s of payload (None: as fast as it can)."""

    def __init__(self, reader: PartitionReader, producers: list[Producer], size: int) -> None:
        self.reader = reader
        self.producers = producers
        self.size = size
        self.it = iter(reader.records())
        self.consumed = 0
        self.next_seq = [0] * len(producers)

    def run(self, seconds: float, rate: float | None) -> list[tuple[int, int]]:
        """Read for ``seconds``; samples of (bytes in flight, announced size)."""
        start = time.monotonic()
        base = self.consumed
        samples: list[tuple[int, int]] = []
        while (now := time.monotonic()) - start < seconds:
            ch, seq, _ = next(self.it)
            assert seq == self.next_seq[ch], "lost or reordered"
            self.next_seq[ch] += 1
            self.consumed += self.size
            if rate is not None:
                due = start + (self.consumed - base) / rate
                if due > now:
                    time.sleep(due - now)
            if self.consumed % (64 * self.size) == 0:
                st = self.reader.debloat_stats
                size = st.buffer_size if st is not None else SEG
                samples.append((sum(p.emitted for p in self.producers) - self.consumed, size))
        return samples


def _start(d: Any, dataset: str, n: int, size: int) -> list[Producer]:
    producers = [Producer(d, dataset, i, size) for i in range(n)]
    for p in producers:
        p.start()
    for p in producers:
        assert p.opened.wait(30)
        assert p.error is None, p.error
    return producers


def _stop(producers: list[Producer], reader: PartitionReader) -> None:
    for p in producers:
        p.stop.set()
    reader.close()
    for p in producers:
        p.join(30)
        assert not p.is_alive()


def test_throttled_consumer_shrinks_buffers_to_its_throughput_then_they_grow_back(
    start_daemon: Any,
) -> None:
    d = start_daemon(*DEBLOAT)
    size, rate, n = 500, 2e6, 2
    producers = _start(d, "deb", n, size)
    reader = _reader(d, "deb", n)
    consumer = Consumer(reader, producers, size)
    try:
        consumer.run(3.0, rate)  # converge
        steady = consumer.run(3.0, rate)
        st = reader.debloat_stats
        assert st is not None
        shrunk = st.buffer_size
        assert shrunk < SEG // 2, st
        # The producer tasks cut their buffers at the announced size.
        for p in producers:
            assert p.writer is not None and p.writer.buffer_size(0) == shrunk
        # In flight: about what the consumer reads in the target time (within 30 %).
        inflight = statistics.median(b for b, _ in steady)
        assert 0.7 * rate * TARGET <= inflight <= 1.3 * rate * TARGET, (inflight, st)
        # Throttle lifted: the buffers grow back to whole segments.
        deadline = time.monotonic() + 30
        while reader.debloat_stats.buffer_size < SEG:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, reader.debloat_stats
            consumer.run(0.5, None)
        assert all(p.writer.buffer_size(0) == SEG for p in producers)  # type: ignore[union-attr]
    finally:
        _stop(producers, reader)
    for p in producers:
        assert p.error is None or "closed" in str(p.error) or "released" in str(p.error)
    d.wait_pool_whole()


def test_with_debloating_off_sizes_never_change(start_daemon: Any) -> None:
    d = start_daemon()
    producers = _start(d, "nodeb", 1, 500)
    reader = _reader(d, "nodeb", 1)
    try:
        assert reader.debloat_stats is None
        Consumer(reader, producers, 500).run(1.5, 1e6)
        assert producers[0].writer is not None and producers[0].writer.buffer_size(0) == SEG
    finally:
        _stop(producers, reader)
    d.wait_pool_whole()


def test_tiny_buffers_still_carry_records_of_one_mib(start_daemon: Any) -> None:
    # The smallest buffers there are, from the start: a 1 MiB record spans 4096 of them.
    d = start_daemon(
        "--debloat",
        "--debloat-min-buffer-size=256",
        "--debloat-initial-buffer-size=256",
        "--debloat-target=1ms",
    )
    pid = ResultPartitionID("tiny", 0, 0)
    big = [bytes([i]) * (1 << 20) for i in range(3)]
    reader = _reader(d, "tiny", 1)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.extend(reader.read_all()), daemon=True)
    t.start()
    with PartitionWriter(pid, 1, daemon_socket=d.local_socket, buffer_timeout=0.01) as w:
        deadline = time.monotonic() + 20
        while w.buffer_size(0) != 256:  # the reader's starting size reached the writer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for i, rec in enumerate(big):
            w.emit_to((i, rec), 0)
    t.join(60)
    assert not t.is_alive()
    assert out == [(i, rec) for i, rec in enumerate(big)]
    d.wait_pool_whole()


def test_a_buffer_counts_in_flight_until_the_task_processed_its_records(
    start_daemon: Any,
) -> None:
    # Flink recycles a buffer when its deserializer leaves it. A reader that gave a decoded
    # batch back at once hid the records still to process from the debloater (they are in
    # flight: a barrier waits behind them) and returned the batch's credit in one burst,
    # so the producer's backlog came with the last buffer of a burst, at its lowest: the
    # aligned checkpoint of bench_checkpointing took 1.7x its design for that.
    d = start_daemon(*DEBLOAT)
    pid = ResultPartitionID("held", 0, 0)
    buffers = 6  # fewer than the reader's credit (2 exclusive + 8 floating)
    writer = PartitionWriter(pid, 1, daemon_socket=d.local_socket, buffer_timeout=-1)
    for i in range(buffers):  # written before the reader announces a size: whole buffers
        writer.emit_to((i, b"r" * 2000), 0)
        writer.flush()  # one record per buffer
    reader = _reader(d, "held", 1)
    closed = False
    try:
        # every buffer handed over to the task thread, which takes them in one batch
        wait_for(
            lambda: reader.handoff_statistics()[0].items_sent >= buffers,
            DEADLINE,
            "the buffers reach the hand-off",
        )
        lists = reader.record_lists()
        for k in range(buffers):
            records = next(lists)
            assert [r[0] for r in records] == [k]
            hand, back = reader.handoff_statistics()
            assert hand.items_received == buffers  # the task took them all at once
            # the buffers of the lists processed before go back, this one's not yet
            assert back.items_sent == k
            if k == 0:  # and the debloater counts the whole batch as in use
                wait_for(
                    lambda: (
                        (st := reader.debloat_stats) is not None and st.buffers_in_use == buffers
                    ),
                    DEADLINE,
                    "the debloater counts the records still to process",
                )
        writer.close()
        closed = True
        assert list(itertools.chain.from_iterable(lists)) == []
        assert reader.handoff_statistics()[1].items_sent == buffers
    finally:
        reader.close()
        if not closed:
            writer.fail(AssertionError("the test failed"))
    d.wait_pool_whole()


def test_a_reader_closed_while_the_task_holds_a_buffer_gives_it_back(start_daemon: Any) -> None:
    # The held buffer and the rest of its batch go back with close(), from another
    # thread too; the reader's pool is whole (close raises otherwise), so is the daemon's.
    d = start_daemon(*DEBLOAT)
    pid = ResultPartitionID("held-close", 0, 0)
    writer = PartitionWriter(pid, 1, daemon_socket=d.local_socket, buffer_timeout=-1)
    for i in range(4):
        writer.emit_to((i, b"r" * 2000), 0)
        writer.flush()
    reader = _reader(d, "held-close", 1)
    try:
        wait_for(
            lambda: reader.handoff_statistics()[0].items_sent >= 4,
            DEADLINE,
            "the buffers reach the hand-off",
        )
        lists = reader.record_lists()
        assert [r[0] for r in next(lists)] == [0]
        assert reader.handoff_statistics()[1].items_sent == 0  # all four held
        closer = threading.Thread(target=reader.close)
        closer.start()
        closer.join(DEADLINE)
        assert not closer.is_alive()
        with pytest.raises(Exception, match="closed"):
            next(lists)
    finally:
        reader.close()
        writer.fail(AssertionError("the reader left early"))
    d.wait_pool_whole()
