"""SegmentPins: shared segments of a consumer connection the daemon dropped stay out of the
pool until the consumer's process exits (a pidfd watched by the event loop), and where
that process cannot be watched, until the daemon stops. Real processes, real pidfds;
every pool whole and every pidfd closed at the end."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from exchange.buffers.buffer import Buffer
from exchange.memory.network_buffer_pool import NetworkBufferPool
from server.segment_pins import PeerProcess, SegmentPins, peer_process, process_start_time
from tests.kit.pidfds import pidfds
from tests.kit.polling import wait_until

pytestmark = pytest.mark.timeout(60)


def take(nbp: NetworkBufferPool, n: int) -> list[Buffer]:
    """``n`` buffers of ``nbp``, as a connection holds them (released: back to ``nbp``)."""
    segments = nbp.request_memory_segments_nowait(n)
    return [Buffer(seg, nbp, seg.size) for seg in segments]


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that only waits (a consumer task stalled in its own code)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        assert proc.stdin is not None
        proc.stdin.close()


def test_peer_process_is_the_connecting_process_with_its_start_time() -> None:
    a, b = socket.socketpair()
    with a, b:
        me = peer_process(a)
    assert me is not None and me.pid == os.getpid()
    assert me.start_time is not None and me.start_time > 0
    tcp = socket.socket()
    with tcp:
        assert peer_process(tcp) is None  # not a Unix socket
    assert peer_process(None) is None


@pytest.mark.asyncio
async def test_segments_pinned_for_a_live_process_return_when_it_dies(
    nbp: NetworkBufferPool, child: subprocess.Popen[bytes]
) -> None:
    pins = SegmentPins()
    before = pidfds()
    peer = PeerProcess(child.pid, _start_time_of(child.pid))
    pins.pin(peer, take(nbp, 3), "consumer connection A")
    pins.pin(peer, take(nbp, 2), "consumer connection B")  # the same process: one pidfd
    assert pins.num_pinned == 5 and pins.num_watched == 1
    assert nbp.num_in_use == 5 and pidfds() == before + 1
    child.send_signal(signal.SIGKILL)
    await wait_until(lambda: pins.num_pinned == 0, 30, "segments back after the exit")
    assert nbp.is_whole() and pins.num_watched == 0
    assert pidfds() == before  # the pidfd is closed
    pins.close()


@pytest.mark.asyncio
async def test_close_returns_every_pinned_segment_and_closes_every_pidfd(
    nbp: NetworkBufferPool, child: subprocess.Popen[bytes]
) -> None:
    before = pidfds()
    pins = SegmentPins()
    pins.pin(PeerProcess(child.pid, _start_time_of(child.pid)), take(nbp, 4), "consumer X")
    pins.pin(None, take(nbp, 1), "consumer Y")  # a process it cannot watch
    assert pins.num_pinned == 5 and pidfds() == before + 1
    pins.close()  # the daemon stops: the child still lives
    assert child.poll() is None
    assert pins.num_pinned == 0 and nbp.is_whole() and pidfds() == before
    # a connection lost after that (shutdown's close timed out): nothing is pinned
    pins.pin(PeerProcess(child.pid, _start_time_of(child.pid)), take(nbp, 2), "consumer W")
    assert pins.num_pinned == 0 and nbp.is_whole() and pidfds() == before


@pytest.mark.asyncio
async def test_a_gone_or_reused_pid_releases_at_once(
    nbp: NetworkBufferPool, child: subprocess.Popen[bytes]
) -> None:
    before = pidfds()
    pins = SegmentPins()
    start = _start_time_of(child.pid)
    pins.pin(PeerProcess(child.pid, start + 1), take(nbp, 2), "consumer of a reused pid")
    assert pins.num_pinned == 0 and nbp.is_whole() and pidfds() == before
    child.kill()
    child.wait(10)
    pins.pin(PeerProcess(child.pid, start), take(nbp, 2), "consumer of a reaped process")
    assert pins.num_pinned == 0 and nbp.is_whole() and pidfds() == before
    pins.close()


def _no_pidfd(pid: int) -> int:
    raise OSError(errno.ENOSYS, "Function not implemented")


@pytest.mark.asyncio
@pytest.mark.parametrize("pidfd_open", [None, _no_pidfd], ids=["no-pidfd_open", "ENOSYS"])
async def test_without_pidfds_segments_stay_pinned_until_the_daemon_stops(
    nbp: NetworkBufferPool,
    child: subprocess.Popen[bytes],
    pidfd_open: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pins = SegmentPins(pidfd_open=pidfd_open)  # type: ignore[arg-type]
    pins.pin(PeerProcess(child.pid, _start_time_of(child.pid)), take(nbp, 3), "consumer Z")
    assert pins.num_pinned == 3 and nbp.num_in_use == 3
    assert "stay out of the pool until the daemon stops" in caplog.text
    child.kill()
    child.wait(10)
    assert pins.num_pinned == 3  # never reused: nothing says the reader is gone
    pins.close()
    assert pins.num_pinned == 0 and nbp.is_whole()


@pytest.mark.asyncio
async def test_a_process_at_the_cap_is_told_once_and_is_free_again_when_it_exits(
    nbp: NetworkBufferPool, child: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """The cap counts per process: below it nothing changes; the pin that reaches it calls
    ``on_cap`` once (and logs why); another process is not concerned; the exit returns the
    pins and the process's count with them."""
    pins = SegmentPins(max_per_process=4)
    told: list[PeerProcess | None] = []
    pins.on_cap = told.append
    peer = PeerProcess(child.pid, _start_time_of(child.pid))
    other = PeerProcess(os.getpid(), _start_time_of(os.getpid()))
    pins.pin(peer, take(nbp, 3), "consumer A")
    assert pins.pinned_for(peer) == 3 and not pins.at_cap(peer) and told == []
    pins.pin(peer, take(nbp, 2), "consumer B")  # 5: past the cap of 4
    assert pins.pinned_for(peer) == 5 and pins.at_cap(peer) and told == [peer]
    assert f"process {child.pid} has 5 shared segment(s) pinned" in caplog.text
    pins.pin(peer, take(nbp, 1), "consumer C")  # already past it: not told again
    assert told == [peer] and pins.num_pinned == 6
    assert pins.pinned_for(other) == 0 and not pins.at_cap(other)
    # processes whose pid is unknown share one count, capped like one process
    pins.pin(None, take(nbp, 4), "consumer of another pid namespace")
    assert pins.at_cap(None) and told == [peer, None]
    child.send_signal(signal.SIGKILL)
    await wait_until(lambda: pins.pinned_for(peer) == 0, 30, "pins back after the exit")
    assert not pins.at_cap(peer) and pins.num_pinned == 4
    pins.close()
    assert nbp.is_whole() and not pins.at_cap(None)


def test_no_cap_by_zero_and_a_negative_cap_is_refused() -> None:
    pins = SegmentPins(max_per_process=0)
    assert not pins.at_cap(None)
    with pytest.raises(ValueError, match="max_per_process"):
        SegmentPins(max_per_process=-1)


def _start_time_of(pid: int) -> int:
    start = process_start_time(pid)
    assert start is not None
    return start
