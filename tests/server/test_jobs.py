"""server.jobs: a job's JobStatus joined with the daemon's own figures of its tasks, over
real ResultPartitions (their back-pressured time and pools) and an injected clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionType
from exchange.protocol.local_messages import CheckpointRecord, JobStatus, JobTask
from server.config import DaemonConfig
from server.jobs import MAX_JOBS, MAX_JOBS_PER_APP, JobBoard, back_pressure_level
from server.metrics import TaskReport


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[NetworkBufferPool]:
    pool = NetworkBufferPool(64, 4096)
    yield pool
    assert pool.stats().available_segments == 64, "segments left behind"


def partition(pool: NetworkBufferPool, dataset: str, index: int) -> ResultPartition:
    return ResultPartition(
        ResultPartitionID(dataset, index, 0),
        ResultPartitionType.PIPELINED,
        2,
        pool.create_buffer_pool(2, 4),
    )


def status(job: str = "j", state: str = "RUNNING", *, dataset: str = "j-a1-e0") -> JobStatus:
    tasks = (
        JobTask("v0-0", "numbers -> by-key", 0, (dataset,), 0, 500, 499),
        JobTask("v1-0", "throttled", 0, (), 1, 400, 0),
        JobTask("v0-1", "numbers -> by-key", 1, (dataset,), 0, 10, 10),
    )
    ck = (CheckpointRecord(3, "COMPLETED", 1.5, 0.25, 0.01, 100, 2000),)
    return JobStatus(job, state, 1, 0, 1.0, 3, 0, tasks, ck, ())


def test_levels_follow_flinks_thresholds() -> None:
    assert back_pressure_level(None) is None
    assert back_pressure_level(0.0) == "OK"
    assert back_pressure_level(0.10) == "OK"
    assert back_pressure_level(0.1001) == "LOW"
    assert back_pressure_level(0.50) == "LOW"
    assert back_pressure_level(0.5001) == "HIGH"


def test_back_pressure_is_the_share_of_the_window_spent_waiting(pool: NetworkBufferPool) -> None:
    clock = Clock()
    p0 = partition(pool, "j-a1-e0", 0)
    reports = [TaskReport("j/v1-0", "reader", {"buffers_in_use": 9, "buffer_size": 2048}, 0.0)]
    board = JobBoard(lambda: [p0], lambda: reports, DaemonConfig(), clock=clock, window=5.0)
    try:
        board.update(status())
        tasks = {t.task: t for t in board.views()[0].tasks}
        assert tasks["v0-0"].back_pressure is None  # one sample: nothing measured yet
        assert tasks["v1-0"].back_pressure == "OK" and tasks["v1-0"].back_pressure_ratio == 0.0
        assert tasks["v0-1"].back_pressure is None  # its partition is not on this daemon
        assert tasks["v0-1"].out_pool_usage is None
        # waiting 0.8 s of every second: HIGH
        for _ in range(3):
            clock.now += 1.0
            p0.record_back_pressure(0.8)
            board.update(status())
        v0 = next(t for t in board.views()[0].tasks if t.task == "v0-0")
        assert v0.back_pressure == "HIGH" and v0.back_pressure_ratio == pytest.approx(0.8)
        # then 0.3 s a second: the 5 s window moves to LOW
        for _ in range(6):
            clock.now += 1.0
            p0.record_back_pressure(0.3)
            board.update(status())
        v0 = next(t for t in board.views()[0].tasks if t.task == "v0-0")
        assert v0.back_pressure == "LOW" and v0.back_pressure_ratio == pytest.approx(0.3)
        # the pool's usage and the gate's report
        held = [p0.buffer_pool.request_buffer() for _ in range(2)]
        view = {t.task: t for t in board.views()[0].tasks}
        assert view["v0-0"].out_pool_usage == pytest.approx(p0.stats().out_pool_usage)
        assert view["v0-0"].out_pool_usage > 0
        for b in held:
            assert b is not None
            b.release()
        # 9 buffers in use of 2 exclusive x 1 channel + 8 floating
        assert view["v1-0"].in_pool_usage == pytest.approx(0.9)
        assert view["v1-0"].buffer_size == 2048
        assert view["v0-0"].in_pool_usage is None  # a source has no gate report
    finally:
        p0.release()


def test_a_restart_starts_the_measurement_over(pool: NetworkBufferPool) -> None:
    clock = Clock()
    parts = [partition(pool, "j-a1-e0", 0)]
    board = JobBoard(lambda: parts, lambda: [], DaemonConfig(), clock=clock)
    try:
        board.update(status())
        clock.now += 1.0
        parts[0].record_back_pressure(0.9)
        board.update(status())
        assert board.views()[0].tasks[0].back_pressure == "HIGH"
        parts[0].release()
        parts[:] = [partition(pool, "j-a2-e0", 0)]  # the next attempt's partition
        clock.now += 1.0
        board.update(status(dataset="j-a2-e0"))
        assert board.views()[0].tasks[0].back_pressure is None
        clock.now += 1.0
        board.update(status(dataset="j-a2-e0"))
        assert board.views()[0].tasks[0].back_pressure == "OK"
    finally:
        parts[0].release()


def test_ended_jobs_keep_their_status_without_live_figures(pool: NetworkBufferPool) -> None:
    board = JobBoard(lambda: [], lambda: [], DaemonConfig())
    board.update(status("a", "FINISHED"))
    (view,) = board.views()
    assert view.status.state == "FINISHED"
    assert all(t.back_pressure is None and t.out_pool_usage is None for t in view.tasks)
    assert view.json(0.0)["checkpoints"][0] == {
        "id": 3,
        "status": "COMPLETED",
        "trigger_time": 1.5,
        "duration": 0.25,
        "alignment": 0.01,
        "aligned_bytes": 100,
        "state_bytes": 2000,
        "unaligned": False,
        "persisted_bytes": {},
    }
    for i in range(MAX_JOBS_PER_APP):  # one application keeps its most recent jobs
        board.update(status(f"job-{i}", "CANCELED"))
    jobs = [v.status.job for v in board.views()]
    assert len(jobs) == MAX_JOBS_PER_APP and "a" not in jobs  # the least recently updated
    board.update(status("job-0", "CANCELED"))
    assert [v.status.job for v in board.views()][-1] == "job-0"


def test_jobs_are_per_application_and_none_pushes_anothers_off() -> None:
    # nine spoofed jobs of no application pushed a real one off the dashboard
    board = JobBoard(lambda: [], lambda: [], DaemonConfig())
    board.update(status("real", "RUNNING"), "app-a")
    board.update(status("real", "FAILED"))  # the same id from no application: its own
    for i in range(3 * MAX_JOBS):
        board.update(status(f"spoof-{i}", "RUNNING"), f"app-{i % 3}-spoof")
    views = board.views()
    assert len(views) == MAX_JOBS
    [real] = [v for v in views if v.app_id == "app-a"]
    assert (real.status.job, real.status.state) == ("real", "RUNNING")
    assert real.json(0.0)["application"] == "app-a"
    assert all(
        sum(v.app_id == app for v in views) <= MAX_JOBS_PER_APP for app in {v.app_id for v in views}
    )


def test_a_wait_still_going_on_counts(pool: NetworkBufferPool) -> None:
    """A producer starved for longer than the window records nothing until its wait ends;
    the board counts the wait going on (the session's back_pressured_now)."""
    clock = Clock()
    p0 = partition(pool, "j-a1-e0", 0)
    started = clock.now
    board = JobBoard(
        lambda: [p0],
        lambda: [],
        DaemonConfig(),
        clock=clock,
        waiting=lambda: {("j-a1-e0", 0): clock.now - started},
    )
    try:
        for _ in range(8):
            board.update(status())
            clock.now += 1.0
        v0 = board.views()[0].tasks[0]
        assert p0.stats().back_pressured_seconds == 0.0
        assert v0.back_pressure == "HIGH" and v0.back_pressure_ratio == pytest.approx(1.0)
    finally:
        p0.release()
