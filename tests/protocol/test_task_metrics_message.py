"""TaskMetrics (local message 76): a consumer task's gate figures for its local daemon."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exchange.errors import ProtocolError
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, InPlaceFrameDecoder, encode
from exchange.protocol.local_messages import (
    MAX_TASK_NAME_LENGTH,
    TASK_METRIC_NAMES,
    TaskMetrics,
)


def frame_bytes(msg: TaskMetrics) -> bytes:
    return b"".join(bytes(p) for p in encode(msg))


def raw_frame(body: Any, *, packed: bytes | None = None) -> bytes:
    """A frame of id 76 around ``body`` (msgpack-packed unless ``packed`` is given)."""
    data = packed if packed is not None else msgpack.packb(body)
    return (
        (FRAME_HEADER_SIZE + len(data)).to_bytes(4, "big")
        + MAGIC.to_bytes(4, "big")
        + bytes([76])
        + data
    )


def decode_all(data: bytes, *, byte_by_byte: bool = False) -> list[Any]:
    dec = InPlaceFrameDecoder()
    if not byte_by_byte:
        return list(dec.feed(data))
    out: list[Any] = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))
    return out


FULL = TaskMetrics(
    "exchange-7/subpartition-3",
    "reader",
    {
        "buffer_size": 4096,
        "computed_buffer_size": 3900,
        "throughput": 10_000_000,
        "buffers_in_use": 12,
        "desired_total_bytes": 2_000_000,
        "estimated_time_to_consume": 0.215,
        "num_triggered": 41,
        "num_aborted": 2,
        "aligning_checkpoint_id": 43,
        "last_alignment_duration": 0.0125,
        "last_aligned_bytes": 81920,
        "current_alignment_duration": 0.0,
        "buffered_bytes": 0,
        "total_parked_bytes": 0,
        "num_resumed": 41,
    },
)


@pytest.mark.parametrize("byte_by_byte", [False, True])
@pytest.mark.parametrize(
    "msg",
    [
        FULL,
        TaskMetrics("t", "g"),
        TaskMetrics("ü" * MAX_TASK_NAME_LENGTH, "gate", {"throughput": 0}),
    ],
    ids=["every-metric", "empty", "longest-name"],
)
def test_round_trip(msg: TaskMetrics, byte_by_byte: bool) -> None:
    data = frame_bytes(msg)
    assert data[8] == 76 == TaskMetrics.MESSAGE_ID
    (back,) = decode_all(data, byte_by_byte=byte_by_byte)
    assert back == msg
    # integers stay integers, floats stay floats
    assert {k: type(v) for k, v in back.metrics.items()} == {
        k: type(v) for k, v in msg.metrics.items()
    }


def test_every_allowed_name_is_in_the_full_report() -> None:
    assert set(FULL.metrics) == TASK_METRIC_NAMES


names = st.text(min_size=1, max_size=MAX_TASK_NAME_LENGTH)
values = st.one_of(
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-(2.0**53), max_value=2.0**53),
)


@given(
    task=names,
    gate=names,
    metrics=st.dictionaries(st.sampled_from(sorted(TASK_METRIC_NAMES)), values),
)
def test_round_trip_property(task: str, gate: str, metrics: dict[str, int | float]) -> None:
    msg = TaskMetrics(task, gate, metrics)
    (back,) = decode_all(frame_bytes(msg))
    assert back == msg


GOOD = {"task": "t", "gate": "g", "metrics": {"buffer_size": 1024}}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({**GOOD, "task": 7}, "task must be a string"),
        ({**GOOD, "task": ""}, "task must be a string of 1 to"),
        ({**GOOD, "task": "x" * (MAX_TASK_NAME_LENGTH + 1)}, "task must be a string of 1 to"),
        ({**GOOD, "gate": None}, "gate must be a string"),
        ({**GOOD, "gate": b"bytes"}, "gate must be a string"),
        ({**GOOD, "metrics": [1, 2]}, "must be a map of at most"),
        (
            {**GOOD, "metrics": {f"m{i}": 1 for i in range(len(TASK_METRIC_NAMES) + 1)}},
            "must be a map of at most",
        ),
        ({**GOOD, "metrics": {"records_content": 1}}, "unknown task metric 'records_content'"),
        ({**GOOD, "metrics": {b"buffer_size": 1}}, "unknown task metric"),
        ({**GOOD, "metrics": {"buffer_size": "1024"}}, "buffer_size must be a finite number"),
        ({**GOOD, "metrics": {"buffer_size": True}}, "buffer_size must be a finite number"),
        ({**GOOD, "metrics": {"buffer_size": None}}, "buffer_size must be a finite number"),
        ({**GOOD, "metrics": {"throughput": math.nan}}, "throughput must be a finite number"),
        ({**GOOD, "metrics": {"throughput": math.inf}}, "throughput must be a finite number"),
        ({**GOOD, "metrics": {"throughput": -math.inf}}, "throughput must be a finite number"),
        ({**GOOD, "metrics": {"throughput": 2**64 - 1}}, "throughput must be a finite number"),
        ({**GOOD, "metrics": {"throughput": {"nested": 1}}}, "must be a finite number"),
        ({"task": "t", "gate": "g"}, "keys"),
        ({**GOOD, "extra": 1}, "keys"),
        ([1, 2, 3], "map"),
    ],
)
def test_bad_body_is_a_protocol_error(body: Any, match: str) -> None:
    for byte_by_byte in (False, True):
        with pytest.raises(ProtocolError, match=match):
            decode_all(raw_frame(body), byte_by_byte=byte_by_byte)


@pytest.mark.parametrize(
    "packed",
    [b"", b"\xc1", b"\x83\xa4task", msgpack.packb(GOOD)[:-1], msgpack.packb(GOOD) + b"\x00"],
    ids=["empty", "reserved-byte", "cut-map", "cut-value", "trailing-byte"],
)
def test_malformed_msgpack_is_a_protocol_error(packed: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_all(raw_frame(None, packed=packed))


def test_the_decoder_stays_poisoned() -> None:
    dec = InPlaceFrameDecoder()
    with pytest.raises(ProtocolError):
        dec.feed(raw_frame({**GOOD, "metrics": {"throughput": math.nan}}))
    with pytest.raises(ProtocolError):
        dec.feed(frame_bytes(FULL))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", "g", {}), "task must be"),
        (("t", "g" * (MAX_TASK_NAME_LENGTH + 1), {}), "gate must be"),
        (("t", "g", {"nope": 1}), "unknown task metric 'nope'"),
        (("t", "g", {"buffer_size": math.nan}), "buffer_size must be a finite number"),
        (("t", "g", {"buffer_size": False}), "buffer_size must be a finite number"),
    ],
)
def test_building_a_bad_report_is_refused(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        TaskMetrics(*args)
