"""A streaming job's driver publishes its status to a real daemon process (JobStatus,
local message 77): what the coordinator loop reports (attempts, acknowledgements,
checkpoint commands, failures) appears on the daemon's /api/stats and /metrics, and the
last status stays after the driver's connection closes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.streaming.functions import Operator
from client.streaming.graph import JobGraph, Node, Partitioning
from client.streaming.job_status import JobStatusTracker
from exchange.checkpointing.coordinator import (
    AbortReason,
    NotifyAborted,
    NotifyComplete,
    TriggerCheckpoint,
)
from exchange.protocol.driver_messages import CheckpointAck

pytestmark = pytest.mark.timeout(120)


def _graph() -> JobGraph:
    """numbers (x2) -> by-key (chained) -> hash -> sink (x1), as the environment builds it."""
    numbers = Node(0, "numbers", Operator, 2, is_source=True)
    by_key = Node(1, "by-key", Operator, 2, inputs=[(numbers, Partitioning.FORWARD, None)])
    sink = Node(
        2,
        "sink",
        Operator,
        1,
        key_fn=lambda pair: pair[0],
        inputs=[(by_key, Partitioning.HASH, lambda pair: pair[0])],
    )
    numbers.outputs.append(by_key)
    by_key.outputs.append(sink)
    return JobGraph.build([numbers, by_key, sink], 128)


def _job(daemon: Any, job: str, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    seen = None
    while time.monotonic() < deadline:
        for j in daemon.stats()["jobs"]:
            if j["job"] == job:
                seen = j
                if until(j):
                    return dict(j)
        time.sleep(0.05)
    raise AssertionError(f"job {job} never got there; last seen {seen}")


def test_the_drivers_view_reaches_the_daemon(
    start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    daemon = start_daemon()
    tracker = JobStatusTracker("job-x", daemon.local_socket)
    graph = _graph()
    tracker.attempt_started(17, graph)
    first = _job(daemon, "job-x", lambda j: j["attempt"] == 17)
    assert first["state"] == "RUNNING" and first["restarts"] == 0
    assert [(t["task"], t["name"]) for t in first["tasks"]] == [
        ("v0-0", "numbers -> by-key"),
        ("v0-1", "numbers -> by-key"),
        ("v1-0", "sink"),
    ]

    tracker.on_command(TriggerCheckpoint(1, 1_764_000_000_000, ("v0-0", "v0-1")))
    for task, alignment in (("v0-0", None), ("v0-1", None), ("v1-0", 0.02)):
        ack = CheckpointAck(1, "h", state_bytes=1000, records_in=50, records_out=40)
        if alignment is not None:  # the reading task triggered it unaligned
            ack = replace(
                ack, alignment=alignment, aligned_bytes=4096, unaligned=True, persisted_bytes=2048
            )
        tracker.on_message(task, ack)
    tracker.on_command(NotifyComplete(1))
    tracker.on_command(TriggerCheckpoint(2, 1_764_000_001_000, ("v0-0", "v0-1")))
    tracker.on_command(NotifyAborted(2, AbortReason.EXPIRED))
    tracker.on_command(TriggerCheckpoint(3, 1_764_000_002_000, ("v0-0", "v0-1")))
    tracker.attempt_failed("task v1-0 lost: killed")
    tracker.attempt_started(18, graph)  # restored from 1: its next checkpoint is 2 again
    tracker.on_command(TriggerCheckpoint(2, 1_764_000_003_000, ("v0-0", "v0-1")))
    tracker.publish(force=True)

    job = _job(daemon, "job-x", lambda j: j["attempt"] == 18 and len(j["checkpoints"]) == 4)
    assert job["state"] == "RUNNING" and job["restarts"] == 1
    assert job["checkpoints_completed"] == 1 and job["checkpoints_failed"] == 2
    assert [(c["id"], c["status"]) for c in job["checkpoints"]] == [
        (1, "COMPLETED"),
        (2, "FAILED"),
        (3, "FAILED"),  # in flight when its attempt failed
        (2, "IN_PROGRESS"),  # the new attempt's
    ]
    one = job["checkpoints"][0]
    assert one["trigger_time"] == 1_764_000_000.0
    assert one["duration"] is not None and one["duration"] >= 0
    assert one["alignment"] == 0.02 and one["aligned_bytes"] == 4096
    assert one["state_bytes"] == 3000
    assert one["unaligned"] is True and one["persisted_bytes"] == {"v1-0": 2048}
    assert job["checkpoints"][1]["unaligned"] is False
    assert job["failures"] == ["task v1-0 lost: killed"]
    assert all(t["records_in"] == 0 for t in job["tasks"])  # the new attempt's counts

    families = {
        f.name: f for f in text_string_to_metric_families(daemon.http_get("/metrics").decode())
    }
    assert families["exchange_job_restarts"].type == "counter"  # exchange_job_restarts_total
    restarts = next(
        s for s in families["exchange_job_restarts"].samples if s.name.endswith("_total")
    )
    assert restarts.labels == {"job_id": "job-x"} and restarts.value == 1
    (size,) = families["exchange_job_last_checkpoint_size_bytes"].samples
    assert size.value == 3000
    (unaligned,) = families["exchange_job_last_checkpoint_unaligned"].samples
    assert unaligned.value == 1
    (persisted,) = families["exchange_job_last_checkpoint_persisted_bytes"].samples
    assert persisted.labels == {"job_id": "job-x", "task": "v1-0"} and persisted.value == 2048

    tracker.job_ended("FINISHED")  # the last status, then the connection closes
    done = _job(daemon, "job-x", lambda j: j["state"] == "FINISHED")
    assert done["restarts"] == 1
    assert tracker.published >= 3 and not tracker.publish_failed


def test_no_daemon_stops_the_publishing_never_the_job(tmp_path: Path) -> None:
    tracker = JobStatusTracker("job-y", str(tmp_path / "no-such.sock"))
    tracker.attempt_started(1, _graph())
    assert tracker.publish_failed and tracker.published == 0
    tracker.on_command(TriggerCheckpoint(1, 0, ("v0-0",)))
    tracker.publish(force=True)  # nothing raised, nothing sent
    assert tracker.snapshot().checkpoints[0].status == "IN_PROGRESS"
