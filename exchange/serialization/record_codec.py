"""Record codecs: how records become the byte stream that data buffers carry.

A data buffer carries a slice of one byte stream per channel; records follow each other
with no padding and may span any number of buffers. A codec gives each writer an
*encoder* that appends records to the stream and each input channel a *decoder* that is
fed the stream in arbitrary pieces and hands back every whole record it has seen.

Three stream formats:

* ``PickleBatchCodec`` (the default, ``default_codec()``, in ``pickle_batch.py``): frames
  ``u32 big-endian length | pickle of a list of records`` (a batch of ``(int, int)``
  records: a packed frame of fixed-width integers, ``int_pairs.pyx``). Records come back
  exactly as pickle round-trips them; batching makes pickle fast. Trusted peers only.
* ``MsgpackCodec``: plain concatenated msgpack objects, for data shared with other
  languages. msgpack is self-delimiting, so there is no length prefix; a streaming
  ``msgpack.Unpacker`` finds the record boundaries in C. It changes values: tuples and
  lists come back as one of the two, and it refuses datetimes, ``Decimal``, sets, ints
  outside -2**63 .. 2**64-1 and user classes.
* ``FramedCodec``: ``u32 big-endian length | payload`` per record, for payload codecs that
  are not self-delimiting (``PickleCodec``, ``BytesCodec``, a user's functions). A length
  above ``max_record_size`` is rejected before anything is allocated for it.

Writers call ``encode_batch`` with the records of one channel: it returns one chunk to
append to the channel's stream, or raises (``RecordTooLargeError``, or ``UsageError``
naming the type of a record the format cannot encode) and nothing is to be appended.
Encoding is by batch only: the RecordWriter is the one caller.

Decoders decode eagerly in ``feed``. A decode error does not surface from ``feed``: the
records before the bad bytes are delivered first, then ``take`` (or iteration) raises a
``CorruptRecordError``, and so does every later call. Decoders never raise msgpack,
struct, pickle or Unicode exceptions.
"""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

import msgpack

from exchange.errors import CorruptRecordError, RecordTooLargeError, UsageError, fresh_error
from exchange.serialization.framing import DecoderBase as _DecoderBase
from exchange.serialization.framing import LengthPrefixedDecoder

__all__ = [
    "DEFAULT_MAX_RECORD_SIZE",
    "MAX_FRAMED_RECORD_SIZE",
    "BytesCodec",
    "BytesLike",
    "FramedCodec",
    "MsgpackCodec",
    "PickleCodec",
    "RecordCodec",
    "RecordDecoder",
    "RecordEncoder",
    "default_codec",
    "unencodable_record",
]

BytesLike = bytes | bytearray | memoryview

#: Largest encoded record accepted by default (encoder and decoder side).
DEFAULT_MAX_RECORD_SIZE: Final = 64 * 1024 * 1024
#: Largest record a u32 length prefix can describe.
MAX_FRAMED_RECORD_SIZE: Final = 0xFFFFFFFF

#: Feeds larger than this go to the Unpacker in pieces, so that its buffer never holds
#: more than ``max_record_size + _FEED_PIECE`` bytes.
_FEED_PIECE: Final = 64 * 1024
#: Initial Unpacker buffer (msgpack's default would be 1 MiB per channel).
_UNPACKER_READ_SIZE: Final = 64 * 1024
#: After a record larger than this, the Unpacker (whose buffer never shrinks) is replaced
#: at the next record boundary.
_UNPACKER_RENEW_ABOVE: Final = 4 * _UNPACKER_READ_SIZE

#: A batch Packer whose buffer grew beyond this (huge records) is replaced.
_STREAM_KEEP: Final = 4 * 1024 * 1024

_LEN: Final = struct.Struct(">I")
_LIMIT_MESSAGE: Final = re.compile(r"(\d+) exceeds max_(str|bin|ext|array|map)_len")


class RecordEncoder(Protocol):
    """Appends records to one writer's byte stream."""

    @property
    def max_record_size(self) -> int: ...

    def encode_batch(self, records: list[Any]) -> bytes | bytearray:
        """One contiguous chunk appending ``records``, in order, to the stream.

        A decoder fed the concatenation of chunks, cut anywhere, yields the records in
        order. Raises ``RecordTooLargeError(size, limit)`` for a record over
        ``max_record_size`` and ``UsageError`` (naming the record's type) for a record
        the format cannot encode; then nothing is to be appended.
        """
        ...


class RecordDecoder(Protocol):
    """Turns one channel's byte stream, fed in arbitrary pieces, back into records."""

    def feed(self, data: BytesLike) -> None:
        """Decode the next piece of the stream; ``data`` is copied, not kept."""
        ...

    def take(self) -> list[Any]:
        """Every whole record decoded so far and not yet taken (a new list, maybe empty).

        Raises the decoder's CorruptRecordError once the records before it are taken.
        """
        ...

    def __iter__(self) -> Iterator[Any]:
        """Yield the records ``take`` would return."""
        ...

    @property
    def has_partial_record(self) -> bool:
        """True while the bytes of an incomplete record are buffered, or after an error.

        A stream that ends while this is true ended inside a record or was corrupt.
        """
        ...

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the incomplete record held by the decoder."""
        ...

    def unconsumed_bytes(self) -> bytes:
        """The bytes of the incomplete record, exactly as fed (b"" at a record boundary):
        fed to a new decoder, they put it where this one is (Flink's
        ``getUnconsumedBuffer``; unaligned checkpoints persist them with the input channel
        state). UsageError if the decoder cannot tell them."""
        ...

    def clear(self) -> None:
        """Forget everything: partial record, undelivered records, error."""
        ...


class RecordCodec(Protocol):
    """A stream format: one encoder per writer, one decoder per input channel."""

    @property
    def max_record_size(self) -> int: ...

    def new_encoder(self) -> RecordEncoder: ...

    def new_decoder(self) -> RecordDecoder: ...


def _check_limit(max_record_size: int, ceiling: int) -> int:
    if (
        not isinstance(max_record_size, int)
        or isinstance(max_record_size, bool)
        or not 0 < max_record_size <= ceiling
    ):
        raise UsageError(
            f"max_record_size must be an int in (0, {ceiling}], got {max_record_size!r}"
        )
    return max_record_size


def default_codec() -> RecordCodec:
    """The codec used when none is given: exact Python values (``PickleBatchCodec``)."""
    from exchange.serialization.pickle_batch import PickleBatchCodec  # imports this module

    return PickleBatchCodec()


def unencodable_record(record: Any, fmt: str, exc: BaseException) -> UsageError:
    """The typed error for a record ``fmt`` cannot encode; ``exc`` becomes its cause."""
    kind = type(record)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    error = UsageError(
        f"cannot encode a record of type {name} with {fmt}: {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error


# -- msgpack -------------------------------------------------------------------------------


class MsgpackCodec:
    """Records as concatenated msgpack objects: for data shared with other languages.

    Records may be None, bool, int (-2**63 .. 2**64-1), float, str, bytes, lists, tuples
    and dicts of these (dict keys of any hashable type). Values change on the way:
    arrays decode as lists, so a tuple, a namedtuple or a ``pyspark.sql.Row`` comes back
    as a plain list; with ``tuples=True`` every array decodes as a tuple instead (lists
    come back as tuples). A ``bytearray`` comes back as ``bytes``. Strings are UTF-8.
    ``encode_batch`` refuses anything else (datetimes, ``Decimal``, sets, larger ints,
    user classes) with a ``UsageError``. For exact Python values use the default
    ``PickleBatchCodec``.
    """

    __slots__ = ("_max_record_size", "tuples")

    def __init__(
        self, *, tuples: bool = False, max_record_size: int = DEFAULT_MAX_RECORD_SIZE
    ) -> None:
        self.tuples = tuples
        # Beyond 2**31 the Unpacker's own buffer limit would overflow.
        self._max_record_size = _check_limit(max_record_size, 2**31 - 1 - _FEED_PIECE)

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def new_encoder(self) -> MsgpackEncoder:
        return MsgpackEncoder(self._max_record_size)

    def new_decoder(self) -> MsgpackDecoder:
        return MsgpackDecoder(self._max_record_size, use_list=not self.tuples)

    def __repr__(self) -> str:
        return f"MsgpackCodec(tuples={self.tuples}, max_record_size={self._max_record_size})"


class MsgpackEncoder:
    """Packs each batch with one reused ``msgpack.Packer`` (cheaper than ``packb`` per
    record); the size of single records is only looked at when the batch is over the
    limit, to find the record that is."""

    __slots__ = ("_max_record_size", "_pack_one", "_stream")

    def __init__(self, max_record_size: int) -> None:
        self._max_record_size = max_record_size
        # autoreset=True: pack() returns one record's bytes and also resets after an error.
        self._pack_one: Callable[[Any], bytes] = msgpack.Packer(autoreset=True).pack
        self._stream = msgpack.Packer(autoreset=False)

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def encode_batch(self, records: list[Any]) -> bytes:
        packer = self._stream
        pack = packer.pack
        for record in records:
            try:
                pack(record)
            except Exception as exc:
                packer.reset()
                raise unencodable_record(record, "msgpack", exc) from exc
        data: bytes = packer.bytes()
        packer.reset()
        limit = self._max_record_size
        if len(data) > limit:
            # Only a record over the limit is an error; find it.
            pack_one = self._pack_one
            for record in records:
                size = len(pack_one(record))
                if size > limit:
                    raise RecordTooLargeError(size, limit)
        if len(data) > _STREAM_KEEP:
            self._stream = msgpack.Packer(autoreset=False)
        return data


class MsgpackDecoder(_DecoderBase):
    """One streaming ``msgpack.Unpacker`` per channel.

    Every feed is decoded at once with ``list.extend(unpacker)`` (a loop in C). The
    Unpacker does not say where records end, and parses containers element by element,
    so the decoder keeps bounds on where the incomplete record starts:

    * The last byte of each feed is fed on its own: a record comes out of it exactly
      when the feed ends on a record boundary (``has_partial_record`` is exact).
    * ``_start_lo <= start <= _start_hi``: once ``fed - _start_hi`` (a lower bound of the
      incomplete record's size) exceeds ``max_record_size``, the record is rejected,
      at most one feed after it crossed the limit.
    * When a record completing in a feed could be over the limit (``fed - _start_lo``
      exceeds it), that feed is decoded record by record, measuring each with ``tell``.

    A record header claiming more elements or bytes than the limit allows is rejected
    at once; an array header still makes msgpack allocate 8 bytes per claimed element.
    """

    __slots__ = ("_fed", "_grown", "_limit", "_start_hi", "_start_lo", "_unpacker", "_use_list")

    def __init__(self, max_record_size: int, *, use_list: bool = True) -> None:
        super().__init__()
        self._limit = max_record_size
        self._use_list = use_list
        self._unpacker = self._new_unpacker()
        self._fed = 0  # bytes fed to the current Unpacker
        self._start_lo = 0  # bounds of the incomplete record's start; == _fed at a boundary
        self._start_hi = 0
        self._grown = False  # the Unpacker's buffer grew for a large record

    def _new_unpacker(self) -> msgpack.Unpacker:
        limit = self._limit
        return msgpack.Unpacker(
            use_list=self._use_list,
            raw=False,
            strict_map_key=False,
            max_buffer_size=limit + _FEED_PIECE,
            read_size=min(_UNPACKER_READ_SIZE, limit + _FEED_PIECE),
            max_str_len=limit,
            max_bin_len=limit,
            max_ext_len=limit,
            max_array_len=limit,  # each element takes at least one byte
            max_map_len=limit // 2,  # each entry at least two
        )

    @property
    def has_partial_record(self) -> bool:
        return self._start_hi < self._fed or self._error is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the incomplete record (a lower bound)."""
        return self._fed - self._start_hi

    def unconsumed_bytes(self) -> bytes:
        """b"" at a record boundary; inside a record a UsageError: the Unpacker keeps its
        buffer to itself and the decoder knows the record's start only within bounds."""
        if self._error is not None:
            raise fresh_error(self._error)
        if self._start_hi < self._fed:
            raise UsageError(
                "the msgpack decoder cannot hand out the bytes of its incomplete record "
                f"({self.buffered_bytes}+ bytes): unaligned checkpoints need a framed codec "
                "(the default PickleBatchCodec, PickleCodec, BytesCodec)"
            )
        return b""

    def feed(self, data: BytesLike) -> None:
        if self._error is not None:
            raise fresh_error(self._error)
        if type(data) is memoryview and data.itemsize == 1 and data.c_contiguous:
            n = data.nbytes
            if 0 < n <= _FEED_PIECE:
                self._feed(data, n)
                return
        view = memoryview(data)
        try:
            with view.cast("B") as flat:
                n = flat.nbytes
                for start in range(0, n, _FEED_PIECE):
                    self._feed(flat[start : start + _FEED_PIECE], min(_FEED_PIECE, n - start))
                    if self._error is not None:
                        return
        finally:
            view.release()

    def _feed(self, data: memoryview, n: int) -> None:
        """Decode ``n`` (> 0) more bytes."""
        unpacker = self._unpacker
        ready = self._ready
        limit = self._limit
        lo = self._start_lo
        hi = self._start_hi
        fed_before = self._fed
        fed = self._fed = fed_before + n
        try:
            if fed - lo <= limit:
                # Fast: no record that completes here can be over the limit.
                done_before = len(ready)
                unpacker.feed(data[:-1])
                ready.extend(unpacker)
                done_head = len(ready)
                unpacker.feed(data[-1:])
                ready.extend(unpacker)
                if len(ready) > done_head:  # a record ended with the last byte
                    lo = hi = fed
                elif done_head > done_before:  # the incomplete one started in here
                    lo = fed_before
                    hi = unpacker.tell()
                    if hi >= fed:
                        hi = fed - 1
                self._start_lo = lo
                self._start_hi = hi
            else:
                unpacker.feed(data)
                self._decode_measured(unpacker)
                lo = self._start_lo
                hi = self._start_hi
        except CorruptRecordError as exc:
            self._fail(exc)
            return
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._fail(self._translate(exc))
            return
        if fed - hi > limit:
            self._fail(RecordTooLargeError(fed - hi, limit, at_least=True))
        elif fed - lo > _UNPACKER_RENEW_ABOVE:
            self._grown = True
        if hi == fed and self._grown:
            self._renew()

    def _decode_measured(self, unpacker: msgpack.Unpacker) -> None:
        limit = self._limit
        ready = self._ready
        start_lo = self._start_lo
        start_hi = self._start_hi
        for record in unpacker:
            end = unpacker.tell()
            if end - start_hi > limit:
                raise RecordTooLargeError(end - start_hi, limit, at_least=start_lo != start_hi)
            ready.append(record)
            start_lo = start_hi = self._start_lo = self._start_hi = end

    def _translate(self, exc: Exception) -> CorruptRecordError:
        error: CorruptRecordError
        m = _LIMIT_MESSAGE.match(str(exc)) if type(exc) is ValueError else None
        if m is not None:
            size = int(m.group(1)) * (2 if m.group(2) == "map" else 1)
            error = RecordTooLargeError(size, self._limit, at_least=True)
        elif isinstance(exc, msgpack.BufferFull):
            error = RecordTooLargeError(self._limit + 1, self._limit, at_least=True)
        else:
            error = CorruptRecordError(f"invalid msgpack data: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    def _renew(self) -> None:
        """Replace the Unpacker, dropping its grown buffer (Flink's prune, reading side)."""
        self._unpacker = self._new_unpacker()
        self._fed = self._start_lo = self._start_hi = 0
        self._grown = False

    def clear(self) -> None:
        self._renew()
        self._ready = []
        self._error = None


# -- length-framed ------------------------------------------------------------------------


class FramedCodec:
    """Records framed as ``u32 big-endian length | payload``.

    ``encode`` turns a record into its payload (bytes-like); ``decode`` turns a payload
    back into a record. ``decode`` gets a memoryview that is valid only during the call:
    it must copy what it keeps. An exception from ``decode`` becomes a
    CorruptRecordError. ``encode=None`` sends bytes-like records as they are.
    """

    __slots__ = ("_decode", "_encode", "_max_record_size")

    #: Names the payload format in errors.
    format_name: str = "a framed codec"

    def __init__(
        self,
        encode: Callable[[Any], BytesLike] | None,
        decode: Callable[[memoryview], Any],
        *,
        max_record_size: int = DEFAULT_MAX_RECORD_SIZE,
    ) -> None:
        self._encode = encode
        self._decode = decode
        self._max_record_size = _check_limit(max_record_size, MAX_FRAMED_RECORD_SIZE)

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def new_encoder(self) -> FramedEncoder:
        return FramedEncoder(self._encode, self._max_record_size, self.format_name)

    def new_decoder(self) -> FramedDecoder:
        return FramedDecoder(self._decode, self._max_record_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_record_size={self._max_record_size})"


class PickleCodec(FramedCodec):
    """Any picklable record, as a framed pickle per record. Only for trusted peers.

    Slower than the default ``PickleBatchCodec`` (one pickle call per record).
    """

    __slots__ = ()

    format_name = "pickle"

    def __init__(
        self,
        *,
        protocol: int = pickle.HIGHEST_PROTOCOL,
        max_record_size: int = DEFAULT_MAX_RECORD_SIZE,
    ) -> None:
        def dumps(record: Any) -> bytes:
            return pickle.dumps(record, protocol)

        super().__init__(dumps, pickle.loads, max_record_size=max_record_size)


class BytesCodec(FramedCodec):
    """Records are bytes-like objects, sent as they are and decoded as ``bytes``."""

    __slots__ = ()

    format_name = "BytesCodec (records must be bytes-like)"

    def __init__(self, *, max_record_size: int = DEFAULT_MAX_RECORD_SIZE) -> None:
        super().__init__(None, bytes, max_record_size=max_record_size)


def _payload_size(payload: object) -> int:
    """The size of a bytes-like payload; TypeError for anything else."""
    if isinstance(payload, memoryview):
        return payload.nbytes
    if isinstance(payload, bytes | bytearray):
        return len(payload)
    raise TypeError(f"record payload must be bytes-like, got {type(payload).__name__}")


class FramedEncoder:
    """Appends ``length | payload``; the payload is never concatenated with its header."""

    __slots__ = ("_format_name", "_inner", "_max_record_size")

    def __init__(
        self,
        inner: Callable[[Any], BytesLike] | None,
        max_record_size: int,
        format_name: str = "a framed codec",
    ) -> None:
        self._inner = inner
        self._max_record_size = max_record_size
        self._format_name = format_name

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def encode_batch(self, records: list[Any]) -> bytearray:
        out = bytearray()
        inner = self._inner
        limit = self._max_record_size
        pack = _LEN.pack
        for record in records:
            try:
                payload = record if inner is None else inner(record)
                n = _payload_size(payload)
            except Exception as exc:
                raise unencodable_record(record, self._format_name, exc) from exc
            if n > limit:
                raise RecordTooLargeError(n, limit)
            out += pack(n)
            out += payload
        return out


class FramedDecoder(LengthPrefixedDecoder):
    """One record per frame, decoded by ``decode``."""

    __slots__ = ("_decode",)

    def __init__(self, decode: Callable[[memoryview], Any], max_record_size: int) -> None:
        super().__init__(max_record_size)
        self._decode = decode

    def _deliver(self, payload: memoryview) -> None:
        try:
            record = self._decode(payload)
        except Exception as exc:
            raise CorruptRecordError(
                f"cannot decode a record of {len(payload)} bytes: {type(exc).__name__}: {exc}"
            ) from exc
        self._ready.append(record)
