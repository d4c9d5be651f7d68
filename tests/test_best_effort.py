"""exchange/best_effort.py: secondary steps of close paths are logged, and only Exceptions
are dropped: KeyboardInterrupt, SystemExit and the caller's cancellation propagate."""

from __future__ import annotations

import asyncio
import logging

import pytest

from exchange.best_effort import best_effort, cancel_and_wait, wait_quietly

log = logging.getLogger("exchange.test.best_effort")


def test_an_exception_is_logged_with_the_callers_logger_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    ran_after = False
    with best_effort(log, "closing the thing", logging.WARNING):
        raise OSError("already gone")
    ran_after = True
    assert ran_after
    [rec] = [r for r in caplog.records if r.name == log.name]
    assert rec.levelno == logging.WARNING and rec.getMessage() == "closing the thing failed"
    assert rec.exc_info is not None and isinstance(rec.exc_info[1], OSError)


def test_a_step_that_succeeds_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    with best_effort(log, "closing"):
        pass
    assert [r for r in caplog.records if r.name == log.name] == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3), asyncio.CancelledError()])
def test_base_exceptions_propagate(exc: BaseException) -> None:
    with pytest.raises(type(exc)), best_effort(log, "closing"):
        raise exc


@pytest.mark.asyncio
async def test_cancel_and_wait_ends_the_task_and_logs_its_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    started = asyncio.Event()

    async def fails_on_cancel() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup bug")

    task = asyncio.create_task(fails_on_cancel())
    await started.wait()
    await cancel_and_wait(task, log, "helper")
    assert task.done()
    [rec] = [r for r in caplog.records if r.name == log.name]
    assert rec.getMessage() == "helper ended with an error"
    await cancel_and_wait(None, log, "nothing")  # no task: nothing to do


@pytest.mark.asyncio
async def test_the_callers_cancellation_is_not_swallowed() -> None:
    """The closer is cancelled while it waits for a task that takes its time to stop:
    the closer's CancelledError must reach it (``suppress(BaseException)`` ate it)."""
    stopping = asyncio.Event()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()  # still cleaning up
            raise

    helper = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    closer_reached_end = False

    async def closer() -> None:
        nonlocal closer_reached_end
        await cancel_and_wait(helper, log, "helper")
        closer_reached_end = True

    closing = asyncio.create_task(closer())
    await stopping.wait()
    closing.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not closer_reached_end
    assert helper.done()


@pytest.mark.asyncio
async def test_wait_quietly_accepts_a_future_cancelled_elsewhere() -> None:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.cancel()
    await wait_quietly(fut, log, "pump")  # its own cancellation is the expected outcome
