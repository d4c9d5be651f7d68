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
    LocalProtocolError,
    PartitionError,
    PartitionNotFoundError,
    ProtocolError,
    RecordTooLargeError,
    SequenceNumberError,
    SubpartitionIndexError,
    TransportError,
    UsageError,
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
    SubpartitionIndexError(4, 2, "p-3", "10.0.0.1:7100"),
    LocalProtocolError("you sent garbage [remote PROTOCOL_ERROR]", "PROTOCOL_ERROR"),
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


# -- the tree's meaning: whose fault, what is broken ---------------------------------------


@pytest.mark.parametrize(
    ("error", "family"),
    [
        # the peer's fault, but one channel's failure: per channel
        (SequenceNumberError(7, 5, 2, "p-1", "10.0.0.1:7100"), PartitionError),
        # a peer's request or push named a subpartition the partition lacks: per channel
        (SubpartitionIndexError(4, 2, "p-1"), PartitionError),
        # the peer says this side broke the protocol: fatal, but not the peer's misbehaviour
        (LocalProtocolError("x [remote PROTOCOL_ERROR]", "PROTOCOL_ERROR"), LocalProtocolError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.__name__,
)
def test_each_error_sits_where_the_tree_says(error: Exception, family: type) -> None:
    families = (UsageError, PartitionError, ProtocolError, LocalProtocolError, TransportError)
    assert [f for f in families if isinstance(error, f)] == [family]


def test_errors_carry_their_numbers() -> None:
    seq = SequenceNumberError(7, 5, 2, "p-1", "10.0.0.1:7100")
    assert (seq.received, seq.expected, seq.receiver_id) == (7, 5, 2)
    assert (seq.partition_id, seq.address) == ("p-1", "10.0.0.1:7100")
    idx = SubpartitionIndexError(4, 2, "p-1")
    assert (idx.index, idx.num_subpartitions, idx.partition_id) == (4, 2, "p-1")
    assert "index 4 out of range [0, 2)" in str(idx)


@pytest.mark.parametrize("code", ["PROTOCOL_ERROR", "VERSION_MISMATCH"])
def test_a_peers_protocol_error_answer_is_a_local_protocol_error(code: str) -> None:
    from exchange.protocol.messages import ErrorCode

    err = error_for_response(ErrorResponse(ErrorCode[code], "bad frame"), "10.0.0.1:7100")
    assert type(err) is LocalProtocolError and err.code == code
    assert "10.0.0.1:7100" in str(err)
