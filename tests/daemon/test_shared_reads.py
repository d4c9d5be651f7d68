"""The consumer side of the shared-memory local path, on a real daemon: a reader on the
daemon's own host reads its application's arena in place (descriptors over the Unix
socket, segments given back by index), a pipelined partition where its producer wrote it,
a blocking one read from its file into the arena; the daemon counts the bytes by path, a
reader that dies holding segments gives them back by dying, and a reader maps only the
arena of its own application."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.consumer.input_channel import BATCH_FLOATING_BUFFERS, STREAMING_FLOATING_BUFFERS
from exchange.errors import TransportError
from exchange.partition.result_partition_id import ResultPartitionID
from tests.daemon._daemon import READY_TIMEOUT, ROOT, ChildProducer, _LineReader, child_env
from tests.daemon.test_shared_memory import bytes_by_path
from tests.kit.pidfds import pidfds
from tests.kit.polling import wait_for

#: What the stalled readers (one channel, a batch reader) may hold: their credit,
#: 2 exclusive buffers + the batch readers' floating buffers.
CREDIT = 2 + BATCH_FLOATING_BUFFERS

pytestmark = pytest.mark.timeout(180)

RECORDS = [(i, f"value-{i}" * 3) for i in range(30_000)]


def location(d: Any, pid: ResultPartitionID, sub: int) -> PartitionLocation:
    return PartitionLocation(pid, sub, d.data_address, d.daemon_id, d.local_socket)


def exchange(
    d: Any, pid: ResultPartitionID, n: int, records: list[Any], *, local: bool = True
) -> list[Any]:
    """Write ``records`` to a pipelined partition of ``n`` subpartitions of ``d`` while a
    reader per subpartition (opened once the partition, and so its application's arena,
    exists) reads it; everything read."""
    got: list[list[Any]] = [[] for _ in range(n)]
    with PartitionWriter(pid, n, blocking=False, daemon_socket=d.local_socket) as w:
        readers = [
            PartitionReader([location(d, pid, sub)], local_daemon_id=d.daemon_id if local else None)
            for sub in range(n)
        ]
        threads = [
            threading.Thread(target=lambda r=r, out=out: out.extend(r.read_all()))
            for r, out in zip(readers, got, strict=True)
        ]
        for t in threads:
            t.start()
        w.emit_all(records)
    for t, r in zip(threads, readers, strict=True):
        t.join(120)
        r.close()
    return [rec for part in got for rec in part]


def test_a_local_reader_reads_the_arena_in_place_and_the_metrics_say_so(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("in-place", 0, 0)
    assert sorted(exchange(d, pid, 2, RECORDS)) == RECORDS
    data = d.stats()["local"]["bytes_shared_memory"]  # data buffers committed in the arena
    assert data == d.stats()["local"]["bytes_received"] > 0
    local = d.wait_stats(lambda s: s["local"]["connections"] == 0)["local"]
    # every data buffer went as a descriptor; only events crossed the socket
    assert local["consumer_bytes_shared_memory"] == data
    assert 0 < local["consumer_bytes_socket"] < 1024
    assert local["consumer_segments_held"] == 0
    by_path = bytes_by_path(d, "consumer")
    assert by_path["shared_memory"] == data
    assert by_path["socket"] == local["consumer_bytes_socket"]
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # the arena went once whole
    d.wait_pool_whole()
    d.stop_clean()


def write_blocking(d: Any, pid: ResultPartitionID, n: int, records: list[Any]) -> int:
    """Write ``records`` to a blocking partition of ``n`` subpartitions of ``d``; its data
    bytes (what the daemon received)."""
    before = d.stats()["local"]["bytes_received"]
    with PartitionWriter(pid, n, blocking=True, daemon_socket=d.local_socket) as w:
        w.emit_all(records)
    written: int = d.stats()["local"]["bytes_received"] - before
    return written


def read_blocking(d: Any, pid: ResultPartitionID, n: int, *, local: bool = True) -> list[Any]:
    """Every record of the finished partition, subpartition after subpartition."""
    got: list[Any] = []
    for sub in range(n):
        daemon_id = d.daemon_id if local else None
        with PartitionReader([location(d, pid, sub)], local_daemon_id=daemon_id) as reader:
            got.extend(reader.read_all())
    return got


def test_a_local_reader_of_a_blocking_partition_reads_it_in_place_again_and_again(
    start_daemon: Any,
) -> None:
    """The daemon reads a blocking partition's file into the reader's application's arena
    (made for the reader: the writer's went once the partition was finished) and sends
    descriptors; the file stays the source, so the partition reads again, in place too."""
    d = start_daemon()
    pid = ResultPartitionID("blocking-in-place", 0, 0)
    data = write_blocking(d, pid, 2, RECORDS)
    assert data > 0
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # the writer's arena went
    for rounds in (1, 2):
        assert sorted(read_blocking(d, pid, 2)) == RECORDS
        local = d.wait_stats(lambda s: s["local"]["connections"] == 0)["local"]
        # every data buffer went as a descriptor; only the ends of partition as bytes
        assert local["consumer_bytes_shared_memory"] == rounds * data
        assert 0 < local["consumer_bytes_socket"] < rounds * 1024
        assert local["consumer_segments_held"] == 0
    by_path = bytes_by_path(d, "consumer")
    assert by_path["shared_memory"] == 2 * data
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # the readers' arena went too
    d.wait_pool_whole()
    d.stop_clean()


def test_a_reader_over_tcp_and_a_daemon_without_shared_memory_use_the_socket(
    start_daemon: Any,
) -> None:
    d = start_daemon()
    pid = ResultPartitionID("tcp", 0, 0)
    assert sorted(exchange(d, pid, 1, RECORDS, local=False)) == RECORDS  # the data port
    blocking = ResultPartitionID("tcp-blocking", 0, 0)
    data = write_blocking(d, blocking, 1, RECORDS)
    assert sorted(read_blocking(d, blocking, 1, local=False)) == RECORDS
    st = d.stats()
    assert st["local"]["consumer_bytes_shared_memory"] == 0
    assert st["local"]["consumer_bytes_socket"] == 0  # no reader on the Unix socket
    assert st["data_port"]["bytes_sent"] > data  # both partitions over TCP
    d.wait_pool_whole()
    d.stop_clean()

    off = start_daemon("--no-shared-memory", "--log-level", "INFO")
    assert sorted(exchange(off, pid, 1, RECORDS)) == RECORDS
    local = off.stats()["local"]
    assert local["consumer_bytes_shared_memory"] == 0
    assert local["consumer_bytes_socket"] > local["bytes_received"]
    off.stop_clean()
    assert "reads over the socket for now: shared_memory = off" in off.stderr


#: A consumer task in a child process: reads 10 records of subpartition 0 of a pipelined
#: partition on its own host's daemon, says so, and stalls holding what it received.
_STALLED_READER = """
import json, sys
from client.consumer import PartitionLocation, PartitionReader
from exchange.partition.result_partition_id import ResultPartitionID
class Task:
    def trigger_checkpoint(self, *args): pass
    def abort_checkpoint(self, *args): pass
sock, daemon_id, data, dataset = sys.argv[1:5]
kind = sys.argv[5] if len(sys.argv) > 5 else "batch"
listener = Task() if kind == "streaming" else None  # a streaming reader: 8 floating
loc = PartitionLocation(ResultPartitionID(dataset, 0, 0), 0, data, daemon_id, sock)
reader = PartitionReader([loc], local_daemon_id=daemon_id, checkpoint_listener=listener)
it = reader.records()
print(json.dumps({"read": len([next(it) for _ in range(10)])}), flush=True)
sys.stdin.read()
"""


def test_a_reader_sigkilled_holding_segments_gives_them_back(start_daemon: Any) -> None:
    d = start_daemon()
    with holding_reader(d, "killed-reader", _STALLED_READER) as (_, reader):
        # stalled: it holds what it received, at most its credit
        local = d.wait_stats(lambda s: s["local"]["consumer_segments_held"] > 0)["local"]
        assert local["consumer_bytes_shared_memory"] > 0
        held = local["consumer_segments_held"]
        assert 0 < held <= CREDIT
        assert local["shared_segments_in_use"] >= held  # never back in the pool meanwhile
        assert reader.end(kill=True) == -signal.SIGKILL
        local = d.wait_stats(lambda s: s["local"]["consumer_segments_held"] == 0, timeout=30)
        assert local["local"]["consumer_segments_pinned"] == 0  # its end, not the daemon's
    d.wait_stats(
        lambda s: s["local"]["shared_arenas"] == 0 and s["partitions"]["count"] == 0, timeout=30
    )
    d.wait_pool_whole()
    d.stop_clean()


def test_a_local_reader_holds_its_whole_credit_of_a_pipelined_partition_read_in_place(
    start_daemon: Any,
) -> None:
    """Read in place, the reader's credit is held in the producer's pool (over the socket
    it is the reader's own memory): the reader's connection lends a pipelined partition of
    its arena the readers' floating buffers beyond its 2n + 8 (16 at least) segments, so a
    stalled reader fills its whole credit (with 16 the stream's whole window was 16
    segments); its end takes them back, every pool whole."""
    d = start_daemon()
    with holding_reader(d, "deep-reader", _STALLED_READER) as (producer, reader):
        local = d.wait_stats(lambda s: s["local"]["consumer_segments_held"] > 16, timeout=60)[
            "local"
        ]
        assert local["consumer_segments_held"] <= CREDIT
        assert reader.end(kill=True) == -signal.SIGKILL
        producer.sigkill()
    d.wait_stats(
        lambda s: s["local"]["shared_arenas"] == 0 and s["partitions"]["count"] == 0, timeout=30
    )
    d.wait_pool_whole()
    d.stop_clean()


@pytest.mark.parametrize(
    ("kind", "floating"), [("streaming", STREAMING_FLOATING_BUFFERS), ("batch", CREDIT - 2)]
)
def test_a_local_reader_lends_the_producers_pool_its_own_floating_credit(
    start_daemon: Any, kind: str, floating: int
) -> None:
    """The producer's pool grows by what the reader in place can hold beyond its
    exclusive buffers, as its PartitionRequest says (``floating_credit``): 8 for a
    streaming reader (a checkpoint listener), 32 for a batch one; a streaming reader
    never holds more than its 2 + 8, and its end takes the loan back."""
    assert STREAMING_FLOATING_BUFFERS == 8 and CREDIT - 2 == 32
    d = start_daemon()
    with holding_reader(d, f"lend-{kind}", _STALLED_READER, kind) as (producer, reader):
        local = d.wait_stats(lambda s: s["local"]["consumer_segments_lent"] > 0)["local"]
        assert local["consumer_segments_lent"] == floating
        # stalled, it holds at most its own credit
        assert local["consumer_segments_held"] <= 2 + floating
        assert reader.end(kill=True) == -signal.SIGKILL
        d.wait_stats(lambda s: s["local"]["consumer_segments_lent"] == 0, timeout=30)
        producer.sigkill()
    d.wait_stats(
        lambda s: s["local"]["shared_arenas"] == 0 and s["partitions"]["count"] == 0, timeout=30
    )
    d.wait_pool_whole()
    d.stop_clean()


def test_a_local_reader_whose_daemon_dies_gets_the_transport_error_and_its_pool_back(
    start_daemon: Any,
) -> None:
    d = start_daemon()
    producer = ChildProducer(d.local_socket, "orphan-reader", 0, 1)
    try:
        producer.wait_writing()
        loc = location(d, ResultPartitionID("orphan-reader", 0, 0), 0)
        with PartitionReader([loc], local_daemon_id=d.daemon_id) as reader:
            it = reader.records()
            assert [next(it)[0] for _ in range(10)] == list(range(10))
            d.wait_stats(lambda s: s["local"]["consumer_bytes_shared_memory"] > 0)
            d.kill()  # the arena stays mapped in this process: what it holds stays readable
            with pytest.raises(TransportError, match=r"lost|closed"):
                for i, record in enumerate(it, 10):
                    assert record[0] == i  # exact up to the error
    finally:
        producer.sigkill()


#: A consumer task in a child process, driven by lines on its stdin: it reads 10 records
#: of subpartition 0 of a pipelined partition on its own host's daemon and says so, then
#: at the next line (mode "close") closes its reader while holding what it received, or
#: (mode "protocol-error") makes the daemon drop its connection: it gives back a segment
#: it never held; at the line after, it reads on and says how many more records came,
#: exactly in order, before which typed error. It lives until its stdin closes.
_DRIVEN_READER = """
import json, sys
from client.consumer import PartitionLocation, PartitionReader
from exchange.errors import ExchangeError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import encode_recycle
sock, daemon_id, data, dataset, mode = sys.argv[1:6]
loc = PartitionLocation(ResultPartitionID(dataset, 0, 0), 0, data, daemon_id, sock)
reader = PartitionReader([loc], local_daemon_id=daemon_id)
it = reader.records()
print(json.dumps({"read": len([next(it) for _ in range(10)])}), flush=True)
sys.stdin.readline()
if mode == "close":
    reader.close()
    print(json.dumps({"closed": True}), flush=True)
else:
    handler = reader._core.connections.connections[0]
    reader._rt.loop.call_soon_threadsafe(handler._transport.write, encode_recycle([2**32 - 1]))
    sys.stdin.readline()
    n = 10
    try:
        for record in it:
            assert record[0] == n, (record[0], n)
            n += 1
    except ExchangeError as e:
        print(json.dumps({"after": n - 10, "error": type(e).__name__}), flush=True)
sys.stdin.read()
"""


class ReaderProcess:
    """A consumer task process (``_STALLED_READER``, ``_DRIVEN_READER``,
    ``_PAUSED_READER``) the test steps through its stdin, stops, kills or lets exit."""

    def __init__(self, script: str, d: Any, dataset: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, d.local_socket, d.daemon_id, d.data_address,
             dataset, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=ROOT, env=child_env(),
        )  # fmt: skip
        self._out = _LineReader(self.proc.stdout, "reader-stdout")
        self._err = _LineReader(self.proc.stderr, "reader-stderr")

    def next(self) -> dict[str, Any]:
        line = self._out.next_line(READY_TIMEOUT)
        assert line is not None, f"reader exited: {''.join(self._err.all)}"
        event: dict[str, Any] = json.loads(line)
        return event

    def step(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def end(self, *, kill: bool = False) -> int:
        """Let it exit (its stdin closed), or SIGKILL it; its exit code."""
        if kill and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # killed: nobody reads it
                self.proc.stdin.close()
        code = self.proc.wait(30)
        self._out.join()
        self._err.join()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code


def in_log(d: Any, text: str) -> None:
    """``text`` reaches the daemon's stderr (read by a thread: polled)."""
    wait_for(lambda: text in d.stderr, 30, f"{text!r} in the daemon's log")


def held_then_pinned(d: Any) -> int:
    """Wait until the daemon dropped the reader's connection and pinned what it held; the
    number pinned (at most the reader's credit, ``CREDIT``)."""
    local = d.wait_stats(
        lambda s: (
            s["local"]["consumer_segments_pinned"] > 0 and s["local"]["consumer_segments_held"] == 0
        ),
        timeout=60,
    )["local"]
    pinned: int = local["consumer_segments_pinned"]
    assert 0 < pinned <= CREDIT
    return pinned


@contextlib.contextmanager
def holding_reader(
    d: Any, dataset: str, script: str, *args: str
) -> Iterator[tuple[ChildProducer, ReaderProcess]]:
    """A producer process streaming into a pipelined partition of ``d`` and a reader
    process (``script``) that read 10 records of it and holds segments of the arena; both
    killed at the end if still there."""
    producer = ChildProducer(d.local_socket, dataset, 0, 1)
    reader: ReaderProcess | None = None
    try:
        producer.wait_writing()  # its partition, and the application's arena, exist
        reader = ReaderProcess(script, d, dataset, *args)
        assert reader.next() == {"read": 10}
        d.wait_stats(lambda s: s["local"]["consumer_segments_held"] > 0)
        yield producer, reader
    finally:
        if reader is not None and reader.proc.poll() is None:
            reader.end(kill=True)
        producer.sigkill()


def test_a_reader_whose_connection_the_daemon_drops_keeps_its_segments_until_it_dies(
    start_daemon: Any,
) -> None:
    """No Pong within peer_timeout (the reader is SIGSTOPped): the daemon drops the
    connection, but the segments the reader held stay out of the pool while its process
    lives, and return once it is SIGKILLed."""
    d = start_daemon("--peer-timeout", "4")
    with holding_reader(d, "stopped-reader", _STALLED_READER) as (producer, reader):
        assert pidfds(d.proc.pid) == 0
        os.kill(reader.proc.pid, signal.SIGSTOP)  # it answers no Ping any more
        pinned = held_then_pinned(d)
        in_log(d, "no Pong within peer_timeout")
        in_log(d, f"while its process {reader.proc.pid} lives")
        # the producer goes, and its partition: what is still out of the arena's pool is
        # exactly what the stopped reader may read, and the arena stays for it
        producer.sigkill()
        local = d.wait_stats(lambda s: s["partitions"]["count"] == 0, timeout=30)["local"]
        assert local["shared_segments_in_use"] == local["consumer_segments_pinned"] == pinned
        assert local["shared_arenas"] == 1
        assert d.metric("exchange_consumer_shared_segments_pinned") == pinned
        assert pidfds(d.proc.pid) == 1  # one pidfd watches the reader
        assert reader.end(kill=True) == -signal.SIGKILL
        local = d.wait_stats(
            lambda s: (
                s["local"]["consumer_segments_pinned"] == 0 and s["local"]["shared_arenas"] == 0
            ),
            timeout=30,
        )["local"]
        assert local["shared_segments_in_use"] == 0
        assert pidfds(d.proc.pid) == 0  # and is closed
    d.wait_pool_whole()
    d.stop_clean()


def test_a_reader_dropped_for_a_protocol_error_reads_on_exactly_and_its_segments_wait(
    start_daemon: Any,
) -> None:
    """A protocol error (a segment given back that it does not hold): the daemon drops the
    connection while the reader lives. The reader reads on what it had, exact records in
    order, then gets the typed error; its segments stay pinned while it lives, and a daemon
    that stops meanwhile still ends with every pool whole."""
    d = start_daemon()
    with holding_reader(d, "bad-reader", _DRIVEN_READER, "protocol-error") as (producer, reader):
        reader.step()  # the bad RecycleSegments
        pinned = held_then_pinned(d)
        in_log(d, "given back but not held")
        reader.step()  # read on
        event = reader.next()
        # the daemon's fatal PROTOCOL_ERROR, after what it held and had taken (exact and in
        # order, checked by the reader): nothing torn
        assert event["error"] == "LocalProtocolError" and event["after"] >= 0, event
        # it lives, having failed: its segments are still out of the pool
        assert d.stats()["local"]["consumer_segments_pinned"] == pinned
        assert pidfds(d.proc.pid) == 1
        producer.sigkill()
        d.wait_stats(lambda s: s["partitions"]["count"] == 0, timeout=30)
        d.stop_clean()  # shutdown returns the pinned segments: every pool whole
        assert reader.proc.poll() is None
        assert reader.end() == 0


def test_a_reader_that_closes_holding_segments_gives_them_back_at_once(
    start_daemon: Any,
) -> None:
    """Only a drop by the daemon pins: a reader that closes while holding segments ends
    its connection itself, and they return while its process lives on (a reused Spark
    worker), without a pidfd."""
    d = start_daemon()
    with holding_reader(d, "closing-reader", _DRIVEN_READER, "close") as (producer, reader):
        reader.step()
        assert reader.next() == {"closed": True}
        local = d.wait_stats(
            lambda s: s["local"]["consumer_segments_held"] == 0 and s["local"]["consumers"] == 0,
            timeout=30,
        )["local"]
        assert local["consumer_segments_pinned"] == 0
        assert pidfds(d.proc.pid) == 0
        assert reader.proc.poll() is None  # it lives on
        producer.sigkill()
        d.wait_stats(
            lambda s: s["local"]["shared_arenas"] == 0 and s["partitions"]["count"] == 0,
            timeout=30,
        )
        assert reader.end() == 0
    d.wait_pool_whole()
    d.stop_clean()


#: A consumer task in a child process (a reused Spark worker): reads 10 records of
#: subpartition 0 of a pipelined partition on its own host's daemon and says so; at the
#: next line makes the daemon drop that connection (it gives back a segment it never
#: held); at the line after, reads the whole finished blocking partition named last and
#: says how many records came and their order's checksum (``order_sum``): with a new
#: reader (mode "after"), or (mode "during") with one opened before the drop, which read
#: 10 records then (said so too). It lives until its stdin closes.
_REUSED_READER = """
import json, sys
from client.consumer import PartitionLocation, PartitionReader
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import encode_recycle
sock, daemon_id, data, dataset, blocking, mode = sys.argv[1:7]
order_sum = lambda keys: sum(k * (i + 1) for i, k in enumerate(keys)) % 2**61
loc = PartitionLocation(ResultPartitionID(dataset, 0, 0), 0, data, daemon_id, sock)
reader = PartitionReader([loc], local_daemon_id=daemon_id)
it = reader.records()
print(json.dumps({"read": len([next(it) for _ in range(10)])}), flush=True)
other = PartitionLocation(ResultPartitionID(blocking, 0, 0), 0, data, daemon_id, sock)
keys = []
if mode == "during":
    again = PartitionReader([other], local_daemon_id=daemon_id)
    records = again.records()
    keys = [next(records)[0] for _ in range(10)]
    print(json.dumps({"blocking_read": len(keys)}), flush=True)
sys.stdin.readline()
handler = reader._core.connections.connections[0]
reader._rt.loop.call_soon_threadsafe(handler._transport.write, encode_recycle([2**32 - 1]))
sys.stdin.readline()
if mode == "during":
    keys += [k for k, _ in records]
    again.close()
else:
    with PartitionReader([other], local_daemon_id=daemon_id) as again:
        keys = [k for k, _ in again.read_all()]
print(json.dumps({"reread": len(keys), "order": order_sum(keys)}), flush=True)
sys.stdin.read()
"""


def order_sum(keys: list[int]) -> int:
    """A checksum of ``keys`` that depends on their order (the reader process's too)."""
    return sum(k * (i + 1) for i, k in enumerate(keys)) % 2**61


def end_capped(d: Any, producer: ChildProducer, reader: ReaderProcess) -> None:
    """SIGKILL the capped reader (its pins come back), then the producer: only the blocking
    partition is left, the arena goes, every pool whole; the daemon stops clean."""
    assert reader.end(kill=True) == -signal.SIGKILL
    d.wait_stats(lambda s: s["local"]["consumer_segments_pinned"] == 0, timeout=30)
    producer.sigkill()
    d.wait_stats(
        lambda s: s["local"]["shared_arenas"] == 0 and s["partitions"]["count"] == 1, timeout=30
    )
    d.wait_pool_whole()
    d.stop_clean()


def test_a_process_at_max_consumer_pins_reads_over_the_socket_until_it_exits(
    start_daemon: Any,
) -> None:
    """A reused worker whose connection the daemon dropped has its segments pinned; at
    ``--max-consumer-pins-per-process`` its next reader is offered no arena and reads a
    blocking partition (read in place otherwise) over the socket, exactly; the daemon
    logs why and counts it. Once the process is killed its pins go and the pool is whole."""
    d = start_daemon("--max-consumer-pins-per-process", "1")
    blocking = ResultPartitionID("capped-blocking", 0, 0)
    data = write_blocking(d, blocking, 1, RECORDS)
    with holding_reader(d, "capped-reader", _REUSED_READER, blocking.dataset_id, "after") as (
        producer,
        reader,
    ):
        reader.step()  # the bad RecycleSegments: dropped while it lives
        pinned = held_then_pinned(d)  # at least the cap of 1
        in_log(d, f"process {reader.proc.pid} has {pinned} shared segment(s) pinned")
        before = d.stats()["local"]
        assert before["consumer_reads_refused"] == 0
        reader.step()  # a new reader in the same process
        keys = [k for k, _ in RECORDS]
        assert reader.next() == {"reread": len(keys), "order": order_sum(keys)}
        local = d.wait_stats(lambda s: s["local"]["consumers"] == 0, timeout=30)["local"]
        # every byte of the blocking partition over the socket, none in place, one refusal
        assert local["consumer_bytes_shared_memory"] == before["consumer_bytes_shared_memory"]
        assert local["consumer_bytes_socket"] - before["consumer_bytes_socket"] > data
        assert local["consumer_reads_refused"] == 1
        assert d.metric("exchange_consumer_in_place_reads_refused_total") == 1
        assert local["consumer_segments_pinned"] == pinned  # nothing more pinned
        in_log(d, "reads over the socket, not in place: its process")
        end_capped(d, producer, reader)


def test_a_process_reaching_max_consumer_pins_reads_on_over_the_socket(
    start_daemon: Any,
) -> None:
    """A reused worker reads a blocking partition in place while the daemon drops its
    other connection: that drop takes the process to the cap, and the reader still open
    gets the rest of the partition over the socket (what it held stays held and is given
    back): every record, in order; nothing more read in place once the cap is reached."""
    d = start_daemon("--max-consumer-pins-per-process", "1")
    blocking = ResultPartitionID("capped-live", 0, 0)
    records = RECORDS * 4  # more than the reader's credit: most is sent after the drop
    data = write_blocking(d, blocking, 1, records)
    with holding_reader(d, "capped-live-reader", _REUSED_READER, blocking.dataset_id, "during") as (
        producer,
        reader,
    ):
        assert reader.next() == {"blocking_read": 10}
        d.wait_stats(lambda s: s["local"]["consumer_bytes_shared_memory"] > 0)
        reader.step()  # the bad RecycleSegments on the other connection
        before = d.wait_stats(
            lambda s: s["local"]["consumer_reads_refused"] == 1 and s["local"]["consumers"] == 1,
            timeout=60,
        )["local"]
        pinned = before["consumer_segments_pinned"]
        assert 0 < pinned <= CREDIT
        in_log(d, "reads over the socket, not in place: its process")
        reader.step()  # read the rest
        keys = [k for k, _ in records]
        assert reader.next() == {"reread": len(keys), "order": order_sum(keys)}
        local = d.wait_stats(lambda s: s["local"]["consumers"] == 0, timeout=30)["local"]
        # the rest came over the socket: in place, no more than what was sent before
        assert local["consumer_bytes_shared_memory"] == before["consumer_bytes_shared_memory"]
        assert local["consumer_bytes_socket"] > before["consumer_bytes_socket"]
        assert local["consumer_bytes_shared_memory"] + local["consumer_bytes_socket"] > data
        assert local["consumer_segments_pinned"] == pinned
        assert local["consumer_segments_held"] == 0  # what it held came back
        end_capped(d, producer, reader)


#: A consumer task in a child process: reads 10 records of subpartition 0 of a finished
#: partition on its own host's daemon, says so, and stalls holding what it received until
#: a line comes on stdin; then reads the rest and says how many and their sum of keys.
_PAUSED_READER = """
import json, sys
from client.consumer import PartitionLocation, PartitionReader
from exchange.partition.result_partition_id import ResultPartitionID
sock, daemon_id, data, dataset = sys.argv[1:5]
loc = PartitionLocation(ResultPartitionID(dataset, 0, 0), 0, data, daemon_id, sock)
with PartitionReader([loc], local_daemon_id=daemon_id) as reader:
    it = reader.records()
    first = [next(it) for _ in range(10)]
    print(json.dumps({"read": len(first)}), flush=True)
    sys.stdin.readline()
    records = first + list(it)
print(json.dumps({"count": len(records), "keys": sum(k for k, _ in records)}), flush=True)
"""


def test_a_reader_sigkilled_holding_blocking_segments_gives_them_back(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("killed-blocking-reader", 0, 0)
    data = write_blocking(d, pid, 1, RECORDS)
    reader = ReaderProcess(_PAUSED_READER, d, pid.dataset_id)
    try:
        assert reader.next() == {"read": 10}
        # paused: it holds what it received, at most its credit
        local = d.wait_stats(lambda s: s["local"]["consumer_segments_held"] > 0)["local"]
        held = local["consumer_segments_held"]
        assert 0 < held <= CREDIT
        assert local["shared_segments_in_use"] >= held  # never back in the arena meanwhile
    finally:
        assert reader.end(kill=True) == -signal.SIGKILL
    local = d.wait_stats(
        lambda s: s["local"]["connections"] == 0 and s["local"]["shared_arenas"] == 0,
        timeout=30,
    )["local"]
    assert local["consumer_segments_held"] == local["consumer_segments_pinned"] == 0
    d.wait_pool_whole()
    # the file is still the source: the partition reads again, whole, in place
    shared = local["consumer_bytes_shared_memory"]
    assert read_blocking(d, pid, 1) == RECORDS
    local = d.wait_stats(lambda s: s["local"]["connections"] == 0)["local"]
    assert local["consumer_bytes_shared_memory"] == shared + data
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)
    d.wait_pool_whole()
    d.stop_clean()


def test_readers_of_one_application_share_its_arena_and_never_wait_for_it(
    start_daemon: Any,
) -> None:
    """An arena of 8 segments: a reader that stops reading holds them all (its credit,
    ``CREDIT``, is larger); a reader of another partition of the same application still
    reads all of it (over the socket while none is spare: it never waits for the arena),
    and the first reads all of its own once it goes on, in place again (its partition is
    larger than its credit: the rest is sent after it goes on)."""
    d = start_daemon("--shared-memory-per-app", str(8 * 32 * 1024))
    seg = d.segment_size
    assert seg == 32 * 1024
    held = ResultPartitionID("arena-full", 0, 0)
    other = ResultPartitionID("arena-full-other", 0, 0)
    records = [(i, f"value-{i}" * 3) for i in range(4 * len(RECORDS))]
    data = write_blocking(d, held, 1, records)
    write_blocking(d, other, 1, RECORDS)
    assert data > 2 * (CREDIT + 8) * seg  # far more than the reader's credit and the arena
    reader = ReaderProcess(_PAUSED_READER, d, held.dataset_id)
    try:
        assert reader.next() == {"read": 10}
        d.wait_stats(lambda s: s["local"]["shared_segments_in_use"] == 8, timeout=30)  # all lent
        assert read_blocking(d, other, 1) == RECORDS
        shared = d.wait_stats(lambda s: s["local"]["connections"] == 1)["local"][
            "consumer_bytes_shared_memory"
        ]
        reader.step()
        assert reader.next() == {"count": len(records), "keys": sum(k for k, _ in records)}
    finally:
        assert reader.end() == 0
    local = d.wait_stats(lambda s: s["local"]["connections"] == 0)["local"]
    assert local["consumer_bytes_shared_memory"] > shared  # its rest went in place again
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)
    d.wait_pool_whole()
    d.stop_clean()
