"""ResultPartition: the output of one producer, split into subpartitions.

Owns its LocalBufferPool (``num_required = number of subpartitions``, as in Flink). The
partition does not encode records: its writer (``exchange.writer``: a RecordWriter driven
by the daemon's local endpoint for producer tasks; in tests, by ``tests/kit``'s sink)
copies each buffer it cut into a segment of this pool and queues it here.

Buffers are handed over complete with ``add_buffer(target, buffer)``;
``target == ALL_SUBPARTITIONS`` queues one buffer for every subpartition (one segment,
reference counted: it returns to the pool once every subpartition's reader released it).

Lifecycle (``states.py``): WRITING -> FINISHED -> RELEASED, or FAILED / RELEASED early.
The pool lives until the partition is released: a pipelined partition's queued buffers
hold its segments until they are read (a blocking partition, whose data is spilled, gives
its pool back at ``finish``). A pipelined partition is released once every subpartition
is done: consumed (its reader polled EndOfPartition) or failed (its reader left early).
Whoever must hear of the end registers a listener (``add_release_listener``,
``add_consumer_failure_listener``); listeners are called in order, each once.

With ``keep_manifest`` (the daemon's partitions) the partition keeps a manifest next to
its spill files (``partition_manifest.py``) so that a restarted daemon serves a finished
blocking partition again and fails the readers of one that died unfinished;
``ResultPartition.restore`` builds a finished blocking partition from such a manifest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final, NamedTuple, NoReturn, TypeVar

from exchange.buffers.buffer import Buffer
from exchange.buffers.buffer_consumer import BufferConsumer
from exchange.errors import (
    PartitionReleasedError,
    ProducerFailedError,
    SpillError,
    SubpartitionIndexError,
    UsageError,
    WriterClosedError,
    error_reason,
    fresh_error,
)
from exchange.events.events import AbstractEvent, EventSerializer
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.partition.bounded_blocking_subpartition import BoundedBlockingSubpartition
from exchange.partition.bounded_data import (
    BOUNDED_DATA_KINDS,
    DEFAULT_BOUNDED_DATA_KIND,
    ReadMemory,
    create_bounded_data,
)
from exchange.partition.partition_manifest import (
    MANIFEST_SUFFIX,
    ManifestState,
    PartitionManifest,
    SpilledSubpartition,
    write_manifest,
)
from exchange.partition.pipelined_subpartition import (
    OutputChannelStateListener,
    PipelinedSubpartition,
)
from exchange.partition.reader_budget import ReaderAccount
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.partition.spill_space import SpillAccount, spill_error
from exchange.partition.states import PARTITION_TRANSITIONS, ResultPartitionState, transition
from exchange.partition.subpartition_view import BufferAvailabilityListener, ResultSubpartitionView
from exchange.paths import default_spill_dir

__all__ = ["ALL_SUBPARTITIONS", "ResultPartition", "ResultPartitionStats", "ResultSubpartition"]

#: ``add_buffer`` target meaning "every subpartition reads this one buffer" (the value the
#: local-endpoint protocol and the writer use for the same meaning).
ALL_SUBPARTITIONS: Final = 0xFFFFFFFF

ResultSubpartition = PipelinedSubpartition | BoundedBlockingSubpartition


class ResultPartitionStats(NamedTuple):
    num_subpartitions: int
    bytes_out: int
    buffers_out: int
    backlog: int
    out_pool_usage: float
    back_pressured_seconds: float
    finished: bool
    released: bool


_T = TypeVar("_T")

ReleaseListener = Callable[["ResultPartition"], None]
ConsumerFailureListener = Callable[[BaseException], None]

_WRITING: Final = ResultPartitionState.WRITING
_FINISHED: Final = ResultPartitionState.FINISHED
_FAILED: Final = ResultPartitionState.FAILED
_RELEASED: Final = ResultPartitionState.RELEASED


class ResultPartition:
    """One producer's output."""

    def __init__(
        self,
        partition_id: ResultPartitionID,
        partition_type: ResultPartitionType,
        num_subpartitions: int,
        buffer_pool: LocalBufferPool,
        *,
        spill_dir: str | os.PathLike[str] | None = None,
        bounded_data_kind: str = DEFAULT_BOUNDED_DATA_KIND,
        keep_manifest: bool = False,
        restore_from: PartitionManifest | None = None,
        app_id: str = "",
        spill_account: SpillAccount | None = None,
        manifest_key: bytes | None = None,
        reader_account: ReaderAccount | None = None,
    ) -> None:
        if not isinstance(num_subpartitions, int) or num_subpartitions <= 0:
            raise UsageError(f"num_subpartitions must be a positive int, got {num_subpartitions!r}")
        if bounded_data_kind not in BOUNDED_DATA_KINDS:
            raise UsageError(
                f"bounded_data_kind must be one of {', '.join(BOUNDED_DATA_KINDS)}, "
                f"got {bounded_data_kind!r}"
            )
        if buffer_pool.num_required < num_subpartitions and restore_from is None:
            # One guaranteed segment per subpartition (Flink's minimum): with fewer, the
            # unread buffers of some subpartitions can hold every segment while the reader
            # that would free one waits for a subpartition that cannot get any.
            raise UsageError(
                f"a {partition_type.value} partition of {num_subpartitions} subpartitions "
                f"needs a pool of at least {num_subpartitions} required segments"
            )
        self.partition_id = partition_id
        self.partition_type = partition_type
        #: The application that created it ("": none); only its connections may use it.
        self.app_id = app_id if restore_from is None else restore_from.app_id
        self.buffer_pool = buffer_pool
        #: Counts this partition's blocking readers against its application's budget.
        self.reader_account = reader_account
        self.segment_size = buffer_pool.segment_size
        self.subpartitions: list[ResultSubpartition] = []
        self._bounded_data_kind = bounded_data_kind
        self._manifest_path: Path | None = None
        self._manifest_key = manifest_key
        self._keep_spilled = False
        directory = Path(spill_dir) if spill_dir is not None else _default_spill_dir()
        self.spill_dir = directory
        stem = f"{_safe(partition_id.dataset_id)}-{partition_id.partition_index}-" + (
            f"{partition_id.attempt_id}-{uuid.uuid4().hex[:8]}"
        )
        if restore_from is not None:
            self._restore_subpartitions(restore_from, directory, spill_account)
        elif partition_type.is_blocking:
            if spill_account is not None:
                spill_account.check_new()  # SpillError: quota used up, free space below floor
            self._create_manifest(directory, stem, num_subpartitions, keep_manifest)
            for i in range(num_subpartitions):  # each file is created on its first write
                data = create_bounded_data(
                    bounded_data_kind,
                    directory / f"{stem}.{i}.bin",
                    self.segment_size,
                    account=spill_account,
                )
                self.subpartitions.append(BoundedBlockingSubpartition(i, self, data))
        else:
            self._create_manifest(directory, stem, num_subpartitions, keep_manifest)
            for i in range(num_subpartitions):
                self.subpartitions.append(PipelinedSubpartition(i, self))
        self._state = _WRITING
        self._finished_at_release = False  # history for statistics, not a state
        self._failure: BaseException | None = None
        self._done: set[int] = set()  # pipelined subpartitions consumed or failed
        self._bytes_out = 0
        self._buffers_out = 0
        self._back_pressured = 0.0
        self._release_listeners: list[ReleaseListener] = []
        self._consumer_failure_listeners: list[ConsumerFailureListener] = []
        if restore_from is not None:
            self._transition(_FINISHED)
            self.buffer_pool.destroy()  # a finished blocking partition needs no pool

    @classmethod
    def restore(
        cls,
        manifest_path: Path,
        manifest: PartitionManifest,
        buffer_pool: LocalBufferPool,
        *,
        spill_account: SpillAccount | None = None,
        reader_account: ReaderAccount | None = None,
    ) -> ResultPartition:
        """A finished blocking partition a previous daemon left (its files checked by
        ``verify_spilled_data``); it keeps ``manifest_path`` as its manifest. Its files
        count against ``spill_account``, its readers against ``reader_account``."""
        if manifest.state is not ManifestState.FINISHED or not manifest.partition_type.is_blocking:
            raise UsageError(f"{manifest_path}: only finished blocking partitions are restored")
        if manifest.segment_size != buffer_pool.segment_size:
            raise UsageError(
                f"{manifest_path}: written with segment size {manifest.segment_size}, "
                f"the daemon now uses {buffer_pool.segment_size}"
            )
        part = cls(
            manifest.partition_id,
            manifest.partition_type,
            manifest.num_subpartitions,
            buffer_pool,
            spill_dir=manifest_path.parent,
            bounded_data_kind=manifest.bounded_data_kind,
            restore_from=manifest,
            spill_account=spill_account,
            reader_account=reader_account,
        )
        part._manifest_path = manifest_path
        return part

    def _create_manifest(
        self, directory: Path, stem: str, num_subpartitions: int, keep_manifest: bool
    ) -> None:
        """Create the spill directory (0700) and, with ``keep_manifest``, the manifest: first,
        so that no spill file exists without its manifest."""
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if keep_manifest:
                path = directory / (stem + MANIFEST_SUFFIX)
                write_manifest(
                    path,
                    self._manifest(num_subpartitions, False),
                    sync=False,
                    key=self._manifest_key,
                )
                self._manifest_path = path
        except OSError as e:
            raise spill_error(directory, "create the partition's manifest", e) from None

    def _restore_subpartitions(
        self, manifest: PartitionManifest, directory: Path, account: SpillAccount | None
    ) -> None:
        for i, spilled in enumerate(manifest.subpartitions):
            data = create_bounded_data(
                manifest.bounded_data_kind,
                directory / spilled.file,
                self.segment_size,
                existing=(spilled.size, spilled.crc32),
                account=account,
            )
            sub = BoundedBlockingSubpartition(i, self, data)
            sub.restore_finished(spilled.payload_bytes, spilled.buffers, spilled.data_buffers)
            self.subpartitions.append(sub)

    def _manifest(self, num_subpartitions: int, finished: bool) -> PartitionManifest:
        subs: tuple[SpilledSubpartition, ...] = ()
        if finished:
            subs = tuple(
                SpilledSubpartition(
                    s.data.path.name,
                    s.data.size,
                    s.data.crc32,
                    s.total_buffers,
                    s.num_data_buffers,
                    s.total_bytes,
                )
                for s in self.subpartitions
                if isinstance(s, BoundedBlockingSubpartition)
            )
        return PartitionManifest(
            self.partition_id,
            self.partition_type,
            ManifestState.FINISHED if finished else ManifestState.WRITING,
            num_subpartitions,
            self.segment_size,
            self._bounded_data_kind,
            time.time() if finished else None,
            subs,
            self.app_id,
        )

    def keep_spilled_data(self) -> None:
        """A finished blocking partition with a manifest keeps its files and manifest when
        released (the daemon shuts down; the next one serves them again). No-op otherwise."""
        if self._manifest_path is None or self._state is not _FINISHED:
            return
        if not self.partition_type.is_blocking:
            return
        self._keep_spilled = True
        for sub in self.subpartitions:
            if isinstance(sub, BoundedBlockingSubpartition):
                sub.keep_data()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def state(self) -> ResultPartitionState:
        return self._state

    def _transition(self, to: ResultPartitionState) -> None:
        self._state = transition(PARTITION_TRANSITIONS, self._state, to, self)

    @property
    def num_subpartitions(self) -> int:
        return len(self.subpartitions)

    @property
    def is_finished(self) -> bool:
        """The producer finished it (it may have been released since, e.g. consumed)."""
        return self._finished_at_release if self._state.is_released else self._state is _FINISHED

    @property
    def is_released(self) -> bool:
        return self._state.is_released

    @property
    def failure_cause(self) -> BaseException | None:
        return self._failure

    def add_release_listener(self, listener: ReleaseListener) -> None:
        """Call ``listener(partition)`` once the partition is released or failed (at once
        if it is already)."""
        if self._state.is_released:
            listener(self)
            return
        self._release_listeners.append(listener)

    def add_consumer_failure_listener(self, listener: ConsumerFailureListener) -> None:
        """Call ``listener(cause)`` whenever a reader leaves a pipelined subpartition before
        its end: a producer not writing into that subpartition would not notice otherwise."""
        self._consumer_failure_listeners.append(listener)

    # -- writing records -----------------------------------------------------------------

    def record_back_pressure(self, seconds: float) -> None:
        """The producer waited ``seconds`` for a segment of this partition's pool (Flink's
        backPressuredTime); whoever drives the writer measures it."""
        if seconds > 0:
            self._back_pressured += seconds

    def check_writable(self, target: int | None = None) -> None:
        """Raise if nothing may be written (finished, released, or a reader failed)."""
        state = self._state
        if state.is_released:
            cause = self._failure
            if isinstance(cause, PartitionReleasedError):
                raise fresh_error(cause)
            raise PartitionReleasedError(
                "partition was released" + (f": {error_reason(cause)}" if cause else ""),
                self.partition_id,
            )
        if state is _FINISHED:
            raise WriterClosedError(f"partition {self.partition_id} is finished")
        if target is not None:
            sub = self.subpartitions[target]
            if sub.is_released:
                cause = sub.failure_cause
                if isinstance(cause, PartitionReleasedError):
                    raise fresh_error(cause)
                raise PartitionReleasedError(
                    f"subpartition {target} was released", self.partition_id
                )

    def add_buffer(self, target: int, buffer: Buffer) -> None:
        """Queue a complete buffer built elsewhere for ``target`` or ``ALL_SUBPARTITIONS``.

        Takes over ``buffer`` (one reference); it is released if the partition cannot take
        it. For ``ALL_SUBPARTITIONS`` every subpartition holds a reference of its own on the
        one segment.
        """
        subs = self.subpartitions
        n = len(subs)
        if 0 <= target < n and self._state is _WRITING and not subs[target].is_released:
            pass  # writable (once per buffer on the commit path: no call to say so)
        else:
            try:
                if target == ALL_SUBPARTITIONS:
                    self.check_writable()
                    for i in range(n):
                        self.check_writable(i)
                elif not 0 <= target < n:
                    raise SubpartitionIndexError(target, n, self.partition_id)
                else:
                    self.check_writable(target)
            except BaseException:
                buffer.release()
                raise
        size = buffer.size
        if target != ALL_SUBPARTITIONS:
            try:
                if not subs[target].add(BufferConsumer.of_buffer(buffer)):
                    self.check_writable(target)  # pragma: no cover - checked above
            except SpillError as e:
                self._spill_failed(e)
            self._bytes_out += size
            self._buffers_out += 1
            return
        for _ in range(n - 1):
            buffer.retain()
        for i, sub in enumerate(subs):  # none refuses: every one was checked writable above
            try:
                sub.add(BufferConsumer.of_buffer(buffer))
            except SpillError as e:
                for _ in range(n - 1 - i):
                    buffer.release()  # the references of the subpartitions not reached
                self._spill_failed(e)
        self._bytes_out += size * n
        self._buffers_out += n

    def _spill_failed(self, error: SpillError) -> NoReturn:
        """A blocking file could not be written: release the partition with ``error`` (files
        deleted, pool destroyed, listeners and the producer told), then raise it."""
        if error.partition_id is None:
            error = SpillError(
                str(error),
                self.partition_id,
                directory=error.directory,
                setting=error.setting,
                errno=error.errno,
            )
        self.release(error)
        raise error

    # -- events, flushing, finishing -----------------------------------------------------

    def broadcast_event(self, event: AbstractEvent) -> None:
        """Send an event to every subpartition, after everything written so far."""
        self.check_writable()
        consumer = EventSerializer.to_buffer_consumer(event)
        try:
            for sub in self.subpartitions:
                sub.add(consumer.copy())
        except SpillError as e:
            self._spill_failed(e)
        finally:
            consumer.close()

    def set_output_channel_state_listener(
        self, listener: OutputChannelStateListener | None
    ) -> None:
        """Who receives, per pipelined subpartition, the buffers an unaligned barrier
        overtook (``PipelinedSubpartition.set_output_channel_state_listener``)."""
        for sub in self.subpartitions:
            if isinstance(sub, PipelinedSubpartition):
                sub.set_output_channel_state_listener(listener)

    def flush(self, target: int) -> None:
        self.subpartitions[target].flush()

    def flush_all(self) -> None:
        """Make everything written so far readable."""
        if self._state.is_released:
            return
        for sub in self.subpartitions:
            sub.flush()

    def finish(self) -> None:
        """Append EndOfPartition to every subpartition.

        Idempotent; on a released partition it raises what every write raises there.
        """
        if self._state is _FINISHED:
            return
        self.check_writable()
        try:
            for sub in self.subpartitions:
                sub.finish()
            if self._manifest_path is not None and self.partition_type.is_blocking:
                try:
                    write_manifest(
                        self._manifest_path,
                        self._manifest(len(self.subpartitions), True),
                        key=self._manifest_key,
                    )
                except OSError as e:
                    raise spill_error(self.spill_dir, "write the partition's manifest", e) from None
        except SpillError as e:
            self._spill_failed(e)
        self._transition(_FINISHED)
        if self.partition_type.is_blocking:
            # Everything is spilled and nothing more will be requested: give the pool's
            # segments and its claim on the global pool back now. A pipelined partition
            # keeps its pool until released: its unread buffers still hold segments.
            self.buffer_pool.destroy()

    def fail(self, cause: BaseException | None) -> None:
        """The producer failed: readers get a ProducerFailedError instead of a short read.

        Also after ``finish``: unread pipelined data is dropped (as Flink's
        ``ResultPartition.fail``). A no-op once released: the first end wins.
        """
        if self._state.is_released:
            return
        if isinstance(cause, ProducerFailedError):
            err = cause
        else:
            err = ProducerFailedError(
                "producer failed" + (f": {cause}" if cause is not None else ""),
                self.partition_id,
            )
            if cause is not None:
                err.__cause__ = cause
        self.release(err)

    def release(self, cause: BaseException | None = None) -> None:
        """Release every subpartition and every buffer; then tell the release listeners.

        With a ProducerFailedError as ``cause`` the partition ends FAILED, else RELEASED.
        Idempotent.
        """
        if self._state.is_released:
            return
        self._finished_at_release = self._state is _FINISHED
        self._transition(_FAILED if isinstance(cause, ProducerFailedError) else _RELEASED)
        self._failure = cause
        # Every step runs whatever an earlier one raised (a full disk, a file already gone):
        # a partition half released would keep its segments and files for ever.
        steps: list[Callable[[], None]] = []
        if self._manifest_path is not None and not self._keep_spilled:
            # before the files: a crash in between leaves orphans the next daemon deletes
            steps.append(self._delete_manifest)
        steps.extend(functools.partial(sub.release, cause) for sub in self.subpartitions)
        steps.append(self.buffer_pool.destroy)
        listeners, self._release_listeners = self._release_listeners, []
        steps.extend(functools.partial(listener, self) for listener in listeners)
        _run_all(steps)

    def _delete_manifest(self) -> None:
        assert self._manifest_path is not None
        with contextlib.suppress(FileNotFoundError):
            self._manifest_path.unlink()

    # -- reading -------------------------------------------------------------------------

    def create_subpartition_view(
        self,
        index: int,
        listener: BufferAvailabilityListener,
        read_memory: ReadMemory | None = None,
    ) -> ResultSubpartitionView:
        """A reader of subpartition ``index``; a blocking one reads its data buffers into
        ``read_memory`` while it lends segments (a pipelined one's buffers already lie
        where their producer put them)."""
        if not isinstance(index, int) or not 0 <= index < len(self.subpartitions):
            raise SubpartitionIndexError(index, len(self.subpartitions), self.partition_id)
        if self._state is _FAILED:
            cause = self._failure
            raise ProducerFailedError(
                f"partition failed: {cause}" if cause else "producer failed", self.partition_id
            )
        if self._state is _RELEASED:
            raise PartitionReleasedError("partition was released", self.partition_id)
        sub = self.subpartitions[index]
        if isinstance(sub, BoundedBlockingSubpartition):
            return sub.create_read_view(listener, read_memory)
        return sub.create_read_view(listener)

    def abandon_subpartition(self, index: int) -> bool:
        """The consumer of pipelined subpartition ``index`` gave up without ever having
        requested it: the subpartition is released as when a reader leaves it before the
        end (the producer sees "released by its consumer before the end"). False, and
        nothing done: a blocking partition (read again by whoever asks), an index out of
        range, a released partition, or a subpartition that has or had its reader."""
        if self._state.is_released or not 0 <= index < len(self.subpartitions):
            return False
        sub = self.subpartitions[index]
        return isinstance(sub, PipelinedSubpartition) and sub.abandon()

    def _on_consumer_failure(self, cause: BaseException) -> None:
        _call_all(list(self._consumer_failure_listeners), cause)

    def _on_subpartition_done(self, index: int) -> None:
        """A pipelined subpartition's reader is gone, after its end or early (a failure).

        Once every subpartition is done, no reader will come: the partition is released
        (with the first consumer failure as its cause, if any).
        """
        if self._state.is_released or index in self._done:
            return
        self._done.add(index)
        if len(self._done) == len(self.subpartitions):
            cause = next(
                (s.failure_cause for s in self.subpartitions if s.failure_cause is not None),
                None,
            )
            self.release(cause)

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> ResultPartitionStats:
        pool = self.buffer_pool
        usage = 0.0 if pool.is_destroyed else pool.stats().usage
        backlog = sum(
            s.buffers_in_backlog for s in self.subpartitions if isinstance(s, PipelinedSubpartition)
        )
        return ResultPartitionStats(
            len(self.subpartitions),
            self._bytes_out,
            self._buffers_out,
            backlog,
            usage,
            self._back_pressured,
            self.is_finished,
            self.is_released,
        )

    def __repr__(self) -> str:
        return (
            f"ResultPartition({self.partition_id}, {self.partition_type.value}, "
            f"{len(self.subpartitions)} subpartitions, {self._state.value})"
        )


def _call_all(listeners: list[Callable[[_T], None]], arg: _T) -> None:
    """Call every listener, even when one raises; then re-raise the first error."""
    _run_all([functools.partial(listener, arg) for listener in listeners])


def _run_all(steps: list[Callable[[], None]]) -> None:
    """Run every step, even when one raises; then re-raise the first error."""
    error: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # re-raised below, after the others ran
            if error is None:
                error = e
    if error is not None:
        raise error


def _default_spill_dir() -> Path:
    """Where an in-process partition spills when given no directory: this user's own
    (never a name every user shares), apart from a daemon's files."""
    return Path(default_spill_dir()) / "in-process"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
