"""Benchmark: the record codecs as the writer and the reader run them, against baselines.

Run ``python bench/bench_serialization.py`` (``--quick`` for a short run). Every figure is
the median of 5 runs, with the baselines measured in the same runs (interleaved, against
load drift). The last line printed is one JSON object with all figures and ratios.

What the writer runs: records are grouped per subpartition into batches of about one
buffer of stream (``BATCH_BYTES``) and each batch goes through the encoder's
``encode_batch``; the reader feeds the channel's stream in ``SEGMENT``-sized memoryview
pieces to the decoder and takes the records after each piece.

* ``encode`` / ``decode``: the default codec (``PickleBatchCodec``), M records/s.
* baselines: ``pickle.dumps`` / ``pickle.loads`` of the same lists (protocol 5, no
  framing, no pieces: the floor of this format); ``pickle.dumps`` per record (what the
  batching saves); ``msgpack.packb`` per record and a streaming ``msgpack.Unpacker`` fed
  the same pieces (the previous default; it cannot encode the mixed records).
* ``msgpack_codec_encode`` / ``_decode``: ``MsgpackCodec`` through the same batch path.

Record sets: small ``(int, int)`` tuples; 1 KiB ``(int, str)`` records; mixed records
(strings, datetimes with a time zone, ``Decimal``, nested lists and dicts, a namedtuple).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import gc
import json
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exchange.serialization import MsgpackCodec, RecordCodec, default_codec

SEGMENT = 32 * 1024
#: Stream bytes per encode_batch call (the writer batches about a buffer per subpartition).
BATCH_BYTES = 32 * 1024
RUNS = 5
#: Records per pass: each pass encodes then decodes one slice, so data stays cache-sized.
PASS_BYTES = 4 * 1024 * 1024

Event = collections.namedtuple("Event", ["user", "at", "amount", "tags"])


def clock(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """``fn(*args)``: the seconds it took (garbage collector off) and its result."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = fn(*args)
        return time.perf_counter() - t0, result
    finally:
        gc.enable()


def batches(records: list[Any], per: int) -> list[list[Any]]:
    return [records[i : i + per] for i in range(0, len(records), per)]


def pieces(stream: bytes | bytearray) -> list[memoryview]:
    """The stream as the reader gets it: buffer-sized memoryviews."""
    view = memoryview(stream)
    return [view[i : i + SEGMENT] for i in range(0, len(stream), SEGMENT)]


def encode_all(codec: RecordCodec, groups: list[list[Any]]) -> list[bytes | bytearray]:
    """The writer: one ``encode_batch`` per batch (copying chunks to buffers is not timed)."""
    encode_batch = codec.new_encoder().encode_batch
    return [encode_batch(group) for group in groups]


def decode_all(codec: RecordCodec, chunks: list[memoryview]) -> int:
    """The reader: feed each buffer, take the records."""
    decoder = codec.new_decoder()
    feed = decoder.feed
    take = decoder.take
    n = 0
    for chunk in chunks:
        feed(chunk)
        n += len(take())
    assert not decoder.has_partial_record
    return n


def bench_records(records: list[Any], *, with_msgpack: bool) -> dict[str, float]:
    """Records/s of each direction and baseline, and the stream's bytes per record."""
    codec = default_codec()
    n = len(records)
    bytes_per_record = len(b"".join(encode_all(codec, [records]))) / n
    per_batch = max(1, int(BATCH_BYTES / bytes_per_record))
    per_pass = max(per_batch, int(PASS_BYTES / bytes_per_record))
    passes = [batches(records[i : i + per_pass], per_batch) for i in range(0, n, per_pass)]

    check = codec.new_decoder()
    check.feed(b"".join(encode_all(codec, passes[0])))
    assert check.take() == [r for group in passes[0] for r in group], "round trip changed"

    mp_codec = MsgpackCodec()
    packb = msgpack.packb
    dumps = pickle.dumps
    loads = pickle.loads

    def run_dumps(groups: list[list[Any]]) -> list[bytes]:
        return [dumps(group, 5) for group in groups]

    def run_loads(blobs: list[bytes]) -> int:
        return sum(len(loads(blob)) for blob in blobs)

    def run_dumps_per_record(groups: list[list[Any]]) -> None:
        for group in groups:
            for record in group:
                dumps(record, 5)

    def run_packb(groups: list[list[Any]]) -> bytes:
        return b"".join([packb(record) for group in groups for record in group])

    def run_unpacker(chunks: list[memoryview]) -> int:
        unpacker = msgpack.Unpacker()
        count = 0
        for chunk in chunks:
            unpacker.feed(chunk)
            for _ in unpacker:
                count += 1
        return count

    seconds: dict[str, list[float]] = {}
    for _ in range(RUNS):
        run: dict[str, float] = collections.defaultdict(float)
        gc.collect()
        for groups in passes:
            count = sum(len(g) for g in groups)
            t, encoded = clock(encode_all, codec, groups)
            run["encode"] += t
            chunks = pieces(b"".join(encoded))
            t, got = clock(decode_all, codec, chunks)
            run["decode"] += t
            assert got == count
            t, blobs = clock(run_dumps, groups)
            run["pickle_dumps"] += t
            t, got = clock(run_loads, blobs)
            run["pickle_loads"] += t
            assert got == count
            run["pickle_dumps_per_record"] += clock(run_dumps_per_record, groups)[0]
            if with_msgpack:
                t, packed = clock(run_packb, groups)
                run["msgpack_packb"] += t
                mp_chunks = pieces(packed)
                t, got = clock(run_unpacker, mp_chunks)
                run["msgpack_unpacker"] += t
                assert got == count
                t, encoded = clock(encode_all, mp_codec, groups)
                run["msgpack_codec_encode"] += t
                t, got = clock(decode_all, mp_codec, pieces(b"".join(encoded)))
                run["msgpack_codec_decode"] += t
                assert got == count
        for name, value in run.items():
            seconds.setdefault(name, []).append(value)

    result = {name: n / statistics.median(values) for name, values in seconds.items()}
    result["bytes_per_record"] = bytes_per_record
    result["records_per_batch"] = per_batch
    result["encode_vs_pickle_dumps"] = result["encode"] / result["pickle_dumps"]
    result["decode_vs_pickle_loads"] = result["decode"] / result["pickle_loads"]
    result["encode_vs_pickle_per_record"] = result["encode"] / result["pickle_dumps_per_record"]
    if with_msgpack:
        result["encode_vs_msgpack_packb"] = result["encode"] / result["msgpack_packb"]
        result["decode_vs_msgpack_unpacker"] = result["decode"] / result["msgpack_unpacker"]
    return result


def mixed_records(n: int) -> list[Any]:
    tz = dt.timezone(dt.timedelta(hours=2))
    base = dt.datetime(2024, 1, 1, tzinfo=tz)
    out: list[Any] = []
    for i in range(n):
        match i % 4:
            case 0:
                out.append((f"user{i % 1000}", base + dt.timedelta(seconds=i), Decimal(i) / 100))
            case 1:
                out.append([i, [f"t{i % 7}", f"t{i % 11}"], {"k": i, "v": [1.5, None]}])
            case 2:
                out.append(Event(f"u{i}", dt.date(2024, 1, 1 + i % 28), i * 0.5, {"a", "b"}))
            case _:
                out.append({"id": i, "name": "x" * (i % 40), "when": base, "ok": i % 2 == 0})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    n_small = 400_000 // scale
    n_large = 30_000 // scale
    n_mixed = 100_000 // scale

    text = "".join(chr(0x61 + i % 26) for i in range(1000))
    sets: dict[str, tuple[list[Any], bool]] = {
        "small": ([(i, i * 7) for i in range(n_small)], True),
        "1kib": ([(i, text[i % 26 :] + text[: i % 26]) for i in range(n_large)], True),
        "mixed": (mixed_records(n_mixed), False),
    }
    results: dict[str, Any] = {
        "quick": args.quick,
        "runs": RUNS,
        "codec": repr(default_codec()),
        "segment": SEGMENT,
        "batch_bytes": BATCH_BYTES,
    }
    for name, (records, with_msgpack) in sets.items():
        results[name] = bench_records(records, with_msgpack=with_msgpack)

    header = f"{'records':<8} {'direction':<8} {'M rec/s':>8}   baselines (M rec/s, ratio)"
    print(header)
    print("-" * 78)
    for name in sets:
        r = results[name]
        enc = (
            f"pickle.dumps list {r['pickle_dumps'] / 1e6:6.2f} ({r['encode_vs_pickle_dumps']:.2f})"
        )
        enc += f", per record {r['pickle_dumps_per_record'] / 1e6:5.2f}"
        dec = (
            f"pickle.loads list {r['pickle_loads'] / 1e6:6.2f} ({r['decode_vs_pickle_loads']:.2f})"
        )
        if "msgpack_packb" in r:
            enc += f", packb {r['msgpack_packb'] / 1e6:5.2f} ({r['encode_vs_msgpack_packb']:.2f})"
            dec += (
                f", Unpacker {r['msgpack_unpacker'] / 1e6:5.2f} "
                f"({r['decode_vs_msgpack_unpacker']:.2f})"
            )
        print(f"{name:<8} {'encode':<8} {r['encode'] / 1e6:8.2f}   {enc}")
        print(f"{name:<8} {'decode':<8} {r['decode'] / 1e6:8.2f}   {dec}")
        if "msgpack_codec_encode" in r:
            print(
                f"{name:<8} {'msgpack':<8} {r['msgpack_codec_encode'] / 1e6:8.2f}   "
                f"MsgpackCodec encode_batch; decode {r['msgpack_codec_decode'] / 1e6:.2f}"
            )
    sizes = ", ".join(
        f"{name} {results[name]['bytes_per_record']:.1f} B x {results[name]['records_per_batch']}"
        for name in sets
    )
    print(f"(stream bytes per record x records per batch: {sizes}; segment {SEGMENT} B)")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
