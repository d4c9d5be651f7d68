"""Coverage-guided fuzzing of the decoders with atheris (a script, not a test module).

Usage::

    python tests/fuzz/fuzz_targets.py TARGET --seconds N [--corpus DIR] [--max-len 2048]
    python tests/fuzz/fuzz_targets.py all --seconds N        # every target, N s each
    python tests/fuzz/fuzz_targets.py TARGET --replay FILE...   # run inputs once
    python tests/fuzz/fuzz_targets.py TARGET --corpus DIR --save-to tests/fuzz/corpus/TARGET

Targets (``TARGETS``): ``frame`` (the compiled ``InPlaceFrameDecoder``, beside the
pure-Python reference ``FrameDecoder`` of ``tests/kit/reference_frame_decoder.py``;
data-port, local-endpoint and driver ids), ``handshake`` (``ServerHandshake``/
``ClientHandshake`` fed the messages the frame decoder makes of the input),
``local_messages`` (the bodies of the local-endpoint messages, ids 64..127),
``driver_messages`` (the bodies of the driver's control and rendezvous messages, ids
128..159), ``msgpack`` (``MsgpackDecoder``), ``framed`` (``FramedDecoder`` of
``BytesCodec`` and of a UTF-8 payload codec), ``pickle_framing`` (``PickleBatchDecoder``),
``manifest`` (the partition manifests a restarted daemon reads, ``decode_manifest``).

The rule, as in python-websockets' fuzzers: **every input either parses or raises a
documented error** (``DOCUMENTED[target]``, typed errors of ``exchange/errors.py``). Each
target also checks invariants that need no oracle: the same bytes fed in one chunk, byte by
byte and split at input-chosen points decode to the same messages/records and fail with the
same error class; a poisoned decoder raises its first error again; decoded local messages
re-encode to themselves; framed decoders agree with a ten-line reference parser. An
undocumented exception or a broken invariant (``InvariantError``) is a *finding*.

Pickle: the daemon never unpickles; record decoders do, because only authenticated peers of
the same application send records. Feeding arbitrary bytes to ``pickle.loads`` can execute
code and is not a bug, so ``pickle_framing`` fuzzes only the framing shared with
``PickleBatchDecoder`` (``LengthPrefixedDecoder``): once with the payloads delivered as
bytes, never unpickled, and once with every payload replaced by a pickle this script made
itself (the real ``_deliver`` on trusted bytes).

Without atheris (``pip install atheris``; cp311 wheels exist) the script falls back to a
random mutation fuzzer over the same targets and seeds (no coverage feedback; it keeps the
inputs that raised documented errors or parsed, sampled). Findings are printed with their
input (hex) and traceback and written under ``--findings`` (default a temporary directory);
fuzzing goes on after a finding unless ``--stop-on-finding``.

``check(target, data)`` is what ``tests/fuzz/test_corpus_replay.py`` runs for every file of
``tests/fuzz/corpus/<target>/``, without atheris.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"

try:  # atheris is optional: the corpus replay test imports this module without it
    import atheris

    HAVE_ATHERIS = True
except ImportError:  # pragma: no cover - depends on the environment
    atheris = None
    HAVE_ATHERIS = False


def _instrumented() -> Any:
    if HAVE_ATHERIS and __name__ == "__main__":
        return atheris.instrument_imports(include=["exchange"])
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__" and str(ROOT) not in sys.path:  # run from a plain checkout
    sys.path.insert(0, str(ROOT))

with _instrumented():
    import msgpack

    from exchange.errors import CorruptRecordError, ExchangeError, ProtocolError
    from exchange.partition.partition_manifest import (
        ManifestState,
        PartitionManifest,
        SpilledSubpartition,
        decode_manifest,
        encode_manifest,
        wrap_body,
    )
    from exchange.partition.result_partition_id import ResultPartitionID
    from exchange.partition.result_partition_type import ResultPartitionType
    from exchange.protocol import driver_messages as dm  # registers ids 128..
    from exchange.protocol import local_messages  # registers ids 64..
    from exchange.protocol.codec import (
        FRAME_HEADER_SIZE,
        MAGIC,
        InPlaceFrameDecoder,
        PayloadReceived,
        encode,
    )
    from exchange.protocol.handshake import (
        ClientHandshake,
        ClientHandshakeState,
        ServerHandshake,
        ServerHandshakeState,
        client_mac,
        server_proof,
    )
    from exchange.protocol.messages import (
        NONCE_SIZE,
        PROTOCOL_VERSION,
        AddCredit,
        AuthOk,
        AuthResponse,
        BufferResponse,
        CancelPartitionRequest,
        ClientHello,
        CloseRequest,
        DataType,
        ErrorCode,
        ErrorResponse,
        Message,
        NewBufferSize,
        PartitionRequest,
        ResumeConsumption,
        ServerHello,
    )
    from exchange.serialization.pickle_batch import PickleBatchDecoder
    from exchange.serialization.record_codec import BytesCodec, FramedCodec, MsgpackCodec
    from tests.kit.reference_frame_decoder import FrameDecoder

__all__ = ["DOCUMENTED", "TARGETS", "InvariantError", "check", "seeds"]


class InvariantError(AssertionError):
    """A decoder broke an invariant (a finding, like an undocumented exception)."""


#: The errors each target may raise for bad input (anything else is a finding).
DOCUMENTED: dict[str, tuple[type[BaseException], ...]] = {
    "frame": (ProtocolError,),
    # and, for an ErrorResponse from the server, the typed error it maps to
    "handshake": (ProtocolError,),
    "local_messages": (ProtocolError,),
    "driver_messages": (ProtocolError,),
    "msgpack": (CorruptRecordError,),
    "framed": (CorruptRecordError,),
    "pickle_framing": (CorruptRecordError,),
    "manifest": (CorruptRecordError,),
}

#: Record decoders get a small limit, so that the fuzzer reaches it with small inputs.
RECORD_LIMIT = 512
_LEN = struct.Struct(">I")
_HEADER = struct.Struct(">IIB")
#: The first input byte of ``local_messages`` picks the id (64 + byte % 64): ids added
#: later keep the meaning of the saved corpus; unregistered ids are UnknownMessageErrors.
LOCAL_IDS = range(64, 128)
#: The same for ``driver_messages`` (128 + byte % 32).
DRIVER_IDS = range(128, 160)


# -- splitting an input into chunks, deterministically ----------------------------------------


def _splits(data: bytes) -> list[list[bytes]]:
    """Ways to deliver ``data``: in one chunk, byte by byte, and cut at points chosen by a
    generator seeded from the data itself (so a corpus file replays identically)."""
    ways = [[data], [data[i : i + 1] for i in range(len(data))]]
    rng = random.Random(hashlib.sha256(data).digest())
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, 6))) if len(data) > 1 else []
    pieces, last = [], 0
    for c in [*cuts, len(data)]:
        pieces.append(data[last:c])
        last = c
    ways.append(pieces)
    return ways


def _norm(value: Any) -> Any:
    """A comparable form of a message (memoryviews as bytes, NaN-safe)."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, PayloadReceived):
        h = value.header
        return ("BufferResponse", h.receiver_id, h.sequence_number, h.backlog, h.data_type,
                h.compressed, bytes(value.payload))  # fmt: skip
    if isinstance(value, BufferResponse):
        return ("BufferResponse", value.receiver_id, value.sequence_number, value.backlog,
                value.data_type, value.compressed, bytes(value.payload))  # fmt: skip
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(_norm(getattr(value, f.name)) for f in fields(value)))
    return repr(value)


# -- frame ------------------------------------------------------------------------------------


def _decode_frames(make: Callable[[], Any], pieces: Sequence[bytes]) -> tuple[list[Any], Any, bool]:
    """Messages decoded from ``pieces``, the error class that stopped decoding (or None),
    and whether the input ended inside a frame. A poisoned decoder raises the same error
    again."""
    decoder = make()
    out: list[Any] = []
    for piece in pieces:
        try:
            out.extend(decoder.feed(piece))
        except ProtocolError as e:
            try:
                decoder.feed(b"\x00")
            except ProtocolError as again:
                if type(again) is not type(e):
                    raise InvariantError(f"poisoned decoder raised {again!r}, first {e!r}") from e
            else:
                raise InvariantError(f"decoder not poisoned after {e!r}") from e
            return out, type(e), False
    return out, None, decoder.buffered > 0


def _in_place(inline: bool) -> Callable[[], InPlaceFrameDecoder]:
    def sink(header: Any) -> memoryview | None:
        return None if inline else memoryview(bytearray(header.size))

    return lambda: InPlaceFrameDecoder(body_sink=sink)


def _agree(results: Iterable[tuple[str, tuple[list[Any], Any, bool]]]) -> None:
    """Every way of decoding gives the same messages, or fails with the same error class
    (messages before an error may differ: a chunk that fails returns none of its own).
    A way may end inside a frame where another failed on that frame: the in-place decoder
    checks a data frame's fixed fields before its body has arrived."""
    ways = [(name, [_norm(m) for m in msgs], err, cut) for name, (msgs, err, cut) in results]
    failed = {err for _, _, err, _ in ways if err is not None}
    if len(failed) > 1:
        raise InvariantError(f"different errors for the same bytes: {ways}"[:2000])
    clean = [(name, normed) for name, normed, err, _ in ways if err is None]
    for name, normed, err, cut in ways:
        if failed and err is None and not cut:
            raise InvariantError(f"{name} decodes what another way refuses: {ways}"[:2000])
        for other, full in clean:
            if err is None and not cut and normed != full[: len(normed)]:
                raise InvariantError(f"{name} gives {normed[:5]}, {other} gives {full[:5]}")
    complete = [normed for _, normed, err, cut in ways if err is None and not cut]
    if any(c != complete[0] for c in complete):
        raise InvariantError(f"different messages for the same bytes: {ways}"[:2000])


def run_frame(data: bytes) -> None:
    """The compiled frame decoder (data port and local endpoint, payloads landing in a sink or
    decoded inline) against the pure-Python reference, every way of feeding."""
    results = []
    for i, pieces in enumerate(_splits(data)):
        results.append((f"FrameDecoder/{i}", _decode_frames(FrameDecoder, pieces)))
        results.append((f"InPlace/{i}", _decode_frames(_in_place(False), pieces)))
        results.append((f"InPlace-inline/{i}", _decode_frames(_in_place(True), pieces)))
    _agree(results)
    for m in results[0][1][0]:  # whatever decodes re-encodes
        frame = b"".join(bytes(p) for p in encode(m))
        again, err2, _ = _decode_frames(_in_place(False), [frame])
        if err2 is not None or [_norm(x) for x in again] != [_norm(m)]:
            raise InvariantError(f"{m!r} does not survive re-encoding: {again!r} / {err2}")


# -- handshake --------------------------------------------------------------------------------

SECRET = b"fuzz-secret"


def _nonce(n: int) -> bytes:
    return b"\x5a" * n


def run_handshake(data: bytes) -> None:
    """Both handshake sides fed the messages in ``data`` (after a mode byte): every failure
    is a ProtocolError that leaves the side FAILED with an ErrorResponse to send."""
    if not data:
        return
    mode, rest = data[0], data[1:]
    try:
        msgs = InPlaceFrameDecoder().feed(rest)
    except ProtocolError:
        return
    secret = SECRET if mode & 1 else None
    if mode & 2:
        client = ClientHandshake(secret, nonce_factory=_nonce, address="fuzz:1")
        for m in client.start():
            encode(m)
        side: Any = client
        done: tuple[Any, Any] = (ClientHandshakeState.ESTABLISHED, ClientHandshakeState.FAILED)
    else:
        side = ServerHandshake(secret, nonce_factory=_nonce)
        done = (ServerHandshakeState.ESTABLISHED, ServerHandshakeState.FAILED)
    for m in msgs:
        if side.state in done:
            break
        try:
            for reply in side.receive(m):
                encode(reply)
        except ExchangeError as e:
            if isinstance(m, ErrorResponse):  # the server gave up: its error, typed
                if side.state is not done[1]:
                    raise InvariantError(f"{e!r} left the handshake in {side.state}") from e
                return
            if not isinstance(e, ProtocolError):
                raise
            if side.state is not done[1]:
                raise InvariantError(f"{e!r} left the handshake in {side.state}") from e
            if side.error_response is None and not isinstance(m, ErrorResponse):
                raise InvariantError(f"{e!r}: no ErrorResponse to send") from e
            return


# -- local-endpoint messages -------------------------------------------------------------------


def _run_messages(ids: range) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        """A frame of a registered message built from ``data`` (id byte, body): it
        decodes, or raises a ProtocolError; what decodes re-encodes to an equal message."""
        if not data:
            return
        msg_id = ids[data[0] % len(ids)]
        body = data[1:]
        frame = _HEADER.pack(FRAME_HEADER_SIZE + len(body), MAGIC, msg_id) + body
        try:
            msgs = InPlaceFrameDecoder().feed(frame)
        except ProtocolError:
            return
        if len(msgs) != 1:
            raise InvariantError(f"one frame gave {len(msgs)} messages")
        (msg,) = msgs
        frame_again = b"".join(bytes(p) for p in encode(msg))
        if frame_again[8] != msg_id:  # (MESSAGE_ID is not set on every class: see the replay)
            raise InvariantError(
                f"id {msg_id} decoded as {msg!r}, which encodes as {frame_again[8]}"
            )
        again = InPlaceFrameDecoder().feed(frame_again)
        if [_norm(m) for m in again] != [_norm(msg)]:
            raise InvariantError(f"{msg!r} re-encodes as {again!r}")

    return run


#: local-endpoint messages (ids 64..127)
run_local_messages = _run_messages(LOCAL_IDS)
#: the driver's control and rendezvous messages (ids 128..159)
run_driver_messages = _run_messages(DRIVER_IDS)


# -- record decoders --------------------------------------------------------------------------


def _decode_records(decoder: Any, pieces: Sequence[bytes]) -> tuple[list[Any], Any]:
    """Records taken after every piece, and the error class that ended the stream (or None).
    A failed decoder must keep failing with the same error."""
    out: list[Any] = []
    try:
        for piece in pieces:
            decoder.feed(piece)
            out.extend(decoder.take())
        out.extend(decoder.take())
    except CorruptRecordError as e:
        calls: list[Callable[[], object]] = [decoder.take, lambda: decoder.feed(b"\x00")]
        for call in calls:
            try:
                call()
            except CorruptRecordError as again:
                if type(again) is not type(e):
                    raise InvariantError(f"failed decoder raised {again!r}, first {e!r}") from e
            else:
                raise InvariantError(f"decoder went on after {e!r}") from e
        return out, type(e)
    return out, None


def _records_agree(
    results: list[tuple[str, tuple[list[Any], Any], bool]], reference: list[Any] | None = None
) -> None:
    """Same records every way (NaN-safe), or an error in every way; a way may instead end
    with a partial record, undetected yet, where another saw the error (a record is
    rejected at most one feed after it crossed the limit). Records before an error are a
    prefix of the records of a way without one."""
    clean = [(n, [repr(r) for r in recs]) for n, (recs, err), _ in results if err is None]
    for name, (recs, err), partial in results:
        got = [repr(r) for r in recs]
        for other, full in clean:
            if err is None and got != full:
                raise InvariantError(f"{name} gives {got[:5]}, {other} gives {full[:5]}")
            if err is not None and got != full[: len(got)]:
                raise InvariantError(f"{name} ({err.__name__}) gives {got[:5]}, not a prefix")
        if err is None and not partial and any(e is not None for _, (_, e), _ in results):
            raise InvariantError(f"{name} ends clean where another way failed: {results!r}"[:500])
    if reference is not None:
        for name, (recs, err), _ in results:
            if err is None and [repr(r) for r in recs] != [repr(r) for r in reference]:
                raise InvariantError(f"{name} gives {recs[:5]}, the reference {reference[:5]}")


def _run_codec(
    new_decoder: Callable[[], Any],
    data: bytes,
    reference: list[Any] | None,
    end: str | None = None,
) -> None:
    """Decode ``data`` every way; with a reference, the records must be those and the
    stream must ``end`` as the reference parser says: "clean", "cut" (a partial record
    left, no error) or "error" (a CorruptRecordError in every way)."""
    results = []
    for i, pieces in enumerate(_splits(data)):
        decoder = new_decoder()
        recs, err = _decode_records(decoder, pieces)
        partial = err is None and decoder.has_partial_record
        results.append((f"way {i}", (recs, err), partial))
    _records_agree(results, reference)
    for name, (_, err), partial in results:
        got = "error" if err is not None else "cut" if partial else "clean"
        if end is not None and got != end:
            raise InvariantError(f"{name} ends {got}, the reference parser says {end}")


def run_msgpack(data: bytes) -> None:
    _run_codec(MsgpackCodec(max_record_size=RECORD_LIMIT).new_decoder, data, None)


def _reference_frames(data: bytes, limit: int) -> tuple[list[bytes], str]:
    """The ten-line parser: whole ``u32 | payload`` frames, and how the input ends: "clean",
    "cut" (inside a frame) or "error" (a frame over the limit)."""
    frames: list[bytes] = []
    pos = 0
    while len(data) - pos >= 4:
        (n,) = _LEN.unpack_from(data, pos)
        if n > limit:
            return frames, "error"
        if pos + 4 + n > len(data):
            return frames, "cut"
        frames.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return frames, "cut" if pos != len(data) else "clean"


def _utf8(view: memoryview) -> str:
    return str(view, "utf-8")


def run_framed(data: bytes) -> None:
    frames, end = _reference_frames(data, RECORD_LIMIT)
    _run_codec(BytesCodec(max_record_size=RECORD_LIMIT).new_decoder, data, frames, end)
    utf8 = FramedCodec(str.encode, _utf8, max_record_size=RECORD_LIMIT)
    texts: list[Any] = []
    for f in frames:
        try:
            texts.append(f.decode("utf-8"))
        except UnicodeDecodeError:  # the decoder must stop there with a CorruptRecordError
            end = "error"
            break
    _run_codec(utf8.new_decoder, data, texts if end != "error" else None, end)


class _FramingOnlyDecoder(PickleBatchDecoder):
    """``PickleBatchDecoder``'s framing, with each payload delivered as bytes, unpickled
    never (arbitrary bytes must not reach ``pickle.loads``)."""

    __slots__ = ()

    def _deliver(self, payload: memoryview) -> None:
        self._ready.append(bytes(payload))


def run_pickle_framing(data: bytes) -> None:
    frames, end = _reference_frames(data, RECORD_LIMIT)
    _run_codec(lambda: _FramingOnlyDecoder(RECORD_LIMIT), data, frames, end)
    # The real decoder, on a stream of pickles this script made (trusted): every frame of
    # the input becomes a pickled list of its bytes and ints, same framing otherwise.
    batches = [[f, len(f), *f[:3]] for f in frames]
    stream = b"".join(_LEN.pack(len(p)) + p for p in (pickle.dumps(b, 5) for b in batches))
    expected = [r for b in batches for r in b]
    results = []
    for i, pieces in enumerate(_splits(stream)):
        decoder = PickleBatchDecoder(1 << 20)
        results.append((f"pickles {i}", _decode_records(decoder, pieces), False))
    _records_agree(results, expected)
    for name, (recs, err), _ in results:
        if len(recs) != len(expected):
            raise InvariantError(f"{name}: {len(recs)} records of {len(expected)}")
        if err is not None:
            raise InvariantError(f"{name}: a stream of valid pickles fails with {err}")


_MANIFEST_PATH = Path("fuzz.manifest")


def run_manifest(data: bytes) -> None:
    """A partition manifest a restarted daemon reads (``decode_manifest``). The first byte
    picks how the rest is used: 0 = the file's bytes as they are (the checksum guards the
    body), else = a body the target wraps with its right checksum, so the fuzzer reaches
    the body's parser. A manifest that parses re-encodes to one that parses equal."""
    if not data:
        return
    raw = data[1:] if data[0] == 0 else wrap_body(data[1:].decode("utf-8", "replace"))
    try:
        manifest = decode_manifest(raw, _MANIFEST_PATH)
    except DOCUMENTED["manifest"]:
        return
    again = decode_manifest(encode_manifest(manifest), _MANIFEST_PATH)
    if again != manifest:
        raise InvariantError(f"manifest does not survive re-encoding: {manifest} -> {again}")


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]


def _frames(*msgs: Message) -> bytes:
    return b"".join(bytes(p) for m in msgs for p in encode(m))


def _frame_seeds() -> list[bytes]:
    pid = ResultPartitionID("ds", 3, 1)
    data = [
        ClientHello(PROTOCOL_VERSION, b"\x01" * NONCE_SIZE),
        ServerHello(PROTOCOL_VERSION, True, b"\x02" * NONCE_SIZE),
        AuthResponse(b"\x03" * 32),
        AuthOk(b"\x04" * 32),
        PartitionRequest(pid, 1, 7, 2),
        BufferResponse(7, 0, 3, DataType.DATA_BUFFER, False, b"payload"),
        BufferResponse(7, 1, 0, DataType.EVENT_BUFFER, False, b""),
        AddCredit(7, 5),
        NewBufferSize(7, 4096),
        ResumeConsumption(7),
        CancelPartitionRequest(7),
        CloseRequest(),
        ErrorResponse(ErrorCode.PARTITION_NOT_FOUND, "no such partition", 7),
        ErrorResponse(ErrorCode.INTERNAL, "fatal"),
    ]
    seeds = [_frames(m) for m in data]
    seeds.append(b"".join(seeds))
    seeds += [s for s in _local_frames()]
    seeds += _driver_frames()
    return seeds


def _local_frames() -> list[bytes]:
    lm = local_messages
    msgs: list[Message] = [
        lm.CreatePartition(ResultPartitionID("ds", 0, 0), True, 4),
        lm.PartitionCreated(8, 32768),
        lm.PushBuffer(1, DataType.DATA_BUFFER, b"\x00\x00\x00\x03abc"),
        lm.AddProducerCredit(2),
        lm.FinishPartition(),
        lm.PartitionFinished(100, 2),
        lm.FailPartition("boom"),
        lm.ReleaseDataset("ds"),
        lm.Released(3),
        lm.DaemonInfoRequest(),
        lm.DaemonInfo("d1", "127.0.0.1:1", 32768, {"a": 1, "b": 0.5, "c": True, "d": None}),
        lm.ProducerBufferSize(0, 1024),
        lm.SharedArena(b"t" * lm.ARENA_TOKEN_SIZE, 1 << 20, (), 32768),
        lm.RequestArena(),
        lm.NoArena("shared_memory = off"),
        lm.ArenaMapped(),
        lm.SharedBufferResponse(((1, 0, 3, 0, 0, 7, 0, 4096), (1, 1, 2, 0, 1, 3, 512, 100))),
        lm.RecycleSegments((7, 7, 3)),
    ]
    if hasattr(lm, "TaskMetrics"):  # local message 76
        names = sorted(lm.TASK_METRIC_NAMES)[:2]
        msgs.append(lm.TaskMetrics("task-1", "gate-0", {names[0]: 1, names[-1]: 0.25}))
    return [_frames(m) for m in msgs]


def _handshake_seeds() -> list[bytes]:
    nonce = b"\x11" * NONCE_SIZE
    server_nonce = _nonce(NONCE_SIZE)
    hello = _frames(ClientHello(PROTOCOL_VERSION, nonce))
    auth = _frames(AuthResponse(client_mac(SECRET, nonce, server_nonce)))
    client_nonce = _nonce(NONCE_SIZE)
    s_hello = _frames(ServerHello(PROTOCOL_VERSION, True, nonce))
    ok = _frames(AuthOk(server_proof(SECRET, client_nonce, nonce)))
    no_auth = _frames(ServerHello(PROTOCOL_VERSION, False, nonce))
    err = _frames(ErrorResponse(ErrorCode.AUTH_FAILED, "nope"))
    return [
        b"\x00" + hello,
        b"\x01" + hello + auth,
        b"\x01" + hello + _frames(AuthResponse(b"\x00" * 32)),
        b"\x03" + s_hello + ok,
        b"\x02" + no_auth,
        b"\x03" + no_auth,
        b"\x02" + err,
        b"\x00" + _frames(ClientHello(PROTOCOL_VERSION + 1, nonce)),
    ]


def _local_seeds() -> list[bytes]:
    out = []
    for frame in _local_frames():
        msg_id = frame[8]
        out.append(bytes([msg_id - LOCAL_IDS.start]) + frame[FRAME_HEADER_SIZE:])
    return out


def _driver_frames() -> list[bytes]:
    loc = dm.TaskLocation(1, 7, "d1", "[::1]:7000", "/tmp/s", 32768)
    daemon = dm.TaskDaemon("d1", "127.0.0.1:7000", "/tmp/s")
    reason = dm.CheckpointFailureReason.SUBSUMED
    msgs: list[Message] = [
        dm.MeetRequest("ex-1", "tok", 3, loc),
        dm.AbortRound("ex-1", "tok", 3, 1, 7),
        dm.Met((loc, loc)),
        dm.RendezvousRefused(dm.RefusalKind.USAGE, "the job runs 1 of 2 tasks"),
        dm.RegisterTask("tok", 1, "v0-0", daemon),
        dm.RegistrationRefused("unknown or stale task"),
        dm.StartTask({"v0-0": daemon}, dm.RestorePoint(4, {"gen": ("f", None)})),
        dm.CheckpointTrigger(4, 1_764_000_000_000, True),
        dm.CheckpointComplete(4),
        dm.CheckpointAbort(5),
        dm.StopInput(),
        dm.FinishTask(),
        dm.CancelTask(),
        dm.CheckpointAck(4, "/c/4", 10, 2, 1, 0.5, 4096, True, 100),
        dm.CheckpointDecline(4, reason),
        dm.SourceExhausted(),
        dm.TaskFinished(3, {"sink": b"\x80\x05N."}),
        dm.TaskFailed("ValueError: boom", 1.5, False),
    ]
    return [_frames(m) for m in msgs]


def _driver_seeds() -> list[bytes]:
    return [bytes([f[8] - DRIVER_IDS.start]) + f[FRAME_HEADER_SIZE:] for f in _driver_frames()]


def _msgpack_seeds() -> list[bytes]:
    recs: list[Any] = [1, -1, 2**63, "text", b"bin", [1, [2, [3]]], {"k": [1.5, None, True]},
                       (4, "x" * 40), 1e308, float("nan")]  # fmt: skip
    return [msgpack.packb(r) for r in recs] + [b"".join(msgpack.packb(r) for r in recs)]


def _framed_seeds() -> list[bytes]:
    payloads = [b"", b"a", "é".encode(), b"x" * 100, b"\xff\xfe", b"y" * RECORD_LIMIT]
    frames = [_LEN.pack(len(p)) + p for p in payloads]
    return [*frames, b"".join(frames), _LEN.pack(RECORD_LIMIT + 1) + b"z" * 8]


def _manifest_seeds() -> list[bytes]:
    pid = ResultPartitionID("ds", 3, 1)
    writing = PartitionManifest(
        pid, ResultPartitionType.PIPELINED, ManifestState.WRITING, 2, 32768, "file"
    )
    finished = PartitionManifest(
        pid,
        ResultPartitionType.BLOCKING,
        ManifestState.FINISHED,
        1,
        32768,
        "mmap",
        1.7e9,
        (SpilledSubpartition("ds-3-1-abcd.0.bin", 100, 12345, 3, 2, 82),),
    )
    out = []
    for m in (writing, finished):
        file = encode_manifest(m)
        out.append(b"\x00" + file)
        out.append(b"\x01" + json.loads(file)["body"].encode())
    return out


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("frame", run_frame, _frame_seeds),
        Target("handshake", run_handshake, _handshake_seeds),
        Target("local_messages", run_local_messages, _local_seeds),
        Target("driver_messages", run_driver_messages, _driver_seeds),
        Target("msgpack", run_msgpack, _msgpack_seeds),
        Target("framed", run_framed, _framed_seeds),
        Target("pickle_framing", run_pickle_framing, _framed_seeds),
        Target("manifest", run_manifest, _manifest_seeds),
    )
}


def seeds(target: str) -> list[bytes]:
    return TARGETS[target].seeds()


def check(target: str, data: bytes) -> None:
    """Run one input: returns if it parsed or raised a documented error (the targets catch
    those themselves); raises the finding otherwise."""
    TARGETS[target].run(data)


# -- running ----------------------------------------------------------------------------------


class _Findings:
    """Findings of one run, deduplicated by exception type and where it was raised."""

    def __init__(self, target: str, directory: Path, stop: bool) -> None:
        self.target = target
        self.directory = directory
        self.stop = stop
        self.seen: set[tuple[str, str]] = set()

    def record(self, data: bytes, exc: BaseException) -> None:
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
        key = (type(exc).__name__, where)
        if key in self.seen:
            return
        self.seen.add(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha1(data).hexdigest()[:16]
        (self.directory / f"{self.target}-{name}").write_bytes(data)
        text = "".join(traceback.format_exception(exc))
        (self.directory / f"{self.target}-{name}.txt").write_text(f"{data.hex()}\n{text}")
        print(f"\n=== FINDING in {self.target}: {key}\ninput: {data.hex()}\n{text}", flush=True)
        if self.stop:
            raise exc


def _one_input(target: Target, findings: _Findings) -> Callable[[bytes], None]:
    def test_one_input(data: bytes) -> None:
        try:
            target.run(data)
        except Exception as exc:
            findings.record(data, exc)

    return test_one_input


def _write_seeds(target: Target, corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for s in target.seeds():
        (corpus / f"seed-{hashlib.sha1(s).hexdigest()[:16]}").write_bytes(s)


def _mutate(rng: random.Random, data: bytes, pool: Sequence[bytes], max_len: int) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and buf:  # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # set a byte to an interesting value
            buf[rng.randrange(len(buf))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif op == 2:  # insert bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and buf:  # delete a range
            i = rng.randrange(len(buf))
            del buf[i : i + rng.randint(1, 8)]
        elif op == 4 and pool:  # splice another input
            other = rng.choice(pool)
            i, j = rng.randrange(len(buf) + 1), rng.randrange(len(other) + 1)
            buf = buf[:i] + other[j:]
        elif op == 5 and len(buf) >= 4:  # an interesting u32
            i = rng.randrange(len(buf) - 3)
            buf[i : i + 4] = _LEN.pack(rng.choice([0, 1, 4, 9, 31, 0xFFFFFFFF, len(buf)]))
    return bytes(buf[:max_len])


def _fallback_fuzz(target: Target, corpus: Path, seconds: float, max_len: int,
                   findings: _Findings, seed: int) -> int:  # fmt: skip
    """A random mutation fuzzer (no coverage feedback), for when atheris is missing."""
    rng = random.Random(seed)
    pool = [p.read_bytes() for p in sorted(corpus.iterdir()) if p.is_file()]
    run = _one_input(target, findings)
    deadline = time.monotonic() + seconds
    runs = kept = 0
    while time.monotonic() < deadline:
        data = _mutate(rng, rng.choice(pool) if pool else b"", pool, max_len)
        run(data)
        runs += 1
        if rng.random() < 0.002 and kept < 200:  # keep a sample as corpus
            (corpus / f"mut-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)
            pool.append(data)
            kept += 1
    print(f"{target.name}: {runs} inputs in {seconds:.0f}s (random mutation, no atheris)")
    return runs


def _atheris_fuzz(target: Target, corpus: Path, seconds: float, max_len: int,
                  findings: _Findings, seed: int) -> None:  # fmt: skip
    argv = [
        sys.argv[0],
        str(corpus),
        f"-max_total_time={int(seconds)}",
        f"-max_len={max_len}",
        f"-seed={seed}",
        "-print_final_stats=1",
        "-timeout=20",
    ]
    atheris.Setup(argv, _one_input(target, findings))
    atheris.Fuzz()  # exits the process when the time is up


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=[*TARGETS, "all"])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--corpus", type=Path, help="working corpus (default: a temp dir)")
    parser.add_argument("--findings", type=Path, default=None)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-atheris", action="store_true", help="use the random fuzzer")
    parser.add_argument("--stop-on-finding", action="store_true")
    parser.add_argument("--replay", nargs="*", type=Path, help="run these inputs once")
    parser.add_argument(
        "--save-to",
        type=Path,
        help="copy the working --corpus (libFuzzer keeps only inputs that added coverage) "
        "into this directory, one file per distinct input, instead of fuzzing",
    )
    args = parser.parse_args(argv)

    if args.target == "all":  # one process per target (libFuzzer runs once per process)
        import subprocess

        code = 0
        for name in TARGETS:
            extra = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "all"]
            code |= subprocess.call([sys.executable, __file__, name, *extra])
        return code

    target = TARGETS[args.target]
    if args.replay is not None:
        bad = 0
        for path in args.replay:
            try:
                check(target.name, path.read_bytes())
            except Exception:
                bad += 1
                print(f"{path}: FINDING\n{traceback.format_exc()}")
        return 1 if bad else 0

    if args.save_to is not None:
        if args.corpus is None:
            parser.error("--save-to needs --corpus")
        args.save_to.mkdir(parents=True, exist_ok=True)
        saved = 0
        for path in sorted(args.corpus.iterdir()):
            data = path.read_bytes()
            if path.is_file() and len(data) <= args.max_len:
                check(target.name, data)  # never save a finding as corpus
                (args.save_to / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)
                saved += 1
        print(f"{target.name}: {saved} inputs saved to {args.save_to}")
        return 0

    corpus = args.corpus or Path(tempfile.mkdtemp(prefix=f"fuzz-{target.name}-"))
    findings_dir = args.findings or (  # created at the first finding only
        Path(tempfile.gettempdir()) / f"fuzz-findings-{target.name}-{os.getpid()}"
    )
    _write_seeds(target, corpus)
    findings = _Findings(target.name, findings_dir, args.stop_on_finding)
    print(f"{target.name}: corpus {corpus}, findings {findings_dir}", flush=True)
    if HAVE_ATHERIS and not args.no_atheris:
        _atheris_fuzz(target, corpus, args.seconds, args.max_len, findings, args.seed)
    else:
        _fallback_fuzz(target, corpus, args.seconds, args.max_len, findings, args.seed)
    return 1 if findings.seen else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
