"""Shared segments kept out of the pool while a live consumer process may read them.

A consumer on this host reads its application's arena in place: the daemon holds every
segment it sent as a descriptor until the consumer gives it back (``RecycleSegments``).
When the consumer ends its connection (it closed, or died) what it still held returns to
the pool. When the *daemon* drops the connection (a protocol error, no Pong within
``peer_timeout``, shutdown) the consumer's process may live on, decoding a batch from
those segments until it notices the loss; a segment reused by a producer then would be
overwritten under it. So the segments are pinned here, by the peer process, until it
exits: the peer's pid comes from ``SO_PEERCRED`` at accept (with its start time, so a pid
reused meanwhile is told apart), and a pidfd (``os.pidfd_open``, Linux >= 5.3) watched by
the event loop becomes readable when the process exits; the segments return then and the
pidfd is closed.

Where that is impossible (the peer's pid unknown: another pid namespace; no pidfd: an
older kernel) the segments stay pinned until the daemon stops, and the log says so: a
segment is never reused while its reader may live. Pinned segments keep their arena (it
is dropped only once whole) and count in ``/metrics``
(``exchange_consumer_shared_segments_pinned``); ``close`` (daemon shutdown) returns every
one and closes every pidfd.

A cap bounds what one live process keeps pinned (``max_consumer_pins_per_process``: a
reused Spark worker lives on across tasks, and each drop of one of its connections may pin
up to that connection's credit): once a process has that many pinned, ``at_cap`` says so
and the local endpoint stops reading in place for it (it reads over the socket: nothing
sent that way is ever pinned) until the process exits and its pins go. A process that
reaches the cap with connections still reading in place is told to ``on_cap``, which turns
them to the socket too; what those held before may still be pinned when they drop, so a
process holds at most the cap plus its in-place connections' credit at that moment.
Processes whose pid is unknown share one count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from exchange.buffers.buffer import Buffer

__all__ = ["PeerProcess", "SegmentPins", "peer_process", "process_start_time"]

log = logging.getLogger("exchange.server.shared_memory")

_UCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: os.pidfd_open where the platform has it (Linux; the kernel may still lack it: ENOSYS)
_PIDFD_OPEN: Final[Callable[[int], int] | None] = getattr(os, "pidfd_open", None)


@dataclass(frozen=True, slots=True)
class PeerProcess:
    """The process at the other end of a Unix socket, as it was at accept."""

    pid: int
    #: its start time (clock ticks after boot, /proc/<pid>/stat): tells a reused pid apart
    start_time: int | None


def peer_process(sock: Any) -> PeerProcess | None:
    """The connecting process of the Unix socket ``sock`` (a socket, or a transport's
    ``get_extra_info("socket")``), from ``SO_PEERCRED``; None if unknown (not a Unix
    socket, or a process outside this pid namespace)."""
    if sock is None or sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError:
        return None
    if pid <= 0:
        return None
    return PeerProcess(pid, process_start_time(pid))


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (None: no such process, or no procfs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count after the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(slots=True)
class _Pin:
    pidfd: int
    peer: PeerProcess
    loop: asyncio.AbstractEventLoop  # the one watching ``pidfd``
    buffers: list[Buffer] = field(default_factory=list)


class SegmentPins:
    """Segments of dropped consumer connections, kept until their process exits."""

    def __init__(
        self,
        *,
        max_per_process: int = 0,
        pidfd_open: Callable[[int], int] | None = _PIDFD_OPEN,
    ) -> None:
        if max_per_process < 0:
            raise ValueError(f"max_per_process must be >= 0, got {max_per_process}")
        #: pinned segments past which a process reads over the socket; 0 = no cap
        self.max_per_process = max_per_process
        self._pidfd_open = pidfd_open
        self._pins: dict[PeerProcess, _Pin] = {}
        #: kept until ``close``: their process cannot be watched
        self._unwatched: list[Buffer] = []
        #: pinned segments per process (None: processes whose pid is unknown)
        self._by_process: dict[PeerProcess | None, int] = {}
        self.num_pinned = 0
        #: consumer connections that read over the socket because their process was at
        #: the cap (counted by the local endpoint, once per connection)
        self.num_refused = 0
        #: called once when a process reaches the cap (its live connections stop reading
        #: in place)
        self.on_cap: Callable[[PeerProcess | None], None] | None = None
        self._closed = False  # the daemon stops: nothing is pinned any more

    @property
    def num_watched(self) -> int:
        """Processes watched now (one pidfd each)."""
        return len(self._pins)

    def pinned_for(self, peer: PeerProcess | None) -> int:
        """Segments pinned now for ``peer`` (None: the processes whose pid is unknown)."""
        return self._by_process.get(peer, 0)

    def at_cap(self, peer: PeerProcess | None) -> bool:
        """True if ``peer`` has ``max_per_process`` segments pinned or more: it must not
        be sent any more descriptors until it exits."""
        cap = self.max_per_process
        return cap > 0 and self._by_process.get(peer, 0) >= cap

    def _count(self, peer: PeerProcess | None, n: int) -> None:
        before = self._by_process.get(peer, 0)
        self._by_process[peer] = after = before + n
        self.num_pinned += n
        cap = self.max_per_process
        if cap > 0 and before < cap <= after:
            log.warning(
                "process %s has %d shared segment(s) pinned, max_consumer_pins_per_process "
                "is %d: its consumer connections read over the socket, not in place, until "
                "it exits",
                "unknown" if peer is None else peer.pid,
                after,
                cap,
            )
            if self.on_cap is not None:
                self.on_cap(peer)

    def pin(self, peer: PeerProcess | None, buffers: list[Buffer], who: str) -> None:
        """``who``'s connection was dropped by the daemon holding ``buffers``: keep them
        out of the pool until ``peer`` exits (at once if it is gone already)."""
        if not buffers:
            return
        if self._closed:  # a connection lost after shutdown's close: the arenas go now
            _release(buffers, who)
            return
        if peer is None:
            self._keep_unwatched(None, buffers, f"{who}: its process is unknown (no SO_PEERCRED)")
            return
        pin = self._pins.get(peer)
        if pin is None:
            watched = self._watch(peer, who, buffers)
            if watched is None:
                return  # gone already (released), or kept unwatched
            pin = self._pins[peer] = watched
        pin.buffers.extend(buffers)
        log.warning(
            "%s was dropped by the daemon while its process %d lives: %d shared segment(s) "
            "it held stay out of the pool until that process exits (%d pinned now)",
            who,
            peer.pid,
            len(buffers),
            self.num_pinned + len(buffers),
        )
        self._count(peer, len(buffers))

    def _watch(self, peer: PeerProcess, who: str, buffers: list[Buffer]) -> _Pin | None:
        """A pidfd of ``peer`` watched by the loop; None if the process is gone (the
        buffers are released) or cannot be watched (kept until ``close``)."""
        pidfd_open = self._pidfd_open
        if pidfd_open is None:
            self._keep_unwatched(peer, buffers, f"{who}: no os.pidfd_open on this platform")
            return None
        try:
            fd = pidfd_open(peer.pid)
        except ProcessLookupError:
            _release(buffers, who)
            return None
        except OSError as e:  # ENOSYS (a kernel before 5.3), EMFILE, ...
            self._keep_unwatched(peer, buffers, f"{who}: pidfd_open({peer.pid}) failed: {e}")
            return None
        # the pid may have been reused since accept: then the peer is gone (no start time
        # known, no procfs: watched all the same, the safe side)
        if peer.start_time is not None and process_start_time(peer.pid) != peer.start_time:
            os.close(fd)
            _release(buffers, who)
            return None
        loop = asyncio.get_running_loop()
        try:
            loop.add_reader(fd, self._on_exit, peer)
        except BaseException:
            os.close(fd)
            raise
        return _Pin(fd, peer, loop)

    def _keep_unwatched(self, peer: PeerProcess | None, buffers: list[Buffer], why: str) -> None:
        self._unwatched.extend(buffers)
        log.warning(
            "%s; the %d shared segment(s) it held when the daemon dropped it stay out of "
            "the pool until the daemon stops (%d pinned now)",
            why,
            len(buffers),
            self.num_pinned + len(buffers),
        )
        self._count(peer, len(buffers))

    def _on_exit(self, peer: PeerProcess) -> None:
        """The pidfd is readable: the process exited. Its segments return."""
        pin = self._pins.pop(peer)
        self._unwatch(pin)
        self.num_pinned -= len(pin.buffers)
        del self._by_process[peer]
        log.info(
            "process %d exited: the %d shared segment(s) pinned for it return to the pool",
            peer.pid,
            len(pin.buffers),
        )
        _release(pin.buffers, f"process {peer.pid}")

    def _unwatch(self, pin: _Pin) -> None:
        try:
            pin.loop.remove_reader(pin.pidfd)
        finally:
            os.close(pin.pidfd)

    def close(self) -> None:
        """The daemon stops: every pinned segment returns (the arenas go with the daemon;
        a reader's mapping keeps its memory), every pidfd is closed."""
        self._closed = True
        pins, self._pins = list(self._pins.values()), {}
        unwatched, self._unwatched = self._unwatched, []
        self.num_pinned = 0
        self._by_process.clear()
        for pin in pins:
            self._unwatch(pin)
            _release(pin.buffers, f"process {pin.peer.pid}")
        _release(unwatched, "an unwatched process")


def _release(buffers: list[Buffer], who: str) -> None:
    for buf in buffers:
        try:
            buf.release()
        except Exception:
            log.exception("recycling a shared segment pinned for %s failed", who)
