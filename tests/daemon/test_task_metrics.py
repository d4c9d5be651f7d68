"""Consumer tasks report their gate's figures to their local daemon (TaskMetrics, local
message 76), through a real daemon process: the debloating and checkpoint gauges of a
running task appear on ``/metrics`` and ``/api/stats``, follow the task while it reads,
and disappear once it closes; a task with nothing to report sends nothing; reporting to a
daemon that goes away never fails the read; one connection may not flood the daemon.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.consumer import (
    AsyncPartitionReader,
    PartitionLocation,
    PartitionReader,
)
from client.local_connection import LocalConnection, fetch_daemon_info
from client.options import ReaderOptions
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.checkpointing.barrier_handler import CheckpointFailureReason
from exchange.errors import ExchangeError
from exchange.events.events import CheckpointOptions
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import TaskMetrics
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)

SEG = 32 * 1024
DEBLOAT = ("--debloat", "--debloat-target=200ms", "--debloat-period=50ms")
TASK = "exchange-tm/subpartition-0"
GAUGES = (
    "exchange_gate_buffer_size_bytes",
    "exchange_gate_throughput_bytes_per_second",
    "exchange_gate_buffers_in_use",
    "exchange_gate_estimated_time_to_consume_seconds",
    "exchange_checkpoint_alignment_seconds",
    "exchange_checkpoint_aligned_bytes",
    "exchange_checkpoints_triggered_total",  # counters: the task's counts only grow
    "exchange_checkpoints_aborted_total",
)


class BarrierProducer(threading.Thread):
    """Streams ``(seq, pad)`` records into a one-subpartition pipelined partition and
    broadcasts an aligned barrier every ``interval`` seconds, until stopped; then finishes
    the partition (the consumer reads to its end)."""

    def __init__(self, d: Any, dataset: str, interval: float = 0.1) -> None:
        super().__init__(daemon=True, name=f"producer-{dataset}")
        self.d, self.dataset, self.interval = d, dataset, interval
        self.stop = threading.Event()
        self.opened = threading.Event()
        self.error: BaseException | None = None
        self.emitted = 0
        self.barriers = 0

    def run(self) -> None:
        pad = b"m" * 200
        try:
            with PartitionWriter(
                ResultPartitionID(self.dataset, 0, 0),
                1,
                daemon_socket=self.d.local_socket,
                buffer_timeout=0.01,
            ) as w:
                self.opened.set()
                next_at = time.monotonic() + self.interval
                while not self.stop.is_set():
                    for _ in range(32):
                        w.emit_to((self.emitted, pad), 0)
                        self.emitted += 1
                    if time.monotonic() >= next_at:
                        self.barriers += 1
                        w.broadcast_barrier(self.barriers, int(time.time() * 1000), aligned=True)
                        next_at += self.interval
                    time.sleep(0.001)  # keep streaming without hogging a shared core
        except BaseException as e:
            self.error = e
        finally:
            self.opened.set()


class Listener:
    def __init__(self) -> None:
        self.triggered: list[int] = []
        self.aborted: list[int] = []

    def trigger_checkpoint(
        self, checkpoint_id: int, timestamp: int, options: CheckpointOptions
    ) -> None:
        self.triggered.append(checkpoint_id)

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.aborted.append(checkpoint_id)


class ConsumerTask(threading.Thread):
    """Reads every record of the reader in order, as a task thread would."""

    def __init__(self, reader: PartitionReader) -> None:
        super().__init__(daemon=True, name="consumer-task")
        self.reader = reader
        self.count = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for seq, _ in self.reader.records():
                assert seq == self.count, "lost or reordered"
                self.count += 1
        except BaseException as e:
            self.error = e


def _reader(d: Any, dataset: str, **extra: Any) -> PartitionReader:
    info = get_runtime().run(fetch_daemon_info(d.local_socket))
    # over TCP (no local_daemon_id), as a remote reader
    options = ReaderOptions.from_daemon(
        info, local_daemon_id=None, backoff_initial=0.01, backoff_max=0.1, **extra
    )
    loc = PartitionLocation(
        ResultPartitionID(dataset, 0, 0), 0, d.data_address, d.daemon_id, d.local_socket
    )
    return PartitionReader([loc], options)


def scrape(d: Any) -> dict[str, dict[tuple[str, str], float]]:
    """``/metrics``: the task gauges, as {name: {(task, gate): value}}."""
    out: dict[str, dict[tuple[str, str], float]] = {name: {} for name in GAUGES}
    out["exchange_task_gates_reporting"] = {}
    text = d.http_get("/metrics").decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GAUGES:
                key = (sample.labels["task"], sample.labels["gate"])
                assert key not in out[sample.name], f"duplicate series {sample}"
                out[sample.name][key] = sample.value
            elif sample.name == "exchange_task_gates_reporting":
                out[sample.name][("", "")] = sample.value
    return out


def task_item(stats: dict[str, Any], task: str) -> dict[str, Any] | None:
    items = [it for it in stats["tasks"]["items"] if it["task"] == task]
    assert len(items) <= 1, items
    return items[0] if items else None


def test_running_task_gauges_appear_follow_and_vanish_after_close(start_daemon: Any) -> None:
    d = start_daemon(*DEBLOAT)
    producer = BarrierProducer(d, "tm")
    producer.start()
    assert producer.opened.wait(30) and producer.error is None, producer.error
    listener = Listener()
    reader = _reader(
        d, "tm", checkpoint_listener=listener, metrics_socket=d.local_socket, task_name=TASK
    )
    consumer = ConsumerTask(reader)
    consumer.start()
    try:
        assert reader.debloat_stats is not None and reader.barrier_stats is not None

        def reported_checkpoint() -> dict[str, Any] | None:
            item = task_item(d.stats(), TASK)
            if item is None or item["metrics"].get("num_triggered", 0) < 1:
                return None
            return item

        first = wait_for(reported_checkpoint, 30, "no report with a triggered checkpoint")
        assert first["gate"] == "reader" and first["id"] == f"{TASK}/reader"
        m = first["metrics"]
        assert 0 < m["buffer_size"] <= SEG
        assert m["buffers_in_use"] >= 0
        assert m["throughput"] >= 0 and m["estimated_time_to_consume"] >= 0
        assert m["last_alignment_duration"] >= 0 and m["last_aligned_bytes"] >= 0
        assert m["num_aborted"] == 0
        assert 0 <= first["age_seconds"] < 5
        # Prometheus: one series per gauge for this task's gate, the same figures.
        prom = scrape(d)
        key = (TASK, "reader")
        for name in GAUGES:
            assert key in prom[name], (name, prom[name])
            assert math.isfinite(prom[name][key])
        assert prom["exchange_task_gates_reporting"][("", "")] == 1
        assert 0 < prom["exchange_gate_buffer_size_bytes"][key] <= SEG
        assert prom["exchange_checkpoints_triggered_total"][key] >= 1
        assert prom["exchange_checkpoints_aborted_total"][key] == 0
        # The figures follow the task: a later report has more checkpoints, and the
        # count the daemon shows never exceeds what the task's listener saw.
        later = wait_for(
            lambda: (
                (it := task_item(d.stats(), TASK)) is not None
                and it["metrics"]["num_triggered"] > m["num_triggered"]
                and it
            ),
            30,
            "the reported figures never moved",
        )
        assert later["metrics"]["num_triggered"] <= len(listener.triggered)
        assert reader.metrics_reports_sent >= 2
    finally:
        producer.stop.set()
        producer.join(30)
        consumer.join(30)
        reader.close()
    assert not producer.is_alive() and producer.error is None, producer.error
    assert not consumer.is_alive() and consumer.error is None, consumer.error
    assert consumer.count == producer.emitted
    assert listener.triggered == list(range(1, len(listener.triggered) + 1))
    assert len(listener.triggered) >= producer.barriers - 1 and not listener.aborted
    # Closed: the task's report goes with its connection, no stale gauges stay.
    wait_for(lambda: d.stats()["tasks"]["count"] == 0, 10, "the report outlived its task")
    assert d.stats()["tasks"]["items"] == []
    prom = scrape(d)
    assert all(not prom[name] for name in GAUGES), prom
    assert prom["exchange_task_gates_reporting"][("", "")] == 0
    d.wait_pool_whole()


def test_the_async_reader_reports_too(start_daemon: Any) -> None:
    """AsyncPartitionReader with debloating: its gate's figures (no checkpoint figures:
    it has no listener) appear while it reads and go when it closes."""
    d = start_daemon(*DEBLOAT)
    producer = BarrierProducer(d, "async", interval=3600)  # records only
    producer.start()
    assert producer.opened.wait(30) and producer.error is None, producer.error

    async def read() -> tuple[dict[str, Any], int, int]:
        info = await fetch_daemon_info(d.local_socket)
        loc = PartitionLocation(
            ResultPartitionID("async", 0, 0), 0, d.data_address, d.daemon_id, d.local_socket
        )
        reader = await AsyncPartitionReader.open(
            [loc],
            ReaderOptions.from_daemon(info, local_daemon_id=None),
            metrics_socket=d.local_socket,
            task_name="async-task",
        )
        count = 0
        try:
            seen: dict[str, Any] | None = None
            deadline = time.monotonic() + 30
            while seen is None:
                assert time.monotonic() < deadline, "the async reader never reported"
                batch = await reader.next_batch()
                assert batch is not None
                for seq, _ in batch:
                    assert seq == count
                    count += 1
                st = await asyncio.to_thread(d.stats)
                seen = task_item(st, "async-task")
            sent = reader.metrics_reports_sent
        finally:
            await reader.close()
        return seen, sent, count

    try:
        seen, sent, count = get_runtime().run(read())
    finally:
        producer.stop.set()
        producer.join(30)
    # the reader stopped before the end: the producer learns its partition was released
    assert producer.error is None or "released" in str(producer.error), producer.error
    assert count > 0 and sent >= 1
    assert seen["gate"] == "reader"
    assert set(seen["metrics"]) == {
        "buffer_size",
        "computed_buffer_size",
        "throughput",
        "buffers_in_use",
        "desired_total_bytes",
        "estimated_time_to_consume",
    }
    d.wait_stats(lambda s: s["tasks"]["count"] == 0, 10)
    d.wait_pool_whole()


def _stream(d: Any, dataset: str, records: int) -> None:
    with PartitionWriter(
        ResultPartitionID(dataset, 0, 0), 1, daemon_socket=d.local_socket, buffer_timeout=0.01
    ) as w:
        for i in range(records):
            w.emit_to((i, b"x" * 100), 0)


def test_a_task_with_nothing_to_report_sends_nothing(start_daemon: Any) -> None:
    d = start_daemon()  # no debloating, and the reader has no checkpoint listener
    writer = threading.Thread(target=_stream, args=(d, "quiet", 5000), daemon=True)
    writer.start()
    reader = _reader(d, "quiet", metrics_socket=d.local_socket, task_name="quiet-task")
    try:
        assert reader.debloat_stats is None and reader.barrier_stats is None
        got = [seq for seq, _ in reader.records()]
    finally:
        reader.close()
        writer.join(30)
    assert got == list(range(5000))
    assert reader.metrics_reports_sent == 0
    assert d.stats()["tasks"] == {"count": 0, "items": []}
    d.wait_pool_whole()


def test_a_daemon_that_goes_away_never_fails_the_read(start_daemon: Any) -> None:
    """The task reports to a second daemon, which shuts down mid-read: reporting stops,
    the read (from the first daemon) goes on to its end."""
    d = start_daemon(*DEBLOAT)
    elsewhere = start_daemon()
    producer = BarrierProducer(d, "gone")
    producer.start()
    assert producer.opened.wait(30) and producer.error is None, producer.error
    reader = _reader(d, "gone", metrics_socket=elsewhere.local_socket, task_name="orphan")
    consumer = ConsumerTask(reader)
    consumer.start()
    try:
        elsewhere.wait_stats(lambda s: s["tasks"]["count"] == 1, 30)
        assert task_item(d.stats(), "orphan") is None  # reported where it was told
        elsewhere.stop_clean()
        sent = reader.metrics_reports_sent
        base = consumer.count
        wait_for(lambda: consumer.count > base + 5000, 30, "the read stalled")
        assert consumer.error is None, consumer.error
        assert reader.metrics_reports_sent <= sent + 1  # at most one went out in between
    finally:
        producer.stop.set()
        producer.join(30)
        consumer.join(30)
        reader.close()
    assert producer.error is None and consumer.error is None, (producer.error, consumer.error)
    assert consumer.count == producer.emitted
    d.wait_pool_whole()


def test_reporting_to_no_daemon_at_all_never_fails_the_read(
    start_daemon: Any, tmp_path: Any
) -> None:
    d = start_daemon(*DEBLOAT)
    writer = threading.Thread(target=_stream, args=(d, "nodaemon", 3000), daemon=True)
    writer.start()
    reader = _reader(
        d, "nodaemon", metrics_socket=str(tmp_path / "no-such.sock"), task_name="lonely"
    )
    try:
        got = [seq for seq, _ in reader.records()]
    finally:
        reader.close()
        writer.join(30)
    assert got == list(range(3000))
    assert reader.metrics_reports_sent == 0
    d.wait_pool_whole()


def test_one_connection_reports_a_bounded_number_of_gates(start_daemon: Any) -> None:
    d = start_daemon()

    async def flood() -> tuple[int, ExchangeError | None]:
        conn = await LocalConnection.connect(d.local_socket)
        try:
            for i in range(16):
                conn.send(TaskMetrics("flood", f"gate-{i}", {"buffer_size": 1024 + i}))
            # the same gates again: an update, not a new series
            conn.send(TaskMetrics("flood", "gate-0", {"buffer_size": 512}))
            await asyncio.sleep(0)
            seen = await asyncio.to_thread(d.wait_stats, lambda s: s["tasks"]["count"] == 16, 10)
            assert task_item_gate(seen, "gate-0")["metrics"] == {"buffer_size": 512}
            conn.send(TaskMetrics("flood", "gate-16", {"buffer_size": 1}))
            await asyncio.wait_for(asyncio.shield(conn.closed), 10)
            return seen["tasks"]["count"], conn.error
        finally:
            conn.close()

    count, error = get_runtime().run(flood())
    assert count == 16
    assert error is not None and "more than 16 task gates" in str(error)
    d.wait_stats(lambda s: s["tasks"]["count"] == 0, 10)


def task_item_gate(stats: dict[str, Any], gate: str) -> dict[str, Any]:
    items: list[dict[str, Any]] = [it for it in stats["tasks"]["items"] if it["gate"] == gate]
    assert len(items) == 1, items
    return items[0]


def test_a_cancel_lost_as_the_connection_completes_still_ends_the_reporter(
    start_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.wait_for`` (inside ``LocalConnection.connect``) returns the
    result and drops a cancel that arrives as the connection completes. The reporter's
    ``close`` cancels it while it connects: it must still end, not wait forever (a task
    whose reader closed early hung there under load, its failure never reported)."""
    from client.consumer import _TaskMetricsReporter

    d = start_daemon()
    real = LocalConnection.connect.__func__  # type: ignore[attr-defined]
    connecting = asyncio.Event()

    async def connect_losing_a_cancel(cls: Any, *args: Any, **kwargs: Any) -> Any:
        attempt = asyncio.ensure_future(real(cls, *args, **kwargs))
        connecting.set()
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            return await attempt  # the result won the race: the cancel is dropped

    monkeypatch.setattr(LocalConnection, "connect", classmethod(connect_losing_a_cancel))
    reporter = _TaskMetricsReporter(d.local_socket, "lost-cancel", "g", dict, secret=None)

    async def start_then_close() -> float:
        reporter.start()
        await connecting.wait()
        loop = asyncio.get_running_loop()
        start = loop.time()
        # close swallows its own cancel too: wait_for ends it only after its timeout
        await asyncio.wait_for(reporter.close(), 30)
        return loop.time() - start

    took = get_runtime().run(start_then_close())
    assert took < 15, f"close waited {took:.1f} s for a reporter that lost its cancel"
    assert reporter._conn is None
    d.wait_stats(lambda s: s["local"]["consumers"] == 0, 20)
