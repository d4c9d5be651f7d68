"""exchange/errors.py: ``fresh_error``, how a remembered failure is reported again."""

from __future__ import annotations

import traceback
from types import TracebackType

import pytest

from exchange.errors import (
    BufferRequestTimeoutError,
    ConfigError,
    FrameTooLargeError,
    LimitExceededError,
    PartitionNotFoundError,
    RecordTooLargeError,
    SequenceNumberError,
    TransportError,
    fresh_error,
)
from exchange.protocol.messages import ErrorResponse, error_for_response, error_response_for

STORED = [
    FrameTooLargeError(10, 5),
    RecordTooLargeError(9, 4, at_least=True),
    PartitionNotFoundError("gone", "p-1", "10.0.0.1:7100"),
    LimitExceededError("too many", "p-2", setting="max_requests", limit=3),
    BufferRequestTimeoutError(2, 0, 1.5, "buffers"),
    SequenceNumberError(7, 5, receiver_id=2),
    ConfigError("segment_size", "must be a power of two"),
    TransportError("connection to daemon x lost"),
    ConnectionResetError(104, "reset by peer"),
]


@pytest.mark.parametrize("stored", STORED, ids=lambda e: type(e).__name__)
def test_a_fresh_error_is_a_new_object_equal_in_all_a_caller_reads(stored: Exception) -> None:
    cause = KeyError("the original cause")
    try:
        raise stored from cause
    except type(stored):
        pass
    tb = stored.__traceback__
    again = fresh_error(stored)
    assert again is not stored and type(again) is type(stored)
    assert (again.args, str(again), vars(again)) == (stored.args, str(stored), vars(stored))
    assert again.__cause__ is cause and again.__suppress_context__
    assert again.__traceback__ is tb  # raising it adds frames in front of a copy
    assert stored.__traceback__ is tb and stored.__cause__ is cause
    if isinstance(stored, OSError):
        assert isinstance(again, OSError) and again.errno == stored.errno


def test_a_fresh_error_travels_as_the_same_error_code() -> None:
    stored = PartitionNotFoundError("gone", "p-1")
    resp = error_response_for(fresh_error(stored), receiver_id=1)
    assert resp == error_response_for(stored, receiver_id=1)
    assert isinstance(error_for_response(resp), PartitionNotFoundError)
    assert isinstance(resp, ErrorResponse)


def test_notes_added_to_a_fresh_error_stay_on_it() -> None:
    stored = TransportError("lost")
    stored.add_note("first")
    again = fresh_error(stored)
    again.add_note("second")
    assert stored.__notes__ == ["first"] and again.__notes__ == ["first", "second"]


def depth(tb: TracebackType | None) -> int:
    return len(traceback.extract_tb(tb))


def test_raising_fresh_errors_leaves_the_stored_one_as_it_was() -> None:
    try:
        raise TransportError("lost")
    except TransportError as e:
        stored = e
    tb, depths = stored.__traceback__, []
    for _ in range(3):
        try:
            try:
                raise KeyError("while handling something else")
            except KeyError:
                raise fresh_error(stored)  # noqa: B904 - the context is what we check
        except TransportError as e:
            assert isinstance(e.__context__, KeyError)
            depths.append(depth(e.__traceback__))
    assert depths == [depth(tb) + 1] * 3
    assert stored.__traceback__ is tb and depth(tb) == 1 and stored.__context__ is None
