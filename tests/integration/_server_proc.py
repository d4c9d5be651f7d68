"""A data-port daemon for integration tests: a DataServer plus producers, in its own process.

Usage: ``python _server_proc.py '<json config>'``. It prints one JSON object per line on
stdout; the first is ``{"event": "ready", "port": ...}``. Then it obeys JSON commands on
stdin, one per line:

* ``{"cmd": "stats"}``: answers ``{"event": "stats", ...}`` with the pool, server,
  partition and producer statistics (see ``stats()``).
* ``{"cmd": "quit"}``: closes the server, releases every partition, checks that the
  NetworkBufferPool is whole and answers ``{"event": "bye", ...}``, then exits.

Producers report ``{"event": "producer_done", "dataset": ..., "producer": ..., "error":
null | "<Type>: message"}`` when they finish or fail.

Config keys (defaults in ``DEFAULTS``); ``streams`` is a list of partitions to write::

    {"dataset": "ds", "producers": 1, "subpartitions": 1, "records": 1000,
     "payload": 100, "pool_max": 16, "start_delay": 0.0, "fail_after": null,
     "sleep_every": 0, "sleep": 0.0, "buffer_timeout": 0.1, "await_readers": 0,
     "barrier_every": 0}

Producer ``p`` writes ``records`` records to each subpartition ``s``, interleaved; record
``i`` of ``(p, s)`` is the list ``[p, s, i, payload]`` (default codec) where ``payload`` is
``payload`` bytes of value ``i % 251``. With ``fail_after`` the producer calls
``writer.fail`` after that many records in all; ``sleep_every`` / ``sleep`` throttle it;
``await_readers`` makes it wait, once registered, until the server has that many readers;
``barrier_every`` broadcasts ``CheckpointBarrier(k)`` after ``k * barrier_every`` records
of each subpartition (exactly once, so aligned: the subpartition blocks until resumed).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

import uvloop

from exchange.events import CheckpointBarrier
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.serialization.record_codec import default_codec
from server.partition_request_server import DataServer
from tests.kit.partition_writer import ResultPartitionWriter

DEFAULTS: dict[str, Any] = {
    "segment_size": 32 * 1024,
    "segments": 512,
    "secret": None,
    "high_watermark": None,
    "low_watermark": None,
    "streams": [],
}
STREAM_DEFAULTS: dict[str, Any] = {
    "dataset": "ds",
    "producers": 1,
    "subpartitions": 1,
    "records": 1000,
    "payload": 100,
    "pool_max": 16,
    "start_delay": 0.0,
    "fail_after": None,
    "sleep_every": 0,
    "sleep": 0.0,
    "buffer_timeout": 0.1,
    "await_readers": 0,
    "barrier_every": 0,
}


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Daemon:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = {**DEFAULTS, **config}
        c = self.config
        self.nbp = NetworkBufferPool(c["segments"], c["segment_size"])
        self.manager = ResultPartitionManager()
        secret = c["secret"].encode() if c["secret"] else None
        self.server = DataServer(
            self.manager,
            segment_size=c["segment_size"],
            secret=secret,
            high_watermark=c["high_watermark"],
            low_watermark=c["low_watermark"],
        )
        self.producers: list[asyncio.Task[None]] = []
        self.done = 0
        self.errors: list[str] = []
        self.max_paused = 0

    async def produce(self, stream: dict[str, Any], p: int) -> None:
        s = {**STREAM_DEFAULTS, **stream}
        error: str | None = None
        try:
            if s["start_delay"]:
                await asyncio.sleep(s["start_delay"])
            n_sub = s["subpartitions"]
            pool = self.nbp.create_buffer_pool(min(n_sub, s["pool_max"]), s["pool_max"])
            part = ResultPartition(
                ResultPartitionID(s["dataset"], p), ResultPartitionType.PIPELINED, n_sub, pool
            )
            self.manager.register_result_partition(part)
            while self.server.stats()["readers"] < s["await_readers"]:
                await asyncio.sleep(0.005)
            # The codec readers use by default (RecordWriter's own default may differ).
            writer = ResultPartitionWriter(
                part, codec=default_codec(), buffer_timeout=s["buffer_timeout"]
            )
            payloads = [bytes([i]) * s["payload"] for i in range(251)]
            fail_after = s["fail_after"]
            sleep_every = s["sleep_every"]
            barrier_every = s["barrier_every"]
            written = 0
            try:
                for i in range(s["records"]):
                    if barrier_every and i and i % barrier_every == 0:
                        await writer.broadcast_event(CheckpointBarrier(i // barrier_every, 0))
                    for sub in range(n_sub):
                        if fail_after is not None and written >= fail_after:
                            await writer.flush()
                            raise RuntimeError(f"injected failure after {written} records")
                        await writer.emit_to([p, sub, i, payloads[i % 251]], sub)
                        written += 1
                        if sleep_every and written % sleep_every == 0:
                            await asyncio.sleep(s["sleep"])
            except BaseException as e:
                await writer.fail(e)
                raise
            await writer.close()
        except asyncio.CancelledError:
            error = "CancelledError"
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            self.done += 1
            if error is not None:
                self.errors.append(error)
            emit(
                {"event": "producer_done", "dataset": stream.get("dataset", "ds"), "producer": p}
                | {"error": error}
            )

    def stats(self) -> dict[str, Any]:
        st = self.nbp.stats()
        conns = list(self.server.connections)
        self.max_paused = max([self.max_paused, *(c.paused_count for c in conns)])
        return {
            "pool": {
                "total": st.total_segments,
                "available": st.available_segments,
                "in_use": st.in_use_segments,
                "local_pools": st.num_local_pools,
                "required": st.required_segments,
            },
            "server": self.server.stats(),
            "partitions": len(self.manager),
            "producers": len(self.producers),
            "producers_done": self.done,
            "producer_errors": self.errors,
            "max_paused": self.max_paused,
        }

    async def run(self) -> None:
        host, port = await self.server.start("127.0.0.1", 0)
        for stream in self.config["streams"]:
            n = stream.get("producers", 1)
            for p in range(n):
                self.producers.append(asyncio.create_task(self.produce(stream, p)))
        emit({"event": "ready", "host": host, "port": port})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            cmd = json.loads(line)["cmd"] if line else "quit"  # EOF: the test went away
            if cmd == "stats":
                emit({"event": "stats", **self.stats()})
            elif cmd == "quit":
                await self.quit()
                return
            else:
                emit({"event": "error", "message": f"unknown command {cmd!r}"})

    async def quit(self) -> None:
        await self.server.close()
        for task in self.producers:
            task.cancel()
        await asyncio.gather(*self.producers, return_exceptions=True)
        self.manager.release_all()
        await asyncio.sleep(0)
        current = asyncio.current_task()
        tasks = [repr(t) for t in asyncio.all_tasks() if t is not current and not t.done()]
        consistent = True
        try:
            self.nbp.check_consistency()
        except Exception:
            consistent = False
        emit(
            {
                "event": "bye",
                **self.stats(),
                "whole": self.nbp.is_whole(),
                "consistent": consistent,
                "connections": len(self.server.connections),
                "tasks": tasks,
            }
        )


def main() -> None:
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    try:
        uvloop.run(Daemon(config).run())
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
