"""The default codec: records batched per channel and pickled as one list per frame.

Stream format: a sequence of frames ``u32 big-endian length | pickle.dumps(list, 5)``;
each frame's list holds consecutive records of the stream. A batch of records that are all
exactly ``(int, int)`` within 64 bits goes instead as a packed frame of fixed-width
integers (``int_pairs.pyx``: same framing, a payload starting with ``PAIRS_TAG``), which
the decoder reads in C; any other record in the batch makes it a pickle. Pickle gives records back
exactly (a tuple stays a tuple, a ``Row`` keeps its fields, a ``Decimal`` stays a
``Decimal``), and pickling a list is several times faster per record than pickling each
record on its own: the per-call overhead is paid once per batch.

Encoding: ``encode_batch`` pickles the whole list; a frame over ``max_record_size`` is
split in halves until it fits, so only a single record whose own frame is over the
limit is refused (``RecordTooLargeError``). A record pickle refuses is reported as a
``UsageError`` naming its type.

Pickle's memo writes an object referenced twice in a batch once (a class, a time zone, a
``Row``'s field names) at the price of a dict entry per container pickled; pickle's
*fast mode* skips the memo. For records that share nothing (tuples of numbers and
strings) fast mode dumps about 40 % faster and its frames load about 25 % faster; for
records that share objects it is several times slower and larger. So the encoder pickles
a batch both ways now and then (``_PROBE_FIRST`` then ever rarer, up to every
``_PROBE_MAX`` batches, and at once after a fast-mode batch of twice the bytes per record
of the last probe) and keeps fast mode until the next probe when it wrote no more bytes
than the memo did. A batch fast mode refuses (a reference cycle) is pickled with
the memo. Either way every record comes back equal and of its type; objects referenced
twice within a batch may come back as equal copies instead of one shared object.

Decoding: a frame lying entirely inside a fed piece is unpickled straight from it (no
copy); only a frame cut by the end of a piece is copied, once its header (checked against
the limit first) is complete, into a scratch ``bytearray`` the decoder reuses (frames up
to ``framing.SCRATCH_KEEP``) or one of the frame's size.
Unpickled objects never refer to the fed memory (pickle copies what it reads), so the
caller may recycle it as soon as ``feed`` returns.

Unpickling runs code named by the stream: only read streams from authenticated peers
(the daemons and tasks of one job share a secret; the daemon itself never unpickles
records). See ``docs/serialization.md``.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, Final

from exchange.errors import CorruptRecordError, RecordTooLargeError, UsageError
from exchange.serialization.framing import LengthPrefixedDecoder
from exchange.serialization.int_pairs import encode_int_pairs
from exchange.serialization.record_codec import (
    DEFAULT_MAX_RECORD_SIZE,
    MAX_FRAMED_RECORD_SIZE,
    _check_limit,
    unencodable_record,
)

__all__ = [
    "PICKLE_PROTOCOL",
    "PickleBatchCodec",
    "PickleBatchDecoder",
    "PickleBatchEncoder",
]

#: Protocol 5 (PEP 574): out-of-band capable, framed, fastest for bytes-heavy records.
PICKLE_PROTOCOL: Final = 5

_LEN: Final = struct.Struct(">I")
#: Batches before the encoder's second probe of fast mode against the memo; the interval
#: doubles after each probe up to ``_PROBE_MAX`` (a probe pickles its batch twice).
_PROBE_FIRST: Final = 8
_PROBE_MAX: Final = 256


#: Bytes a fast-mode batch may exceed its expected size by before it is cut short.
_FAST_SLACK: Final = 1 << 20


class _FastPickleTooLarge(Exception):
    """A fast-mode pickle outgrew its limit (see ``PickleBatchEncoder._dump_fast``)."""


class _BoundedFile(io.BytesIO):
    """The fast pickler's output: refuses writes past ``limit`` bytes."""

    limit = 0

    def write(self, b: Any, /) -> int:
        if self.tell() + len(b) > self.limit:
            raise _FastPickleTooLarge
        return super().write(b)


class PickleBatchCodec:
    """Any picklable record, exactly as pickle round-trips it; records batched per frame.

    Only for streams from trusted (authenticated) peers: unpickling can run code.
    """

    __slots__ = ("_max_record_size",)

    def __init__(self, *, max_record_size: int = DEFAULT_MAX_RECORD_SIZE) -> None:
        self._max_record_size = _check_limit(max_record_size, MAX_FRAMED_RECORD_SIZE)

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def new_encoder(self) -> PickleBatchEncoder:
        return PickleBatchEncoder(self._max_record_size)

    def new_decoder(self) -> PickleBatchDecoder:
        return PickleBatchDecoder(self._max_record_size)

    def __repr__(self) -> str:
        return f"PickleBatchCodec(max_record_size={self._max_record_size})"


class PickleBatchEncoder:
    """Pickles lists of records into length-prefixed frames (fast mode while it pays: see
    the module docstring)."""

    __slots__ = (
        "_fast",
        "_fast_bound",
        "_file",
        "_max_record_size",
        "_next_probe",
        "_probe_interval",
        "_use_fast",
    )

    def __init__(self, max_record_size: int) -> None:
        self._max_record_size = max_record_size
        self._file = _BoundedFile()
        self._fast = self._new_fast_pickler()
        self._use_fast = False
        self._next_probe = 0  # batches until the next probe
        self._probe_interval = _PROBE_FIRST
        # bytes per record above which a fast-mode batch makes the next batch a probe
        self._fast_bound = 0.0

    @property
    def max_record_size(self) -> int:
        return self._max_record_size

    def encode_batch(self, records: list[Any]) -> bytes:
        """One chunk of frames holding ``records`` in order (empty for no records).

        Usually one frame; more when the batch's frame would exceed ``max_record_size``.
        Raises ``RecordTooLargeError`` for a record whose own frame is over the limit and
        ``UsageError`` for a record pickle refuses; then nothing is returned to append.
        """
        if not records:
            return b""
        packed = encode_int_pairs(records, self._max_record_size)
        if packed is not None:
            return packed
        try:
            payload = self._dumps(records)
        except Exception as exc:
            raise _unpicklable(records, exc) from exc
        n = len(payload)
        if n <= self._max_record_size:
            return _LEN.pack(n) + payload
        frames: list[bytes] = []
        self._split(records, frames)
        return b"".join(frames)

    def _dumps(self, records: list[Any]) -> bytes:
        """The pickle of ``records``: fast mode or the memo, as the last probe decided."""
        if self._next_probe > 0:
            self._next_probe -= 1
            if self._use_fast:
                bound = int(self._fast_bound * len(records))
                fast = self._dump_fast(records, 2 * bound + _FAST_SLACK)
                if fast is not None and len(fast) <= bound:
                    return fast
                # over twice the bytes per record of the probe: maybe objects are shared
                # now, which fast mode writes again at every reference (a batch far over
                # it was cut short, and is pickled with the memo)
                self._next_probe = 0
                if fast is not None:
                    return fast
            return pickle.dumps(records, PICKLE_PROTOCOL)
        payload, self._use_fast = self._smallest(records)
        self._fast_bound = 2 * len(payload) / len(records)
        self._next_probe = self._probe_interval
        self._probe_interval = min(2 * self._probe_interval, _PROBE_MAX)
        return payload

    def _smallest(self, records: list[Any]) -> tuple[bytes, bool]:
        """The smaller pickle of ``records``, fast mode's when it is no larger, and
        whether it is fast mode's."""
        memo = pickle.dumps(records, PICKLE_PROTOCOL)
        fast = self._dump_fast(records, len(memo))
        if fast is not None and len(fast) <= len(memo):
            return fast, True
        return memo, False

    def _dump_fast(self, records: list[Any], limit: int) -> bytes | None:
        """``records`` pickled in fast mode (no memo); None if fast mode refused them (a
        reference cycle, or an object pickle refuses: the memo's pickling reports it) or
        its pickle grew past ``limit`` bytes: an object reached along many paths (a DAG of
        shared lists) is written once per path, which can grow exponentially; the pickler
        writes 64 KiB frames as it goes, so the dump stops soon after the limit."""
        f = self._file
        f.seek(0)
        f.truncate()
        f.limit = limit
        try:
            self._fast.dump(records)
        except Exception:
            self._fast = self._new_fast_pickler()  # nothing of a failed dump is kept
            return None
        return f.getvalue()

    def _new_fast_pickler(self) -> pickle.Pickler:
        pickler = pickle.Pickler(self._file, PICKLE_PROTOCOL)
        pickler.fast = True
        return pickler

    def _split(self, records: list[Any], frames: list[bytes]) -> None:
        """Append frames of the two halves of ``records`` (too large for one frame)."""
        limit = self._max_record_size
        if len(records) == 1:
            # one record's size is its smallest frame, whichever way the batch went
            payload, _ = self._smallest(records)
            if len(payload) > limit:
                raise RecordTooLargeError(len(payload), limit)
            frames.append(_LEN.pack(len(payload)))
            frames.append(payload)
            return
        mid = len(records) // 2
        for half in (records[:mid], records[mid:]):
            payload = self._dumps(half)
            if len(payload) <= limit:
                frames.append(_LEN.pack(len(payload)))
                frames.append(payload)
            else:
                self._split(half, frames)


def _unpicklable(records: list[Any], exc: Exception) -> UsageError:
    """The error for a batch pickle refused, naming the first record it refuses alone."""
    for record in records:
        try:
            pickle.dumps(record, PICKLE_PROTOCOL)
        except Exception as record_exc:
            return unencodable_record(record, "pickle", record_exc)
    return unencodable_record(records, "pickle", exc)


class PickleBatchDecoder(LengthPrefixedDecoder):
    """Unpickles each frame's list straight from the fed memory (the framing, and the
    copy of a cut frame only, are ``LengthPrefixedDecoder``'s)."""

    __slots__ = ()

    def __init__(self, max_record_size: int) -> None:
        super().__init__(max_record_size, int_pairs=True)

    def _deliver(self, payload: memoryview) -> None:
        """Unpickle one frame's payload and queue its records."""
        try:
            batch = pickle.loads(payload)
        except Exception as exc:
            raise CorruptRecordError(
                f"cannot unpickle a frame of {len(payload)} bytes: {type(exc).__name__}: {exc}"
            ) from exc
        if type(batch) is not list:
            raise CorruptRecordError(
                f"a frame of {len(payload)} bytes holds a {type(batch).__name__}, not a list"
            )
        if self._ready:
            self._ready += batch
        else:
            self._ready = batch
