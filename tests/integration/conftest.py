"""Fixtures for integration tests: real daemon processes on port 0, real sockets.

* ``spawn_server(config)`` starts ``_server_proc.py`` (a DataServer and producers in
  their own process, on uvloop) and returns a ``ServerProcess`` to query (``stats()``)
  and stop (``quit()``, which also returns the daemon's own leak check). Every process
  still running at teardown is killed.
* ``client_pool(segments, segment_size)`` makes NetworkBufferPools for the test process
  that must be consistent and whole at teardown.
* ``consume(...)`` reads records through a SingleInputGate of RemoteInputChannels.

Async tests here run on the loops of ``pytest_asyncio_loop_factories``: plain asyncio in
debug mode, and uvloop; a test picks with ``@pytest.mark.asyncio(loop_factories=[...])``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvloop

from client.network import ConnectionManager
from exchange.consumer import RecordReader, SingleInputGate
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SERVER_SCRIPT = HERE / "_server_proc.py"
CLIENT_SCRIPT = HERE / "_client_proc.py"
#: Upper bound for one JSON line from a child process.
LINE_TIMEOUT = 20.0


def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    return loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": _debug_loop, "uvloop": uvloop.new_event_loop}


class ChildProcess:
    """A Python child speaking JSON lines on stdout (and taking commands on stdin)."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.events: list[dict[str, Any]] = []  # every event seen
        self._unclaimed: list[dict[str, Any]] = []  # seen, not yet returned by expect()
        self.stderr = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def next_event(self, timeout: float = LINE_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise AssertionError(f"{self.name} exited: {await self.read_stderr()}")
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    async def expect(
        self, name: str, timeout: float = LINE_TIMEOUT, **fields: Any
    ) -> dict[str, Any]:
        """The oldest event called ``name`` (with these ``fields``) not returned yet,
        waiting for it if need be."""

        def match(event: dict[str, Any]) -> bool:
            return event["event"] == name and all(event.get(k) == v for k, v in fields.items())

        for i, event in enumerate(self._unclaimed):
            if match(event):
                return self._unclaimed.pop(i)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = await self.next_event(max(deadline - loop.time(), 0.01))
            if match(event):
                return event
            self._unclaimed.append(event)

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd}).encode() + b"\n")

    async def read_stderr(self) -> str:
        if self.proc.stderr is not None and self.proc.returncode is not None:
            self.stderr += await self.proc.stderr.read()
        return self.stderr.decode(errors="replace")

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
                os.kill(self.proc.pid, signal.SIGKILL)

    async def wait(self, timeout: float = LINE_TIMEOUT) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await self.read_stderr()
        return code

    async def close(self) -> None:
        """Kill if still running, reap, and close the pipes."""
        self.kill()
        await self.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


class ServerProcess(ChildProcess):
    """``_server_proc.py``: a DataServer plus producers."""

    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stats(self) -> dict[str, Any]:
        self.send("stats")
        return await self.expect("stats")

    async def quit(self) -> dict[str, Any]:
        """Stop the daemon; returns its final report after checking it is clean."""
        self.send("quit")
        bye = await self.expect("bye")
        assert await self.wait() == 0, self.stderr.decode(errors="replace")
        assert bye["consistent"], bye
        assert bye["whole"], f"daemon's pool not whole: {bye['pool']}"
        assert bye["connections"] == 0, bye
        assert bye["tasks"] == [], bye["tasks"]
        assert bye["partitions"] == 0, bye
        return bye

    async def wait_for_stats(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, interval: float = 0.02
    ) -> dict[str, Any]:
        """Poll ``stats()`` until ``predicate`` holds; AssertionError with the last stats."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            st = await self.stats()
            if predicate(st):
                return st
            if loop.time() > deadline:
                raise AssertionError(f"condition not reached within {timeout}s: {st}")
            await asyncio.sleep(interval)


async def _spawn(script: Path, config: dict[str, Any], name: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        json.dumps(config),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(ROOT),
        env=env,
    )


@pytest_asyncio.fixture
async def spawn_server() -> AsyncIterator[Callable[..., Awaitable[ServerProcess]]]:
    procs: list[ChildProcess] = []

    async def spawn(**config: Any) -> ServerProcess:
        proc = ServerProcess(await _spawn(SERVER_SCRIPT, config, "daemon"), "daemon")
        procs.append(proc)
        ready = await proc.expect("ready")
        proc.port = int(ready["port"])
        return proc

    yield spawn
    for p in procs:
        await p.close()


@pytest_asyncio.fixture
async def spawn_client() -> AsyncIterator[Callable[..., Awaitable[ChildProcess]]]:
    procs: list[ChildProcess] = []

    async def spawn(**config: Any) -> ChildProcess:
        proc = ChildProcess(await _spawn(CLIENT_SCRIPT, config, "consumer"), "consumer")
        procs.append(proc)
        return proc

    yield spawn
    for p in procs:
        await p.close()


@pytest.fixture
def client_pool() -> Iterator[Callable[..., NetworkBufferPool]]:
    """NetworkBufferPools of the test process; each must be whole at teardown."""
    pools: list[NetworkBufferPool] = []

    def make(segments: int = 256, segment_size: int = 32 * 1024) -> NetworkBufferPool:
        pool = NetworkBufferPool(segments, segment_size)
        pools.append(pool)
        return pool

    yield make
    try:
        for pool in pools:
            pool.check_consistency()
            assert pool.is_whole(), f"client pool not whole: {pool.stats()} {pool.local_pools}"
    finally:
        for pool in pools:
            pool.destroy()


def make_gate(
    address: str,
    pids: Sequence[ResultPartitionID],
    subpartition: int,
    cm: ConnectionManager,
    nbp: NetworkBufferPool,
    *,
    floating: int = 8,
    exclusive: int = 2,
    backoff: tuple[float, float] = (0.01, 0.32),
    name: str = "gate",
) -> SingleInputGate:
    gate = SingleInputGate(name, nbp.create_buffer_pool(0, floating))
    gate.set_input_channels(
        [
            RemoteInputChannel(
                gate,
                i,
                pid,
                subpartition,
                address,
                cm,
                nbp,
                num_exclusive=exclusive,
                backoff_initial=backoff[0],
                backoff_max=backoff[1],
            )
            for i, pid in enumerate(pids)
        ]
    )
    return gate


async def read_all(gate: SingleInputGate, timeout: float = 30.0) -> list[Any]:
    """Request the gate's partitions and read every record; the gate is closed after."""
    reader = RecordReader(gate)
    try:
        async with asyncio.timeout(timeout):
            await gate.request_partitions()
            return await reader.read_all()
    finally:
        reader.close()


def check_records(
    records: Sequence[Any],
    producers: Sequence[int],
    subpartition: int,
    count: int,
    payload: int,
) -> None:
    """Every record of every producer exactly once and in order, with its payload."""
    seqs: dict[int, list[int]] = {p: [] for p in producers}
    for p, sub, i, data in records:
        assert sub == subpartition, (p, sub, i)
        assert data == bytes([i % 251]) * payload, (p, sub, i)
        seqs[p].append(i)
    for p in producers:
        assert seqs[p] == list(range(count)), (
            f"producer {p}: {len(seqs[p])} records, first out of order at "
            f"{next((k for k, v in enumerate(seqs[p]) if k != v), None)}"
        )
    assert len(records) == count * len(producers)


async def assert_no_other_tasks(timeout: float = 5.0) -> None:
    """No task but the caller's is left; tasks that are just finishing get ``timeout``."""
    current = asyncio.current_task()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if not pending or loop.time() > deadline:
            break
        await asyncio.sleep(0.005)
    assert pending == [], pending


class Helpers:
    """The helpers above, for test modules (which cannot import this conftest)."""

    make_gate = staticmethod(make_gate)
    read_all = staticmethod(read_all)
    check_records = staticmethod(check_records)
    assert_no_other_tasks = staticmethod(assert_no_other_tasks)


@pytest.fixture
def net() -> type[Helpers]:
    return Helpers
