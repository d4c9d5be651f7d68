"""The driver's services' messages (ids 128..159: rendezvous and control) on the project's
framing: every message survives encode/decode whole and byte by byte; truncated,
oversized, unknown and mistyped frames raise the typed errors of exchange/errors.py and
poison the decoder; a side accepts only its service's ids."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import pytest

from exchange.checkpointing import CheckpointFailureReason
from exchange.errors import (
    BadMagicError,
    FrameTooLargeError,
    ProtocolError,
    UnknownMessageError,
)
from exchange.protocol.codec import (
    FRAME_HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    InPlaceFrameDecoder,
    encode,
)
from exchange.protocol.driver_messages import (
    CONTROL_MESSAGE_IDS,
    RENDEZVOUS_MESSAGE_IDS,
    AbortRound,
    CancelTask,
    CheckpointAbort,
    CheckpointAck,
    CheckpointComplete,
    CheckpointDecline,
    CheckpointTrigger,
    FinishTask,
    MeetRequest,
    Met,
    RefusalKind,
    RegisterTask,
    RegistrationRefused,
    RendezvousRefused,
    RestorePoint,
    SourceExhausted,
    StartTask,
    StopInput,
    TaskDaemon,
    TaskFailed,
    TaskFinished,
    TaskLocation,
)
from exchange.protocol.messages import Message

LOC = TaskLocation(3, 2**40, "host-1-abc", "[::1]:7000", "/tmp/exchange.sock", 32768)
DAEMON = TaskDaemon("host-1-abc", "10.0.0.2:7000", "")
RENDEZVOUS = [
    MeetRequest("exchange-\u00e9", "ab" * 16, 7, LOC),
    AbortRound("exchange-1", "ab" * 16, 7, 3, 2**40),
    Met((LOC, TaskLocation(0, 1, "d", "h:1", "", 4096))),
    Met(()),
    RendezvousRefused(RefusalKind.SCHEDULING, "Spark ran task 0 again"),
    RendezvousRefused(RefusalKind.BAD_REQUEST, ""),
]
CONTROL = [
    RegisterTask("cd" * 16, 3, "v0-1", DAEMON),
    RegistrationRefused("unknown or stale task"),
    StartTask({"v0-0": DAEMON, "v1-0": DAEMON}, None),
    StartTask({}, RestorePoint(9, {"gen": ("v0-0.9.state", None), "sink": ()})),
    CheckpointTrigger(9, 1_764_000_000_000, exactly_once=False),
    CheckpointComplete(9),
    CheckpointAbort(10),
    StopInput(),
    FinishTask(),
    CancelTask(),
    CheckpointAck(9, "/ckpt/9/v0-0", 100, 5, 4),
    CheckpointAck(9, "/ckpt/9/v1-0", 100, 5, 4, 0.25, 4096, True, 2048),
    CheckpointDecline(9, CheckpointFailureReason.ALIGNMENT_LIMIT),
    SourceExhausted(),
    TaskFinished(12, {"collect": b"\x80\x05pickled"}),
    TaskFailed("Traceback ...\nValueError: boom", 1_764_000_000.5, False),
]


def frame_bytes(msg: Message) -> bytes:
    return b"".join(bytes(p) for p in encode(msg))


def raw_frame(msg_id: int, body: Any, length: int | None = None) -> bytes:
    data = body if isinstance(body, bytes) else msgpack.packb(body)
    size = FRAME_HEADER_SIZE + len(data) if length is None else length
    return struct.pack(">IIB", size, MAGIC, msg_id) + data


def same(a: Message, b: Message) -> bool:
    """Equal, including the fields left out of ``==`` (maps)."""
    return a == b and all(
        getattr(a, f) == getattr(b, f) for f in a.__dataclass_fields__ if f != "MESSAGE_ID"
    )


@pytest.mark.parametrize(
    ("msgs", "ids"), [(RENDEZVOUS, RENDEZVOUS_MESSAGE_IDS), (CONTROL, CONTROL_MESSAGE_IDS)]
)
def test_every_message_round_trips_whole_and_byte_by_byte(msgs: list[Message], ids: range) -> None:
    data = b"".join(frame_bytes(m) for m in msgs)
    assert {m.MESSAGE_ID for m in msgs} <= set(ids)
    whole = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE, accept=ids).feed(data)
    dec = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE, accept=ids)
    by_byte = [m for i in range(len(data)) for m in dec.feed(data[i : i + 1])]
    assert len(whole) == len(by_byte) == len(msgs)
    for got, again, sent in zip(whole, by_byte, msgs, strict=True):
        assert same(got, sent) and same(again, sent), (got, sent)


def test_every_message_of_the_module_is_covered() -> None:
    """A message added to the module without a case here fails this test."""
    import exchange.protocol.driver_messages as dm

    declared = {
        obj
        for obj in vars(dm).values()
        if isinstance(obj, type) and issubclass(obj, Message) and obj is not Message
    }
    assert declared == {type(m) for m in RENDEZVOUS + CONTROL}


def test_a_side_accepts_only_its_own_services_ids() -> None:
    control = InPlaceFrameDecoder(accept=CONTROL_MESSAGE_IDS)
    with pytest.raises(UnknownMessageError):
        control.feed(frame_bytes(RENDEZVOUS[2]))
    rendezvous = InPlaceFrameDecoder(accept=RENDEZVOUS_MESSAGE_IDS)
    with pytest.raises(UnknownMessageError):
        rendezvous.feed(frame_bytes(StopInput()))
    with pytest.raises(UnknownMessageError):  # an id of the range nobody registered
        InPlaceFrameDecoder(accept=range(128, 160)).feed(raw_frame(159, {}))


def test_an_oversized_frame_is_refused_at_its_header() -> None:
    dec = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE, accept=CONTROL_MESSAGE_IDS)
    with pytest.raises(FrameTooLargeError) as excinfo:
        dec.feed(raw_frame(147, b"", MAX_CONTROL_FRAME_SIZE + 1))  # 9 bytes: the header
    assert (excinfo.value.size, excinfo.value.limit) == (
        MAX_CONTROL_FRAME_SIZE + 1,
        MAX_CONTROL_FRAME_SIZE,
    )
    # a server raises the limit once its peer registered: a larger frame passes then
    dec = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE, accept=CONTROL_MESSAGE_IDS)
    dec.max_frame_size = 1 << 20
    big = TaskFinished(1, {"collect": b"x" * 100_000})
    (got,) = dec.feed(frame_bytes(big))
    assert same(got, big)


def test_a_truncated_frame_decodes_nothing_and_says_so() -> None:
    data = frame_bytes(CONTROL[3])
    for cut in (1, FRAME_HEADER_SIZE - 1, FRAME_HEADER_SIZE, len(data) - 1):
        dec = InPlaceFrameDecoder(accept=CONTROL_MESSAGE_IDS)
        assert dec.feed(data[:cut]) == []
        assert dec.buffered == cut  # the stream ended mid-frame: the adapter reports it


def test_bad_magic_is_typed() -> None:
    with pytest.raises(BadMagicError):
        InPlaceFrameDecoder(accept=CONTROL_MESSAGE_IDS).feed(b"\x00\x00\x00\x10junk\x88")


def _body(msg: Message) -> dict[str, Any]:
    body: dict[str, Any] = msgpack.unpackb(frame_bytes(msg)[FRAME_HEADER_SIZE:])
    return body


def _with(msg: Message, **changes: Any) -> tuple[int, dict[str, Any]]:
    body = _body(msg)
    for key, value in changes.items():
        if value is KeyError:
            del body[key]
        else:
            body[key] = value
    return msg.MESSAGE_ID, body


@pytest.mark.parametrize(
    ("msg_id", "body"),
    [
        # truncated / malformed bodies
        (138, b"\x82\xa7daemons"),
        (144, b"\xc1"),
        (146, b"\x91\x01"),  # a list, not a map
        # missing and unknown keys
        _with(CONTROL[0], daemon=KeyError),
        _with(CONTROL[0], extra=1),
        _with(RENDEZVOUS[0], location={**_body(RENDEZVOUS[0])["location"], "x": 1}),
        # wrong field types and out-of-range values
        _with(CONTROL[0], attempt="3"),
        _with(CONTROL[0], attempt=True),
        _with(CONTROL[0], attempt=-1),
        _with(CONTROL[0], token=""),
        _with(CONTROL[0], token="t" * 257),
        _with(CONTROL[0], daemon="d"),
        _with(CONTROL[0], daemon={"daemon_id": "d", "data_address": "a", "local_socket": 1}),
        _with(CONTROL[2], daemons=[["v0-0", {}]]),
        _with(CONTROL[2], daemons={"v0-0": None}),
        _with(CONTROL[3], restore={"checkpoint_id": 9}),
        _with(CONTROL[3], restore={"checkpoint_id": 9, "operators": {"gen": "f"}}),
        _with(CONTROL[3], restore={"checkpoint_id": 9, "operators": {"gen": [1]}}),
        _with(CONTROL[3], restore={"checkpoint_id": -9, "operators": {}}),
        _with(CONTROL[4], exactly_once=1),
        _with(CONTROL[4], timestamp=1.5),
        _with(CONTROL[5], checkpoint_id=2**63),
        _with(CONTROL[11], alignment=math.nan),
        _with(CONTROL[11], alignment=-0.5),
        _with(CONTROL[11], alignment="fast"),
        _with(CONTROL[11], state_bytes=-1),
        _with(CONTROL[11], unaligned=None),
        _with(CONTROL[11], handle=b"/bytes"),
        _with(CONTROL[12], reason="BORED"),
        _with(CONTROL[12], reason=3),
        _with(CONTROL[14], results={"collect": "not bytes"}),
        _with(CONTROL[14], results=[b"x"]),
        _with(CONTROL[14], records_in=None),
        _with(CONTROL[15], time=math.inf),
        _with(CONTROL[15], consequence=0),
        _with(CONTROL[15], error=None),
        _with(RENDEZVOUS[0], round_id=-1),
        _with(RENDEZVOUS[0], location=[3, 1]),
        _with(RENDEZVOUS[0], location={**_body(RENDEZVOUS[0])["location"], "index": 2**32}),
        _with(RENDEZVOUS[0], location={**_body(RENDEZVOUS[0])["location"], "daemon_id": ""}),
        _with(RENDEZVOUS[1], attempt=-1),
        _with(RENDEZVOUS[2], locations={"0": {}}),
        _with(RENDEZVOUS[2], locations=[None]),
        _with(RENDEZVOUS[4], kind="fatal"),
        _with(RENDEZVOUS[4], kind=None),
        _with(RENDEZVOUS[4], message=7),
    ],
)
def test_a_bad_body_is_a_protocol_error_and_poisons_the_decoder(msg_id: int, body: Any) -> None:
    dec = InPlaceFrameDecoder(accept=[*RENDEZVOUS_MESSAGE_IDS, *CONTROL_MESSAGE_IDS])
    with pytest.raises(ProtocolError):
        dec.feed(raw_frame(msg_id, body))
    with pytest.raises(ProtocolError):  # poisoned: the stream is out of sync
        dec.feed(frame_bytes(StopInput()))


def test_the_sender_cannot_build_what_the_receiver_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        TaskLocation(-1, 0, "d", "h:1", "", 4096)
    with pytest.raises(ProtocolError):
        MeetRequest("x", "t", 0, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        CheckpointDecline(1, "DECLINED")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        TaskFinished(1, {"sink": "text"})  # type: ignore[dict-item]
    with pytest.raises(ProtocolError):
        StartTask({"v0-0": {"id": "d"}}, None)  # type: ignore[dict-item]
