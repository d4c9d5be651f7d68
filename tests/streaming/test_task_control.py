"""A StreamTask driven over its control channel by the test as the driver (no Spark): a
real daemon, a real ControlServer, the task in a thread. The clean stop: after ``stop``
an unbounded source emits nothing more and says ``exhausted``; the final checkpoint's
state holds exactly the position of the last record emitted; ``finish`` ends the task."""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.streaming.connectors import CollectSink, GeneratorSource
from client.streaming.control import ControlServer
from client.streaming.graph import JobGraph, Node, Partitioning
from client.streaming.task import JobSpec, run_task
from exchange.state import (
    DEFAULT_MAX_PARALLELISM,
    OperatorStateBackend,
    SnapshotKind,
    decode_snapshot,
)


@pytest.fixture
def daemon(start_daemon: Callable[..., Any]) -> Any:
    return start_daemon()  # at teardown: SIGTERM, exit 0 with the pool whole


def _next(server: ControlServer, kind: str, timeout: float = 30.0) -> dict[str, Any]:
    while True:
        try:
            _task, msg = server.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {kind!r} from the task within {timeout} s") from None
        assert msg["type"] not in ("failed", "lost"), msg
        if msg["type"] == kind:
            return msg


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
        reg = _next(server, "register")
        server.send("v0-0", {"type": "start", "daemons": {"v0-0": reg["daemon"]}, "restore": None})
        server.send("v0-0", {"type": "trigger", "checkpoint": 1, "timestamp": 1})
        ack = _next(server, "ack")
        figures = ack["metrics"]  # a source reads no input: no alignment figure
        assert ack["checkpoint"] == 1 and figures["state_bytes"] > 0 and "alignment" not in figures
        server.send("v0-0", {"type": "complete", "checkpoint": 1})
        server.send("v0-0", {"type": "stop"})
        _next(server, "exhausted")
        server.send("v0-0", {"type": "trigger", "checkpoint": 2, "timestamp": 2})
        final = _next(server, "ack")
        server.send("v0-0", {"type": "complete", "checkpoint": 2})
        server.send("v0-0", {"type": "finish"})
        finished = _next(server, "finished")
        thread.join(30)
        assert not thread.is_alive() and outcome
    finally:
        server.close()
        thread.join(30)
    emitted = finished["records_in"]
    assert emitted > 0
    state = decode_snapshot(
        Path(final["handle"]).read_bytes(),  # the driver did not commit it: no metadata
        SnapshotKind.TASK_STATE,
        final["handle"],
    )
    gen = OperatorStateBackend(0, 1)
    gen.restore([("v0-0", state["operators"]["gen"]["operator"])])
    # the generator's one split (first 0, step 1, next index): next == records emitted
    assert [tuple(x) for x in gen.union_list_state("gen", "generator-splits").get()] == [
        (0, 1, emitted)
    ]


def test_a_source_blocked_by_back_pressure_still_serves_triggers_and_cancel(
    daemon: Any, tmp_path: Path
) -> None:
    """Nobody reads the source's partition: its pool on the daemon fills, credit runs out
    and the source's writer window stays full. The task keeps handling its control
    messages meanwhile (Flink's mailbox while the output is unavailable): every trigger
    is snapshotted and acknowledged at once (two in a row with the same record count show
    the source is held), the snapshot holds exactly the records emitted, and a cancel
    ends the task. Before, the task looked at its inbox only when a batch freed: never."""
    ckpt = str(tmp_path / "ckpt")
    source = Node(0, "gen", lambda: GeneratorSource(lambda i: i), 1, is_source=True)
    sink = Node(1, "collect", CollectSink, 1, inputs=[(source, Partitioning.REBALANCE, None)])
    source.outputs.append(sink)
    graph = JobGraph.build([source, sink], DEFAULT_MAX_PARALLELISM)
    assert graph.num_tasks == 2  # the sink's task is never started: nobody reads
    token = secrets.token_hex(8)
    server = ControlServer(token, 3, {"v0-0"})
    job = JobSpec("bp", 3, token, server.address, graph, ckpt, "exactly_once")
    job = JobSpec(**{**job.__dict__, "daemon_hint": daemon.local_socket})
    errors: list[BaseException] = []

    def body() -> None:
        try:
            run_task(job, 0)
        except BaseException as e:  # the cancel: checked below
            errors.append(e)

    thread = threading.Thread(target=body, name="stream-task", daemon=True)
    try:
        thread.start()
        reg = _next(server, "register")
        server.send("v0-0", {"type": "start", "daemons": {"v0-0": reg["daemon"]}, "restore": None})
        counts: list[int] = []
        for cid in itertools.count(1):
            assert cid <= 500, f"the source never stopped emitting: {counts[-5:]}"
            server.send("v0-0", {"type": "trigger", "checkpoint": cid, "timestamp": cid})
            ack = _next(server, "ack", timeout=20.0)
            assert ack["checkpoint"] == cid
            counts.append(ack["metrics"]["records_out"])
            if len(counts) >= 2 and counts[-1] == counts[-2] > 0:
                break
        state = decode_snapshot(
            Path(ack["handle"]).read_bytes(), SnapshotKind.TASK_STATE, ack["handle"]
        )
        gen = OperatorStateBackend(0, 1)
        gen.restore([("v0-0", state["operators"]["gen"]["operator"])])
        assert [tuple(x) for x in gen.union_list_state("gen", "generator-splits").get()] == [
            (0, 1, counts[-1])
        ]
        server.send("v0-0", {"type": "cancel"})
        thread.join(30)
        assert not thread.is_alive(), "the blocked source did not see the cancel"
        assert len(errors) == 1 and "cancelled by the driver" in str(errors[0])
    finally:
        server.close()
        thread.join(30)
