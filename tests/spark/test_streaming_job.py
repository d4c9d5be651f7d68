"""A streaming job end to end on local PySpark: a replayable source, a keyed running sum
in keyed state and a sink that commits only completed checkpoints, through the embedded
daemon, with exactly-once checkpoints; and a restart from the last checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from client.streaming.functions import Collector, Operator, OperatorContext, Source

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


class RangeSource(Source):
    """Emits 0..n-1 split over subtasks; the next index is its checkpointed offset."""

    def __init__(self, n: int, per_poll: int = 50) -> None:
        self.n = n
        self.per_poll = per_poll

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self.offsets = ctx.operator_state.list_state(ctx.operator_id, "next")
        got = self.offsets.get()
        self.next = got[0] if got else ctx.subtask_index

    def poll(self, out: Collector, max_records: int) -> bool:
        step = self.ctx.parallelism
        for _ in range(min(max_records, self.per_poll)):
            if self.next >= self.n:
                return False
            out.collect(self.next)
            self.next += step
        return self.next < self.n

    def snapshot_state(self, checkpoint_id: int) -> None:
        self.offsets.update([self.next])


class CommitSink(Operator):
    """Buffers records; a snapshot makes them pending; completion appends them to a file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self.pending_state = ctx.operator_state.list_state(ctx.operator_id, "pending")
        self.buffer: list[Any] = []
        self.pending: dict[int, list[Any]] = {}
        self.path = os.path.join(self.directory, f"out-{ctx.subtask_index}.jsonl")
        for cid, records in self.pending_state.get():  # restored: that checkpoint completed
            self._commit(cid, records)

    def _commit(self, cid: int, records: list[Any]) -> None:
        marker = os.path.join(self.directory, f".done-{self.ctx.subtask_index}-{cid}")
        if os.path.exists(marker):
            return  # committed before the failure: never twice
        with open(self.path, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        Path(marker).touch()

    def process(self, record: Any, out: Collector) -> None:
        self.buffer.append(record)

    def snapshot_state(self, checkpoint_id: int) -> None:
        self.pending[checkpoint_id], self.buffer = self.buffer, []
        self.pending_state.update(sorted(self.pending.items()))

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        for cid in sorted(c for c in self.pending if c <= checkpoint_id):
            self._commit(cid, self.pending.pop(cid))


class RunningSum:
    def open(self, rc: Any) -> None:
        self.total = rc.value_state("total", 0)

    def process_element(self, value: int, ctx: Any, out: Collector) -> None:
        self.total.update(self.total.value() + value)
        out.collect([ctx.current_key, value, self.total.value()])


def _committed(directory: Path) -> list[list[int]]:
    out: list[list[int]] = []
    for f in sorted(directory.glob("out-*.jsonl")):
        out.extend(json.loads(line) for line in f.read_text().splitlines())
    return out


def test_keyed_running_sums_are_committed_exactly_once(spark: Any, tmp_path: Path) -> None:
    from client.streaming.environment import StreamEnvironment

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    n = 3000
    env = StreamEnvironment(
        spark,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_interval="200ms",
        job_id="sums",
    )
    (
        env.add_source(lambda: RangeSource(n), parallelism=1, name="range")
        .key_by(lambda x: x % 5, name="bykey")
        .process(RunningSum(), parallelism=1, name="sums")
        .sink_to(lambda: CommitSink(str(out_dir)), name="sink")
    )
    result = env.execute(restart_attempts=0)
    rows = _committed(out_dir)
    assert sorted(r[1] for r in rows) == list(range(n))  # every record once
    for key in range(5):
        values = [r for r in rows if r[0] == key]
        total = 0
        for _, v, t in values:  # the running sum, in order, per key
            total += v
            assert t == total
    assert result.checkpoints_completed >= 1


class FailOnceSink(CommitSink):
    """Fails its task once, after ``at`` records (a marker file remembers it did)."""

    def __init__(self, directory: str, at: int) -> None:
        super().__init__(directory)
        self.at = at

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self.count = 0

    def process(self, record: Any, out: Collector) -> None:
        super().process(record, out)
        self.count += 1
        marker = os.path.join(self.directory, ".failed-once")
        if self.count == self.at and not os.path.exists(marker):
            Path(marker).touch()
            raise RuntimeError("injected task failure")


def test_a_failed_task_restarts_the_job_from_its_last_checkpoint(
    spark: Any, tmp_path: Path
) -> None:
    from client.streaming.environment import StreamEnvironment

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    n = 4000
    env = StreamEnvironment(
        spark, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval="100ms", job_id="rs"
    )
    (
        env.add_source(lambda: RangeSource(n, per_poll=20), parallelism=1, name="range")
        .key_by(lambda x: x % 3, name="bykey")
        .process(RunningSum(), parallelism=1, name="sums")
        .sink_to(lambda: FailOnceSink(str(out_dir), at=2500), name="sink")
    )
    result = env.execute(restart_attempts=2, restart_backoff=0.2)
    assert result.restarts == 1, result
    assert "injected task failure" in result.failures[0]
    rows = _committed(out_dir)
    # Nothing lost, nothing twice, although the first attempt committed part of it.
    assert sorted(r[1] for r in rows) == list(range(n))
    for key in range(3):  # the keyed state resumed where the checkpoint left it
        total = 0
        for _, v, t in (r for r in rows if r[0] == key):
            total += v
            assert t == total
