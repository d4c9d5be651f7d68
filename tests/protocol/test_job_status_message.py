"""JobStatus (local message 77): a streaming job's status, from its driver to its daemon."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from exchange.errors import ProtocolError
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, InPlaceFrameDecoder, encode
from exchange.protocol.local_messages import (
    MAX_JOB_CHECKPOINTS,
    MAX_JOB_TASKS,
    CheckpointRecord,
    JobStatus,
    JobTask,
)

TASKS = (
    JobTask("v0-0", "clicks -> parse -> by-user", 0, ("job-a17-e0",), 0, 41_000, 40_999),
    JobTask("v1-0", "totals -> filesink", 0, (), 2, 40_500, 0),
)
CHECKPOINTS = (
    CheckpointRecord(6, "COMPLETED", 1_764_000_000.25, 0.21, 0.0125, 81_920, 3_500_000),
    CheckpointRecord(
        9, "COMPLETED", 1_764_000_003.25, 0.01, 0.0, 0, 4_000, True, (("v1-0", 65_536),)
    ),
    CheckpointRecord(7, "FAILED", 1_764_000_001.25, 0.05, None, 0, 0),
    CheckpointRecord(8, "IN_PROGRESS", 1_764_000_002.25, None, None, 0, 0),
)
FULL = JobStatus(
    "clickstream-42", "RUNNING", 1_764_000_000_000, 1, 1_763_999_990.5, 6, 1, TASKS,
    CHECKPOINTS, ("task v1-0 lost: IncompleteReadError",),
)  # fmt: skip


def frame_bytes(msg: JobStatus) -> bytes:
    return b"".join(bytes(p) for p in encode(msg))


def raw_frame(body: Any) -> bytes:
    data = msgpack.packb(body)
    return (
        (FRAME_HEADER_SIZE + len(data)).to_bytes(4, "big")
        + MAGIC.to_bytes(4, "big")
        + bytes([77])
        + data
    )


def body_of(msg: JobStatus) -> dict[str, Any]:
    data = frame_bytes(msg)[FRAME_HEADER_SIZE:]
    body: dict[str, Any] = msgpack.unpackb(data)
    return body


def test_round_trip_whole_and_byte_by_byte() -> None:
    data = frame_bytes(FULL)
    assert InPlaceFrameDecoder().feed(data) == [FULL]
    dec = InPlaceFrameDecoder()
    out = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))
    assert out == [FULL]
    minimal = JobStatus("j", "FINISHED", 0, 0, 0, 0, 0)
    assert InPlaceFrameDecoder().feed(frame_bytes(minimal)) == [minimal]


def test_the_wire_keys_are_the_documented_ones() -> None:
    body = body_of(FULL)
    assert set(body) == {
        "job", "state", "attempt", "restarts", "started", "completed", "failed", "tasks",
        "checkpoints", "failures",
    }  # fmt: skip
    assert set(body["tasks"][0]) == {"task", "name", "subtask", "outputs", "channels", "in", "out"}
    assert set(body["checkpoints"][0]) == {
        "id", "status", "trigger", "duration", "alignment", "aligned", "size", "unaligned",
        "persisted",
    }  # fmt: skip


def _mutated(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = body_of(FULL)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("state",), "SLEEPING"),
        (("job",), ""),
        (("job",), "j" * 257),
        (("attempt",), -1),
        (("attempt",), True),
        (("restarts",), 2**32),
        (("started",), math.nan),
        (("started",), -1.0),
        (("completed",), "6"),
        (("tasks",), {"v0-0": 1}),
        (("tasks", 0, "in"), -5),
        (("tasks", 0, "outputs"), ["d"] * 9),
        (("tasks", 0, "outputs"), [""]),
        (("tasks", 0, "extra"), 1),
        (("tasks", 1, "name"), KeyError),
        (("checkpoints", 0, "status"), "DONE"),
        (("checkpoints", 0, "duration"), math.inf),
        (("checkpoints", 0, "alignment"), "fast"),
        (("checkpoints", 0, "size"), -1),
        (("checkpoints", 1, "unaligned"), 1),
        (("checkpoints", 1, "persisted"), [["v1-0", 5]]),
        (("checkpoints", 1, "persisted"), {"v1-0": -5}),
        (("checkpoints", 1, "persisted"), {"": 5}),
        (("checkpoints", 1, "persisted"), {f"t{i}": 1 for i in range(65)}),
        (("checkpoints", 1, "persisted"), KeyError),
        (("failures",), ["x" * 513]),
        (("failures",), [1]),
        (("failures",), ["a"] * 5),
        (("extra",), 1),
        (("failed",), KeyError),
    ],
)
def test_a_body_out_of_bounds_is_a_protocol_error(path: tuple[Any, ...], value: Any) -> None:
    dec = InPlaceFrameDecoder()
    with pytest.raises(ProtocolError):
        dec.feed(raw_frame(_mutated(path, value)))
    with pytest.raises(ProtocolError):  # poisoned: the stream is out of sync
        dec.feed(frame_bytes(FULL))


def test_the_sender_cannot_build_what_the_receiver_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        JobStatus("j", "RUNNING", 0, 0, 0, 0, 0, tasks=TASKS * (MAX_JOB_TASKS // 2 + 1))
    with pytest.raises(ProtocolError):
        JobStatus("j", "RUNNING", 0, 0, 0, 0, 0, checkpoints=CHECKPOINTS * MAX_JOB_CHECKPOINTS)
    with pytest.raises(ProtocolError):
        CheckpointRecord(1, "COMPLETED", 0.0, -0.5, None, 0, 0)
    with pytest.raises(ProtocolError):
        JobTask("v0-0", "x", 0, ["list", "not", "tuple"], 0, 0, 0)  # type: ignore[arg-type]
