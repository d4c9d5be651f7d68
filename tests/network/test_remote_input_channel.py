"""RemoteInputChannel credit accounting against real pools, with a recording client double.

The ``Sender`` below plays the server: it keeps the credit the channel announced (initial
credit + AddCredits - data buffers sent), refuses to send without credit, and numbers
buffers. The key invariant of credit-based flow control, checked after every step of a
randomized run, is

    sender's credit + channel's unannounced credit == channel's free buffers

so the sender never sends a buffer the receiver has no room for, and no free buffer goes
unannounced for long.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import struct
from typing import Any

import pytest

from exchange.buffers.buffer import Buffer, DataType
from exchange.consumer.remote_input_channel import (
    AvailableBufferQueue,
    RemoteInputChannel,
)
from exchange.consumer.single_input_gate import BufferOrEvent, SingleInputGate
from exchange.errors import (
    CorruptRecordError,
    IllegalStateError,
    PartitionError,
    PartitionNotFoundError,
    ProtocolError,
    SequenceNumberError,
    TransportError,
    UsageError,
)
from exchange.events.events import (
    CheckpointBarrier,
    CheckpointOptions,
    EndOfPartitionEvent,
    EventSerializer,
)
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID

PID = ResultPartitionID("remote-test", 0)


class RecordingClient:
    """A PartitionRequestClient that records what the channel asks it to send."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.requests: list[RemoteInputChannel] = []
        self.credit_pending: list[RemoteInputChannel] = []
        self.add_credits: list[tuple[int, int]] = []
        self.resumed: list[int] = []
        self.buffer_sizes: list[tuple[int, int]] = []
        self.cancelled: list[int] = []

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        if channel.receiver_id < 0:
            channel.receiver_id = next(self._ids)
        self.requests.append(channel)

    def notify_credit_available(self, channel: RemoteInputChannel) -> None:
        self.credit_pending.append(channel)

    def flush_credits(self) -> dict[int, int]:
        """Write AddCredit for every channel that asked (what the handler does in call_soon)."""
        out: dict[int, int] = {}
        pending, self.credit_pending = self.credit_pending, []
        for ch in pending:
            credit = ch.get_and_reset_unannounced_credit()
            if credit > 0:
                self.add_credits.append((ch.receiver_id, credit))
                out[ch.receiver_id] = out.get(ch.receiver_id, 0) + credit
        return out

    def resume_consumption(self, channel: RemoteInputChannel) -> None:
        self.resumed.append(channel.receiver_id)

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None:
        self.buffer_sizes.append((channel.receiver_id, size))

    def cancel_request(self, channel: RemoteInputChannel) -> None:
        self.cancelled.append(channel.receiver_id)


class Provider:
    def __init__(self, client: RecordingClient) -> None:
        self.client = client

    async def create_partition_request_client(self, address: str) -> RecordingClient:
        return self.client


class Sender:
    """The server's side of one channel: credit, sequence numbers, backlog."""

    def __init__(self, channel: RemoteInputChannel, total: int) -> None:
        self.channel = channel
        self.credit = channel.initial_credit
        self.seq = 0
        self.sent = 0
        self.total = total

    def can_send(self) -> bool:
        return self.credit > 0 and self.sent < self.total

    def send_data(self) -> None:
        assert self.credit > 0, "the sender must not send without credit"
        buf = self.channel.request_buffer()
        assert buf is not None, "credit was announced but the channel has no free buffer"
        payload = struct.pack(">II", self.channel.channel_index, self.sent)
        buf.segment.view()[: len(payload)] = payload
        buf.set_size(len(payload))
        self.credit -= 1
        self.sent += 1
        self.deliver(buf)

    def send_end_of_partition(self) -> None:
        data = EventSerializer.to_bytes(EndOfPartitionEvent.INSTANCE)
        self.deliver(self.channel.receive_event(data, DataType.EVENT_BUFFER))

    def deliver(self, buf: Buffer) -> None:
        seq = self.seq
        self.seq += 1
        self.channel.on_buffer(buf, seq, self.total - self.sent)


def make_gate(
    nbp: NetworkBufferPool,
    n: int,
    client: RecordingClient,
    *,
    floating: int = 4,
    exclusive: int = 2,
    backoff: tuple[float, float] = (0.01, 0.04),
    floating_share: int = 0,
) -> tuple[SingleInputGate, list[RemoteInputChannel]]:
    gate = SingleInputGate("g", nbp.create_buffer_pool(0, floating))
    channels = [
        RemoteInputChannel(
            gate,
            i,
            ResultPartitionID("remote-test", i),
            0,
            client.address,
            Provider(client),
            nbp,
            num_exclusive=exclusive,
            backoff_initial=backoff[0],
            backoff_max=backoff[1],
            floating_share=floating_share,
        )
        for i in range(n)
    ]
    gate.set_input_channels(channels)
    return gate, channels


def check_credit_invariant(sender: Sender) -> None:
    ch = sender.channel
    assert sender.credit + ch.unannounced_credit == ch.num_available_buffers, (
        f"sender credit {sender.credit} + unannounced {ch.unannounced_credit} "
        f"!= free buffers {ch.num_available_buffers}"
    )


def test_num_exclusive_must_be_positive(nbp: NetworkBufferPool) -> None:
    gate = SingleInputGate("g")
    client = RecordingClient()
    with pytest.raises(UsageError):
        RemoteInputChannel(gate, 0, PID, 0, client.address, Provider(client), nbp, num_exclusive=0)


@pytest.mark.asyncio
async def test_request_takes_exclusive_buffers_as_initial_credit(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, exclusive=3)
    await gate.request_partitions()
    assert client.requests == [ch]
    assert ch.initial_credit == 3 and ch.num_available_buffers == 3
    assert nbp.num_required >= 3
    assert ch.unannounced_credit == 0  # the initial credit travels in the PartitionRequest
    await ch.request_subpartition()  # a second request is a no-op
    assert len(client.requests) == 1
    gate.close()
    assert client.cancelled == [ch.receiver_id]
    assert nbp.num_available == nbp.total_segments


@pytest.mark.asyncio
async def test_backlog_asks_for_floating_buffers_and_announces_them_once(
    nbp: NetworkBufferPool,
) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, floating=4, exclusive=2)
    await gate.request_partitions()
    sender = Sender(ch, total=10)
    sender.send_data()  # backlog 9: wants 9 + 2 buffers, the floating pool has 4
    assert ch.num_available_buffers == 1 + 4
    assert ch.unannounced_credit == 4
    assert client.credit_pending == [ch]  # 0 -> positive: one notification
    sender.send_data()  # the new floating buffers do not notify again
    assert client.credit_pending == [ch]
    assert client.flush_credits() == {ch.receiver_id: 4}
    sender.credit += 4
    check_credit_invariant(sender)
    gate.close()


async def _paced_reads(nbp: NetworkBufferPool, floating: int) -> list[int]:
    """One channel (2 exclusive buffers) whose reader keeps pace with its sender: one
    buffer sent, one read and released, credit flushed; the AddCredits it sent."""
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, floating=floating, exclusive=2)
    await gate.request_partitions()
    sender = Sender(ch, total=200)
    while sender.sent < sender.total:
        assert sender.can_send(), "the sender is stranded without credit"
        sender.send_data()
        boe = gate.poll_next()
        assert boe is not None and boe.buffer is not None
        boe.buffer.release()
        sender.credit += client.flush_credits().get(ch.receiver_id, 0)
        check_credit_invariant(sender)
    gate.close()
    return [credit for rid, credit in client.add_credits if rid == ch.receiver_id]


@pytest.mark.asyncio
async def test_a_large_window_announces_credit_in_halves_and_never_strands_the_sender(
    nbp: NetworkBufferPool,
) -> None:
    """32 buffers (HALVES_FROM and more free): the credit goes out once the sender holds
    no more than is unannounced, one AddCredit per half window, not one per buffer."""
    announcements = await _paced_reads(nbp, floating=30)
    assert announcements[0] >= 30  # the floating buffers the first backlog asked for
    assert set(announcements[1:-1]) == {16}, announcements
    assert len(announcements) <= 2 + 200 // 16, announcements


@pytest.mark.asyncio
async def test_a_window_of_flinks_defaults_announces_every_credit_at_once(
    nbp: NetworkBufferPool,
) -> None:
    """2 exclusive + 8 floating buffers (fewer than HALVES_FROM free): as Flink, each
    credit gained goes out with the next flush."""
    announcements = await _paced_reads(nbp, floating=8)
    assert announcements[0] >= 8
    assert set(announcements[1:]) == {1}, announcements


async def _producer_bound_reads(nbp: NetworkBufferPool, floating_share: int) -> list[int]:
    """One channel (2 exclusive + 30 floating buffers) whose producer is the bottleneck:
    the daemon's queue is empty (backlog 0 with every buffer); the sender sends what its
    credit allows, up to a burst of 8, the task takes the burst and gives it back at once,
    then credit is flushed (``PartitionReader``'s give-back). The AddCredits it sent."""
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, floating=30, exclusive=2, floating_share=floating_share)
    await gate.request_partitions()
    sender = Sender(ch, total=400)
    sender.deliver = lambda buf: _deliver_backlog_0(sender, buf)  # type: ignore[method-assign]
    while sender.sent < sender.total:
        assert sender.can_send(), "the sender is stranded without credit"
        burst = 0
        while sender.can_send() and burst < 8:
            sender.send_data()
            burst += 1
        while (boe := gate.poll_next()) is not None:
            assert boe.buffer is not None
            boe.buffer.release()
        sender.credit += client.flush_credits().get(ch.receiver_id, 0)
        check_credit_invariant(sender)
    gate.close()
    assert nbp.num_available == nbp.total_segments
    return [credit for rid, credit in client.add_credits if rid == ch.receiver_id]


def _deliver_backlog_0(sender: Sender, buf: Buffer) -> None:
    seq = sender.seq
    sender.seq += 1
    sender.channel.on_buffer(buf, seq, 0)


@pytest.mark.asyncio
async def test_a_floating_share_keeps_a_producer_bound_window_announced_in_halves(
    nbp: NetworkBufferPool,
) -> None:
    """Backlog 0 with every buffer: by Flink's rule (no share) the channel keeps only its
    2 exclusive buffers, so every give-back is an AddCredit of 2 and the sender moves 2
    buffers per round; with its share of the floating pool (30) it keeps 32 free buffers,
    announced in halves: bursts of 8 and a fraction of the AddCredits."""
    flink = await _producer_bound_reads(nbp, 0)
    assert set(flink) == {2} and len(flink) >= 400 // 2 - 1, flink
    shared = await _producer_bound_reads(nbp, 30)
    assert shared[0] >= 30  # the share, asked for with the first buffer
    assert all(credit >= 16 for credit in shared[1:-1]), shared
    assert len(shared) <= 2 + 400 // 16, shared


def test_floating_share_must_not_be_negative(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    with pytest.raises(UsageError):
        RemoteInputChannel(
            SingleInputGate("g"),
            0,
            PID,
            0,
            client.address,
            Provider(client),
            nbp,
            floating_share=-1,
        )


@pytest.mark.asyncio
async def test_returning_exclusive_buffer_gives_a_floating_one_back(
    nbp: NetworkBufferPool,
) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, floating=4, exclusive=2)
    pool = gate.buffer_pool
    assert pool is not None
    await gate.request_partitions()
    sender = Sender(ch, total=4)
    sender.send_data()  # takes an exclusive buffer; backlog 3 -> 4 floating requested
    sender.credit += client.flush_credits()[ch.receiver_id]
    check_credit_invariant(sender)
    sender.total = sender.sent + 1  # the producer has one more buffer: backlog 0 next
    sender.send_data()  # takes a floating buffer; backlog 0 -> needs 2 buffers
    check_credit_invariant(sender)
    assert len(ch._queue.floating) == 3 and len(ch._queue.exclusive) == 1
    in_pool = pool.num_available

    first = gate.poll_next()
    assert first is not None and first.buffer is not None
    first.buffer.release()  # an exclusive buffer comes back: a floating one is returned
    assert pool.num_available == in_pool + 1
    assert ch.unannounced_credit == 0  # net gain zero: nothing to announce
    check_credit_invariant(sender)
    second = gate.poll_next()
    assert second is not None and second.buffer is not None
    second.buffer.release()  # a floating buffer goes back to the gate's pool
    check_credit_invariant(sender)
    gate.close()


@pytest.mark.asyncio
async def test_channel_waits_for_floating_buffers_as_a_listener(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, (a, b) = make_gate(nbp, 2, client, floating=2, exclusive=1)
    await gate.request_partitions()
    sa, sb = Sender(a, total=3), Sender(b, total=5)
    sa.send_data()  # backlog 2: a wants 3 buffers, takes both floating ones and waits
    assert a.unannounced_credit == 2
    sb.send_data()  # backlog 4, but the pool is empty: b waits as a listener too
    assert b.unannounced_credit == 0 and b.num_available_buffers == 0
    sa.credit += client.flush_credits()[a.receiver_id]
    sa.send_data()
    sa.send_data()  # backlog 0: a needs only its exclusive buffer from now on
    check_credit_invariant(sa)
    got: dict[int, list[Buffer]] = {0: [], 1: []}
    while (boe := gate.poll_next()) is not None:
        assert boe.buffer is not None
        got[boe.channel_index].append(boe.buffer)
    assert len(got[0]) == 3 and len(got[1]) == 1
    # First a's exclusive buffer comes back to a; then its floating ones are offered to
    # the listeners: a needs none, so b gets them.
    for buf in got[0]:
        buf.release()
    assert b.unannounced_credit == 2
    assert b in client.credit_pending
    credits = client.flush_credits()
    sa.credit += credits.get(a.receiver_id, 0)
    sb.credit += credits.get(b.receiver_id, 0)
    check_credit_invariant(sa)
    check_credit_invariant(sb)
    got[1][0].release()
    gate.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(6))
async def test_randomized_credit_invariant_and_order(nbp: NetworkBufferPool, seed: int) -> None:
    """Random interleavings of sending, announcing, reading and releasing."""
    rng = random.Random(seed)
    client = RecordingClient()
    n = 3
    floating = rng.randint(1, 5)
    exclusive = rng.randint(1, 3)
    gate, channels = make_gate(nbp, n, client, floating=floating, exclusive=exclusive)
    await gate.request_partitions()
    senders = [Sender(ch, total=rng.randint(20, 60)) for ch in channels]
    held: list[Buffer] = []
    seen: dict[int, list[int]] = {i: [] for i in range(n)}
    ended = [False] * n

    for _ in range(20_000):
        if gate.is_finished:
            break
        op = rng.random()
        if op < 0.35:
            s = rng.choice(senders)
            if s.can_send():
                s.send_data()
            elif s.sent == s.total and not ended[s.channel.channel_index]:
                ended[s.channel.channel_index] = True
                s.send_end_of_partition()
        elif op < 0.5:
            for rid, credit in client.flush_credits().items():
                senders[rid - 1].credit += credit
        elif op < 0.8:
            boe = gate.poll_next()
            if boe is not None and boe.buffer is not None:
                ch_index, seq = struct.unpack(">II", boe.buffer.memoryview())
                assert ch_index == boe.channel_index
                seen[ch_index].append(seq)
                held.append(boe.buffer)
        elif held:
            held.pop(rng.randrange(len(held))).release()
        for s in senders:
            if not s.channel.is_released:
                check_credit_invariant(s)
        # Bounded memory: the channels never own more than their exclusive buffers plus
        # the gate's floating ones (queued EndOfPartition events are unpooled).
        owned = len(held) + sum(
            ch.num_available_buffers + ch.num_queued_buffers - ended[i]
            for i, ch in enumerate(channels)
            if not ch.is_released
        )
        assert owned <= n * exclusive + floating
    assert gate.is_finished, "the run did not finish: credit was lost somewhere"
    for i, s in enumerate(senders):
        assert seen[i] == list(range(s.total))
    for buf in held:
        buf.release()
    gate.close()
    assert sorted(client.cancelled) == [1, 2, 3]


@pytest.mark.asyncio
async def test_sequence_gap_fails_the_channel(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    sender = Sender(ch, total=5)
    sender.send_data()
    sender.seq += 1  # buffer 1 is lost on the way
    sender.send_data()
    # The error wins over data still queued (Flink's checkError comes first).
    with pytest.raises(SequenceNumberError) as info:
        gate.poll_next()
    assert (info.value.received, info.value.expected) == (2, 1)
    assert info.value.receiver_id == ch.receiver_id
    gate.close()


@pytest.mark.asyncio
async def test_a_sequence_gap_fails_its_channel_only(nbp: NetworkBufferPool) -> None:
    """Sequence numbers count per receiver: a gap is the peer's fault, but the error is
    per channel (a PartitionError naming the partition), and the connection's other
    channel goes on receiving."""
    client = RecordingClient()
    gate, [ch0, ch1] = make_gate(nbp, 2, client)
    await gate.request_partitions()
    s0, s1 = Sender(ch0, total=3), Sender(ch1, total=3)
    s0.send_data()
    s0.seq += 1  # buffer 1 of channel 0 is lost
    s0.send_data()
    s1.send_data()
    s1.send_data()
    with pytest.raises(SequenceNumberError) as info:
        ch0.get_next_buffer()
    err = info.value
    assert isinstance(err, PartitionError) and not isinstance(err, ProtocolError)
    assert (err.partition_id, err.address) == (ch0.partition_id, client.address)
    for expected in (0, 1):
        got = ch1.get_next_buffer()
        assert got is not None
        payload = bytes(got.buffer.memoryview()[:8])
        got.buffer.release()
        assert struct.unpack(">II", payload) == (1, expected)
    gate.close()


@pytest.mark.asyncio
async def test_repeated_sequence_number_fails_the_channel(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    sender = Sender(ch, total=5)
    sender.send_data()
    sender.seq -= 1  # buffer 0 again
    sender.send_data()
    with pytest.raises(SequenceNumberError):
        gate.poll_next()
    gate.close()


@pytest.mark.asyncio
async def test_buffers_after_release_are_recycled(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    sender = Sender(ch, total=5)
    sender.send_data()
    boe = gate.poll_next()
    assert boe is not None and boe.buffer is not None
    late = ch.request_buffer()
    assert late is not None
    gate.close()  # the channel goes away while the reader holds one buffer ...
    late.set_size(0)
    ch.on_buffer(late, 1, 0)  # ... and one more arrives: both go back to the pool
    boe.buffer.release()
    with pytest.raises(IllegalStateError):
        await ch.request_subpartition()


@pytest.mark.asyncio
async def test_partition_not_found_retries_with_backoff_then_fails(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, backoff=(0.01, 0.04))
    await gate.request_partitions()
    loop = asyncio.get_running_loop()
    start = loop.time()
    retries = 0
    while ch.on_partition_not_found():  # the server answered PARTITION_NOT_FOUND
        retries += 1
        before = len(client.requests)
        async with asyncio.timeout(2):
            while len(client.requests) == before:
                await asyncio.sleep(0.002)
    # Delays 0.01, 0.02, 0.04 (doubling to the max), then the channel gives up.
    assert retries == 3
    assert len(client.requests) == 4
    assert loop.time() - start >= 0.01 + 0.02 + 0.04
    with pytest.raises(PartitionNotFoundError):
        await asyncio.wait_for(gate.get_next(), 10)
    gate.close()


@pytest.mark.asyncio
async def test_partition_found_on_retry(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, backoff=(0.005, 0.1))
    await gate.request_partitions()
    assert ch.on_partition_not_found()
    async with asyncio.timeout(2):
        while len(client.requests) < 2:
            await asyncio.sleep(0.002)
    sender = Sender(ch, total=1)
    sender.send_data()
    sender.send_end_of_partition()
    boe = await asyncio.wait_for(gate.get_next(), 10)
    assert boe is not None and boe.buffer is not None
    boe.buffer.release()
    assert await asyncio.wait_for(gate.get_next(), 10) is not None  # EndOfPartition
    assert await asyncio.wait_for(gate.get_next(), 10) is None
    gate.close()


@pytest.mark.asyncio
async def test_no_retry_after_release(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, backoff=(0.005, 0.1))
    await gate.request_partitions()
    assert ch.on_partition_not_found()
    gate.close()
    await asyncio.sleep(0.02)
    assert len(client.requests) == 1


@pytest.mark.asyncio
async def test_resume_and_buffer_size_go_to_the_client(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    ch.resume_consumption()
    ch.notify_new_buffer_size(1024)
    assert client.resumed == [ch.receiver_id]
    assert client.buffer_sizes == [(ch.receiver_id, 1024)]
    gate.close()
    ch.notify_new_buffer_size(512)  # ignored once released
    assert len(client.buffer_sizes) == 1
    with pytest.raises(IllegalStateError):
        ch.resume_consumption()


def test_available_buffer_queue_hands_out_floating_first(nbp: NetworkBufferPool) -> None:
    pool = nbp.create_buffer_pool(0, 4)
    q = AvailableBufferQueue()
    excl_segments = nbp.request_memory_segments_nowait(2)
    recycled: list[object] = []

    class Recycler:
        def recycle(self, segment: object) -> None:
            recycled.append(segment)

    e1, e2 = (Buffer(s, Recycler()) for s in excl_segments)
    f1 = pool.request_buffer()
    assert f1 is not None
    q.exclusive.append(e1)
    q.add_floating(f1)
    assert len(q) == 2
    assert q.take() is f1
    f1.release()
    f2 = pool.request_buffer()
    assert f2 is not None
    q.add_floating(f2)
    assert q.add_exclusive(e2, num_required=1) == 0  # over what is needed: f2 returned
    assert len(q) == 2 and pool.num_available == 1
    assert q.take() is e1 and q.take() is e2 and q.take() is None
    nbp.recycle_memory_segments(excl_segments)
    pool.destroy()


@pytest.mark.asyncio
async def test_retry_on_a_dead_connection_fails_the_channel(nbp: NetworkBufferPool) -> None:
    """The connection died during the backoff: the retry must fail the channel, not the
    event loop's exception handler."""
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, backoff=(0.005, 0.1))
    await gate.request_partitions()
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))

    def dead(channel: RemoteInputChannel) -> None:
        raise TransportError("connection to daemon 127.0.0.1:1 is closed")

    client.request_subpartition = dead  # type: ignore[method-assign]
    try:
        assert ch.on_partition_not_found()
        with pytest.raises(TransportError):
            await asyncio.wait_for(gate.get_next(), 10)
    finally:
        loop.set_exception_handler(None)
        gate.close()
    assert unhandled == []


def _barrier_buffer(ch: RemoteInputChannel, checkpoint_id: int) -> Buffer:
    barrier = CheckpointBarrier(checkpoint_id, 0, CheckpointOptions(unaligned=True))
    data = EventSerializer.to_bytes(barrier)
    return ch.receive_event(data, DataType.PRIORITIZED_EVENT_BUFFER)


def _item(boe: BufferOrEvent) -> tuple[int, object, tuple[int, ...]]:
    """(channel, data tag or event, overtaken_by) of what the gate returned (released)."""
    if boe.buffer is None:
        return boe.channel_index, boe.event, boe.overtaken_by
    tag = struct.unpack(">II", boe.buffer.to_bytes())[1]
    boe.buffer.release()
    return boe.channel_index, tag, boe.overtaken_by


def _taken(gate: SingleInputGate) -> list[tuple[int, object, tuple[int, ...]]]:
    """(channel, data tag or event, overtaken_by) of everything the gate returns now."""
    out: list[tuple[int, object, tuple[int, ...]]] = []
    while (boe := gate.poll_next()) is not None:
        out.append(_item(boe))
    return out


@pytest.mark.asyncio
async def test_priority_barrier_overtakes_received_buffers_and_flags_them(
    nbp: NetworkBufferPool,
) -> None:
    """Flink's RemoteInputChannelTest#testPriorityEvent... : the barrier goes ahead of the
    buffers received and not taken; those come after it, flagged as its channel state."""
    client = RecordingClient()
    gate, [ch0, ch1] = make_gate(nbp, 2, client, floating=8, exclusive=4)
    await gate.request_partitions()
    s0, s1 = Sender(ch0, total=10), Sender(ch1, total=10)
    s1.send_data()  # channel 1 is queued first in the gate
    for _ in range(3):
        s0.send_data()
    first = gate.poll_next()  # channel 1's buffer 0
    assert first is not None and first.channel_index == 1 and first.buffer is not None
    first.buffer.release()
    s1.send_data()
    taken = _taken_one(gate)  # channel 0's buffer 0: taken before the barrier, not state
    assert taken == (0, 0, ())
    s0.deliver(_barrier_buffer(ch0, 7))  # overtakes channel 0's buffers 1 and 2
    s0.send_data()  # arrives after the barrier: not overtaken
    barrier = CheckpointBarrier(7, 0, CheckpointOptions(unaligned=True))
    assert ch0.has_priority_event
    assert _taken(gate) == [
        (0, barrier, ()),  # ahead of channel 1's queued buffer too
        (1, 1, ()),
        (0, 1, (7,)),
        (0, 2, (7,)),
        (0, 3, ()),
    ]
    gate.close()
    assert nbp.num_available == nbp.total_segments


def _taken_one(gate: SingleInputGate) -> tuple[int, object, tuple[int, ...]]:
    boe = gate.poll_next()
    assert boe is not None and boe.buffer is not None
    return _item(boe)


@pytest.mark.asyncio
@pytest.mark.parametrize("take", ["poll_next", "poll_data_first"])
async def test_nested_priority_barriers_flag_buffers_with_every_checkpoint(
    nbp: NetworkBufferPool, take: str
) -> None:
    """Also through the reader pump's batch path: ``poll_data`` takes nothing behind a
    priority barrier, the barriers and the buffers they overtook (flagged) come from
    ``poll_next`` in the same order."""
    taken = _taken if take == "poll_next" else _taken_batched
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client, floating=8, exclusive=6)
    await gate.request_partitions()
    s = Sender(ch, total=10)
    s.send_data()
    s.send_data()
    s.deliver(_barrier_buffer(ch, 1))  # overtakes 0, 1
    s.send_data()
    s.deliver(_barrier_buffer(ch, 2))  # overtakes 0, 1, 2 (behind barrier 1)
    b1 = CheckpointBarrier(1, 0, CheckpointOptions(unaligned=True))
    b2 = CheckpointBarrier(2, 0, CheckpointOptions(unaligned=True))
    assert taken(gate) == [(0, b1, ()), (0, b2, ()), (0, 0, (1, 2)), (0, 1, (1, 2)), (0, 2, (2,))]
    s.send_data()
    assert taken(gate) == [(0, 3, ())]
    gate.close()


@pytest.mark.asyncio
async def test_malformed_priority_event_fails_the_channel(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    s = Sender(ch, total=3)
    data = EventSerializer.to_bytes(EndOfPartitionEvent.INSTANCE)
    s.deliver(ch.receive_event(data, DataType.PRIORITIZED_EVENT_BUFFER))
    with pytest.raises(CorruptRecordError):
        gate.poll_next()
    gate.close()


def _taken_batched(gate: SingleInputGate) -> list[tuple[int, object, tuple[int, ...]]]:
    """``_taken`` through the reader pump's path: ``poll_data`` (data buffers of a
    channel at once) first, ``poll_next`` for what it leaves."""
    out: list[tuple[int, object, tuple[int, ...]]] = []
    while True:
        data = gate.poll_data(64)
        if data is not None:
            index, buffers = data
            assert buffers, "poll_data returns None, never an empty batch"
            for buf in buffers:
                out.append((index, struct.unpack(">II", buf.to_bytes())[1], ()))
                buf.release()
            continue
        boe = gate.poll_next()
        if boe is None:
            return out
        out.append(_item(boe))


@pytest.mark.asyncio
async def test_poll_data_takes_a_channels_buffers_at_once_in_order(
    nbp: NetworkBufferPool,
) -> None:
    """The pump's batch path: every data buffer at the head of a channel in one call, up
    to the limit, round robin over the channels, stopping at an event (which poll_next
    returns), each buffer exactly once."""
    client = RecordingClient()
    gate, [ch0, ch1] = make_gate(nbp, 2, client, floating=8, exclusive=4)
    await gate.request_partitions()
    s0, s1 = Sender(ch0, total=10), Sender(ch1, total=10)
    for _ in range(3):
        s0.send_data()
    s1.send_data()
    got = gate.poll_data(2)  # the limit: channel 0 keeps its third buffer, goes last
    assert got is not None and got[0] == 0 and len(got[1]) == 2
    for buf in got[1]:
        buf.release()
    s0.send_end_of_partition()
    assert _taken_batched(gate) == [
        (1, 0, ()),
        (0, 2, ()),
        (0, EndOfPartitionEvent.INSTANCE, ()),  # not a data buffer: poll_next's
    ]
    assert gate.poll_data(64) is None and gate.poll_next() is None
    gate.close()
    assert nbp.num_available == nbp.total_segments


@pytest.mark.asyncio
async def test_poll_data_raises_the_channels_error(nbp: NetworkBufferPool) -> None:
    client = RecordingClient()
    gate, [ch] = make_gate(nbp, 1, client)
    await gate.request_partitions()
    s = Sender(ch, total=3)
    s.send_data()
    ch.set_error(TransportError("connection to daemon 127.0.0.1:1 lost"))
    with pytest.raises(TransportError):
        gate.poll_data(64)
    gate.close()
