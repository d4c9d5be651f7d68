"""A consumer task for the network-namespace tests, run inside a namespace:

    python _consumer.py '{"locations": [[dataset, index, sub, data_address, daemon_id]],
                          "expect": records}'

It opens a ``PartitionReader`` on the locations (over TCP: the partitions are on the other
namespace's daemon), prints ``{"event": "attached"}``, reads nothing until a line comes on
its standard input (the producer must be held back by credit meanwhile), then reads
everything, checking each
channel's records are ``(seq, payload)`` with seq 0, 1, ... in order, and prints one JSON
line: records, payload bytes, seconds from the first record to the last, and MB/s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from client.consumer import PartitionLocation, PartitionReader
from exchange.partition.result_partition_id import ResultPartitionID


def main() -> None:
    spec = json.loads(sys.argv[1])
    locations = [
        PartitionLocation(ResultPartitionID(ds, index, 0), sub, address, daemon_id, None)
        for ds, index, sub, address, daemon_id in spec["locations"]
    ]
    expect = int(spec["expect"])
    with PartitionReader(locations, backoff_initial=0.01, backoff_max=0.2) as reader:
        print(json.dumps({"event": "attached"}), flush=True)
        # the stall is the point: nothing is read until the test has seen the producer
        # held back and says go (a line on stdin; a fixed sleep ran out on a loaded machine
        # before the test looked)
        sys.stdin.readline()
        records = payload = 0
        t0 = None
        for seq, data in reader:
            if t0 is None:
                t0 = time.monotonic()
            if seq != records or data != bytes([seq % 251]) * len(data):
                raise SystemExit(f"record {records}: got seq {seq} (lost/duplicated/corrupt)")
            records += 1
            payload += len(data)
        seconds = time.monotonic() - (t0 or time.monotonic())
    if records != expect:
        raise SystemExit(f"read {records} records, {expect} were written")
    print(
        json.dumps(
            {
                "event": "done",
                "records": records,
                "payload": payload,
                "seconds": seconds,
                "mb_per_s": payload / max(seconds, 1e-9) / 1e6,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
