"""client.channel: the bounded cross-thread channel (batches in, everything out).

No sockets: two threads, or a thread and an event loop, on one channel."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from client.channel import (
    Channel,
    ChannelBrokenError,
    ChannelClosedError,
    ChannelFullError,
    ChannelTimeoutError,
    EndOfChannel,
)
from exchange.errors import IllegalStateError, UsageError
from tests.kit.polling import wait_for

DEADLINE = 30.0


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; its result or exception lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _joined(t: threading.Thread, out: list[Any]) -> Any:
    t.join(DEADLINE)
    assert not t.is_alive() and len(out) == 1
    return out[0]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(UsageError):
        Channel(0)


def test_a_batch_get_returns_everything_queued_in_order() -> None:
    ch: Channel[int] = Channel(10)
    ch.send([1, 2])
    ch.send_nowait([3])
    assert ch.queued() == [1, 2, 3]  # a copy: they stay queued
    assert ch.receive() == [1, 2, 3]
    assert ch.receive_nowait() == [] and ch.queued() == []
    s = ch.statistics()
    assert (s.items_sent, s.items_received, s.batches_sent, s.batches_received) == (3, 3, 2, 1)
    assert s.wakeups == 0  # nobody ever waited: no wake-up


def test_bounded_capacity_blocks_the_sender_until_the_receiver_takes() -> None:
    ch: Channel[int] = Channel(4)
    ch.send([1, 2, 3])
    with pytest.raises(ChannelFullError):
        ch.send_nowait([4, 5])
    with pytest.raises(ChannelTimeoutError):
        ch.send([4, 5], timeout=0.05)
    t, out = _in_thread(lambda: ch.send([4, 5]))
    wait_for(lambda: ch.statistics().senders_waiting == 1, DEADLINE, "the sender waits")
    assert ch.statistics().items_queued == 3  # it did not get in
    assert ch.receive() == [1, 2, 3]
    assert _joined(t, out) is False
    assert ch.receive() == [4, 5]
    assert ch.statistics().wakeups >= 1


def test_a_batch_larger_than_the_capacity_enters_an_empty_channel_alone() -> None:
    ch: Channel[int] = Channel(2)
    ch.send(list(range(5)))
    with pytest.raises(ChannelFullError):
        ch.send_nowait([9])
    ch.send_nowait([9], force=True)  # what is not back-pressured (events)
    assert ch.receive() == [0, 1, 2, 3, 4, 9]


def test_one_wake_up_for_a_batch_however_many_items() -> None:
    ch: Channel[int] = Channel(1000)
    t, out = _in_thread(ch.receive)
    wait_for(lambda: ch.statistics().receivers_waiting == 1, DEADLINE, "the receiver waits")
    ch.send(list(range(100)))
    assert _joined(t, out) == list(range(100))
    assert ch.statistics().wakeups == 1


def test_sender_closed_the_receiver_drains_then_gets_the_end() -> None:
    ch: Channel[int] = Channel(10)
    ch.send([1, 2])
    ch.close_sender()
    ch.close_sender()  # idempotent
    with pytest.raises(ChannelClosedError):
        ch.send([3])
    assert ch.receive() == [1, 2]
    with pytest.raises(EndOfChannel):
        ch.receive()
    with pytest.raises(EndOfChannel):
        ch.receive_nowait()
    s = ch.statistics()
    assert not s.sender_open and s.receiver_open


def test_receiver_closed_the_sender_gets_a_typed_error_and_the_items_come_back() -> None:
    ch: Channel[int] = Channel(2)
    ch.send([1, 2])
    t, out = _in_thread(lambda: ch.send([3]))
    wait_for(lambda: ch.statistics().senders_waiting == 1, DEADLINE, "the sender waits")
    assert ch.close_receiver() == [1, 2]  # never received: the owner releases them
    assert ch.close_receiver() == []
    assert isinstance(_joined(t, out), ChannelBrokenError)
    with pytest.raises(ChannelBrokenError):
        ch.send_nowait([4])
    with pytest.raises(ChannelClosedError):
        ch.receive()


@pytest.mark.parametrize(
    ("close", "error"), [("close_sender", EndOfChannel), ("close_receiver", ChannelClosedError)]
)
def test_either_side_closed_from_another_thread_wakes_the_waiting_receiver(
    close: str, error: type[Exception]
) -> None:
    ch: Channel[int] = Channel(2)
    t, out = _in_thread(ch.receive)
    wait_for(lambda: ch.statistics().receivers_waiting == 1, DEADLINE, "the receiver waits")
    getattr(ch, close)()
    assert isinstance(_joined(t, out), error)


def test_receive_times_out() -> None:
    ch: Channel[int] = Channel(2)
    with pytest.raises(ChannelTimeoutError):
        ch.receive(timeout=0.05)
    assert ch.statistics().receivers_waiting == 0


def test_poll_arms_notify_once_for_the_next_send_or_close() -> None:
    ch: Channel[int] = Channel(4)
    calls: list[int] = []
    assert ch.poll(lambda: calls.append(1)) is None
    assert ch.statistics().receivers_waiting == 1
    ch.send([7])
    ch.send([8])
    assert calls == [1]  # once
    assert ch.poll(lambda: calls.append(2)) == [7, 8]
    assert ch.poll(lambda: calls.append(3)) is None
    ch.close_receiver()
    assert calls == [1, 3]


def test_starved_hook_once_until_the_next_send_which_reports_it() -> None:
    ch: Channel[int] = Channel(4)
    starved: list[int] = []
    ch.on_starved = lambda: starved.append(1)
    assert ch.receive_nowait() == []
    assert ch.receive_nowait() == []
    assert starved == [1] and ch.receiver_starved
    assert ch.send([1]) is True  # it fed a starved receiver
    assert ch.send([2]) is False
    assert ch.receive() == [1, 2]


def test_capacity_grown_lets_a_waiting_sender_in() -> None:
    ch: Channel[int] = Channel(1)
    ch.send([1])
    t, out = _in_thread(lambda: ch.send([2]))
    wait_for(lambda: ch.statistics().senders_waiting == 1, DEADLINE, "the sender waits")
    ch.set_capacity(2)
    assert _joined(t, out) is False
    assert ch.receive() == [1, 2]


@pytest.mark.asyncio
async def test_asyncio_ends_against_a_thread_and_cancellation_leaves_it_unchanged() -> None:
    ch: Channel[int] = Channel(2)
    # an asyncio receiver woken by a thread's send (one thread-safe wake-up)
    recv = asyncio.ensure_future(ch.areceive())
    while ch.statistics().receivers_waiting == 0:
        await asyncio.sleep(0.001)
    t, out = _in_thread(lambda: ch.send([1, 2]))
    assert await asyncio.wait_for(recv, DEADLINE) == [1, 2]
    assert _joined(t, out) is True  # it fed a receiver that had found nothing
    # an asyncio sender waiting for room, cancelled: nothing sent
    await ch.asend([3, 4])
    send = asyncio.ensure_future(ch.asend([5]))
    while ch.statistics().senders_waiting == 0:
        await asyncio.sleep(0.001)
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    s = ch.statistics()
    assert s.senders_waiting == 0 and s.items_queued == 2
    # a cancelled receive takes nothing
    assert await ch.areceive() == [3, 4]
    recv = asyncio.ensure_future(ch.areceive())
    await asyncio.sleep(0)
    recv.cancel()
    with pytest.raises(asyncio.CancelledError):
        await recv
    ch.send_nowait([6])
    assert ch.receive_nowait() == [6]
    # the receiver closed: a waiting asyncio sender gets the typed error
    await ch.asend([7, 8])
    send = asyncio.ensure_future(ch.asend([9]))
    while ch.statistics().senders_waiting == 0:
        await asyncio.sleep(0.001)
    _, _ = _in_thread(ch.close_receiver)
    with pytest.raises(ChannelBrokenError):
        await asyncio.wait_for(send, DEADLINE)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_item_lost_or_reordered_under_concurrent_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    ch: Channel[int] = Channel(rng.randint(1, 50))
    batches: list[list[int]] = []
    n = 0
    for _ in range(2000):
        size = rng.randint(1, 60)
        batches.append(list(range(n, n + size)))
        n += size

    def produce() -> None:
        for b in batches:
            if rng.random() < 0.1:
                ch.send_nowait(b, force=True)
            else:
                ch.send(b, timeout=DEADLINE)
        ch.close_sender()

    def consume() -> list[int]:
        got: list[int] = []
        while True:
            try:
                got.extend(ch.receive(timeout=DEADLINE))
            except EndOfChannel:
                return got

    tp, outp = _in_thread(produce)
    tc, outc = _in_thread(consume)
    assert _joined(tp, outp) is None
    assert _joined(tc, outc) == list(range(n))
    s = ch.statistics()
    assert s.items_sent == s.items_received == n
    assert s.batches_received <= s.batches_sent
    assert s.senders_waiting == s.receivers_waiting == 0


def test_room_waited_for_by_a_thread_and_by_a_notify_without_sending() -> None:
    ch: Channel[int] = Channel(2)
    ch.send_nowait([1, 2, 3], force=True)  # over the capacity: room is waited for
    calls: list[int] = []
    assert ch.poll_room(1, lambda: calls.append(1)) is False
    t, out = _in_thread(lambda: ch.wait_room(0))
    wait_for(lambda: ch.statistics().senders_waiting == 2, DEADLINE, "both wait for room")
    assert ch.receive() == [1, 2, 3]
    assert _joined(t, out) is None
    assert calls == [1]
    assert ch.poll_room(2, lambda: calls.append(2)) is True
    ch.send_nowait([4, 5])
    assert ch.poll_room(1, lambda: calls.append(3)) is False
    ch.close_receiver()  # room never comes: the notify still fires, the wait raises
    assert calls == [1, 3]
    with pytest.raises(ChannelBrokenError):
        ch.wait_room(0)


@pytest.mark.asyncio
async def test_items_received_held_keep_their_room_until_released() -> None:
    """``areceive(hold=True)``: the bound is on the items in flight (the writer's window:
    batches its sender took keep their room until they reached the daemon), so a sender
    can not queue a second ``capacity`` while the receiver works on the first."""
    ch: Channel[int] = Channel(2)
    ch.send([1, 2])
    assert await ch.areceive(hold=True) == [1, 2]
    s = ch.statistics()
    assert (s.items_queued, s.items_held) == (0, 2)
    # nothing queued, yet no room: the held items fill the capacity
    with pytest.raises(ChannelFullError):
        ch.send_nowait([3])
    assert ch.poll_room(1, lambda: None) is False
    t, out = _in_thread(lambda: ch.send([3]))
    wait_for(lambda: ch.statistics().senders_waiting == 2, DEADLINE, "the sender waits")
    assert ch.statistics().items_queued == 0  # it did not get in
    ch.release(1)  # room for one: the waiting send gets in
    assert _joined(t, out) is False
    assert ch.statistics()[:2] == (1, 2) and ch.statistics().items_held == 1
    with pytest.raises(IllegalStateError):
        ch.release(2)  # more than held
    ch.release(1)
    assert await ch.areceive() == [3]  # without hold: the room comes back at once
    assert ch.statistics().items_held == 0
    ch.send_nowait([4, 5])
