"""The daemon's shared arenas: one per application that has local producers.

An application's partitions written by tasks on this host take their segments from its
own arena (a ``NetworkBufferPool(shared=True)``), never from another application's, so
a task maps only memory that holds its own application's data. Arenas are made when an
application's first producer asks and dropped once nothing of it uses them (every
segment back, no partition pool left). Together they hold at most ``network_memory``
besides the daemon's own pool; past that, and wherever no arena can be had (no memfd,
/dev/shm too small, ``shared_memory = off``), producers push over the socket and the log
says why.

A consumer task on this host maps its application's arena too (it reads the segments in
place, see ``server.local_endpoint``), with a token as producers do; an arena offered to
a consumer connection is pinned (never dropped) until that connection closes. Segments
pinned for a consumer process the daemon dropped (``server.segment_pins``) keep their
arena too: it is not whole until they return. An arena is made for a consumer only when
its application has blocking partitions here: their readers read the files into it
(``exchange.network.server_connection.ArenaReads``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets

from exchange.errors import SharedMemoryUnavailableError
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.memory.shared_arena import SHM_DIR, create_arena
from exchange.protocol.local_messages import ARENA_TOKEN_SIZE
from server.config import DaemonConfig

__all__ = ["SharedArenas"]

log = logging.getLogger("exchange.server.shared_memory")


class SharedArenas:
    """Application id -> its shared NetworkBufferPool."""

    def __init__(self, config: DaemonConfig, *, shm_dir: str = SHM_DIR) -> None:
        self.segment_size = config.segment_size
        self.arena_size = config.effective_shared_memory_per_app
        self.budget = max(config.network_memory, self.arena_size)
        self.shm_dir = shm_dir
        self._pools: dict[str, NetworkBufferPool] = {}
        #: application -> why it got no arena (told in the log once)
        self._refused: dict[str, str] = {}
        self._release_pending = False
        #: one-time token -> the arena whose descriptor it fetches; an arena with a token
        #: out is never dropped (its task has yet to map it)
        self._tokens: dict[bytes, NetworkBufferPool] = {}
        #: id(arena) -> consumer connections it is offered to (pinned while any is open)
        self._readers: dict[int, int] = {}
        #: why producers push over the socket instead (None: shared memory is used)
        self.unavailable: str | None = None
        if not config.shared_memory:
            self.unavailable = "shared_memory = off"
            log.info("shared memory off (shared_memory = off): producers push over the socket")
            return
        try:  # a probe: a platform without any shared memory says so once, at start
            fd, mm = create_arena(self.segment_size, "exchange-probe", shm_dir=shm_dir)
        except SharedMemoryUnavailableError as e:
            self.unavailable = e.reason
            log.warning("%s; local producers push over the Unix socket", e)
            return
        mm.close()
        os.close(fd)

    def __len__(self) -> int:
        return len(self._pools)

    def pools(self) -> list[NetworkBufferPool]:
        return list(self._pools.values())

    def pool_for(
        self, app_id: str, otherwise: str = "its producers push over the socket"
    ) -> NetworkBufferPool | None:
        """Application ``app_id``'s arena, made on first use; None (logged once per
        application, with ``otherwise``: what happens instead) when it cannot have one."""
        if self.unavailable is not None:
            return None
        pool = self._pools.get(app_id)
        if pool is not None:
            return pool
        self.release_idle()
        who = f"application {app_id!r}" if app_id else "no application"
        if (len(self._pools) + 1) * self.arena_size > self.budget:
            self._refuse(
                app_id,
                f"no shared arena for {who}: {len(self._pools)} arenas of {self.arena_size} "
                f"bytes use the budget of {self.budget} (network_memory); {otherwise}",
            )
            return None
        try:
            pool = NetworkBufferPool(
                self.arena_size // self.segment_size,
                self.segment_size,
                shared=True,
                shm_dir=self.shm_dir,
            )
        except SharedMemoryUnavailableError as e:
            self._refuse(app_id, f"{e} (arena for {who}); {otherwise}")
            return None
        self._refused.pop(app_id, None)
        pool.on_whole = self._on_whole
        self._pools[app_id] = pool
        log.info("shared arena of %d bytes for %s", self.arena_size, who)
        return pool

    def refusal(self, app_id: str) -> str | None:
        """Why ``pool_for`` last gave application ``app_id`` no arena (None: it did)."""
        return self._refused.get(app_id)

    def existing(self, app_id: str) -> NetworkBufferPool | None:
        """Application ``app_id``'s arena if it has one now (never made here: a consumer
        alone gets none, its data came over the socket)."""
        return self._pools.get(app_id)

    def pin(self, pool: NetworkBufferPool) -> None:
        """A consumer connection was offered ``pool``: keep it until ``unpin``."""
        self._readers[id(pool)] = self._readers.get(id(pool), 0) + 1

    def unpin(self, pool: NetworkBufferPool) -> None:
        """That consumer connection closed."""
        n = self._readers.pop(id(pool), 0) - 1
        if n > 0:
            self._readers[id(pool)] = n
        elif pool.is_whole():
            self._on_whole()

    def _refuse(self, app_id: str, message: str) -> None:
        if app_id not in self._refused:
            log.warning(message)
        self._refused[app_id] = message

    def issue_token(self, pool: NetworkBufferPool) -> bytes:
        """A one-time token for ``pool``'s descriptor; the arena stays until the token is
        redeemed or revoked (a partition released before its task mapped the arena must
        not take the arena from under the task: it gets the partition's typed error)."""
        token = secrets.token_bytes(ARENA_TOKEN_SIZE)
        self._tokens[token] = pool
        return token

    def redeem(self, token: bytes) -> NetworkBufferPool | None:
        """The arena of a token, once (None: unknown, used or revoked)."""
        pool = self._tokens.pop(token, None)
        if pool is not None and pool.is_whole():
            self._on_whole()  # dropped once this hand-out is done, if nothing took it
        return pool

    def revoke(self, token: bytes) -> None:
        """The token's connection is gone: the token is good no more."""
        pool = self._tokens.pop(token, None)
        if pool is not None and pool.is_whole():
            self._on_whole()

    def _on_whole(self) -> None:
        """An arena got every segment back: drop it once the current callback is done
        (not inside the pool's own call; a new partition may take it first)."""
        if self._release_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (tests driving it directly): release_idle is called by hand
        self._release_pending = True
        loop.call_soon(self._release_scheduled)

    def _release_scheduled(self) -> None:
        self._release_pending = False
        self.release_idle()

    def release_idle(self) -> None:
        """Drop the arenas no partition uses any more (their segments all back)."""
        pinned = {id(p) for p in self._tokens.values()} | set(self._readers)
        for app_id, pool in list(self._pools.items()):
            if pool.is_whole() and id(pool) not in pinned:
                del self._pools[app_id]
                pool.destroy()

    def close(self) -> bool:
        """Destroy every arena; True if each had all its segments back."""
        whole = True
        for app_id, pool in self._pools.items():
            pool.check_consistency()
            if not pool.is_whole():
                whole = False
                log.error("shutdown: shared arena of %r not whole: %s", app_id, pool.stats())
            pool.destroy()
        self._pools.clear()
        self._tokens.clear()
        self._readers.clear()
        return whole
