"""Benchmark: buffer pool round trips and record (de)serialization against raw msgpack.

Run ``python bench/bench_serialization.py`` (``--quick`` for a short run). Every figure is
the median of 5 runs. The last line printed is one JSON object with all figures.

* pool: ``request_buffer()`` + ``release()`` pairs per second through a LocalBufferPool.
* serialize: records -> SpanningRecordSerializer -> 32 KiB BufferBuilders -> finished
  buffers (``BufferConsumer.build()``), the way a RecordWriter drives it: serialize
  records until the pending bytes fill the builder, then copy (one copy per buffer: the
  remainder waits for the next records). ``serialize`` calls ``serialize_record`` per
  record; ``serialize_batch`` fills each builder with one ``serialize_until`` call.
* deserialize: those buffers -> RecordDeserializer -> records (each buffer released).
* baselines: ``msgpack.packb`` per record; a streaming ``msgpack.Unpacker`` fed 32 KiB
  chunks of the same stream.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exchange.buffers.buffer import Buffer
from exchange.buffers.buffer_builder import BufferBuilder
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.serialization import (
    BytesCodec,
    RecordCodec,
    RecordDeserializer,
    SpanningRecordSerializer,
)

SEGMENT = 32 * 1024
RUNS = 5
#: Stream bytes serialized (and then deserialized) per pass of a run.
PASS_BYTES = 4 * 1024 * 1024


def median_rate(count: int, run: Callable[[], float]) -> float:
    """Median of RUNS of ``count / run()`` where ``run`` returns the seconds it measured."""
    rates = []
    for _ in range(RUNS):
        gc.collect()
        rates.append(count / run())
    return statistics.median(rates)


def clock(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """``fn(*args)``: the seconds it took (garbage collector off) and its result."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = fn(*args)
        return time.perf_counter() - t0, result
    finally:
        gc.enable()


def timed(fn: Callable[[], Any]) -> float:
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


# -- pool -----------------------------------------------------------------------------------


def bench_pool(pool: LocalBufferPool, n: int) -> float:
    request = pool.request_buffer

    def run() -> None:
        for _ in range(n):
            buf = request()
            assert buf is not None
            buf.release()

    return median_rate(n, lambda: timed(run))


# -- records ------------------------------------------------------------------------------


class _Writer:
    """Finished buffers of one channel, the way a RecordWriter produces them."""

    def __init__(self, pool: LocalBufferPool) -> None:
        self.request = pool.request_buffer_builder
        self.out: list[Buffer] = []
        self.builder = self._new_builder()
        self.consumer = self.builder.create_buffer_consumer()

    def _new_builder(self) -> BufferBuilder:
        builder = self.request()
        assert builder is not None, "benchmark pool too small"
        return builder

    def next_builder(self) -> BufferBuilder:
        """Finish the current builder and start a new one."""
        self.builder.finish()
        self.out.append(self.consumer.build())
        self.consumer.close()
        self.builder.close()
        self.builder = self._new_builder()
        self.consumer = self.builder.create_buffer_consumer()
        return self.builder

    def fill(self, ser: SpanningRecordSerializer) -> BufferBuilder:
        """Copy while the pending bytes fill whole builders; a remainder waits for more.

        One copy per buffer: the bytes left over after a full builder are copied with
        the next records instead of on their own.
        """
        builder = self.builder
        while ser.copy_to_buffer_builder(builder).is_full_buffer:
            builder = self.next_builder()
            if ser.pending_bytes < builder.writable_bytes:
                break
        return builder

    def copy_all(self, ser: SpanningRecordSerializer) -> BufferBuilder:
        """Copy everything pending (Flink's copyFromSerializerToTargetChannel)."""
        builder = self.builder
        result = ser.copy_to_buffer_builder(builder)
        while result.is_full_buffer:
            builder = self.next_builder()
            if result.is_full_record:
                break
            result = ser.copy_to_buffer_builder(builder)
        return builder

    def close(self, ser: SpanningRecordSerializer) -> list[Buffer]:
        self.copy_all(ser)
        self.builder.finish()
        self.out.append(self.consumer.build())
        self.consumer.close()
        self.builder.close()
        return self.out


def serialize_all(
    pool: LocalBufferPool, records: list[Any], codec: RecordCodec | None = None
) -> list[Buffer]:
    """Records -> finished buffers with ``serialize_record`` (RecordWriter.emit)."""
    ser = SpanningRecordSerializer(codec)
    serialize = ser.serialize_record
    writer = _Writer(pool)
    room = writer.builder.writable_bytes
    for record in records:
        if serialize(record) >= room:
            room = writer.fill(ser).writable_bytes
    return writer.close(ser)


def serialize_all_batched(
    pool: LocalBufferPool, records: list[Any], codec: RecordCodec | None = None
) -> list[Buffer]:
    """Records -> finished buffers with ``serialize_until`` (a batch per builder)."""
    ser = SpanningRecordSerializer(codec)
    serialize_until = ser.serialize_until
    writer = _Writer(pool)
    room = writer.builder.writable_bytes
    it = iter(records)
    while serialize_until(it, room) >= room:
        room = writer.fill(ser).writable_bytes
    return writer.close(ser)


def deserialize_all(buffers: list[Buffer], codec: RecordCodec | None = None) -> int:
    deser = RecordDeserializer(codec)
    feed = deser.set_next_buffer
    take = deser.records
    n = 0
    for buf in buffers:
        feed(buf)
        for _record in take():
            n += 1
    assert not deser.has_partial_record
    return n


def slices(records: list[Any], stream_bytes: int) -> list[list[Any]]:
    """``records`` cut into slices of about ``PASS_BYTES`` of stream each."""
    per = max(1, len(records) * PASS_BYTES // max(stream_bytes, 1))
    return [records[i : i + per] for i in range(0, len(records), per)]


def bench_records(pool: LocalBufferPool, records: list[Any]) -> dict[str, float]:
    """Our directions and the msgpack baselines, runs interleaved against load drift.

    A run goes through the records in slices of about PASS_BYTES of stream: each slice is
    serialized into buffers that are then deserialized, so the buffers in flight stay
    cache-sized, as in a pipelined exchange; the baselines go through the same slices.
    """
    n = len(records)
    expected = [list(r) for r in records]
    for serialize in (serialize_all, serialize_all_batched):
        got: list[Any] = []
        deser = RecordDeserializer()
        for buf in serialize(pool, records):
            deser.set_next_buffer(buf)
            got += deser.records()
        assert got == expected, "round trip changed the records"
    del got, expected

    packb = msgpack.packb
    stream_bytes = sum(len(packb(r)) for r in records)
    parts = slices(records, stream_bytes)
    part_chunks = []
    for part in parts:
        stream = b"".join(packb(r) for r in part)
        part_chunks.append([stream[i : i + SEGMENT] for i in range(0, len(stream), SEGMENT)])

    def run_packb(part: list[Any]) -> None:
        for record in part:
            packb(record)

    def run_unpacker(chunks: list[bytes]) -> int:
        unpacker = msgpack.Unpacker()
        feed = unpacker.feed
        count = 0
        for chunk in chunks:
            feed(chunk)
            for _obj in unpacker:
                count += 1
        return count

    seconds: dict[str, list[float]] = {}
    for _ in range(RUNS):
        run: dict[str, float] = dict.fromkeys(
            ("serialize", "packb", "deserialize", "unpacker", "serialize_batch"), 0.0
        )
        gc.collect()
        for part, chunks in zip(parts, part_chunks, strict=True):
            t, buffers = clock(serialize_all, pool, part)
            run["serialize"] += t
            run["packb"] += clock(run_packb, part)[0]
            t, count = clock(deserialize_all, buffers)
            run["deserialize"] += t
            assert count == len(part)
            t, count = clock(run_unpacker, chunks)
            run["unpacker"] += t
            assert count == len(part)
            t, buffers = clock(serialize_all_batched, pool, part)
            run["serialize_batch"] += t
            deserialize_all(buffers)
            assert pool.num_in_use == 0
        for name, value in run.items():
            seconds.setdefault(name, []).append(value)

    result = {name: n / statistics.median(values) for name, values in seconds.items()}
    result["bytes_per_record"] = stream_bytes / n
    return result


def bench_blobs(pool: LocalBufferPool, records: list[bytes]) -> dict[str, float]:
    """4 KiB bytes records through BytesCodec (framed, no msgpack): MB/s of payload."""
    codec = BytesCodec()
    n = len(records)
    mb = n * len(records[0]) / 1e6
    got: list[Any] = []
    deser = RecordDeserializer(codec)
    for buf in serialize_all(pool, records, codec):
        deser.set_next_buffer(buf)
        got += deser.records()
    assert got == records
    del got
    rates: dict[str, list[float]] = {}

    def measure(name: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        holder: list[Any] = []
        seconds = timed(lambda: holder.append(fn()))
        rates.setdefault(name, []).append(mb / seconds)
        return holder[0]

    for _ in range(RUNS):
        buffers = measure("serialize_mb_s", lambda: serialize_all(pool, records, codec))
        assert measure("deserialize_mb_s", lambda b=buffers: deserialize_all(b, codec)) == n
        buffers = measure(
            "serialize_batch_mb_s", lambda: serialize_all_batched(pool, records, codec)
        )
        deserialize_all(buffers, codec)
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    n_pool = 500_000 // scale
    n_small = 300_000 // scale
    n_large = 30_000 // scale

    nbp = NetworkBufferPool(1500, SEGMENT)
    pool = nbp.create_buffer_pool(1, 1500)
    text = "".join(chr(0x61 + i % 26) for i in range(1000))
    small = [(i, f"k{i % 10_000_000:07d}", i * 0.25) for i in range(n_small)]
    large = [(i, text[i % 26 :] + text[: i % 26]) for i in range(n_large)]
    blobs = [bytes([i % 256]) * 4096 for i in range(n_large // 4)]

    results: dict[str, Any] = {"quick": args.quick, "runs": RUNS}
    results["pool_request_release_per_s"] = bench_pool(pool, n_pool)
    for name, records in (("small", small), ("1kib", large)):
        r = bench_records(pool, records)
        results[name] = r
        r["serialize_vs_packb"] = r["serialize"] / r["packb"]
        r["serialize_batch_vs_packb"] = r["serialize_batch"] / r["packb"]
        r["deserialize_vs_unpacker"] = r["deserialize"] / r["unpacker"]
    results["blobs_4kib"] = bench_blobs(pool, blobs)

    pool.destroy()
    nbp.check_consistency()
    assert nbp.is_whole()
    nbp.destroy()

    targets = {"small": 0.70, "1kib": 0.85}
    print(f"pool request+release pairs: {results['pool_request_release_per_s'] / 1e6:8.2f} M/s")
    print()
    header = f"{'records':<8} {'direction':<16} {'ours M rec/s':>13} {'baseline':>16} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name in ("small", "1kib"):
        r = results[name]
        target = targets[name]
        for direction, base, key in (
            ("serialize", "packb", "serialize_vs_packb"),
            ("serialize_batch", "packb", "serialize_batch_vs_packb"),
            ("deserialize", "unpacker", "deserialize_vs_unpacker"),
        ):
            ok = "ok" if r[key] >= target else f"< {target}"
            print(
                f"{name:<8} {direction:<16} {r[direction] / 1e6:13.3f} "
                f"{r[base] / 1e6:9.3f} {base:<6} {r[key]:7.2f} {ok}"
            )
    print(
        f"(record sizes: small {results['small']['bytes_per_record']:.1f} B, "
        f"1kib {results['1kib']['bytes_per_record']:.1f} B; segment {SEGMENT} B)"
    )
    b = results["blobs_4kib"]
    print(
        f"4 KiB bytes records (BytesCodec): serialize {b['serialize_mb_s']:.0f} MB/s, "
        f"batch {b['serialize_batch_mb_s']:.0f} MB/s, deserialize {b['deserialize_mb_s']:.0f} MB/s"
    )
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
