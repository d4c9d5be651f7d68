"""Exactly-once at the edges of a streaming job (issue 18), on local PySpark with the
embedded daemon and the real file sink:

* what ``end_input`` emits is committed: end of data travels downstream before the final
  checkpoint's barrier (FLIP-147), in every task of a three-task pipeline, aligned and
  tracked;
* a task that waits for input still handles its control messages: an idle stream's output
  is committed at its checkpoints, not at the end of the job;
* what ``prepare_snapshot_pre_barrier`` emits precedes the barrier (it is in that
  checkpoint); what ``snapshot_state`` emits follows it (the next checkpoint).

The idle source emits its records, then idles until the test writes ``release``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from client.streaming.connectors import FileSink
from client.streaming.functions import Collector, OperatorContext, Source
from tests.kit.modules import load_module

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

#: Longest the tests wait for what the job should do while it runs.
DEADLINE = 90.0

st: Any = load_module(
    "exchange_tests_streaming_pipeline", Path(__file__).with_name("_streaming.py")
)


@pytest.fixture(scope="module")
def spark(sx: ModuleType) -> Iterator[Any]:
    """local[3]: the longest pipeline here runs three tasks at once."""
    pytest.importorskip("pyspark")
    with st.session(sx, "local[3]", "exchange-streaming-end-of-data") as session:
        yield session


# -- the job's parts ------------------------------------------------------------------------


class IdleSource(Source):
    """Emits 0..n-1 (its next index is operator state), writes ``idle``, then emits nothing
    until ``release`` exists; then its input ends. With ``flush_in_snapshot`` it holds
    what it generates and emits it from ``snapshot_state`` (after the barrier)."""

    def __init__(self, n: int, probes: str, *, flush_in_snapshot: bool = False) -> None:
        self.n = n
        self.probes = probes
        self.flush_in_snapshot = flush_in_snapshot
        self.held: list[int] = []
        self.out: Collector | None = None

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self.position = ctx.operator_state.list_state(ctx.operator_id, "next")
        got = self.position.get()
        self.next = got[0] if got else 0

    def poll(self, out: Collector, max_records: int) -> bool:
        if self.next >= self.n:
            return not os.path.exists(os.path.join(self.probes, "release"))
        self.out = out
        for _ in range(min(max_records, self.n - self.next)):
            if self.flush_in_snapshot:
                self.held.append(self.next)
            else:
                out.collect(self.next)
            self.next += 1
        if self.next == self.n:
            _write(self.probes, "idle", str(time.time()))
        return True

    def ready_in(self) -> float:
        return 0.0 if self.next < self.n else 0.05  # idle: look for the release now and then

    def snapshot_state(self, checkpoint_id: int) -> None:
        self.position.update([self.next])
        if self.held:  # after the barrier: these belong to the next checkpoint
            assert self.out is not None
            for value in self.held:
                self.out.collect(value)
            _write(self.probes, f"flushed-{checkpoint_id}", str(len(self.held)))
            self.held = []


class Summary:
    """Keyed: a running count per key, ``[key, value, count]``; ``end_input`` emits one
    ``[tag, records seen]`` row (held in memory: these jobs do not restart)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen = 0

    def open(self, rc: Any) -> None:
        self.count = rc.value_state("count", 0)

    def process_element(self, value: Any, ctx: Any, out: Collector) -> None:
        n = self.count.value() + 1
        self.count.update(n)
        self.seen += 1
        out.collect([str(ctx.current_key), value, n])

    def end_input(self, out: Collector) -> None:
        out.collect([self.tag, self.seen])


class Batching:
    """Keyed: holds every value in memory and emits what it holds in
    ``prepare_snapshot_pre_barrier`` (so it checkpoints nothing held), the rest at
    ``end_input``; writes ``flushed-<checkpoint>`` with the count it emitted there."""

    def __init__(self, probes: str) -> None:
        self.probes = probes
        self.held: list[int] = []

    def process_element(self, value: int, ctx: Any, out: Collector) -> None:
        self.held.append(value)

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int, out: Collector) -> None:
        if self.held:
            for value in self.held:
                out.collect(value)
            _write(self.probes, f"flushed-{checkpoint_id}", str(len(self.held)))
            self.held = []

    def end_input(self, out: Collector) -> None:
        for value in self.held:
            out.collect(value)
        self.held = []


class SnapshotProbeSink(FileSink):
    """The file sink, writing ``snap-<checkpoint>`` with the records it took since its
    previous snapshot (when there were any): which checkpoint a record belongs to."""

    def __init__(self, directory: str, probes: str) -> None:
        super().__init__(directory)
        self.probes = probes
        self.since = 0

    def process(self, record: Any, out: Collector) -> None:
        self.since += 1
        super().process(record, out)

    def snapshot_state(self, checkpoint_id: int) -> None:
        super().snapshot_state(checkpoint_id)
        if self.since:
            _write(self.probes, f"snap-{checkpoint_id}", str(self.since))
            self.since = 0


# -- helpers --------------------------------------------------------------------------------


def _write(probes: str, name: str, text: str) -> None:
    tmp = os.path.join(probes, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(probes, name))


def _counts(probes: Path, prefix: str) -> dict[int, int]:
    """``<prefix>-<checkpoint>`` probes: checkpoint -> count."""
    return {int(f.name[len(prefix) + 1 :]): int(f.read_text()) for f in probes.glob(f"{prefix}-*")}


def _wait_for(predicate: Any, what: str) -> Any:
    return st.wait_for(predicate, DEADLINE, what)


def _flushed_and_snapshotted(
    env: Any, probes: Path, out: Path, n: int
) -> tuple[dict[int, int], dict[int, int]]:
    """Run the job until its ``n`` records were flushed and the sink snapshotted all of
    them, then to its end (every record committed once, a final checkpoint): which
    checkpoints they were flushed at, and which ones the sink took them in (-> count)."""
    run = _Run(env)
    try:
        _wait_for(lambda: sum(_counts(probes, "flushed").values()) == n, "all flushed")
        flushed = _counts(probes, "flushed")
        _wait_for(lambda: sum(_counts(probes, "snap").values()) == n, "all snapshotted")
    finally:
        result = run.join(probes)
    assert sorted(st.committed(out)) == list(range(n))
    assert result.checkpoints[-1].is_final
    return flushed, _counts(probes, "snap")


class _Run:
    """``execute`` on a thread, so the test can watch the running job."""

    def __init__(self, env: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(env,), daemon=True)
        self.thread.start()

    def _run(self, env: Any) -> None:
        try:
            self.result = env.execute(restart_attempts=0)
        except BaseException as e:
            self.error = e

    def join(self, probes: Path) -> Any:
        (probes / "release").touch()  # let the source end, whatever the test saw
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), f"the job did not end within {DEADLINE} s"
        if self.error is not None:
            raise self.error
        return self.result


_dirs = st.dirs
_env = st.environment


# -- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exactly_once", "at_least_once"])
def test_what_end_input_emits_is_committed(spark: Any, tmp_path: Path, mode: str) -> None:
    """generator -> key_by | Summary("first") -> key_by | Summary("second") -> file sink:
    three tasks. Each Summary emits a row from ``end_input``; the second
    one's count includes the first one's row, so EndOfData reached the last task after
    it. Before, a reading task ran ``end_input`` at EndOfPartition, after the final
    checkpoint: both rows stayed in ``.inprogress`` and were never committed."""
    probes, out, ckpt = _dirs(tmp_path)
    n = 3000
    env = _env(spark, ckpt, "eod", mode=mode)
    (
        env.from_generator(lambda i: i, count=n, parallelism=1, name="gen")
        .key_by(lambda v: v % 5, name="bykey")
        .process(Summary("first"), parallelism=1, name="first")
        .key_by(lambda r: r[0], name="bytag")
        .process(Summary("second"), parallelism=1, name="second")
        .sink_to_files(str(out))
    )
    result = _Run(env).join(probes)
    assert result.checkpoints and result.checkpoints[-1].is_final
    rows = st.committed(out)
    assert ["second", n + 1] in rows, sorted(r for r in rows if r[0] in ("first", "second"))
    firsts = [r for r in rows if r[0] == "first"]  # the first row, through the second Summary
    assert len(firsts) == 1 and firsts[0][1] == ["first", n], firsts
    data = Counter(r[1][1] for r in rows if r[0] not in ("first", "second"))
    assert sorted(data) == list(range(n)) and set(data.values()) == {1}, "each record once"
    assert len(rows) == n + 2


def test_an_idle_stream_commits_at_its_checkpoints(spark: Any, tmp_path: Path) -> None:
    """The source emits its records and idles: the sink's task waits for input, and
    still hears ``complete``, so the records are committed at the next checkpoint, with
    the job running. Before, a reading task looked at its control messages only between
    records: the records stayed pending until the job ended."""
    probes, out, ckpt = _dirs(tmp_path)
    n = 2000
    p = str(probes)
    env = _env(spark, ckpt, "idle")
    (
        env.add_source(lambda: IdleSource(n, p), parallelism=1, name="idle")
        .rebalance()
        .sink_to_files(str(out), parallelism=1)
    )
    run = _Run(env)
    try:
        idle_at = float(_wait_for(lambda: _read(probes / "idle"), "the source went idle"))
        _wait_for(lambda: len(st.committed(out)) == n, f"{n} records committed while idle")
        committed_after = time.time() - idle_at
        assert run.thread.is_alive() and not (probes / "release").exists()
    finally:
        result = run.join(probes)
    print(f"committed {committed_after:.2f} s after the source went idle (interval 0.3 s)")
    assert sorted(st.committed(out)) == list(range(n))
    assert result.checkpoints[-1].is_final


def test_records_emitted_before_the_barrier_belong_to_that_checkpoint(
    spark: Any, tmp_path: Path
) -> None:
    """A keyed function holds every value and emits it in
    ``prepare_snapshot_pre_barrier(N)``: the sink, in the next task, took exactly those
    records in its snapshot of the same checkpoint N."""
    probes, out, ckpt = _dirs(tmp_path)
    n = 2000
    p = str(probes)
    env = _env(spark, ckpt, "prebarrier")
    (
        env.add_source(lambda: IdleSource(n, p), parallelism=1, name="idle")
        .key_by(lambda v: v % 3, name="bykey")
        .process(Batching(p), parallelism=1, name="batching")
        .rebalance()
        .sink_to(lambda: SnapshotProbeSink(str(out), p), name="sink", parallelism=1)
    )
    flushed, snaps = _flushed_and_snapshotted(env, probes, out, n)
    assert snaps == flushed  # each record in the checkpoint it preceded


def test_records_emitted_in_snapshot_state_follow_the_barrier(spark: Any, tmp_path: Path) -> None:
    """What the docs say of ``snapshot_state``: the source emits what it held from its
    snapshot of checkpoint N, after N's barrier left; the sink gets them after its
    snapshot of N, so they belong to a later checkpoint."""
    probes, out, ckpt = _dirs(tmp_path)
    n = 2000
    p = str(probes)
    env = _env(spark, ckpt, "insnapshot")
    (
        env.add_source(lambda: IdleSource(n, p, flush_in_snapshot=True), name="idle")
        .rebalance()
        .sink_to(lambda: SnapshotProbeSink(str(out), p), name="sink", parallelism=1)
    )
    flushed, snaps = _flushed_and_snapshotted(env, probes, out, n)
    for cid in flushed:
        assert cid not in snaps, (flushed, snaps)  # none in the checkpoint N it was emitted in
    assert min(snaps) > min(flushed)


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except FileNotFoundError:
        return None
