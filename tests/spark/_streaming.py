"""The pipeline of the streaming fault tests, and what they use to watch and kill it.

generator source (p subtasks) -> key_by(value % KEYS) -> keyed running sum -> file sink
(two-phase commit), the sum and the sink chained in one task. Event i is the int i + 1.
The connectors are the real ones, subclassed only to leave marks the test reads (the
worker's pid per attempt) and to hold a task at a chosen point (in a snapshot, or a source
stalled so that its downstream task aligns) until the test killed it or lets it go.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from client.streaming.connectors import FileSink, GeneratorSource
from client.streaming.functions import Collector, OperatorContext
from tests.kit.polling import wait_for as wait_for  # the tests call st.wait_for

KEYS = 7
#: Longest a held task waits for the test (it is normally killed or released at once).
HOLD_LIMIT = 60.0


def event(i: int) -> int:
    return i + 1


def key_of(value: int) -> int:
    return value % KEYS


def _mark(probes: str, name: str, text: str = "") -> bool:
    """Create ``probes/name`` once (False if it exists: the mark is taken), with its text
    in it from the first moment it exists: written to a file of its own, then linked
    (a test that sees the mark reads the whole text, never an empty file)."""
    tmp = os.path.join(probes, f".{name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(text)
    try:
        os.link(tmp, os.path.join(probes, name))
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def _hold(probes: str, release: str) -> None:
    """Wait until the test kills this process or writes ``release``."""
    deadline = time.monotonic() + HOLD_LIMIT
    while not os.path.exists(os.path.join(probes, release)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"held for {HOLD_LIMIT} s and never released ({release})")
        time.sleep(0.02)


class _Progress:
    """Writes a running count to ``probes/name`` (atomically) at most every 0.1 s."""

    def __init__(self, probes: str, name: str) -> None:
        self.path = os.path.join(probes, name)
        self.count = 0
        self._last = 0.0

    def add(self, n: int) -> None:
        self.count += n
        now = time.monotonic()
        if now - self._last >= 0.1:
            self._last = now
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{time.time()} {self.count}")
            os.replace(tmp, self.path)


def progress(probes: Path, name: str) -> int:
    """The last count ``name`` reported (0 before its first report)."""
    try:
        return int((probes / name).read_text().split()[1])
    except FileNotFoundError:
        return 0


def _record_pid(probes: str, ctx: OperatorContext) -> None:
    name = f"pid-{ctx.attempt}-{ctx.operator_id}-{ctx.subtask_index}"
    _mark(probes, name, str(os.getpid()))


class ProbedGenerator(GeneratorSource):
    """A GeneratorSource that records its pid; ``stall_at``: subtask 1 of the first attempt
    stops emitting after that many records until released (its barriers stop too)."""

    def __init__(
        self,
        probes: str,
        count: int | None,
        rate: float | None = None,
        stall_at: int | None = None,
        report: bool = False,
    ) -> None:
        super().__init__(event, count=count, rate=rate)
        self.probes = probes
        self.stall_at = stall_at
        self.report = report
        self.emitted = 0

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        _record_pid(self.probes, ctx)
        self.progress = _Progress(self.probes, f"emitted-{ctx.subtask_index}")

    def poll(self, out: Collector, max_records: int) -> bool:
        if (
            self.stall_at is not None
            and self.ctx.subtask_index == 1
            and self.emitted >= self.stall_at
            and _mark(self.probes, "stalled")
        ):
            _hold(self.probes, "release")
        if self.stall_at is None and not self.report:
            return super().poll(out, max_records)
        counted = _Counting(out)
        alive = super().poll(counted, max_records)
        self.emitted += counted.n
        if self.report:
            self.progress.add(counted.n)
        return alive


class _Counting:
    def __init__(self, out: Collector) -> None:
        self.out = out
        self.n = 0

    def collect(self, record: Any) -> None:
        self.n += 1
        self.out.collect(record)


class RunningSum:
    """Keyed state: the running total of the values of a key; emits [key, value, total]."""

    def open(self, rc: Any) -> None:
        self.total = rc.value_state("total", 0)

    def process_element(self, value: int, ctx: Any, out: Collector) -> None:
        total = self.total.value() + value
        self.total.update(total)
        out.collect([ctx.current_key, value, total])


class ProbedSink(FileSink):
    """A FileSink that records its pid; ``hold_snapshot``: the first snapshot of a
    checkpoint >= that id pre-commits, then waits in the snapshot until released;
    ``fail_commit``: the first commit for a checkpoint >= that id raises;
    ``throttle``: seconds spent on every record (a slow sink)."""

    def __init__(
        self,
        probes: str,
        directory: str,
        *,
        hold_snapshot: int | None = None,
        fail_commit: int | None = None,
        throttle: float = 0.0,
    ) -> None:
        super().__init__(directory)
        self.probes = probes
        self.hold_snapshot = hold_snapshot
        self.fail_commit = fail_commit
        self.throttle = throttle

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        _record_pid(self.probes, ctx)
        self.progress = _Progress(self.probes, f"sunk-{ctx.subtask_index}")

    def process(self, record: Any, out: Collector) -> None:
        if self.throttle:
            end = time.perf_counter() + self.throttle
            while time.perf_counter() < end:
                pass
            self.progress.add(1)
        super().process(record, out)

    def snapshot_state(self, checkpoint_id: int) -> None:
        super().snapshot_state(checkpoint_id)
        if (
            self.hold_snapshot is not None
            and checkpoint_id >= self.hold_snapshot
            and _mark(self.probes, "snapshotting", str(checkpoint_id))
        ):
            _hold(self.probes, "release")

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        if (
            self.fail_commit is not None
            and checkpoint_id >= self.fail_commit
            and self._pending
            and _mark(self.probes, "commit-failed", str(checkpoint_id))
        ):
            from client.streaming.connectors import SinkCommitError

            raise SinkCommitError(f"injected: the commit of checkpoint {checkpoint_id} failed")
        super().notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        _mark(self.probes, f"aborted-{checkpoint_id}")
        super().notify_checkpoint_aborted(checkpoint_id)


def build(
    env: Any,
    probes: Path,
    out: Path,
    count: int | None,
    *,
    parallelism: int = 2,
    rate: float | None = None,
    stall_at: int | None = None,
    report: bool = False,
    **sink: Any,
) -> None:
    p, o = str(probes), str(out)
    (
        env.add_source(
            lambda: ProbedGenerator(p, count, rate, stall_at, report),
            parallelism=parallelism,
            name="gen",
        )
        .key_by(key_of, name="bykey")
        .process(RunningSum(), parallelism=1, name="sums")
        .sink_to(lambda: ProbedSink(p, o, **sink), name="sink")
    )


def committed(out: Path) -> list[list[int]]:
    """Every committed row (visible files only: names without a leading dot)."""
    rows: list[list[int]] = []
    for f in sorted(out.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            rows.extend(json.loads(line) for line in f.read_text().splitlines() if line)
    return rows


def check_running_sums(rows: list[list[int]]) -> None:
    """Per key, the totals chain: each is the previous plus its value (state restored)."""
    by_key: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for key, value, total in rows:
        assert key == key_of(value), (key, value)
        by_key[key].append((total, value))
    for key, items in by_key.items():
        running = 0
        for total, value in sorted(items):
            running += value
            assert total == running, f"key {key}: total {total} after value {value}, not {running}"


def check_exactly_once(out: Path, count: int) -> list[list[int]]:
    rows = committed(out)
    values = Counter(r[1] for r in rows)
    missing = [event(i) for i in range(count) if values[event(i)] == 0]
    twice = {v: c for v, c in values.items() if c > 1}
    assert not missing and not twice and len(values) == count, (
        f"{len(missing)} missing (first {missing[:5]}), {len(twice)} more than once "
        f"(first {sorted(twice.items())[:5]}), {len(rows)} rows for {count} events"
    )
    check_running_sums(rows)
    return rows


def pids(probes: Path) -> dict[int, dict[str, int]]:
    """attempt -> {"<operator>-<subtask>": pid} of every task that opened."""
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for f in probes.glob("pid-*"):
        _, attempt, rest = f.name.split("-", 2)
        with_text = f.read_text()
        if with_text:
            out[int(attempt)][rest] = int(with_text)
    return dict(out)


@contextlib.contextmanager
def session(sx: ModuleType, master: str, app: str) -> Iterator[Any]:
    """A local SparkSession whose tasks unpickle this module by value; at the end the
    embedded daemon must report its pool whole."""
    from pyspark import cloudpickle

    from client import spark as xs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    spark = sx.local_session(master, app)
    try:
        yield spark
    finally:
        spark.stop()
        assert xs.stop_embedded_daemon() is True, "embedded daemon's pool not whole at exit"


def dirs(tmp_path: Path) -> tuple[Path, Path, str]:
    """``probes`` and ``out`` (created) and the checkpoint directory's path."""
    probes, out = tmp_path / "probes", tmp_path / "out"
    probes.mkdir()
    out.mkdir()
    return probes, out, str(tmp_path / "ckpt")


def environment(spark: Any, ckpt: str, job_id: str, **kw: Any) -> Any:
    """A StreamEnvironment checkpointing every 300 ms (unless ``kw`` says otherwise)."""
    from client.streaming.environment import StreamEnvironment

    kw.setdefault("checkpoint_interval", "300ms")
    return StreamEnvironment(spark, checkpoint_dir=ckpt, job_id=job_id, **kw)
