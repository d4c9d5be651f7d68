"""SIGKILL at a random point of a producer task, a consumer task or the daemon, during a
pipelined and a blocking exchange (real processes: ``python -m server`` and task
processes of ``_tasks.py``), table-driven with a few seeds.

What must hold whatever dies and whenever:

* nothing hangs: every surviving process ends within ``FAIL_WITHIN`` seconds of the kill;
* errors are typed (``ExchangeError``), and the right kind: a consumer whose producer died
  gets a ProducerFailedError, a task whose daemon died a TransportError;
* nothing is lost or duplicated: a consumer that ends normally read every record, in
  order (checked in the task);
* surviving pools are whole: every task process reports its NetworkBufferPools whole, a
  surviving daemon's pool is whole once the exchange is released (and it stops cleanly);
* a blocking partition whose consumer died is read again, whole, by a new consumer;
* the kill landed mid-stream: the side reading (or writing a blocking partition) never
  finished; a case whose kill came after the end proved nothing and fails.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.local_connection import release_dataset
from client.runtime import get_runtime

pytestmark = pytest.mark.timeout(180)

Daemon = Any
TASKS = Path(__file__).resolve().parent / "_tasks.py"
RECORDS = 60_000
#: Every survivor must end within this many seconds of the kill.
FAIL_WITHIN = 20.0
START_WITHIN = 30.0
SEEDS = (11, 29)
VICTIMS = ("producer", "consumer", "daemon")
MODES = ("pipelined", "blocking")
CASES = [(v, m, s) for v in VICTIMS for m in MODES for s in SEEDS]


class Task:
    """A task process of ``_tasks.py`` and its JSON lines."""

    def __init__(self, *args: str) -> None:
        helpers: Any = sys.modules["exchange_tests_daemon_helpers"]
        self.proc = subprocess.Popen(
            [sys.executable, str(TASKS), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=helpers.child_env(),
        )
        self._out = helpers._LineReader(self.proc.stdout, "task-stdout")
        self._err = helpers._LineReader(self.proc.stderr, "task-stderr")
        self.events: list[dict[str, Any]] = []

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        line = self._out.next_line(timeout)
        if line is None:
            return None
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    def wait_started(self) -> bool:
        """True once started; False if it ended first (its last event is recorded)."""
        event = self.next_event(START_WITHIN)
        assert event is not None, f"task died: {self.stderr}"
        return event["event"] == "started"

    def result(self, timeout: float) -> dict[str, Any]:
        """The task's last event; it must exit within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.events or self.events[-1]["event"] == "started":
            event = self.next_event(max(0.01, deadline - time.monotonic()))
            assert event is not None, f"task exited without a result: {self.stderr}"
        self.proc.wait(max(0.01, deadline - time.monotonic()))
        return self.events[-1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def finished(self, timeout: float = 10.0) -> bool:
        """Whether it reported ``done`` (its whole stream); for a dead process, reads what
        it printed before it died."""
        if self.proc.poll() is not None:
            while self.next_event(timeout) is not None:
                pass
        return any(e["event"] == "done" for e in self.events)

    @property
    def stderr(self) -> str:
        return "".join(self._err.all)[-3000:]


def check_survivor(task: Task, timeout: float, victim: str, role: str) -> dict[str, Any]:
    try:
        res = task.result(timeout)
    except (TimeoutError, subprocess.TimeoutExpired):
        task.kill()
        raise AssertionError(f"the {role} hangs after the {victim} was killed") from None
    assert res["pools_whole"] is True, res
    if res["event"] == "done":
        assert res["count"] == RECORDS, res  # ended normally: every record, once, in order
        return res
    assert res["typed"] is True, f"untyped error in the {role}: {res} {task.stderr}"
    expected = {
        ("producer", "consumer"): {"ProducerFailedError"},
        ("daemon", "consumer"): {"TransportError"},
        ("daemon", "producer"): {"TransportError"},
        # a producer whose consumer died: its pipelined partition is released
        ("consumer", "producer"): {"PartitionReleasedError", "ProducerFailedError"},
    }[(victim, role)]
    assert res["type"] in expected, res
    return res


@pytest.mark.parametrize(
    ("victim", "mode", "seed"), CASES, ids=[f"{v}-{m}-{s}" for v, m, s in CASES]
)
def test_sigkill(start_daemon: Callable[..., Daemon], victim: str, mode: str, seed: int) -> None:
    rng = random.Random(f"{victim}-{mode}-{seed}")
    d = start_daemon()
    dataset = f"kill-{victim}-{mode}-{seed}"
    produce = ("produce", mode, d.local_socket, dataset, str(RECORDS))
    consume = ("consume", d.data_address, dataset)
    tasks: list[Task] = []

    def kill_victim(producer: Task | None, consumer: Task | None) -> float:
        time.sleep(rng.uniform(0.0, 1.0))  # the random point (the stream lasts ~1.5 s)
        target = {"producer": producer, "consumer": consumer}.get(victim)
        if victim == "daemon":
            d.kill()
        else:
            assert target is not None
            target.kill()
        return time.monotonic()

    try:
        phase = "stream"
        if mode == "pipelined":
            consumer = Task(*consume)
            producer = Task(*produce)
            tasks += [consumer, producer]
            producer.wait_started()
            consumer.wait_started()
            killed_at = kill_victim(producer, consumer)
            survivors = {"producer": producer, "consumer": consumer}
        else:
            producer = Task(*produce)
            tasks.append(producer)
            phase = {"producer": "write", "consumer": "read"}.get(victim) or rng.choice(
                ["write", "read"]
            )
            if phase == "write":
                producer.wait_started()
                killed_at = kill_victim(producer, None)
                survivors = {"producer": producer}
            else:
                assert producer.result(START_WITHIN + 60)["event"] == "done"
                consumer = Task(*consume)
                tasks.append(consumer)
                consumer.wait_started()
                killed_at = kill_victim(None, consumer)
                survivors = {"producer": producer, "consumer": consumer}
        for role, task in survivors.items():
            if role != victim:
                left = FAIL_WITHIN - (time.monotonic() - killed_at)
                check_survivor(task, left, victim, role)
        # the kill cut the stream (else this case proved nothing): the side that was
        # reading (the producer, while a blocking partition is written) never finished
        reading = consumer if mode == "pipelined" or phase == "read" else producer
        assert not reading.finished(), (
            f"the {victim} was killed after the stream ended: {reading.events}"
        )

        if victim == "daemon":
            return  # no daemon survived; its tasks ended typed and whole (checked above)
        if mode == "blocking":
            # a blocking partition outlives its consumer, not a producer that died writing
            late = Task(*consume)
            tasks.append(late)
            res = late.result(START_WITHIN + FAIL_WITHIN)
            if victim == "consumer" or producer.events[-1]["event"] == "done":
                assert res["event"] == "done" and res["count"] == RECORDS, res
            else:
                assert res["event"] == "error" and res["type"] == "ProducerFailedError", res
        get_runtime().run(release_dataset(d.local_socket, dataset))
        d.wait_stats(lambda s: s["partitions"]["count"] == 0, timeout=FAIL_WITHIN)
        d.wait_pool_whole(timeout=FAIL_WITHIN)
    finally:
        for t in tasks:
            t.kill()
