"""A consumer process for integration tests: reads subpartitions from a daemon.

Usage: ``python _client_proc.py '<json config>'`` with keys ``address``, ``dataset``,
``producers``, ``subpartition``, and optionally ``segment_size``, ``segments``,
``floating``, ``exclusive``, ``report_every`` (records). It prints JSON lines:
``{"event": "records", "n": ...}`` every ``report_every`` records, then ``{"event":
"done", "n": ..., "whole": ...}`` or ``{"event": "failed", "error": ...}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import uvloop

from client.network import ConnectionManager
from exchange.consumer import RecordReader, SingleInputGate
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(c: dict[str, Any]) -> None:
    segment_size = c.get("segment_size", 32 * 1024)
    nbp = NetworkBufferPool(c.get("segments", 256), segment_size)
    cm = ConnectionManager(segment_size=segment_size)
    gate = SingleInputGate("client", nbp.create_buffer_pool(0, c.get("floating", 8)))
    channels = [
        RemoteInputChannel(
            gate,
            i,
            ResultPartitionID(c["dataset"], i),
            c["subpartition"],
            c["address"],
            cm,
            nbp,
            num_exclusive=c.get("exclusive", 2),
            backoff_initial=0.01,
            backoff_max=0.5,
        )
        for i in range(c["producers"])
    ]
    gate.set_input_channels(channels)
    reader = RecordReader(gate)
    every = c.get("report_every", 1000)
    n = 0
    reported = 0
    try:
        await gate.request_partitions()
        while (batch := await reader.next_batch()) is not None:
            n += len(batch)
            if n - reported >= every:
                reported = n
                emit({"event": "records", "n": n})
    except Exception as e:
        emit({"event": "failed", "error": f"{type(e).__name__}: {e}", "n": n})
        return
    finally:
        reader.close()
        await cm.close()
    emit({"event": "done", "n": n, "whole": nbp.is_whole()})


if __name__ == "__main__":
    uvloop.run(main(json.loads(sys.argv[1])))
