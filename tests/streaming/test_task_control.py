"""A StreamTask driven over its control channel by the test as the driver (no Spark): a
real daemon, a real ControlServer, the task in a thread. The clean stop: after ``stop``
an unbounded source emits nothing more and says ``exhausted``; the final checkpoint's
state holds exactly the position of the last record emitted; ``finish`` ends the task."""

from __future__ import annotations

import itertools
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from client.producer import PartitionWriter
from client.streaming.checkpoint_storage import (
    CheckpointMetadata,
    CheckpointStorage,
    operator_files,
)
from client.streaming.connectors import CollectSink, GeneratorSource
from client.streaming.control import ControlLost, ControlServer
from client.streaming.functions import Collector, Operator, Source
from client.streaming.graph import JobGraph, Node, Partitioning
from client.streaming.operators import MapOperator
from client.streaming.task import JobSpec, run_task
from exchange.protocol.driver_messages import (
    CancelTask,
    CheckpointAbort,
    CheckpointAck,
    CheckpointComplete,
    CheckpointTrigger,
    FinishTask,
    RegisterTask,
    RestorePoint,
    SourceExhausted,
    StartTask,
    StopInput,
    TaskFailed,
    TaskFinished,
)
from exchange.protocol.messages import Message
from exchange.state import (
    DEFAULT_MAX_PARALLELISM,
    OperatorStateBackend,
    SnapshotKind,
    decode_snapshot,
)

_M = TypeVar("_M", bound=Message)


@pytest.fixture
def daemon(start_daemon: Callable[..., Any]) -> Any:
    return start_daemon()  # at teardown: SIGTERM, exit 0 with the pool whole


def _next(
    server: ControlServer, kind: type[_M], timeout: float = 30.0, task: str | None = None
) -> _M:
    """The next ``kind`` message (from ``task``, if given; the others are dropped)."""
    while True:
        try:
            sender, msg = server.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {kind.__name__} from the task within {timeout} s") from None
        assert not isinstance(msg, TaskFailed | ControlLost), msg
        if isinstance(msg, kind) and task in (None, sender):
            return msg


def _start_tasks(
    server: ControlServer, job: JobSpec, tasks: list[str], errors: dict[int, BaseException]
) -> list[threading.Thread]:
    """Run tasks 0..len(tasks)-1 of ``job`` in threads (what each raises goes to
    ``errors``), answer their registrations and start them."""

    def body(index: int) -> None:
        try:
            run_task(job, index)
        except BaseException as e:  # a cancel: the caller checks
            errors[index] = e

    threads = [
        threading.Thread(target=body, args=(i,), name=f"stream-task-{i}", daemon=True)
        for i in range(len(tasks))
    ]
    for t in threads:
        t.start()
    daemons = {}
    for _ in tasks:
        reg = _next(server, RegisterTask)
        daemons[reg.task_id] = reg.daemon
    for task in tasks:
        server.send(task, StartTask(daemons, None))
    return threads


def test_a_stopped_source_ends_its_input_and_the_final_checkpoint_holds_its_position(
    daemon: Any, tmp_path: Path
) -> None:
    ckpt = str(tmp_path / "ckpt")
    source = Node(0, "gen", lambda: GeneratorSource(lambda i: i), 1, is_source=True)
    sink = Node(1, "collect", CollectSink, 1, inputs=[(source, Partitioning.FORWARD, None)])
    source.outputs.append(sink)
    graph = JobGraph.build([source, sink], DEFAULT_MAX_PARALLELISM)
    assert graph.num_tasks == 1  # the sink is chained to the source
    token = secrets.token_hex(8)
    server = ControlServer(token, 7, {"v0-0"})
    job = JobSpec("ctl", 7, token, server.address, graph, ckpt, "exactly_once")
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket})
    outcome: list[Any] = []
    thread = threading.Thread(
        target=lambda: outcome.append(run_task(job, 0)), name="stream-task", daemon=True
    )
    try:
        thread.start()
        reg = _next(server, RegisterTask)
        server.send("v0-0", StartTask({"v0-0": reg.daemon}, None))
        server.send("v0-0", CheckpointTrigger(1, 1))
        ack = _next(server, CheckpointAck)
        # a source reads no input: no alignment figure
        assert ack.checkpoint_id == 1 and ack.state_bytes > 0 and ack.alignment is None
        server.send("v0-0", CheckpointComplete(1))
        server.send("v0-0", StopInput())
        _next(server, SourceExhausted)
        server.send("v0-0", CheckpointTrigger(2, 2))
        final = _next(server, CheckpointAck)
        server.send("v0-0", CheckpointComplete(2))
        server.send("v0-0", FinishTask())
        finished = _next(server, TaskFinished)
        thread.join(30)
        assert not thread.is_alive() and outcome
    finally:
        server.close()
        thread.join(30)
    emitted = finished.records_in
    assert emitted > 0
    state = decode_snapshot(
        Path(final.handle).read_bytes(),  # the driver did not commit it: no metadata
        SnapshotKind.TASK_STATE,
        final.handle,
    )
    gen = OperatorStateBackend(0, 1)
    gen.restore([("v0-0", state["operators"]["gen"]["operator"])])
    # the generator's one split (first 0, step 1, next index): next == records emitted
    assert [tuple(x) for x in gen.union_list_state("gen", "generator-splits").get()] == [
        (0, 1, emitted)
    ]


def _trigger_until_the_source_is_held(server: ControlServer) -> None:
    """Trigger checkpoints 1, 2, ... of the generator source ``v0-0`` until two in a row
    are acknowledged with the same record count (held: every trigger still answered at
    once); its snapshot holds exactly the records emitted."""
    counts: list[int] = []
    for cid in itertools.count(1):
        assert cid <= 500, f"the source never stopped emitting: {counts[-5:]}"
        server.send("v0-0", CheckpointTrigger(cid, cid))
        ack = _next(server, CheckpointAck, timeout=20.0, task="v0-0")
        assert ack.checkpoint_id == cid
        counts.append(ack.records_out)
        if len(counts) >= 2 and counts[-1] == counts[-2] > 0:
            break
    handle = ack.handle
    state = decode_snapshot(Path(handle).read_bytes(), SnapshotKind.TASK_STATE, handle)
    gen = OperatorStateBackend(0, 1)
    gen.restore([("v0-0", state["operators"]["gen"]["operator"])])
    assert [tuple(x) for x in gen.union_list_state("gen", "generator-splits").get()] == [
        (0, 1, counts[-1])
    ]


@pytest.mark.parametrize("held", ["source", "map"])
def test_a_task_held_by_back_pressure_still_handles_its_control_messages(
    daemon: Any, tmp_path: Path, held: str
) -> None:
    """Nobody reads the last partition (the sink's task is never started): its pool on the
    daemon fills, credit runs out and the writer window of the task before it stays full
    (with ``map``, the source is then held too). The held tasks keep handling their control
    messages (Flink's mailbox while the output is unavailable): every trigger is
    snapshotted and acknowledged at once (two in a row with the same record count show
    the source is held), the snapshot holds exactly the records emitted, and a cancel
    ends every task. Before, a held task looked at its inbox only when a batch freed:
    never."""
    ckpt = str(tmp_path / "ckpt")
    source = Node(0, "gen", lambda: GeneratorSource(lambda i: i), 1, is_source=True)
    nodes = [source]
    if held == "map":
        nodes.append(Node(1, "map", lambda: MapOperator(lambda r: r), 1))
    nodes.append(Node(len(nodes), "collect", CollectSink, 1))
    for up, down in itertools.pairwise(nodes):
        down.inputs.append((up, Partitioning.REBALANCE, None))
        up.outputs.append(down)
    graph = JobGraph.build(nodes, DEFAULT_MAX_PARALLELISM)
    assert graph.num_tasks == len(nodes)  # nothing chained
    tasks = [f"v{i}-0" for i in range(len(nodes) - 1)]  # every task but the sink's
    token = secrets.token_hex(8)
    server = ControlServer(token, 3, set(tasks))
    job = JobSpec("bp", 3, token, server.address, graph, ckpt, "exactly_once")
    # buffers ship when full only (no buffer timeout): one poll or 64 records of these
    # small ints ship at most one batch, so a task that found room never blocks in emit
    # (with a timeout, a batch slower than it may ship twice and overrun the window)
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket, "buffer_timeout": -1})
    errors: dict[int, BaseException] = {}
    threads: list[threading.Thread] = []
    try:
        threads = _start_tasks(server, job, tasks, errors)
        _trigger_until_the_source_is_held(server)
        for task in reversed(tasks):  # the map first: the source alone cannot free it
            server.send(task, CancelTask())
        for t in threads:
            t.join(30)
            assert not t.is_alive(), f"{t.name}, held, did not see the cancel"
        assert len(errors) == len(tasks)
        assert all("cancelled by the driver" in str(e) for e in errors.values()), errors
    finally:
        server.close()
        for t in threads:
            t.join(30)


class _Held(Operator):
    """A sink that processes nothing until ``release`` is set (its reader still reads,
    and announces its debloated buffer size upstream)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def process(self, record: Any, out: Collector) -> None:
        while not self.release.wait(0.005):
            pass


class _GatedGenerator(GeneratorSource):
    """A GeneratorSource that emits nothing before ``gate`` is set."""

    def __init__(self, gate: threading.Event, fn: Callable[[int], Any]) -> None:
        super().__init__(fn)
        self.gate = gate

    def poll(self, out: Collector, max_records: int) -> bool:
        return super().poll(out, max_records) if self.gate.is_set() else True


def test_a_source_held_with_debloated_buffers_still_takes_triggers(
    start_daemon: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debloating shrinks the source's buffers to 256 bytes (two records each) and the
    sink processes nothing, so credit runs out. A poll of the old fixed 256 records
    shipped a hundred buffers, and the emit that found the window full waited inside
    the poll, where no mail is run: the source never saw a trigger again (this test got
    no acknowledgement). Now a poll emits about one shipment (one debloated buffer), and
    the source waits for room *between* polls, handling its mail: every trigger is
    acknowledged (twice with the same record count: held), the snapshot holding exactly
    the records emitted. The source emits once its writer cuts 256-byte buffers (a size
    that comes while a poll runs applies to the next poll only)."""
    writers: list[PartitionWriter] = []
    original = PartitionWriter.__init__

    def recording_init(self: PartitionWriter, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        writers.append(self)

    monkeypatch.setattr(PartitionWriter, "__init__", recording_init)
    daemon = start_daemon(
        "--debloat",
        "--debloat-min-buffer-size=256",
        "--debloat-initial-buffer-size=256",
        "--debloat-target=1ms",
    )
    ckpt = str(tmp_path / "ckpt")
    release, gate = threading.Event(), threading.Event()
    pad = b"p" * 100
    source = Node(0, "gen", lambda: _GatedGenerator(gate, lambda i: (i, pad)), 1, is_source=True)
    sink = Node(1, "held", lambda: _Held(release), 1)
    sink.inputs.append((source, Partitioning.REBALANCE, None))
    source.outputs.append(sink)
    graph = JobGraph.build([source, sink], DEFAULT_MAX_PARALLELISM)
    tasks = ["v0-0", "v1-0"]
    token = secrets.token_hex(8)
    server = ControlServer(token, 5, set(tasks))
    job = JobSpec("dbl", 5, token, server.address, graph, ckpt, "unaligned")
    # no buffer timeout: only the task thread ships (a flush timer's shipment may overrun
    # the window by one batch, which the next full buffer then waits for)
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket, "buffer_timeout": -1})
    errors: dict[int, BaseException] = {}
    threads: list[threading.Thread] = []
    try:
        threads = _start_tasks(server, job, tasks, errors)
        _until(lambda: len(writers) == 1, "the source's writer opened")
        _until(lambda: writers[0].buffer_size(0) == 256, "the sink's buffer size announced")
        gate.set()
        _trigger_until_the_source_is_held(server)
    finally:
        release.set()
        for task in reversed(tasks):
            server.send(task, CancelTask())
        for t in threads:
            t.join(30)
        server.close()
    assert not any(t.is_alive() for t in threads)
    assert all("cancelled by the driver" in str(e) for e in errors.values()), errors


class _IdleAfter(Source):
    """Unbounded: emits ``k`` records, then nothing (``ready_in`` infinite: only mail)."""

    bounded = False

    def __init__(self, k: int) -> None:
        self.k = k
        self.next = 0

    def poll(self, out: Collector, max_records: int) -> bool:
        while self.next < self.k and max_records > 0:
            out.collect(self.next)
            self.next += 1
            max_records -= 1
        return True

    def ready_in(self) -> float:
        return 0.0 if self.next < self.k else math.inf


class _Recorder(Operator):
    """A sink that notes what reaches it, for the test thread to watch."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.calls: list[tuple[str, int]] = []

    def process(self, record: Any, out: Collector) -> None:
        self.records.append(record)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.calls.append(("complete", checkpoint_id))

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        self.calls.append(("abort", checkpoint_id))


def _until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def test_a_task_waiting_for_input_handles_its_control_messages(daemon: Any, tmp_path: Path) -> None:
    """The source emits 100 records and then nothing: the sink's task waits for input.
    ``complete``, ``abort`` and ``cancel`` still reach it at once (the task waits on its
    mailbox, which the reader's hand-off wakes). Before, a reading task looked at its
    control messages only between records: none of them arrived while its input was
    idle."""
    sink = _Recorder()
    source = Node(0, "idle", lambda: _IdleAfter(100), 1, is_source=True)
    node = Node(1, "rec", lambda: sink, 1, inputs=[(source, Partitioning.REBALANCE, None)])
    source.outputs.append(node)
    graph = JobGraph.build([source, node], DEFAULT_MAX_PARALLELISM)
    tasks = ["v0-0", "v1-0"]
    token = secrets.token_hex(8)
    server = ControlServer(token, 5, set(tasks))
    job = JobSpec("idle", 5, token, server.address, graph, str(tmp_path / "ckpt"), "exactly_once")
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket})
    errors: dict[int, BaseException] = {}
    threads: list[threading.Thread] = []
    try:
        threads = _start_tasks(server, job, tasks, errors)
        _until(lambda: len(sink.records) == 100, "the 100 records reached the sink")
        server.send("v0-0", CheckpointTrigger(1, 1))
        assert _next(server, CheckpointAck, task="v1-0").checkpoint_id == 1  # the barrier came
        server.send("v1-0", CheckpointComplete(1))
        _until(lambda: sink.calls == [("complete", 1)], "complete while waiting for input")
        server.send("v1-0", CheckpointAbort(2))
        _until(lambda: ("abort", 2) in sink.calls, "abort while waiting for input")
        server.send("v1-0", CancelTask())
        threads[1].join(20)
        assert not threads[1].is_alive(), "the idle task did not see the cancel"
        assert "cancelled by the driver" in str(errors[1])
        assert sink.records == list(range(100))
    finally:
        server.send("v0-0", CancelTask())
        for t in threads:
            t.join(30)
        server.close()


class _EndMarker(Operator):
    """Passes records on; emits ``"end"`` from ``end_input``."""

    def process(self, record: Any, out: Collector) -> None:
        out.collect(record)

    def end_input(self, out: Collector) -> None:
        out.collect("end")


def _run_bounded_chain(
    daemon: Any, ckpt: str, attempt: int, restore: RestorePoint | None
) -> tuple[_Recorder, CheckpointAck]:
    """generator(3) -> _EndMarker -> _Recorder, chained in one task, to its end: the
    records that reached the recorder and the final checkpoint's ack."""
    sink = _Recorder()
    nodes = [
        Node(0, "gen", lambda: GeneratorSource(lambda i: i, count=3), 1, is_source=True),
        Node(1, "marker", _EndMarker, 1),
        Node(2, "rec", lambda: sink, 1),
    ]
    for up, down in itertools.pairwise(nodes):
        down.inputs.append((up, Partitioning.FORWARD, None))
        up.outputs.append(down)
    graph = JobGraph.build(nodes, DEFAULT_MAX_PARALLELISM)
    assert graph.num_tasks == 1
    token = secrets.token_hex(8)
    server = ControlServer(token, attempt, {"v0-0"})
    job = JobSpec("fin", attempt, token, server.address, graph, ckpt, "exactly_once")
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket})
    errors: dict[int, BaseException] = {}

    def body() -> None:
        try:
            run_task(job, 0)
        except BaseException as e:  # checked below
            errors[0] = e

    thread = threading.Thread(target=body, daemon=True)
    try:
        thread.start()
        reg = _next(server, RegisterTask)
        server.send("v0-0", StartTask({"v0-0": reg.daemon}, restore))
        _next(server, SourceExhausted)
        cid = attempt * 10
        server.send("v0-0", CheckpointTrigger(cid, cid))
        ack = _next(server, CheckpointAck)
        name = os.path.basename(ack.handle)  # the driver's part: the metadata
        files = {"v0-0": name}
        operators = operator_files(files, graph.operator_tasks())
        CheckpointStorage(ckpt).commit(
            CheckpointMetadata(cid, cid, files, is_final=True, operators=operators)
        )
        server.send("v0-0", CheckpointComplete(cid))
        server.send("v0-0", FinishTask())
        _next(server, TaskFinished)
        thread.join(30)
        assert not thread.is_alive() and not errors
    finally:
        server.close()
        thread.join(30)
    return sink, ack


def test_a_task_restored_after_its_end_of_input_does_not_run_end_input_again(
    daemon: Any, tmp_path: Path
) -> None:
    """Restored from a checkpoint taken after its input ended (the final one here, as a
    rerun or a restart after it would), the task is finished on restore: the source
    polls nothing and ``end_input`` does not run again, so nothing it emitted is emitted
    twice; it still ends its input and serves the final checkpoint."""
    ckpt = str(tmp_path / "ckpt")
    first, ack = _run_bounded_chain(daemon, ckpt, 1, None)
    assert first.records == [0, 1, 2, "end"]
    latest = CheckpointStorage(ckpt).latest_completed()
    assert latest is not None and latest.checkpoint_id == ack.checkpoint_id
    restore = RestorePoint(latest.checkpoint_id, dict(latest.operators))
    again, _ = _run_bounded_chain(daemon, ckpt, 2, restore)
    assert again.records == []
