"""Producer and consumer tasks as processes of their own, for the SIGKILL tests.

    python _tasks.py produce pipelined|blocking SOCKET DATASET RECORDS
    python _tasks.py consume ADDRESS DATASET

Each prints JSON lines: ``{"event": "started"}`` once its partition is open (producer)
or its first record arrived (consumer), then one last line, ``{"event": "done", "count":
n, "pools_whole": bool}`` or ``{"event": "error", "type": name, "typed": bool,
"message": text, "count": n, "pools_whole": bool}``, and exits 0 (done) or 3 (error).
``typed`` says the error is an ExchangeError; ``pools_whole`` that every
NetworkBufferPool the process made is whole or destroyed at the end. Records are
``(i, pad)`` into one subpartition; the consumer checks they come in order.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from exchange.errors import CorruptRecordError, ExchangeError
from exchange.memory.network_buffer_pool import NetworkBufferPool

#: Both tasks pause PACE_SLEEP every PACE_EVERY records: 60,000 records take about 1.5 s.
PACE_EVERY = 200
PACE_SLEEP = 0.004

_pools: list[NetworkBufferPool] = []
_init = NetworkBufferPool.__init__


def _recording_init(self: NetworkBufferPool, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    _pools.append(self)


NetworkBufferPool.__init__ = _recording_init  # type: ignore[method-assign]


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _pools_whole() -> bool:
    return all(p.is_destroyed or p.is_whole() for p in _pools)


def produce(mode: str, socket: str, dataset: str, n: int) -> int:
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    pad = b"p" * 100
    count = 0
    try:
        with PartitionWriter(
            ResultPartitionID(dataset, 0, 0),
            1,
            blocking=mode == "blocking",
            daemon_socket=socket,
            buffer_timeout=0.005,
        ) as w:
            _say(event="started", pid=os.getpid())
            for i in range(n):
                w.emit_to((i, pad), 0)
                count += 1
                if count % PACE_EVERY == 0:
                    time.sleep(PACE_SLEEP)  # a stream that lasts, so kills land inside it
    except BaseException as e:
        _say(event="error", type=type(e).__name__, typed=isinstance(e, ExchangeError),
             message=str(e)[:500], count=count, pools_whole=_pools_whole())  # fmt: skip
        return 3
    _say(event="done", count=count, pools_whole=_pools_whole())
    return 0


def consume(address: str, dataset: str) -> int:
    from client.consumer import PartitionLocation, PartitionReader
    from exchange.partition.result_partition_id import ResultPartitionID

    count = 0
    loc = PartitionLocation(ResultPartitionID(dataset, 0, 0), 0, address)
    try:
        with PartitionReader([loc], backoff_initial=0.01, backoff_max=0.5) as reader:
            for i, _ in reader:
                if i != count:
                    raise CorruptRecordError(f"record {i} where {count} was due")
                if count == 0:
                    _say(event="started", pid=os.getpid())
                count += 1
                if count % PACE_EVERY == 0:
                    time.sleep(PACE_SLEEP)
    except BaseException as e:
        _say(event="error", type=type(e).__name__, typed=isinstance(e, ExchangeError),
             message=str(e)[:500], count=count, pools_whole=_pools_whole())  # fmt: skip
        return 3
    _say(event="done", count=count, pools_whole=_pools_whole())
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["produce"]:
        sys.exit(produce(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    if sys.argv[1:2] == ["consume"]:
        sys.exit(consume(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
