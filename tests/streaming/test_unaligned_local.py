"""Unaligned checkpoints end to end through the local runner (real task processes, the
embedded daemon, real checkpoint files): a keyed running sum behind two source subtasks
that outrun it (back pressure), checkpoints triggered at a task's first barrier with the
input that overtook the cut persisted in its state file, a task SIGKILLed and the job
restored (the persisted input replayed first), output exact; and the settings' errors."""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.streaming import LocalRunner, StreamEnvironment
from client.streaming.checkpoint_storage import CheckpointStorage
from client.streaming.connectors import CollectSink
from exchange.errors import ConfigError
from tests.kit.jobs import JobThread, run_killing_once
from tests.streaming.test_local_runner import (
    KEYS,
    PidMark,
    event,
    expected_totals,
    totals_by_key,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _daemon_pool_whole() -> Iterator[None]:
    from client import spark as xs

    yield
    assert xs.stop_embedded_daemon() is True, "embedded daemon's pool not whole at exit"


class SlowSum(PidMark):
    """PidMark's keyed running sum, slower than its sources (back pressure)."""

    def __init__(self, pids: str, delay: float) -> None:
        super().__init__(pids)
        self.delay = delay

    def process_element(self, value: tuple[int, int], ctx: Any, out: Any) -> None:
        time.sleep(self.delay)
        super().process_element(value, ctx, out)


def check_exact(got: list[Any], n: int) -> None:
    """Two sources interleave a key's values: per key one running sum per value, never
    falling, ending at the key's total (a record lost or seen twice breaks one of them)."""
    want = expected_totals(n)
    have = totals_by_key(got)
    assert set(have) == set(range(KEYS))
    for key, totals in have.items():
        assert len(totals) == len(want[key]), (key, len(totals), len(want[key]))
        assert sorted(totals) == totals and totals[-1] == want[key][-1]


def restored_ids(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The checkpoints the driver restored, in order (its log)."""
    return [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(r"restoring checkpoint (\d+)", r.getMessage()))
    ]


def skewed_event(i: int) -> tuple[int, int]:
    """``event``, with source subtask 1 (odd indices) spending 2 ms per record: a
    checkpoint's trigger finds that subtask mid-record for up to 2 ms, so its barrier
    reaches the keyed task that much after subtask 0's (an alignment of a millisecond or
    more, most checkpoints), on a loaded machine or a quiet one."""
    if i % 2:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
    return event(i)


def job(
    tmp_path: Path,
    n: int,
    delay: float,
    rate: float | None,
    source: Any = event,
    **settings: Any,
) -> tuple[StreamEnvironment, Path]:
    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    env = StreamEnvironment(
        None,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_interval=0.1,
        mode="unaligned",
        **settings,
    )
    (
        env.from_generator(source, count=n, rate=rate, parallelism=2)
        .key_by(lambda e: e[0])
        .process(SlowSum(str(pids), delay), parallelism=1)
        .collect(name="totals")
    )
    return env, pids


def newest_persisted(storage: CheckpointStorage) -> dict[str, int]:
    """The in-flight bytes each task persisted in the newest completed checkpoint."""
    ids = storage.completed_ids()
    if not ids:
        return {}
    try:
        meta = storage.load(ids[-1])
    except Exception:  # being written
        return {}
    return dict(meta.extra.get("persisted_bytes", {}))


def test_unaligned_checkpoints_under_back_pressure_persist_in_flight_input(
    tmp_path: Path,
) -> None:
    n = 9000
    env, _ = job(tmp_path, n, 0.0005, 1500.0)
    result = env.execute(runner=LocalRunner())
    check_exact(result.collected["totals"], n)
    assert result.restarts == 0 and result.checkpoints[-1].is_final
    unaligned = [c for c in result.checkpoints if c.unaligned]
    assert unaligned, result.checkpoints
    assert all(set(c.persisted_bytes) <= {"v0-0", "v0-1", "v1-0"} for c in unaligned)
    # the sources' priority barriers overtook their backlog (their output state) and
    # buffers the keyed task had received (its input state)
    assert any(sum(c.persisted_bytes.values()) > 0 for c in unaligned), unaligned
    # the final checkpoint is forced aligned (its barriers follow EndOfData)
    assert not result.checkpoints[-1].unaligned
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    # channel state lives in the task's state file: subsumed checkpoints left nothing
    assert storage.checkpoint_ids() == [result.last_checkpoint_id]
    meta = storage.load(result.last_checkpoint_id)  # type: ignore[arg-type]
    assert meta.extra["alignment"] == "aligned" and meta.extra["persisted_bytes"] == {}


def test_a_killed_task_restores_its_persisted_input_exactly_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exchange.streaming.driver")
    n = 9000
    env, pids = job(tmp_path, n, 0.0005, 1500.0, retained_checkpoints=1000)
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    # the newest committed checkpoint holds in-flight data (a source's output, the keyed
    # task's input)
    result = run_killing_once(
        env,
        pids,
        lambda: any(newest_persisted(storage).values()),
        "an unaligned checkpoint with input",
    )
    assert result.restarts == 1, result.failures
    check_exact(result.collected["totals"], n)
    # the restored checkpoint held in-flight input of the keyed task: it was replayed
    restored = restored_ids(caplog)
    assert len(restored) == 1, restored
    assert any(storage.load(restored[0]).extra["persisted_bytes"].values())


def test_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="aligned_checkpoint_timeout"):
        StreamEnvironment(
            None, checkpoint_dir=str(tmp_path), mode="at_least_once", aligned_checkpoint_timeout=1
        )
    with pytest.raises(ConfigError, match="aligned_checkpoint_timeout"):
        StreamEnvironment(
            None, checkpoint_dir=str(tmp_path), mode="exactly_once", aligned_checkpoint_timeout=1
        )
    with pytest.raises((ConfigError, ValueError)):
        StreamEnvironment(
            None, checkpoint_dir=str(tmp_path), mode="unaligned", aligned_checkpoint_timeout=-1
        )
    env = StreamEnvironment(
        None, checkpoint_dir=str(tmp_path), mode="unaligned", aligned_checkpoint_timeout="50ms"
    )
    assert env.config.aligned_checkpoint_timeout == 0.05 and env.config.exactly_once


@pytest.mark.parametrize(("timeout", "some_unaligned"), [("1ms", True), ("1h", False)])
def test_aligned_checkpoint_timeout_turns_slow_alignments_unaligned(
    tmp_path: Path, timeout: str, some_unaligned: bool
) -> None:
    """Aligned first: a slow source subtask makes alignments outlast 1 ms, so checkpoints turn
    unaligned (with persisted input); none outlasts an hour, so every one stays aligned
    (the keyed task blocks the channel that delivered its barrier, persists nothing).
    Evenly paced sources are not enough: on a quiet machine both barriers of a checkpoint
    can reach the keyed task in one batch (an alignment of microseconds)."""
    n = 3000
    env, _ = job(
        tmp_path, n, 0.0005, 1500.0, source=skewed_event, aligned_checkpoint_timeout=timeout
    )
    result = env.execute(runner=LocalRunner())
    check_exact(result.collected["totals"], n)
    assert len(result.checkpoints) >= 2, result.checkpoints
    unaligned = [c for c in result.checkpoints if c.unaligned]
    if some_unaligned:
        assert unaligned, result.checkpoints
    else:
        assert not unaligned and all(not c.persisted_bytes for c in result.checkpoints)


#: bytes of padding per record: every record spans several buffers, so a priority
#: barrier's cut falls inside one nearly always
PAD = 40_000


def big_event(i: int) -> tuple[int, int, bytes]:
    return (i % KEYS, i, bytes([i % 251]) * PAD)


class SlowBigSum(SlowSum):
    """SlowSum of big records, each checked whole (a torn one has the wrong padding)."""

    def process_element(self, value: Any, ctx: Any, out: Any) -> None:
        key, i, pad = value
        assert pad == bytes([i % 251]) * PAD, f"record {i} torn"
        super().process_element((key, i), ctx, out)


class KillAtACutRecord(CollectSink):
    """A collect sink, chained into the keyed task, that SIGKILLs its own process (first
    attempt only) when checkpoint N completed with a record cut by a priority barrier:
    the keyed task persisted the head of a record (``partial_records``) and a source the
    rest (``output_state``). N is then the newest completed checkpoint, and stays so (the
    task that would acknowledge the next one is this thread), so the job restores N."""

    def __init__(self, ckpt: str, mark: str) -> None:
        super().__init__()
        self.ckpt, self.mark = ckpt, mark

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        super().notify_checkpoint_complete(checkpoint_id)
        if self.ctx.restored_checkpoint_id is not None or os.path.exists(self.mark):
            return
        storage = CheckpointStorage(self.ckpt)
        if storage.completed_ids()[-1] != checkpoint_id:
            return
        meta = storage.load(checkpoint_id)
        files = {t: storage.read_task_state(checkpoint_id, f) for t, f in meta.task_files.items()}
        if files["v1-0"].get("partial_records") and any(
            files[t].get("output_state") for t in ("v0-0", "v0-1")
        ):
            with open(self.mark, "w") as f:
                f.write(str(checkpoint_id))
            os.kill(os.getpid(), signal.SIGKILL)


def test_priority_barriers_cut_records_spanning_buffers_and_a_restore_joins_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Sources far ahead of a slow keyed sum, records of 40 kB (several buffers each):
    every checkpoint's priority barriers overtake the sources' backlog, which becomes
    their output state, and cut a record whose head the keyed task's decoder holds. The
    keyed task is SIGKILLed right after such a checkpoint completed: the restore feeds the
    persisted head back to the decoder, the sources re-send their output state, the
    records join again (none torn) and the output is exact."""
    caplog.set_level(logging.INFO, logger="exchange.streaming.driver")
    n = 1200
    pids = tmp_path / "pids"
    pids.mkdir()
    ckpt, mark = str(tmp_path / "ckpt"), str(tmp_path / "killed-at")
    env = StreamEnvironment(None, checkpoint_dir=ckpt, checkpoint_interval=0.2, mode="unaligned")
    (
        env.from_generator(big_event, count=n, rate=400.0, parallelism=2)
        .key_by(lambda e: e[0])
        .process(SlowBigSum(str(pids), 0.004), parallelism=1)
        .sink_to(lambda: KillAtACutRecord(ckpt, mark), name="totals")
    )
    result = env.execute(runner=LocalRunner(), restart_backoff=0.1)
    assert os.path.exists(mark), "no checkpoint cut a record (nothing was killed)"
    killed_at = int(Path(mark).read_text())
    assert result.restarts == 1, result.failures
    check_exact(result.collected["totals"], n)
    restored = restored_ids(caplog)
    assert restored == [killed_at], (restored, killed_at)


def padded_event(i: int) -> tuple[int, int, bytes]:
    """``event`` with 1 kB of padding: a few dozen records per buffer, so the buffers a
    task holds are many records for a slow consumer."""
    return (i % KEYS, i, b"p" * 1000)


_MARKED: list[bool] = []


def pass_marking(pids: str, value: Any) -> Any:
    """An identity map that leaves its process id in ``pids`` (once per process)."""
    if not _MARKED:
        _MARKED.append(True)
        tmp = os.path.join(pids, f".{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(pids, str(os.getpid())))
    return value


def test_a_task_blocked_on_its_output_takes_the_barrier_and_restores_exactly_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """source -> rebalance -> map -> key_by -> slow sum: the map's output is blocked (the
    sum is far slower) and the buffers handed to it wait in its reader. A priority barrier
    reaches the map while it waits for room: it takes it there (its record boundary),
    forwards its own barrier and persists what it held as input channel state, so
    checkpoints complete with the map's input in them. The map SIGKILLed after such a
    checkpoint: the job restores it, replays the map's input before new input, output
    exact."""
    caplog.set_level(logging.INFO, logger="exchange.streaming.driver")
    n = 3000
    pids, sums = tmp_path / "pids", tmp_path / "sums"
    pids.mkdir()
    sums.mkdir()
    env = StreamEnvironment(
        None,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_interval=0.1,
        mode="unaligned",
        retained_checkpoints=1000,
    )
    (
        env.from_generator(padded_event, count=n, rate=1000.0, parallelism=1)
        .rebalance()
        .map(functools.partial(pass_marking, str(pids)), parallelism=1)
        .key_by(lambda e: e[0])
        .process(SlowSum(str(sums), 0.002), parallelism=1)
        .collect(name="totals")
    )
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    result = run_killing_once(
        env,
        pids,
        lambda: bool(newest_persisted(storage).get("v1-0")),
        "a checkpoint with the map's input",
    )
    assert result.restarts == 1, result.failures
    check_exact(result.collected["totals"], n)
    restored = restored_ids(caplog)
    assert len(restored) == 1, restored
    assert storage.load(restored[0]).extra["persisted_bytes"].get("v1-0")


class HeldSum(PidMark):
    """PidMark's keyed running sum that processes nothing until ``flag`` exists: its
    upstream's output fills and stays full (full back pressure, no credit ever)."""

    def __init__(self, pids: str, flag: str) -> None:
        super().__init__(pids)
        self.flag = flag

    def process_element(self, value: tuple[int, int], ctx: Any, out: Any) -> None:
        while not os.path.exists(self.flag):
            time.sleep(0.005)
        super().process_element(value, ctx, out)


def test_a_task_whose_output_never_frees_still_snapshots_at_a_priority_barrier(
    tmp_path: Path,
) -> None:
    """source -> map -> keyed sum that is held (it processes nothing): the map's output is
    full and no buffer frees while the hold lasts. The map still takes the priority barrier
    (waiting for room *or* a priority barrier) and writes its state file, with the input it
    held as channel state, before the sum is released; before, it read no input while its
    output was blocked and never saw the barrier. Released, the job ends exact."""
    n = 50_000  # 50 MB in 10 s: the exchanges fill, the source still runs at the trigger
    pids, ckpt = tmp_path / "pids", tmp_path / "ckpt"
    pids.mkdir()
    flag = tmp_path / "release"
    env = StreamEnvironment(
        None, checkpoint_dir=str(ckpt), checkpoint_interval=1.0, mode="unaligned"
    )
    (
        env.from_generator(padded_event, count=n, rate=5000.0, parallelism=1)
        .rebalance()
        .map(lambda e: e, parallelism=1)
        .key_by(lambda e: e[0])
        .process(HeldSum(str(pids), str(flag)), parallelism=1)
        .collect(name="totals")
    )
    job = JobThread(env, runner=LocalRunner())
    thread, outcome = job.thread, job.outcome
    try:
        # the map (v1) snapshots while the sum holds everything back
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("*/v1-0-*.state")):
            assert time.monotonic() < deadline, "the map never snapshotted under the hold"
            assert thread.is_alive(), outcome
            time.sleep(0.01)
        assert not list(ckpt.glob("*/_metadata")), "completed while the sum was held"
    finally:
        flag.touch()
        thread.join(240)
    assert not thread.is_alive()
    result = outcome["result"]
    check_exact(result.collected["totals"], n)
    first = result.checkpoints[0]
    assert first.unaligned and first.persisted_bytes.get("v1-0"), result.checkpoints
