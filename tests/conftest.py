"""Shared fixtures: a leak-checked NetworkBufferPool, a partition manager, partitions.

Every test that moves data ends with its pools whole (available + in use == total, no local
pool left): the ``nbp`` fixture checks its pool at teardown, and the autouse
``_every_pool_whole`` checks every NetworkBufferPool the test created in this process (a
reader's, an in-process writer's) that is still alive. Every async test ends with no
asyncio task left pending besides its own. Daemon processes report their own pool at
SIGTERM (``pool_whole`` in their last line), which their tests check.

Real daemons, for every directory (helpers in ``tests/daemon/_daemon.py``):

* ``start_daemon(*flags)``: a running ``python -m server`` (``DaemonProcess``). At teardown
  every daemon still running gets SIGTERM and must exit 0 with its pool whole; every
  process is reaped and its spill directory removed.
* ``run_daemon_cli(args)``: ``python -m server ARGS`` expected to exit by itself.
* ``dm``: the ``_daemon`` module itself (``DaemonProcess``, ``child_env``, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import pytest_asyncio

from exchange.consumer import SingleInputGate
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from tests.kit.local_input_channel import LocalInputChannel
from tests.kit.modules import load_module

TESTS = Path(__file__).resolve().parent

# One module name wherever it is loaded (the conftests, tests/streaming/test_task_control.py).
_daemon: Any = load_module("exchange_tests_daemon_helpers", TESTS / "daemon" / "_daemon.py")

#: Segments and segment size of the ``nbp`` fixture.
NBP_SEGMENTS = 256
NBP_SEGMENT_SIZE = 4096

PartitionFactory = Callable[..., ResultPartition]
GateOpener = Callable[..., Awaitable[SingleInputGate]]


@pytest.fixture
def nbp() -> Iterator[NetworkBufferPool]:
    """A NetworkBufferPool(256, 4096) that must be whole again when the test ends."""
    pool = NetworkBufferPool(NBP_SEGMENTS, NBP_SEGMENT_SIZE)
    try:
        yield pool
        pool.check_consistency()
        assert pool.num_available + pool.num_in_use == pool.total_segments
        assert pool.is_whole(), (
            f"pool not whole at teardown: {pool.stats()}, local pools {pool.local_pools}"
        )
    finally:
        pool.destroy()


@pytest.fixture
def manager(nbp: NetworkBufferPool) -> Iterator[ResultPartitionManager]:
    """A ResultPartitionManager whose partitions are all released at teardown (before the
    pool's leak check, which is why it depends on ``nbp``)."""
    mgr = ResultPartitionManager()
    yield mgr
    mgr.release_all()


def as_partition_id(pid: ResultPartitionID | str | int) -> ResultPartitionID:
    if isinstance(pid, ResultPartitionID):
        return pid
    if isinstance(pid, int):
        return ResultPartitionID("ds", pid)
    return ResultPartitionID(pid, 0)


@pytest.fixture
def make_partition(
    nbp: NetworkBufferPool, manager: ResultPartitionManager, tmp_path: Path
) -> PartitionFactory:
    """``make_partition(pid, type, n, pool_size=None, spill_dir=tmp_path, *, kind="file",
    register=True)``: a ResultPartition with its own LocalBufferPool of ``nbp``.

    ``pid`` is a ResultPartitionID, a dataset name or a partition index; ``type`` a
    ResultPartitionType or its value. ``pool_size`` is ``(required, max)`` or a max (the
    required count is then ``min(n, max)``); by default ``(n, 2 n + 2)``. The partition is
    registered with ``manager`` unless ``register`` is false.
    """

    def make(
        pid: ResultPartitionID | str | int,
        type: ResultPartitionType | str,
        n: int,
        pool_size: int | tuple[int, int] | None = None,
        spill_dir: Path = tmp_path,
        *,
        kind: str = "file",
        register: bool = True,
    ) -> ResultPartition:
        ptype = type if isinstance(type, ResultPartitionType) else ResultPartitionType(type)
        if pool_size is None:
            required, maximum = n, 2 * n + 2
        elif isinstance(pool_size, tuple):
            required, maximum = pool_size
        else:
            required, maximum = min(n, pool_size), pool_size
        pool = nbp.create_buffer_pool(required, maximum)
        try:
            part = ResultPartition(
                as_partition_id(pid),
                ptype,
                n,
                pool,
                spill_dir=spill_dir,
                bounded_data_kind=kind,
            )
        except BaseException:
            pool.destroy()
            raise
        if register:
            manager.register_result_partition(part)
        return part

    return make


@pytest.fixture
def open_gate(manager: ResultPartitionManager) -> Iterator[GateOpener]:
    """``await open_gate([(pid, subpartition), ...], *, name="gate", request=True,
    backoff_initial=0.01, backoff_max=0.04)``: a SingleInputGate with one
    LocalInputChannel per pair (channel ``i`` reads pair ``i``), its partitions requested.
    Every gate is closed at teardown."""
    gates: list[SingleInputGate] = []

    async def open_(
        channels: Sequence[tuple[ResultPartitionID | str | int, int]],
        *,
        name: str = "gate",
        request: bool = True,
        backoff_initial: float = 0.01,
        backoff_max: float = 0.04,
    ) -> SingleInputGate:
        gate = SingleInputGate(name)
        gate.set_input_channels(
            [
                LocalInputChannel(
                    gate,
                    i,
                    manager,
                    as_partition_id(pid),
                    sub,
                    backoff_initial=backoff_initial,
                    backoff_max=backoff_max,
                )
                for i, (pid, sub) in enumerate(channels)
            ]
        )
        gates.append(gate)
        if request:
            await gate.request_partitions()
        return gate

    yield open_
    for gate in gates:
        gate.close()


# -- real daemons ---------------------------------------------------------------------------


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., Any]]:
    """``start_daemon(*flags)``: a running daemon, stopped and checked at teardown."""
    yield from _daemon.started_daemons()


@pytest.fixture
def run_daemon_cli() -> Callable[..., Any]:
    return _daemon.run_daemon_cli  # type: ignore[no-any-return]


@pytest.fixture
def dm() -> ModuleType:
    return _daemon


# -- no pool left broken, no task left behind --------------------------------------------


@pytest.fixture(autouse=True)
def _every_pool_whole(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every NetworkBufferPool created during the test and not destroyed is whole at its end."""
    created: list[NetworkBufferPool] = []
    original = NetworkBufferPool.__init__

    def recording_init(self: NetworkBufferPool, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        created.append(self)

    monkeypatch.setattr(NetworkBufferPool, "__init__", recording_init)
    yield
    broken = [p for p in created if not p.is_destroyed and not p.is_whole()]
    created.clear()
    assert not broken, f"network buffer pools not whole at the end of the test: {broken}"


@pytest_asyncio.fixture
async def _no_pending_tasks() -> AsyncIterator[None]:
    yield
    current = asyncio.current_task()
    for _ in range(3):  # let tasks that were just cancelled or completed settle
        await asyncio.sleep(0)
    pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    assert not pending, f"tasks left pending at the end of the test: {pending}"


@pytest.fixture(autouse=True)
def _check_no_pending_tasks(request: pytest.FixtureRequest) -> None:
    """Every ``@pytest.mark.asyncio`` test must leave no other task pending."""
    if request.node.get_closest_marker("asyncio") is not None:
        request.getfixturevalue("_no_pending_tasks")
