"""Shared helpers of the benchmarks that run real daemons and task processes.

* ``Daemon``: ``python -m server`` in a subprocess with its own temp dir (spill dir and
  local socket), its ready line, ``/api/stats``, RSS from ``/proc``, SIGTERM stop.
* ``Child``: a ``multiprocessing`` spawn process with a pipe to the driver; killed on close.
* ``produce`` / ``consume``: a producer task (``client.producer.PartitionWriter``) and a
  consumer task (``client.consumer.PartitionReader``), as PySpark tasks run them. They
  report wall clock (``time.monotonic``, one clock for every process on Linux), process
  CPU and the CPU of the task thread (the rest is the client's loop thread).
* Records are ``bytes`` with their index (big endian) in the first and the last 8 bytes,
  taken in turn from a pool of ``POOL`` distinct records (so building them costs nothing
  in the timed loop). The consumer checks each record's two ends agree, the count, the
  payload bytes and the sum of the indices; the 100 B run (one channel, in order) checks
  the count, the bytes and one record per chunk of ``CHUNK`` against its position.

* ``flight_gbps``: the Arrow Flight ``DoGet`` baseline (server and client processes): a
  ``FlightServerBase`` yields record batches of one binary column of ``record_size``
  values; the client reads the stream. GB/s of values.
* ``relay_ceiling``: the raw ceiling of the end-to-end shape: three processes, a producer
  writing 32 KiB chunks to a relay over a Unix socket (blocking ``sendall``), the relay
  (uvloop) forwarding them over loopback TCP with backpressure, a consumer (uvloop,
  ``BufferedProtocol``) counting bytes. No framing, no records, no copies beyond the
  kernel's: what the machine allows three processes with two hops.
* ``proc_cpu``: a process's CPU seconds from ``/proc`` (the daemon's, for the split);
  ``threads_cpu``: the same from its threads' schedstat, in nanoseconds (finer than ticks).

The last line a benchmark prints is ``json_line(results)``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import operator
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB: Final = 1e9
SEG: Final = 32 * 1024
#: Distinct records the producer cycles through.
POOL: Final = 4096
#: Records the consumer takes from the iterator at a time.
CHUNK: Final = 1024
READY_TIMEOUT: Final = 60.0


class BenchError(RuntimeError):
    """A benchmark run lost or corrupted records, or a process failed."""


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def json_line(results: dict[str, Any]) -> str:
    return json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})


# -- records --------------------------------------------------------------------------------


def make_record(index: int, size: int) -> bytes:
    tag = index.to_bytes(8, "big")
    return tag + b"x" * (size - 16) + tag


def record_pool(size: int) -> list[bytes]:
    return [make_record(i, size) for i in range(POOL)]


def expected_index_sum(count: int) -> int:
    """Sum of the indices of ``count`` records taken in turn from the pool."""
    full, rest = divmod(count, POOL)
    return full * (POOL * (POOL - 1) // 2) + rest * (rest - 1) // 2


def records(size: int, count: int) -> Iterator[bytes]:
    return itertools.islice(itertools.cycle(record_pool(size)), count)


_HEAD = operator.itemgetter(slice(0, 8))
_TAIL = operator.itemgetter(slice(-8, None))


class Checker:
    """Counts what a consumer read and checks it (see the module docstring)."""

    def __init__(self, size: int, ordered: bool) -> None:
        self.size = size
        self.ordered = ordered
        self.pool = record_pool(size) if ordered else []
        self.count = 0
        self.payload = 0
        self.index_sum = 0

    def add(self, chunk: list[bytes]) -> None:
        if self.ordered:
            if chunk[0] != self.pool[self.count % POOL]:
                raise BenchError(f"record {self.count} is not the one written there")
        else:
            heads = list(map(_HEAD, chunk))
            if heads != list(map(_TAIL, chunk)):
                raise BenchError("a record's two ends disagree (corrupted)")
            self.index_sum += sum(map(int.from_bytes, heads))
        self.count += len(chunk)
        self.payload += sum(map(len, chunk))

    def verify(self, count: int) -> None:
        if self.count != count:
            raise BenchError(f"read {self.count} records, {count} were written")
        if self.payload != count * self.size:
            raise BenchError(f"read {self.payload} payload bytes, {count * self.size} written")
        if not self.ordered and self.index_sum != expected_index_sum(count):
            raise BenchError("the sum of record indices differs: records lost or duplicated")


# -- a daemon -------------------------------------------------------------------------------


class Daemon:
    """``python -m server`` on ports 0 with its own temp dir; a context manager."""

    def __init__(self, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="xbench-")
        self.socket_path = os.path.join(self.dir, "d.sock")
        spill = os.path.join(self.dir, "spill")
        os.mkdir(spill)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        for key in [k for k in env if k.startswith("EXCHANGE_")]:
            del env[key]
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "server", "--host", "127.0.0.1",
                "--data-port", "0", "--http-port", "0", "--spill-dir", spill,
                "--local-socket", self.socket_path, "--log-level", "WARNING", *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.info: dict[str, Any] = {}
        try:
            line = self._lines.get(timeout=READY_TIMEOUT)
            if line is None:
                raise BenchError(f"daemon exited before ready: {self.stderr}")
            self.info = json.loads(line)
        except BaseException:
            self.close()
            raise

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout as pipe:
            for line in pipe:
                self._lines.put(line)
        self._lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr as pipe:
            for line in pipe:
                self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def data_address(self) -> str:
        return str(self.info["data"])

    @property
    def daemon_id(self) -> str:
        return str(self.info["daemon_id"])

    @property
    def network_memory(self) -> int:
        return int(self.info["segments"]) * int(self.info["segment_size"])

    def rss(self) -> int:
        """Resident set size in bytes (``VmRSS`` of ``/proc/<pid>/status``)."""
        return proc_rss(self.proc.pid)

    def stats(self) -> dict[str, Any]:
        url = f"http://{self.info['http']}/api/stats"
        with urllib.request.urlopen(url, timeout=10) as resp:
            result: dict[str, Any] = json.loads(resp.read())
        return result

    def stop(self) -> bool:
        """SIGTERM and wait; True if the daemon said every segment came back."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise BenchError(f"daemon ignored SIGTERM: {self.stderr}") from None
        for t in self._threads:
            t.join(5)
        whole = False
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                break
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "stopped":
                    whole = bool(event.get("pool_whole"))
        return whole

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def threads_cpu(pid: int) -> float:
    """CPU seconds the live threads of ``pid`` have run (``/proc/<pid>/task/*/schedstat``,
    nanoseconds: ``proc_cpu``'s clock ticks are 6.5 us per 32 KiB of a quick run)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_switches(pid: int | str = "self") -> int:
    """Voluntary context switches of every live thread of ``pid`` so far: each is a
    thread that blocked (a wait for the other thread, a lock, the event loop's epoll)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for pid {pid}")


# -- task processes -------------------------------------------------------------------------


class Child:
    """A spawn process running ``target(conn, *args)``; ``close`` kills it if still alive."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()  # a child that dies reads as EOF here, not as a long wait
        self.name = getattr(target, "__name__", "child")

    def recv(self, timeout: float) -> Any:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except EOFError:
            pass
        raise BenchError(f"{self.name} process gave nothing in {timeout}s (see its traceback)")

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None
        return pid

    def kill(self) -> None:
        """SIGKILL now and reap (a task that dies without closing anything)."""
        self.proc.kill()
        self.close()

    def close(self) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def produce(
    conn: Connection,
    socket_path: str,
    dataset: str,
    num_subpartitions: int,
    size: int,
    count: int,
    blocking: bool,
) -> None:
    """A producer task: open the partition, say ready, wait for "go", write, close."""
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    pid = ResultPartitionID(dataset, 0)
    n = num_subpartitions
    source = records(size, count)  # the pool is built before the clock starts
    writer = PartitionWriter(pid, n, blocking=blocking, daemon_socket=socket_path)
    conn.send("ready")
    conn.recv()
    t0, cpu0, task0 = time.monotonic(), time.process_time(), time.thread_time()
    switches0 = proc_switches()
    if n == 1:
        writer.emit_all(source)
    else:  # index k goes to subpartition k % n (its last byte; the pool has 4096 = 0 mod n)
        writer.emit_all(source, partition_func=lambda k: k % n, key_func=lambda r: r[-1])
    finished = writer.close()
    t1, cpu1, task1 = time.monotonic(), time.process_time(), time.thread_time()
    switches = proc_switches() - switches0
    conn.send(
        {
            "switches": switches,
            "t0": t0,
            "t1": t1,
            "cpu": cpu1 - cpu0,
            "task_cpu": task1 - task0,
            "bytes_written": finished.bytes_written,
            "buffers_written": finished.buffers_written,
        }
    )


def consume(
    conn: Connection,
    locations: list[tuple[str, int, str, str | None, str | None]],
    local_daemon_id: str | None,
    size: int,
    count: int,
    ordered: bool,
    attach_first: bool,
) -> None:
    """A consumer task: open a reader on ``locations``, say ready, wait for "go", read
    and check everything.

    Each location is ``(dataset, subpartition, data_address, daemon_id, local_socket)``;
    the reader takes the Unix socket when ``local_daemon_id`` names that daemon.
    """
    from client.consumer import PartitionLocation, PartitionReader
    from exchange.partition.result_partition_id import ResultPartitionID

    locs = [
        PartitionLocation(ResultPartitionID(ds, 0), sub, addr, did, sock)
        for ds, sub, addr, did, sock in locations
    ]
    checker = Checker(size, ordered)
    if attach_first:  # a pipelined partition: attached before its producer starts
        reader = PartitionReader(locs, local_daemon_id=local_daemon_id)
    conn.send("ready")
    conn.recv()
    t0, cpu0, task0 = time.monotonic(), time.process_time(), time.thread_time()
    switches0 = proc_switches()
    if not attach_first:  # a filled partition: opening it is part of the read
        reader = PartitionReader(locs, local_daemon_id=local_daemon_id)
    it = reader.records()
    islice = itertools.islice
    add = checker.add
    while chunk := list(islice(it, CHUNK)):
        add(chunk)
    t1, cpu1, task1 = time.monotonic(), time.process_time(), time.thread_time()
    switches = proc_switches() - switches0
    reader.close()
    checker.verify(count)
    conn.send(
        {
            "t0": t0,
            "t1": t1,
            "cpu": cpu1 - cpu0,
            "task_cpu": task1 - task0,
            "records": count,
            "switches": switches,
        }
    )


# -- the Arrow Flight baseline ---------------------------------------------------------------------


def fill_partition(
    daemon: Daemon, dataset: str, subpartitions: int, size: int, count: int
) -> dict[str, Any]:
    """A producer task process writes ``count`` records of ``size`` bytes into a
    blocking partition on ``daemon`` and finishes it; its report."""
    producer = Child(produce, daemon.socket_path, dataset, subpartitions, size, count, True)
    return _go(producer, "producer did not open its partition")


def _go(child: Child, not_ready: str) -> dict[str, Any]:
    """Wait for ``child``'s "ready", start it, return its report; close it either way."""
    try:
        if child.recv(READY_TIMEOUT) != "ready":
            raise BenchError(not_ready)
        child.send("go")
        result: dict[str, Any] = child.recv(600)
        return result
    finally:
        child.close()


def read_partition(
    daemon: Daemon,
    dataset: str,
    subpartitions: int,
    size: int,
    count: int,
    env: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """A fresh consumer task process reads a filled partition over the daemon's data port
    (opening the reader is inside its clock) and checks every record; its report.

    ``env``: variables the consumer process starts with (None: unset), as an executor
    would have them; this process's environment is restored afterwards.
    """
    saved = {k: os.environ.get(k) for k in env or {}}
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    locations = [(dataset, i, daemon.data_address, None, None) for i in range(subpartitions)]
    try:
        consumer = Child(consume, locations, None, size, count, False, False)
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
    return _go(consumer, "consumer did not start")


def producer_to_consumer(
    daemon: Daemon, dataset: str, size: int, count: int, *, same_host: bool
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """One producer task -> daemon -> consumer task run (over the Unix socket when
    ``same_host``, else over TCP); both processes' reports and the wall seconds from the
    first record produced to the last consumed."""
    producer = Child(produce, daemon.socket_path, dataset, 1, size, count, False)
    consumer: Child | None = None
    try:
        if producer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("producer did not open its partition")
        if same_host:
            location = (dataset, 0, daemon.data_address, daemon.daemon_id, daemon.socket_path)
            local_id: str | None = daemon.daemon_id
        else:
            location = (dataset, 0, daemon.data_address, None, None)
            local_id = None
        consumer = Child(consume, [location], local_id, size, count, size < 1024, True)
        if consumer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("consumer did not attach")
        consumer.send("go")
        producer.send("go")
        prod = producer.recv(600)
        cons = consumer.recv(600)
    finally:
        if consumer is not None:
            consumer.close()
        producer.close()
    return prod, cons, float(max(prod["t1"], cons["t1"]) - min(prod["t0"], cons["t0"]))


def flight_server(conn: Connection, total: int, record_size: int) -> None:
    import pyarrow as pa
    import pyarrow.flight as fl

    rows = 256
    batch = pa.record_batch([pa.array([bytes(record_size)] * rows, type=pa.binary())], names=["v"])
    n_batches = -(-total // (rows * record_size))

    class Server(fl.FlightServerBase):  # type: ignore[misc]
        def do_get(self, context: Any, ticket: Any) -> Any:
            def gen() -> Any:
                for _ in range(n_batches):
                    yield batch

            return fl.GeneratorStream(batch.schema, gen())

    server = Server("grpc://127.0.0.1:0")
    conn.send(server.port)
    conn.recv()  # "stop"
    server.shutdown()
    conn.send({})


def flight_client(conn: Connection, port: int, total: int, record_size: int) -> None:
    import pyarrow.flight as fl

    client = fl.FlightClient(f"grpc://127.0.0.1:{port}")
    t0 = time.perf_counter()
    reader = client.do_get(fl.Ticket(b"bench"))
    payload = 0
    for chunk in reader:
        col = chunk.data.column(0)
        payload += col.buffers()[2].size if col.offset == 0 else sum(len(v) for v in col)
    elapsed = time.perf_counter() - t0
    client.close()
    assert payload >= total, (payload, total)
    conn.send({"seconds": elapsed, "bytes": payload})


def run_pair(
    server: Callable[..., None],
    server_args: tuple[Any, ...],
    client: Callable[..., None],
    client_args: tuple[Any, ...],
    *,
    stop_server: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run: the server process reports its port, the client process its result."""
    sp = Child(server, *server_args)
    cp: Child | None = None
    try:
        port = sp.recv(READY_TIMEOUT)
        cp = Child(client, port, *client_args)
        result = cp.recv(600)
        if stop_server:
            sp.send("stop")
        server_result = sp.recv(60)
        return result, server_result
    finally:
        if cp is not None:
            cp.close()
        sp.close()


def flight_gbps(total: int, record_size: int) -> float:
    """GB/s of values of one Flight DoGet of ``total`` bytes of ``record_size`` values."""
    res, _ = run_pair(
        flight_server, (total, record_size), flight_client, (total, record_size), stop_server=True
    )
    return float(res["bytes"]) / float(res["seconds"]) / GB


# -- the raw relay ceiling -------------------------------------------------------------------


def _uvloop_run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def relay_server(conn: Connection, path: str, total: int) -> None:
    """Forward what arrives on a Unix socket to the first TCP client, with backpressure."""
    import asyncio

    async def main() -> None:
        loop = asyncio.get_running_loop()
        down_ready: asyncio.Future[asyncio.Transport] = loop.create_future()
        done: asyncio.Future[None] = loop.create_future()
        up: list[asyncio.Transport] = []

        class Down(asyncio.Protocol):
            def connection_made(self, t: Any) -> None:
                down_ready.set_result(t)

            def pause_writing(self) -> None:
                up[0].pause_reading()

            def resume_writing(self) -> None:
                up[0].resume_reading()

        class Up(asyncio.Protocol):
            def connection_made(self, t: Any) -> None:
                up.append(t)

            def data_received(self, data: bytes) -> None:
                down.write(data)

            def connection_lost(self, exc: Exception | None) -> None:
                down.close()
                done.set_result(None)

        tcp = await loop.create_server(Down, "127.0.0.1", 0)
        unix = await loop.create_unix_server(Up, path)
        conn.send(tcp.sockets[0].getsockname()[1])
        down = await down_ready
        await done
        tcp.close()
        unix.close()

    _uvloop_run(main())
    conn.send({})


def relay_consumer(conn: Connection, port: int, total: int) -> None:
    import asyncio

    async def main() -> float:
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[float] = loop.create_future()
        buf = memoryview(bytearray(1 << 20))

        class Sink(asyncio.BufferedProtocol):
            got = 0

            def get_buffer(self, sizehint: int) -> memoryview:
                return buf

            def buffer_updated(self, nbytes: int) -> None:
                self.got += nbytes
                if self.got >= total and not finished.done():
                    finished.set_result(time.monotonic())

            def connection_lost(self, exc: Exception | None) -> None:
                if not finished.done():
                    finished.set_exception(BenchError(f"relay closed after {self.got} bytes"))

        await loop.create_connection(Sink, "127.0.0.1", port)
        conn.send("ready")
        return await finished

    conn.send({"t1": _uvloop_run(main())})


def relay_producer(conn: Connection, path: str, total: int) -> None:
    import socket

    chunk = memoryview(bytes(SEG))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    conn.send("ready")
    conn.recv()
    t0 = time.monotonic()
    sent = 0
    while sent < total:
        sock.sendall(chunk)
        sent += SEG
    sock.close()
    conn.send({"t0": t0})


def relay_ceiling(total: int) -> dict[str, float]:
    """GB/s of one producer -> relay -> consumer run, and the relay's CPU per 32 KiB."""
    workdir = tempfile.mkdtemp(prefix="xrelay-")
    path = os.path.join(workdir, "relay.sock")
    total = total // SEG * SEG
    relay = Child(relay_server, path, total)
    consumer: Child | None = None
    producer: Child | None = None
    try:
        port = relay.recv(READY_TIMEOUT)
        consumer = Child(relay_consumer, port, total)
        if consumer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("relay consumer did not connect")
        producer = Child(relay_producer, path, total)
        if producer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("relay producer did not connect")
        cpu0 = proc_cpu(relay.pid)
        producer.send("go")
        t0 = producer.recv(600)["t0"]
        t1 = consumer.recv(600)["t1"]
        relay_cpu = proc_cpu(relay.pid) - cpu0
        relay.recv(60)
    finally:
        for child in (producer, consumer, relay):
            if child is not None:
                child.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"gbps": total / (t1 - t0) / GB, "relay_us": relay_cpu / (total / SEG) * 1e6}
