"""Which failure an attempt reports (Flink's root cause of a failover): the earliest
failure that is not a consequence of another, whatever order the reports arrive in; the
others are listed as its consequences.

The collector alone (reports fed in any order), a task's error classified by its chain,
then real StreamTasks on a real daemon and a real ControlServer: a task whose partition
was released or that was cancelled reports a consequence, a task whose own code raised
reports a root cause, each stamped with when it failed; the server says when every task's
connection has ended (all their reports are in)."""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from client.runtime import get_runtime
from client.streaming.connectors import CollectSink, GeneratorSource
from client.streaming.control import ControlLost, ControlServer
from client.streaming.graph import JobGraph, Node, Partitioning
from client.streaming.job_status import AttemptFailure, FailureCollector, FailureReport
from client.streaming.operators import MapOperator
from client.streaming.task import JobSpec, StreamTaskFailed, dataset_of, is_consequence, run_task
from exchange.errors import (
    PartitionDataLostError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    WriterClosedError,
)
from exchange.protocol.driver_messages import (
    CancelTask,
    CheckpointAck,
    RegisterTask,
    StartTask,
    TaskFailed,
)
from exchange.protocol.messages import Message
from exchange.state import DEFAULT_MAX_PARALLELISM

_M = TypeVar("_M", bound=Message)

pytestmark = pytest.mark.timeout(120)


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the collector ------------------------------------------------------------------------


def test_the_earliest_failure_is_the_root_cause_though_its_report_arrives_last() -> None:
    """The race of issue 23: the sink's commit fails at t=10; the source's write then
    fails at t=11 (its partition was released) and that report reaches the driver first."""
    clock = _Clock(12.0)
    c = FailureCollector(wall_clock=clock)
    released = "PartitionReleasedError: ... [remote PARTITION_RELEASED]"
    c.on_message("v0-0", TaskFailed(released, 11.0, True))
    assert c.failed and c.failing_since == 12.0
    clock.now = 13.0
    c.on_message("v1-0", ControlLost("ConnectionResetError", 12.5))
    c.on_message("v2-0", TaskFailed("SinkCommitError: injected", 10.0, False))
    assert c.result(5) == AttemptFailure(
        5,
        "task v2-0 failed: SinkCommitError: injected",
        (f"task v0-0 failed: {released}", "task v1-0 lost: ConnectionResetError"),
    )


def test_a_root_cause_later_in_time_beats_an_earlier_consequence() -> None:
    """A consequence never wins over a failure of its own, even stamped earlier (clocks
    of two hosts disagree)."""
    c = FailureCollector(wall_clock=_Clock(0.0))
    c.on_message("a", TaskFailed("released", 1.0, True))
    c.on_message("b", TaskFailed("ValueError: boom", 2.0, False))
    root = c.root_cause()
    assert root == FailureReport("b", 2.0, "task b failed: ValueError: boom", False)


def test_with_only_consequences_the_earliest_is_reported() -> None:
    c = FailureCollector(wall_clock=_Clock(0.0))
    for task, at in (("x", 3.0), ("y", 1.0), ("z", 2.0)):
        c.on_message(task, TaskFailed("e", at, True))
    result = c.result(1)
    assert result is not None
    assert result.root_cause == "task y failed: e"
    assert result.consequences == ("task z failed: e", "task x failed: e")


def test_a_task_lost_after_the_attempt_began_failing_is_a_consequence() -> None:
    """Tasks lost once the driver knows of a failure were killed by the cancel; a task lost
    first (its worker killed) is the root cause."""
    clock = _Clock(100.0)
    c = FailureCollector(wall_clock=clock)
    c.on_message("k", ControlLost("killed", 99.0))
    clock.now = 101.0
    c.on_message("m", ControlLost("killed too", 100.5))
    assert [r.consequence for r in c.reports] == [False, True]
    assert c.root_cause() is c.reports[0]


def test_the_drivers_findings_after_a_task_failure_are_consequences() -> None:
    clock = _Clock(5.0)
    c = FailureCollector(wall_clock=clock)
    c.driver_failure("cancelled")
    assert c.reports == [FailureReport("", 5.0, "cancelled", False)]
    clock.now = 6.0
    c.driver_failure("the Spark stage failed: Py4JJavaError: ...")
    assert c.reports[1].consequence
    assert c.result(1) == AttemptFailure(
        1, "cancelled", ("the Spark stage failed: Py4JJavaError: ...",)
    )


def test_only_failure_reports_count_and_they_are_typed() -> None:
    c = FailureCollector(wall_clock=_Clock(7.0))
    c.on_message("t", CheckpointAck(1, "h", 0, 0, 0))
    assert not c.failed and c.result(1) is None
    with pytest.raises(ProtocolError, match="time"):  # a report always says when
        TaskFailed("x", True, False)
    with pytest.raises(ProtocolError, match="consequence"):
        TaskFailed("x", 1.0, 1)  # type: ignore[arg-type]


# -- which errors are consequences --------------------------------------------------------


def _raised(make: Callable[[], BaseException], cause: BaseException | None = None) -> BaseException:
    try:
        try:
            if cause is not None:
                raise cause
        except BaseException as inner:
            raise make() from inner
        raise make()
    except BaseException as e:
        return e


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (PartitionReleasedError("p released"), True),
        (ProducerFailedError("producer failed"), True),
        (StreamTaskFailed("v0-0: cancelled by the driver"), True),
        (PartitionDataLostError("spill lost"), False),
        (ValueError("the user's function"), False),
        (WriterClosedError("closed"), False),
    ],
)
def test_an_error_is_a_consequence_by_its_type(error: BaseException, expected: bool) -> None:
    assert is_consequence(error) is expected


def test_an_error_raised_from_a_released_partition_is_a_consequence() -> None:
    chained = _raised(lambda: WriterClosedError("write after close"), PartitionReleasedError("p"))
    assert isinstance(chained.__cause__, PartitionReleasedError)
    assert is_consequence(chained)
    assert not is_consequence(_raised(lambda: RuntimeError("x"), ValueError("y")))


# -- real tasks, a real daemon, a real ControlServer --------------------------------------


@pytest.fixture
def daemon(start_daemon: Callable[..., Any]) -> Any:
    return start_daemon()


class _Boom(Exception):
    pass


def _explode_at(n: int) -> Callable[[int], int]:
    def f(i: int) -> int:
        if i == n:
            raise _Boom(f"the user's function failed at record {n}")
        return i

    return f


def _next(server: ControlServer, kind: type[_M], timeout: float = 30.0) -> tuple[str, _M]:
    while True:
        try:
            task, msg = server.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {kind.__name__} within {timeout} s") from None
        if isinstance(msg, kind):
            return task, msg


@pytest.mark.parametrize("how", ["raised", "cancelled", "released"])
def test_a_real_task_reports_when_it_failed_and_whether_it_is_a_consequence(
    daemon: Any, tmp_path: Path, how: str
) -> None:
    """gen -> map -> collect, nothing chained; the collect task never starts, so the map's
    partition holds what it wrote. ``raised``: the map's function raises (a root cause);
    ``cancelled``: the driver cancels the map; ``released``: the map's partition is
    released on the daemon under it (both consequences)."""
    gen = Node(0, "gen", lambda: GeneratorSource(lambda i: i), 1, is_source=True)
    fn = _explode_at(100) if how == "raised" else (lambda r: r)
    nodes = [gen, Node(1, "map", lambda: MapOperator(fn), 1), Node(2, "collect", CollectSink, 1)]
    for up, down in itertools.pairwise(nodes):
        down.inputs.append((up, Partitioning.REBALANCE, None))
        up.outputs.append(down)
    graph = JobGraph.build(nodes, DEFAULT_MAX_PARALLELISM)
    tasks = ["v0-0", "v1-0"]
    token = secrets.token_hex(8)
    server = ControlServer(token, 9, set(tasks))
    job = JobSpec("rc", 9, token, server.address, graph, str(tmp_path / "ckpt"), "exactly_once")
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket})
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            run_task(job, index)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(2)]
    try:
        before = time.time()
        for t in threads:
            t.start()
        daemons = {}
        for _ in tasks:
            task, reg = _next(server, RegisterTask)
            daemons[task] = reg.daemon
        for task in tasks:
            server.send(task, StartTask(daemons, None))
        if how == "cancelled":
            server.send("v1-0", CancelTask())
        elif how == "released":
            edge = next(e for e in graph.edges if e.source == 1)
            dataset = dataset_of("rc", 9, edge)
            address = daemons["v1-0"].data_address
            deadline = time.monotonic() + 60
            while get_runtime().run(_release(address, dataset)) == 0:  # until it exists
                assert time.monotonic() < deadline, "the map's partition never appeared"
                time.sleep(0.05)  # a poll: the partition appears once the map has started
        # the map's failure; another task's consequence of it (the gen meeting its
        # released partition) may reach the control server first: which message arrives
        # first is a race, what each says is not
        task, failed = _next(server, TaskFailed)
        while task != "v1-0":
            assert task == "v0-0" and failed.consequence is True, (task, failed)
            task, failed = _next(server, TaskFailed)
        after = time.time()
        assert before <= failed.time <= after
        assert failed.consequence is (how != "raised"), failed.error
        server.send("v0-0", CancelTask())
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        assert server.wait_disconnected(30), "a task's control connection outlived its task"
    finally:
        server.close()
        for t in threads:
            t.join(30)
    assert len(errors) == 2
    if how == "raised":
        assert any(isinstance(e, _Boom) for e in errors), errors


async def _release(address: str, dataset: str) -> int:
    from client.local_connection import release_dataset

    return await release_dataset(address, dataset)
