"""Benchmark: the compiled frame parser on the receive path, per read-ahead.

Run ``python bench/bench_frame_parser.py`` (``--quick`` for a short run). A sender process
writes 32 KiB ``BufferResponse`` frames (``writev`` of header + payload pieces) into one end
of a Unix socketpair; the receiver is a uvloop ``asyncio.BufferedProtocol`` around
``InPlaceFrameDecoder`` whose body sink hands out segment views (as the data-port client
does), and checks every landed frame (sequence, size, the payload's first and last byte).
Figure: the receiving process's CPU (user + system, so the kernel's copy out of the socket
is in it) per 32 KiB frame, for a read-ahead of 1 KiB (a frame costs two receive calls:
header, then the payload straight into its segment), 64 KiB and 256 KiB (the data-port
client's: a batch of frames per read, payloads copied from the read into their
segments). Rounds interleave the read-aheads, against load drift; medians. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchError, json_line, median

from exchange.buffers.buffer import DataType
from exchange.protocol.codec import (
    DEFAULT_READ_AHEAD,
    BufferResponseHeader,
    InPlaceFrameDecoder,
    encode_buffer_response_header,
    max_frame_size_for,
)

SEG = 32 * 1024
BATCH = 64  # frames per sendmsg
READ_AHEADS = {"1k": 1024, "64k": 64 * 1024, "256k": 256 * 1024}
assert READ_AHEADS["256k"] == DEFAULT_READ_AHEAD  # the data-port client's


def payload(seq: int) -> bytes:
    return bytes([seq % 251]) + bytes(SEG - 2) + bytes([(seq * 7) % 251])


def sender(fd: int, frames: int) -> None:
    sock = socket.socket(fileno=fd)
    with sock:
        for first in range(0, frames, BATCH):
            pieces: list[bytes] = []
            for seq in range(first, min(first + BATCH, frames)):
                header = encode_buffer_response_header(1, seq, 0, DataType.DATA_BUFFER, False, SEG)
                pieces += [header, payload(seq)]
            sock.sendmsg(pieces)


def receive(read_ahead: int, frames: int) -> float:
    """CPU seconds of this process to receive and check ``frames`` frames."""
    import uvloop

    ours, theirs = socket.socketpair()
    fd = theirs.detach()
    proc = mp.get_context("fork").Process(target=sender, args=(fd, frames))
    proc.start()
    socket.socket(fileno=fd).close()  # the sender holds its end now: EOF when it is done
    # More segments than frames in one read: each is checked before it is used again.
    segments = [memoryview(bytearray(SEG)) for _ in range(16)]
    expect = [0]
    errors: list[str] = []

    def sink(header: BufferResponseHeader) -> memoryview:
        return segments[header.sequence_number % 16][: header.size]

    decoder = InPlaceFrameDecoder(max_frame_size_for(SEG), body_sink=sink, read_ahead=read_ahead)

    class Receiver(asyncio.BufferedProtocol):
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.done = done
            self.transport: asyncio.BaseTransport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def get_buffer(self, sizehint: int) -> memoryview:
            return decoder.get_buffer(sizehint)

        def buffer_updated(self, nbytes: int) -> None:
            for item in decoder.buffer_updated(nbytes):
                h = item.header  # type: ignore[union-attr]
                seq = expect[0]
                p = item.payload  # type: ignore[union-attr]
                ok = h.sequence_number == seq and h.size == SEG
                if not ok or p[0] != seq % 251 or p[-1] != (seq * 7) % 251:
                    errors.append(f"frame {seq} arrived wrong: {h!r}")
                    assert self.transport is not None
                    self.transport.abort()
                    return
                expect[0] = seq + 1

        def connection_lost(self, exc: Exception | None) -> None:
            self.done.set_result(None)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        await loop.connect_accepted_socket(lambda: Receiver(done), ours)
        await done
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime

    cpu = uvloop.run(main())
    if errors:
        proc.kill()
    proc.join()
    if errors:
        raise BenchError(errors[0])
    if proc.exitcode != 0 or expect[0] != frames or decoder.buffered:
        raise BenchError(f"received {expect[0]} of {frames} frames (sender {proc.exitcode})")
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,048 frames per run, 3 rounds")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    frames = 2048 if args.quick else 8192
    runs: dict[str, list[float]] = {k: [] for k in READ_AHEADS}
    for _ in range(rounds):
        for name, read_ahead in READ_AHEADS.items():
            runs[name].append(receive(read_ahead, frames) / frames * 1e6)
    m = {k: median(v) for k, v in runs.items()}
    results: dict[str, Any] = {
        "bench": "frame_parser",
        "quick": args.quick,
        "rounds": rounds,
        "frames_per_run": frames,
        "frame_payload_bytes": SEG,
        **{f"receive_cpu_us_per_32k_read_ahead_{k}": v for k, v in m.items()},
        "ratio_256k_over_1k": m["256k"] / m["1k"],
    }
    print(f"receiving 32 KiB BufferResponses from a socketpair, median of {rounds} rounds")
    for name, values in runs.items():
        print(
            f"  read-ahead {name:>4}: {m[name]:5.2f} us of CPU per frame   "
            f"runs {[round(v, 2) for v in values]}"
        )
    print(json_line(results))


if __name__ == "__main__":
    main()
