"""ReaderBudget: how many blocking-partition readers, and how much read memory, each
application may hold on a daemon.

A blocking partition may be read any number of times, by any number of readers at once;
each reader holds a descriptor of its file and (for ``file`` storage) read segments
allocated outside network memory. Without a bound, one application's requests for its
own partition take every descriptor and unbounded memory of the daemon. A
``ReaderAccount`` per application counts both; a reader beyond either limit is refused
with a :class:`~exchange.errors.LimitExceededError` (per channel: that request fails, the
connection and the other channels go on) and its place is given back when it is released.
A reader is charged its base read memory when it opens; a ``file`` reader then grows its
read segments one at a time while the account has room (``try_acquire_memory``, never an
error) and gives them back with the rest when it closes. Grown bytes never refuse a reader:
a new reader is admitted against the base charges only (the same readers are let in as
without growth), and when that puts the account over its limit, grown readers free their
extra segments as they come back (``over_limit``) until it is under again.
"""

from __future__ import annotations

from exchange.errors import LimitExceededError

__all__ = ["ReaderAccount", "ReaderBudget"]


class ReaderBudget:
    """Per-application limits of open readers and their read memory (0: unlimited)."""

    def __init__(self, max_readers: int = 0, max_memory: int = 0) -> None:
        self.max_readers = max_readers
        self.max_memory = max_memory
        self._accounts: dict[str, ReaderAccount] = {}

    def account(self, app_id: str) -> ReaderAccount:
        acct = self._accounts.get(app_id)
        if acct is None:
            acct = self._accounts[app_id] = ReaderAccount(self, app_id)
        return acct

    def totals(self) -> tuple[int, int]:
        """(open readers, bytes of read memory) of every application together."""
        return (
            sum(a.readers for a in self._accounts.values()),
            sum(a.memory for a in self._accounts.values()),
        )

    def usage(self, app_id: str) -> tuple[int, int]:
        """(open readers, bytes of read memory) of ``app_id``."""
        acct = self._accounts.get(app_id)
        return (0, 0) if acct is None else (acct.readers, acct.memory)


class ReaderAccount:
    """One application's open readers and their memory."""

    __slots__ = ("_budget", "app_id", "grown", "memory", "readers")

    def __init__(self, budget: ReaderBudget, app_id: str) -> None:
        self._budget = budget
        self.app_id = app_id
        self.readers = 0
        #: bytes of read memory held, grown segments included
        self.memory = 0
        #: of which grown (``try_acquire_memory``): given back first when over the limit
        self.grown = 0

    def acquire(self, memory: int, partition_id: object = None) -> None:
        """Count one more reader holding ``memory`` bytes, or raise LimitExceededError."""
        budget = self._budget
        who = f"application {self.app_id!r}" if self.app_id else "no application"
        if budget.max_readers and self.readers >= budget.max_readers:
            raise LimitExceededError(
                f"{who} has {self.readers} readers open on this daemon",
                partition_id,
                setting="max_readers_per_app",
                limit=budget.max_readers,
            )
        base = self.memory - self.grown
        if budget.max_memory and base + memory > budget.max_memory:
            raise LimitExceededError(
                f"{who}'s readers hold {base} bytes of read buffers; one more would add {memory}",
                partition_id,
                setting="max_reader_memory_per_app",
                limit=budget.max_memory,
            )
        self.readers += 1
        self.memory += memory

    def release(self, memory: int) -> None:
        self.readers -= 1
        self.memory -= memory

    def try_acquire_memory(self, memory: int) -> bool:
        """Count ``memory`` more bytes for a reader already counted (a ``file`` reader
        growing its read segments) if the limit has room for them; False (nothing
        counted) if not. Never raises: growth is optional, a reader goes on without it."""
        limit = self._budget.max_memory
        if limit and self.memory + memory > limit:
            return False
        self.memory += memory
        self.grown += memory
        return True

    def release_memory(self, memory: int) -> None:
        """Give back bytes counted by :meth:`try_acquire_memory`."""
        self.memory -= memory
        self.grown -= memory

    @property
    def over_limit(self) -> bool:
        """Readers admitted since others grew hold more than the limit: grown segments
        are to be freed as they come back."""
        limit = self._budget.max_memory
        return bool(limit) and self.memory > limit
