"""Sources and sinks: a generator, files in (JSON lines, CSV, Parquet), files out with
two-phase commit, and a collect sink for tests. ``docs/streaming.md`` ("Sources and sinks")
states each one's guarantee.

How the sources split their input and survive a rescale: the input is cut into *splits*
(the generator: one arithmetic progression of indices per subtask of the first run; the file
source: one split per file), each split's position lives in **union** operator state, and
after a restore every subtask sees the same table of all splits and takes split ``i`` of the
sorted table when ``i % parallelism == subtask_index``. Every split thus has exactly one
owner, which resumes at the recorded position, whatever the new parallelism (a generator
restored with more subtasks than it has splits leaves the extra subtasks idle).

The sources never sleep: a rate-limited or idle source returns from ``poll`` with what it
has, possibly nothing, and says in ``ready_in()`` how long the runtime may wait before
polling again (on its control queue, so a checkpoint trigger is not delayed).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import time
import zlib
from collections.abc import Callable
from typing import Any, Final, Protocol

import fsspec

from client.streaming.functions import Collector, Operator, OperatorContext, Source
from exchange.errors import ConfigError, ExchangeError, UsageError
from exchange.state import CorruptSnapshotError

__all__ = [
    "CollectSink",
    "ConnectorError",
    "FileSink",
    "FileSource",
    "GeneratorSource",
    "PrintSink",
    "SinkCommitError",
    "SourceFormatError",
    "SourceNotFoundError",
]

log = logging.getLogger("exchange.streaming.connectors")

Clock = Callable[[], float]

FILE_FORMATS: Final = ("jsonl", "csv", "parquet")
SINK_FORMATS: Final = ("jsonl",)
INPROGRESS_DIR: Final = ".inprogress"
PENDING_DIR: Final = ".pending"
_PART = re.compile(r"part-(\d+)-(\d+)-(\d+)\.")
_PENDING_CHK = re.compile(r"-chk-(\d+)$")
_GLOB_CHARS = re.compile(r"[*?\[]")


class ConnectorError(ExchangeError):
    """A source or sink could not do its job (its input or output is not as expected)."""


class SourceNotFoundError(ConnectorError):
    """A bounded file source's path names no file (at the job's first start)."""

    def __init__(self, path: str) -> None:
        super().__init__(
            f"file source: {path!r} names no file (nothing matches the glob, the directory "
            "has no visible files, or the path does not exist); a bounded source would read "
            "nothing and the job would finish with no output"
        )
        self.path = path


class SourceFormatError(ConnectorError):
    """A record of an input file cannot be decoded; names the file and the position."""

    def __init__(self, path: str, position: int, detail: str) -> None:
        super().__init__(f"{path} at {position}: {detail}")
        self.path = path
        self.position = position


class SinkCommitError(ConnectorError):
    """A pending file a completed checkpoint names is gone and was never committed."""


# -- generator --------------------------------------------------------------------------------


class _RateLimiter:
    """A token bucket on an injected clock: ``take(n)`` grants what is due, never waits."""

    def __init__(self, rate: float, clock: Clock) -> None:
        self.rate = rate
        self.clock = clock
        #: at most 100 ms of records in one burst (a source that was backpressured does not
        #: flood the pipeline when it may run again)
        self.capacity = max(1.0, rate / 10)
        self.tokens = 1.0
        self.last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def take(self, n: int) -> int:
        self._refill()
        granted = min(n, int(self.tokens))
        self.tokens -= granted
        return granted

    def ready_in(self) -> float:
        self._refill()
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


class GeneratorSource(Source):
    """``fn(0), fn(1), ...`` (``count`` records, or forever when ``count`` is None), at most
    ``rate`` records per second over all subtasks. Subtask k of p emits indices k, k+p, ...;
    deterministic and replayable: after a restore the records resume exactly after the last
    index emitted before the checkpoint."""

    def __init__(
        self,
        fn: Callable[[int], Any],
        count: int | None = None,
        rate: float | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        if not callable(fn):
            raise ConfigError("fn", f"a callable index -> record, got {type(fn).__name__}")
        if count is not None and (type(count) is not int or count < 0):
            raise ConfigError("count", f"None or an int >= 0, got {count!r}")
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0
        ):
            raise ConfigError("rate", f"None or records per second > 0, got {rate!r}")
        if rate is not None and not math.isfinite(rate):
            raise ConfigError("rate", f"must be finite, got {rate!r}")
        self.fn = fn
        self.count = count
        self.rate = rate
        self.clock = clock
        self.bounded = count is not None
        #: [first, step, next index] of every split this subtask owns
        self._splits: list[list[int]] = []
        self._limiter: _RateLimiter | None = None
        self._turn = 0

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        state = ctx.operator_state.union_list_state(ctx.operator_id, "generator-splits")
        started = ctx.operator_state.union_list_state(ctx.operator_id, "generator-started")
        k, p = ctx.subtask_index, ctx.parallelism
        if len(started):
            table = sorted(tuple(s) for s in state.get())
            firsts = [s[0] for s in table]
            steps = {s[1] for s in table}
            if (
                len(set(firsts)) != len(table)
                or steps != {len(table)}
                or any(s[2] % s[1] != s[0] for s in table)
            ):
                raise CorruptSnapshotError(
                    f"operator state of {ctx.operator_id!r}",
                    f"generator splits {table[:8]} are not one progression per old subtask",
                )
            self._splits = [list(s) for i, s in enumerate(table) if i % p == k]
            total = len(table)
        else:
            self._splits = [[k, p, k]]
            total = p
        started.update([True])
        self._write_state()
        if self.rate is not None and self._splits:
            self._limiter = _RateLimiter(self.rate * len(self._splits) / total, self.clock)

    def _write_state(self) -> None:
        self.ctx.operator_state.union_list_state(self.ctx.operator_id, "generator-splits").update(
            tuple(s) for s in self._splits
        )

    def _active(self) -> list[list[int]]:
        if self.count is None:
            return self._splits
        count = self.count
        return [s for s in self._splits if s[2] < count]

    def poll(self, out: Collector, max_records: int) -> bool:
        active = self._active()
        if not active:
            return self.count is None
        budget = max_records if self._limiter is None else self._limiter.take(max_records)
        fn = self.fn
        end = self.count
        if len(active) == 1:
            split = active[0]
            i, step = split[2], split[1]
            stop = i + budget * step if end is None else min(end, i + budget * step)
            try:
                while i < stop:
                    out.collect(fn(i))
                    i += step
            finally:
                split[2] = i
        else:
            # several splits after a rescale: one record of each in turn
            while budget > 0 and active:
                self._turn %= len(active)
                split = active[self._turn]
                out.collect(fn(split[2]))
                split[2] += split[1]
                budget -= 1
                if end is not None and split[2] >= end:
                    active.pop(self._turn)
                else:
                    self._turn += 1
        return self.count is None or bool(self._active())

    def ready_in(self) -> float:
        """Seconds until ``poll`` has a record to emit (0: now; infinite: never, an
        unbounded subtask left without splits by a rescale)."""
        if not self._splits and self.count is None:
            return math.inf
        if self._limiter is None or not self._active():
            return 0.0
        return self._limiter.ready_in()

    def snapshot_state(self, checkpoint_id: int) -> None:
        self._write_state()

    @property
    def next_indices(self) -> list[int]:
        """The next index of each split this subtask owns."""
        return [s[2] for s in self._splits]


# -- file source ------------------------------------------------------------------------------


class _Reader(Protocol):
    position: int
    eof: bool

    def emit(self, out: Collector, n: int) -> int: ...

    def close(self) -> None: ...


class _LineReader:
    """JSON lines or CSV from a byte offset; ``position`` is the offset after the last
    record emitted (blank lines are skipped)."""

    def __init__(self, fs: Any, path: str, position: int, fmt: str) -> None:
        self.path = path
        self.fmt = fmt
        self.eof = False
        self.header: list[str] = []
        self.file = fs.open(path, "rb")
        try:
            if fmt == "csv":
                first = self.file.readline()
                self.header = self._csv_fields(first, 0) if first.strip() else []
                position = max(position, len(first))
            self.file.seek(position)
        except BaseException:
            self.file.close()
            raise
        self.position = position

    def _csv_fields(self, line: bytes, position: int) -> list[str]:
        try:
            return next(csv.reader([line.decode("utf-8")]))
        except (UnicodeDecodeError, csv.Error, StopIteration) as exc:
            raise SourceFormatError(self.path, position, f"not a CSV line: {exc}") from exc

    def _decode(self, line: bytes, position: int) -> Any:
        if self.fmt == "jsonl":
            try:
                return json.loads(line)
            except ValueError as exc:
                raise SourceFormatError(self.path, position, f"not a JSON line: {exc}") from exc
        fields = self._csv_fields(line, position)
        if len(fields) != len(self.header):
            raise SourceFormatError(
                self.path,
                position,
                f"{len(fields)} fields, the header has {len(self.header)}: {fields!r:.80}",
            )
        return dict(zip(self.header, fields, strict=True))

    def emit(self, out: Collector, n: int) -> int:
        readline = self.file.readline
        emitted = 0
        while emitted < n:
            line = readline()
            if not line:
                self.eof = True
                break
            at = self.position
            self.position += len(line)
            if line.strip():
                out.collect(self._decode(line, at))
                emitted += 1
        return emitted

    def close(self) -> None:
        self.file.close()


class _ParquetReader:
    """Parquet rows (dicts) from a row index, one row group in memory at a time."""

    def __init__(self, fs: Any, path: str, position: int) -> None:
        import pyarrow.parquet as pq  # only when parquet is used

        self.path = path
        self.eof = False
        self.file = fs.open(path, "rb")
        try:
            self.pf = pq.ParquetFile(self.file)
        except Exception as exc:
            self.file.close()
            raise SourceFormatError(path, position, f"not a Parquet file: {exc}") from exc
        meta = self.pf.metadata
        self.group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.position = position
        self.rows: list[Any] = []
        self.rows_start = 0

    def _load(self) -> bool:
        start = 0
        for g, n in enumerate(self.group_rows):
            if self.position < start + n:
                self.rows = self.pf.read_row_group(g).to_pylist()
                self.rows_start = start
                return True
            start += n
        return False

    def emit(self, out: Collector, n: int) -> int:
        emitted = 0
        while emitted < n:
            offset = self.position - self.rows_start
            if not 0 <= offset < len(self.rows):
                if not self._load():
                    self.eof = True
                    break
                offset = self.position - self.rows_start
            take = min(n - emitted, len(self.rows) - offset)
            for row in self.rows[offset : offset + take]:
                out.collect(row)
                self.position += 1
            emitted += take
        return emitted

    def close(self) -> None:
        self.rows = []
        self.file.close()


class FileSource(Source):
    """The records of the files ``path`` names: a file, a directory (its files, not
    recursive) or a glob, on any fsspec URL; names starting with ``.`` or ``_`` are skipped.

    ``format``: ``jsonl`` (a JSON value per line), ``csv`` (a header line, then a dict of
    strings per line; no line breaks inside fields) or ``parquet`` (a dict per row, read with
    pyarrow). Files are split across subtasks: at the first start file i of the sorted list
    goes to subtask ``i % p``; with ``watch=True`` (unbounded) the directory is listed again
    every ``watch_interval`` seconds while the source is idle, and a new file goes to the
    subtask ``crc32(path) % p`` (each subtask decides alone, so files must appear whole:
    written elsewhere, then moved in). The position (byte offset after the last record for
    lines, row index for Parquet) of every file is operator state.
    """

    def __init__(
        self,
        path: str,
        format: str = "jsonl",
        watch: bool = False,
        *,
        watch_interval: float = 1.0,
        storage_options: dict[str, Any] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError("path", f"a path, URL or glob, got {path!r}")
        if format not in FILE_FORMATS:
            raise ConfigError("format", f"one of {', '.join(FILE_FORMATS)}, got {format!r}")
        if not (isinstance(watch_interval, int | float) and watch_interval > 0):
            raise ConfigError("watch_interval", f"seconds > 0, got {watch_interval!r}")
        self.path = path
        self.format = format
        self.watch = watch
        self.watch_interval = float(watch_interval)
        self.storage_options = storage_options or {}
        self.clock = clock
        self.bounded = not watch
        #: path -> [position, done] of every file this subtask owns, in reading order
        self._files: dict[str, list[Any]] = {}
        self._queue: list[str] = []
        self._known: set[str] = set()
        self._reader: _Reader | None = None
        self._next_scan = 0.0

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._fs, self._root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        table_state = ctx.operator_state.union_list_state(ctx.operator_id, "file-positions")
        started = ctx.operator_state.union_list_state(ctx.operator_id, "file-started")
        k, p = ctx.subtask_index, ctx.parallelism
        if len(started):
            table: dict[str, list[Any]] = {}
            for path, position, done in table_state.get():
                if path in table:
                    raise CorruptSnapshotError(
                        f"operator state of {ctx.operator_id!r}", f"file {path} listed twice"
                    )
                table[path] = [position, done]
            self._known = set(table)
            for i, path in enumerate(sorted(table)):
                if i % p == k:
                    self._files[path] = table[path]
        else:
            listed = self._list()
            if not listed and not self.watch:  # seen from this task's host
                raise SourceNotFoundError(self.path)
            self._known = set(listed)
            for i, path in enumerate(listed):
                if (self._owner(path) if self.watch else i % p) == k:
                    self._files[path] = [0, False]
        started.update([True])
        self._queue = [path for path, (_, done) in self._files.items() if not done]
        self._next_scan = self.clock() + self.watch_interval
        self._write_state()

    def check_input(self) -> None:
        """Raise SourceNotFoundError if the path names no file and the source is bounded
        (the driver calls it before a job's first start)."""
        if self.watch:
            return
        self._fs, self._root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        if not self._list():
            raise SourceNotFoundError(self.path)

    def _owner(self, path: str) -> int:
        return zlib.crc32(path.encode()) % self.ctx.parallelism

    def _list(self) -> list[str]:
        fs, root = self._fs, self._root
        if _GLOB_CHARS.search(root):
            infos = fs.glob(root, detail=True)
        elif fs.isdir(root):
            infos = {i["name"]: i for i in fs.ls(root, detail=True)}
        elif fs.exists(root):
            infos = {root: fs.info(root)}
        else:
            infos = {}
        return sorted(
            name
            for name, info in infos.items()
            if info.get("type") == "file" and not name.rsplit("/", 1)[-1].startswith((".", "_"))
        )

    def _scan(self) -> None:
        for path in self._list():
            if path not in self._known:
                self._known.add(path)
                if self._owner(path) == self.ctx.subtask_index:
                    self._files[path] = [0, False]
                    self._queue.append(path)

    def _open_reader(self, path: str) -> _Reader:
        position = self._files[path][0]
        if self.format == "parquet":
            return _ParquetReader(self._fs, path, position)
        return _LineReader(self._fs, path, position, self.format)

    def poll(self, out: Collector, max_records: int) -> bool:
        budget = max_records
        while budget > 0:
            reader = self._reader
            if reader is None:
                if not self._queue:
                    break
                reader = self._reader = self._open_reader(self._queue[0])
            try:
                budget -= reader.emit(out, budget)
            finally:
                self._files[self._queue[0]][0] = reader.position
            if reader.eof:
                self._files[self._queue.pop(0)][1] = True
                self._reader = None
                reader.close()
        if self._reader is None and not self._queue:
            if not self.watch:
                return False
            if self.clock() >= self._next_scan:
                self._scan()
                self._next_scan = self.clock() + self.watch_interval
        return True

    def ready_in(self) -> float:
        """Seconds until ``poll`` may have a record (0: now)."""
        if self._reader is not None or self._queue or not self.watch:
            return 0.0
        return max(0.0, self._next_scan - self.clock())

    def _write_state(self) -> None:
        self.ctx.operator_state.union_list_state(self.ctx.operator_id, "file-positions").update(
            (path, pos, done) for path, (pos, done) in self._files.items()
        )

    def snapshot_state(self, checkpoint_id: int) -> None:
        self._write_state()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @property
    def positions(self) -> dict[str, tuple[int, bool]]:
        """(position, done) of every file this subtask owns."""
        return {path: (pos, done) for path, (pos, done) in self._files.items()}


# -- file sink --------------------------------------------------------------------------------


class FileSink(Operator):
    """JSON lines into ``directory`` with two-phase commit (Flink's ``FileSink``).

    Records go to ``<dir>/.inprogress/part-<subtask>-<attempt>-<n>.jsonl``; at checkpoint N
    the file is closed and moved to ``<dir>/.pending/<name>-chk-N`` (pre-commit) and the
    list of pending files is operator state; when N completes, pending files of checkpoints
    <= N are moved to ``<dir>/<name>`` (committed: visible, never rewritten). ``open`` after a
    restore commits the pending files the restored state names (their checkpoint completed;
    a file already committed is skipped) and deletes every other in-progress file and every
    pending file of a checkpoint newer than the restored one, of the subtasks it answers for
    (``old subtask % parallelism == subtask_index``): what a dead attempt wrote after the
    checkpoint, zombies included. A pending file of the restored checkpoint or an older one
    that the state does not name is never deleted (its checkpoint may have completed: state
    dropped or lost): it stays, with a warning. Readers must skip names that start with
    ``.``.
    """

    def __init__(
        self,
        directory: str,
        format: str = "jsonl",
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(directory, str) or not directory:
            raise ConfigError("directory", f"a path or URL, got {directory!r}")
        if format not in SINK_FORMATS:
            raise ConfigError("format", f"one of {', '.join(SINK_FORMATS)}, got {format!r}")
        self.directory = directory
        self.format = format
        self.storage_options = storage_options or {}
        self._file: Any = None
        self._name = ""
        #: (checkpoint id, subtask, part name) of every pre-committed, uncommitted file
        self._pending: list[tuple[int, int, str]] = []
        self._next = 0
        self.committed_files = 0

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        fs, root = fsspec.core.url_to_fs(self.directory, **self.storage_options)
        self._fs, self._root = fs, root.rstrip("/")
        self._inprogress = f"{self._root}/{INPROGRESS_DIR}"
        self._pending_dir = f"{self._root}/{PENDING_DIR}"
        for d in (self._root, self._inprogress, self._pending_dir):
            fs.makedirs(d, exist_ok=True)
        k, p = ctx.subtask_index, ctx.parallelism
        state = self._state()
        restored = sorted(tuple(e) for e in state.get())
        for cid, subtask, name in restored:
            if subtask % p == k:
                self._commit(cid, name)
        restored_id = ctx.restored_checkpoint_id
        for d in (self._inprogress, self._pending_dir):
            for path in fs.ls(d, detail=False):
                name = path.rsplit("/", 1)[-1]
                m = _PART.match(name)
                if m is None or int(m.group(1)) % p != k:
                    continue
                chk = _PENDING_CHK.search(name) if d == self._pending_dir else None
                if chk is not None and restored_id is not None and int(chk[1]) <= restored_id:
                    log.warning(
                        "%s: pending file %s of checkpoint %s (restored: %d) is not in the "
                        "restored state; left in place, not committed",
                        ctx.operator_id,
                        path,
                        chk[1],
                        restored_id,
                    )
                    continue
                fs.rm(path)
        # names stay unique even if an attempt number is used twice (a new driver)
        prefix = f"part-{k}-{ctx.attempt}-"
        for path in fs.ls(self._root, detail=False):
            m = _PART.match(path.rsplit("/", 1)[-1])
            if m is not None and path.rsplit("/", 1)[-1].startswith(prefix):
                self._next = max(self._next, int(m.group(3)) + 1)
        self._pending = []
        state.clear()

    def _state(self) -> Any:
        return self.ctx.operator_state.union_list_state(self.ctx.operator_id, "pending-files")

    def _commit(self, checkpoint_id: int, name: str) -> None:
        """Idempotent: a file already committed is left alone."""
        fs = self._fs
        pending = f"{self._pending_dir}/{name}-chk-{checkpoint_id}"
        final = f"{self._root}/{name}"
        if not fs.exists(final):
            try:
                fs.mv(pending, final)
                self.committed_files += 1
                return
            except FileNotFoundError:
                if not fs.exists(final):  # not committed concurrently by a zombie either
                    raise SinkCommitError(
                        f"pending file {pending} of completed checkpoint {checkpoint_id} is "
                        f"gone and {final} was never committed: output lost"
                    ) from None
        if fs.exists(pending):
            fs.rm(pending)

    def process(self, record: Any, out: Collector) -> None:
        if self._file is None:
            ctx = self.ctx
            self._name = f"part-{ctx.subtask_index}-{ctx.attempt}-{self._next}.{self.format}"
            self._next += 1
            self._file = self._fs.open(f"{self._inprogress}/{self._name}", "wb")
        try:
            line = json.dumps(record, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise UsageError(
                f"file sink: a {type(record).__name__} record is not JSON: {exc}"
            ) from exc
        self._file.write(line.encode() + b"\n")

    def snapshot_state(self, checkpoint_id: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._fs.mv(
                f"{self._inprogress}/{self._name}",
                f"{self._pending_dir}/{self._name}-chk-{checkpoint_id}",
            )
            self._pending.append((checkpoint_id, self.ctx.subtask_index, self._name))
        self._state().update(self._pending)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        keep = []
        for entry in self._pending:
            if entry[0] <= checkpoint_id:
                self._commit(entry[0], entry[2])
            else:
                keep.append(entry)
        self._pending = keep

    def end_input(self, out: Collector) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        # an in-progress file stays where it is: the next attempt deletes it
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


# -- collect sink -----------------------------------------------------------------------------


class CollectSink(Operator):
    """Keeps the records of completed checkpoints in the task, exactly once.

    Records since the last checkpoint are held back; at checkpoint N they become pending,
    and committed when N completes. Committed and pending records are operator state, so a
    restored subtask starts with everything committed before the crash. ``results()`` is
    what the runtime ships to the driver after the final checkpoint. Memory and checkpoint
    size grow with the output: a sink for tests and small results.
    """

    def __init__(self) -> None:
        self._committed: list[Any] = []
        self._pending: list[tuple[int, list[Any]]] = []
        self._current: list[Any] = []

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        state = ctx.operator_state.list_state(ctx.operator_id, "collected")
        # everything restored was committed or pending at a completed checkpoint
        for _, records in state.get():
            self._committed.extend(records)
        self._write_state()

    def _write_state(self) -> None:
        self.ctx.operator_state.list_state(self.ctx.operator_id, "collected").update(
            [(-1, self._committed), *self._pending]
        )

    def process(self, record: Any, out: Collector) -> None:
        self._current.append(record)

    def snapshot_state(self, checkpoint_id: int) -> None:
        if self._current:
            self._pending.append((checkpoint_id, self._current))
            self._current = []
        self._write_state()

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        while self._pending and self._pending[0][0] <= checkpoint_id:
            self._committed.extend(self._pending.pop(0)[1])

    def results(self) -> list[Any]:
        """The records of completed checkpoints, in arrival order."""
        return list(self._committed)


# -- print sink -------------------------------------------------------------------------------


class PrintSink(Operator):
    """Prints every record to the task's standard output (or ``stream="stderr"``), one line
    each: ``prefix:subtask> record`` (``subtask> record`` without a prefix, ``record``
    alone at parallelism 1 without one), as Flink's ``PrintSink``. At-least-once: after a
    restart the records since the last completed checkpoint are printed again. In a local
    Spark run and with the local runner the tasks' output is the terminal's; on a cluster
    it is in the executors' logs."""

    def __init__(self, prefix: str | None = None, stream: str = "stdout") -> None:
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigError("prefix", f"None or a str, got {prefix!r}")
        if stream not in ("stdout", "stderr"):
            raise ConfigError("stream", f"'stdout' or 'stderr', got {stream!r}")
        self.prefix = prefix
        self.stream = stream

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        import sys

        self._file = sys.stdout if self.stream == "stdout" else sys.stderr
        head = "" if self.prefix is None else self.prefix
        if ctx.parallelism > 1:
            head = f"{head}:{ctx.subtask_index + 1}" if head else str(ctx.subtask_index + 1)
        self._head = f"{head}> " if head else ""

    def process(self, record: Any, out: Collector) -> None:
        print(f"{self._head}{record}", file=self._file)

    def snapshot_state(self, checkpoint_id: int) -> None:
        self._file.flush()

    def end_input(self, out: Collector) -> None:
        self._file.flush()
