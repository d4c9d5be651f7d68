"""Benchmark: the network stack against a raw uvloop socket and Arrow Flight, on loopback.

Run ``python bench/bench_network.py`` (``--quick`` for a short run, ``--profile`` to
cProfile one run of (b) in both processes). Every configuration runs in two fresh
processes (sender and receiver, ``multiprocessing`` spawn), 5 times (3 with ``--quick``);
figures are medians. The last line printed is one JSON object with every figure.

* (a) raw: a uvloop ``asyncio.Protocol`` sender writes 32 KiB chunks (respecting
  ``pause_writing``/``resume_writing``) to a ``Protocol`` receiver that counts bytes.
* (b) stack: a RecordWriter writes 4 KiB ``bytes`` records (BytesCodec) into one
  pipelined partition of a daemon-style process (DataServer, 32 KiB buffers, default
  watermarks); a RemoteInputChannel in the other process reads them back through a
  SingleInputGate and a RecordReader (BytesCodec), with credit-based flow control
  (2 exclusive buffers, 8 floating). GB/s of record payload.
* (b8) the same with 8 subpartitions read by 8 channels over one connection.
* (b100) 100-byte records, in records/s (and payload GB/s).
* (c) Arrow Flight DoGet: a FlightServerBase yields record batches of one binary column
  of 4 KiB values; the client reads the stream. GB/s of values.

Ratios: b/a (the target is >= 0.40), b8/a, b/c.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEG = 32 * 1024
CHUNK = 32 * 1024
RECORD = 4096
SMALL = 100
EXCLUSIVE, FLOATING = 2, 8
PARTITION_POOL = 64  # buffers of the producer's partition (2 MiB)
GB = 1e9


# -- (a) raw socket -----------------------------------------------------------------------


def raw_receiver(conn: Connection, total: int) -> None:
    import uvloop

    class Receiver(asyncio.Protocol):
        def __init__(self, done: asyncio.Future[float]) -> None:
            self.done = done
            self.n = 0
            self.t0 = 0.0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t0 = time.perf_counter()

        def data_received(self, data: bytes) -> None:
            self.n += len(data)
            if self.n >= total and not self.done.done():
                self.done.set_result(time.perf_counter() - self.t0)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[float] = loop.create_future()
        server = await loop.create_server(lambda: Receiver(done), "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        elapsed = await done
        conn.send({"seconds": elapsed, "bytes": total})
        server.close()

    uvloop.run(main())


def raw_sender(conn: Connection, port: int, total: int) -> None:
    import uvloop

    class Sender(asyncio.Protocol):
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.done = done
            self.chunk = bytes(CHUNK)
            self.sent = 0
            self.paused = False
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.write()

        def write(self) -> None:
            transport = self.transport
            assert transport is not None
            chunk = self.chunk
            while not self.paused and self.sent < total:
                transport.write(chunk)
                self.sent += CHUNK
            if self.sent >= total and not self.done.done():
                transport.close()

        def pause_writing(self) -> None:
            self.paused = True

        def resume_writing(self) -> None:
            self.paused = False
            self.write()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.done.done():
                self.done.set_result(None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(lambda: Sender(done), "127.0.0.1", port)
        await done

    uvloop.run(main())
    conn.send({})


# -- (b) this stack -----------------------------------------------------------------------


def stack_server(
    conn: Connection, total_records: int, record_size: int, subpartitions: int, profile: bool
) -> None:
    import uvloop

    from exchange.memory import NetworkBufferPool
    from exchange.partition import (
        ResultPartition,
        ResultPartitionID,
        ResultPartitionManager,
        ResultPartitionType,
    )
    from exchange.serialization.codec import BytesCodec
    from exchange.writer import RecordWriter
    from server.partition_request_server import DataServer

    prof = cProfile.Profile() if profile else None

    async def main() -> None:
        nbp = NetworkBufferPool(256, SEG)
        manager = ResultPartitionManager()
        server = DataServer(manager, segment_size=SEG)
        _, port = await server.start("127.0.0.1", 0)
        pool = nbp.create_buffer_pool(subpartitions, max(PARTITION_POOL, 2 * subpartitions))
        part = ResultPartition(
            ResultPartitionID("bench", 0), ResultPartitionType.PIPELINED, subpartitions, pool
        )
        manager.register_result_partition(part)
        conn.send(port)
        record = bytes(record_size)
        writer = RecordWriter(part, codec=BytesCodec())
        cpu0 = time.process_time()
        if prof is not None:
            prof.enable()
        batch = 10_000
        left = total_records
        while left > 0:
            n = min(batch, left)
            await writer.emit_all([record] * n)
            left -= n
        await writer.close()
        cpu = time.process_time() - cpu0
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        if prof is not None:
            prof.disable()
        await server.close()
        nbp.check_consistency()
        conn.send({"whole": nbp.is_whole(), "cpu": cpu, "profile": _profile_text(prof)})

    uvloop.run(main())


def stack_client(
    conn: Connection, port: int, subpartitions: int, expect_records: int, profile: bool
) -> None:
    import uvloop

    from client.network import ConnectionManager
    from exchange.consumer import RecordReader, SingleInputGate
    from exchange.consumer.remote_input_channel import RemoteInputChannel
    from exchange.memory import NetworkBufferPool
    from exchange.partition import ResultPartitionID
    from exchange.serialization.codec import BytesCodec

    prof = cProfile.Profile() if profile else None

    async def main() -> None:
        nbp = NetworkBufferPool(subpartitions * EXCLUSIVE + FLOATING + 8, SEG)
        cm = ConnectionManager(segment_size=SEG)
        gate = SingleInputGate("bench", nbp.create_buffer_pool(0, FLOATING))
        pid = ResultPartitionID("bench", 0)
        address = f"127.0.0.1:{port}"
        gate.set_input_channels(
            [
                RemoteInputChannel(gate, i, pid, i, address, cm, nbp, num_exclusive=EXCLUSIVE)
                for i in range(subpartitions)
            ]
        )
        reader = RecordReader(gate, codec=BytesCodec())
        records = 0
        payload = 0
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        await gate.request_partitions()
        while (batch := await reader.next_batch()) is not None:
            records += len(batch)
            payload += sum(map(len, batch))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if prof is not None:
            prof.disable()
        reader.close()
        await cm.close()
        assert records == expect_records, (records, expect_records)
        conn.send(
            {
                "seconds": elapsed,
                "bytes": payload,
                "records": records,
                "cpu": cpu,
                "whole": nbp.is_whole(),
                "profile": _profile_text(prof),
            }
        )

    uvloop.run(main())


# -- (c) Arrow Flight ---------------------------------------------------------------------


def flight_server(conn: Connection, total: int) -> None:
    import pyarrow as pa
    import pyarrow.flight as fl

    rows = 256
    batch = pa.record_batch([pa.array([bytes(RECORD)] * rows, type=pa.binary())], names=["v"])
    n_batches = -(-total // (rows * RECORD))

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


def flight_client(conn: Connection, port: int, total: int) -> None:
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


# -- driver -------------------------------------------------------------------------------


def _profile_text(prof: cProfile.Profile | None, limit: int = 25) -> str | None:
    if prof is None:
        return None
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def _receive(conn: Connection, timeout: float, what: str) -> Any:
    try:
        if conn.poll(timeout):
            return conn.recv()
    except EOFError:
        pass
    raise RuntimeError(f"{what} (see its traceback above)")


def run_pair(
    server: Callable[..., None],
    server_args: tuple[Any, ...],
    client: Callable[..., None],
    client_args: tuple[Any, ...],
    *,
    stop_server: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run: the server process reports its port, the client process its result."""
    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    c_parent, c_child = ctx.Pipe()
    sp = ctx.Process(target=server, args=(s_child, *server_args))
    procs = [sp]
    sp.start()
    s_child.close()  # so that a child that dies reads as EOF here, not as a long wait
    try:
        port = _receive(s_parent, 60, "server process did not start")
        cp = ctx.Process(target=client, args=(c_child, port, *client_args))
        procs.append(cp)
        cp.start()
        c_child.close()
        result = _receive(c_parent, 600, "client process gave no result")
        cp.join(30)
        if stop_server:
            s_parent.send("stop")
        server_result = _receive(s_parent, 60, "server process gave no result")
        sp.join(30)
        return result, server_result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def median_of(runs: int, once: Callable[[], dict[str, Any]], key: str) -> tuple[float, list[float]]:
    values = [once()[key] for _ in range(runs)]
    return statistics.median(values), values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 MB per run, 3 runs")
    ap.add_argument("--profile", action="store_true", help="cProfile one run of (b)")
    args = ap.parse_args()
    runs = 3 if args.quick else 5
    total = 500_000_000 if args.quick else 2_000_000_000
    n_records = total // RECORD
    n_small = 3_000_000 if args.quick else 10_000_000

    if args.profile:
        n = min(n_records, 100_000)
        res, srv = run_pair(
            stack_server, (n, RECORD, 1, True), stack_client, (1, n, True), stop_server=True
        )
        print(f"(b) once, {res['bytes'] / res['seconds'] / GB:.2f} GB/s")
        print("== consumer process ==\n" + (res["profile"] or ""))
        print("== producer / daemon process ==\n" + (srv["profile"] or ""))
        return

    def raw_once() -> dict[str, Any]:
        _, res = run_pair(raw_receiver, (total,), raw_sender, (total,), stop_server=False)
        return {"gbps": res["bytes"] / res["seconds"] / GB}

    def stack_once(record: int, count: int, subs: int) -> dict[str, Any]:
        res, srv = run_pair(
            stack_server, (count, record, subs, False), stack_client, (subs, count, False),
            stop_server=True,
        )  # fmt: skip
        assert res["whole"] and srv["whole"], (res, srv)
        buffers = count * (record + 4) / SEG
        return {
            "gbps": res["bytes"] / res["seconds"] / GB,
            "recps": res["records"] / res["seconds"],
            "client_cpu_us": res["cpu"] / buffers * 1e6,
            "server_cpu_us": srv["cpu"] / buffers * 1e6,
        }

    def flight_once() -> dict[str, Any]:
        res, _ = run_pair(flight_server, (total,), flight_client, (total,), stop_server=True)
        return {"gbps": res["bytes"] / res["seconds"] / GB}

    results: dict[str, Any] = {}
    raw, raw_all = median_of(runs, raw_once, "gbps")
    results["a_raw_gbps"] = raw
    b_runs = [stack_once(RECORD, n_records, 1) for _ in range(runs)]
    results["b_stack_gbps"] = statistics.median(r["gbps"] for r in b_runs)
    results["b_consumer_cpu_us_per_buffer"] = statistics.median(r["client_cpu_us"] for r in b_runs)
    results["b_producer_cpu_us_per_buffer"] = statistics.median(r["server_cpu_us"] for r in b_runs)
    b8_runs = [stack_once(RECORD, n_records, 8) for _ in range(runs)]
    results["b8_stack_8ch_gbps"] = statistics.median(r["gbps"] for r in b8_runs)
    b100_runs = [stack_once(SMALL, n_small, 1) for _ in range(runs)]
    results["b100_records_per_s"] = statistics.median(r["recps"] for r in b100_runs)
    results["b100_gbps"] = statistics.median(r["gbps"] for r in b100_runs)
    flight, flight_all = median_of(runs, flight_once, "gbps")
    results["c_flight_gbps"] = flight
    results["b_over_a"] = results["b_stack_gbps"] / raw
    results["b8_over_a"] = results["b8_stack_8ch_gbps"] / raw
    results["b_over_c"] = results["b_stack_gbps"] / flight
    results["runs"] = runs
    results["bytes_per_run"] = total
    results["b100_records_per_run"] = n_small

    rows = [
        ("(a) raw uvloop Protocol, 32 KiB chunks", f"{raw:.2f} GB/s", raw_all),
        ("(b) stack, 4 KiB records, 1 channel", f"{results['b_stack_gbps']:.2f} GB/s",
         [r["gbps"] for r in b_runs]),
        ("(b8) stack, 8 channels / 1 connection", f"{results['b8_stack_8ch_gbps']:.2f} GB/s",
         [r["gbps"] for r in b8_runs]),
        ("(b100) stack, 100 B records", f"{results['b100_records_per_s'] / 1e6:.2f} M rec/s",
         [r["recps"] / 1e6 for r in b100_runs]),
        ("(c) Arrow Flight DoGet, 4 KiB values", f"{flight:.2f} GB/s", flight_all),
    ]  # fmt: skip
    print(f"{'configuration':42} {'median':>14}   runs")
    for name, med, values in rows:
        print(f"{name:42} {med:>14}   " + " ".join(f"{v:.2f}" for v in values))
    print(
        f"(b) CPU per 32 KiB buffer: consumer process "
        f"{results['b_consumer_cpu_us_per_buffer']:.1f} us, producer/daemon process "
        f"{results['b_producer_cpu_us_per_buffer']:.1f} us"
    )
    print(
        f"b/a = {results['b_over_a']:.2f} (target >= 0.40)   "
        f"b8/a = {results['b8_over_a']:.2f}   b/c = {results['b_over_c']:.2f}"
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
