"""Errors of the state backends and snapshots (all ``ExchangeError``)."""

from __future__ import annotations

from exchange.errors import ExchangeError, UsageError

__all__ = [
    "CorruptSnapshotError",
    "KeyGroupOutOfRangeError",
    "NonRestoredStateError",
    "SnapshotAuthenticationError",
    "StateError",
]


class StateError(UsageError):
    """State used wrongly: no current key, a name registered as another kind of state."""


class KeyGroupOutOfRangeError(StateError):
    """A key was set whose key group this backend does not own (a routing bug upstream)."""

    def __init__(self, key: object, key_group: int, start: int, end: int) -> None:
        super().__init__(
            f"key {key!r} is in key group {key_group}, outside this backend's key groups "
            f"[{start}, {end}]: the keyed exchange routed it to the wrong subtask"
        )
        self.key_group = key_group


class CorruptSnapshotError(ExchangeError):
    """A state snapshot or checkpoint file is corrupt, truncated or not what was expected.

    ``source`` names the file (or what the bytes came from), ``detail`` what was wrong.
    """

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"corrupt snapshot {source}: {detail}")
        self.source = source
        self.detail = detail


class SnapshotAuthenticationError(ExchangeError):
    """A checkpoint file's MAC is missing or wrong under the configured key (or a MAC is
    present and no key is configured): refused before anything in it is unpickled.

    Not a CorruptSnapshotError: a restore never falls back past a forged file silently.
    """

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"unauthenticated checkpoint file {source}: {detail}")
        self.source = source
        self.detail = detail


class NonRestoredStateError(UsageError):
    """A checkpoint holds state of operators the new job does not have (Flink's "cannot
    map checkpoint state ... allowNonRestoredState"); ``operators`` names them."""

    def __init__(self, checkpoint: str, operators: list[str]) -> None:
        super().__init__(
            f"checkpoint {checkpoint} holds state of operator(s) {', '.join(operators)} that "
            "the job does not have (operator state belongs to an operator's uid: its name "
            "unless .uid() was given). Give the operators their old names or uids, or pass "
            "allow_non_restored_state=True to execute() to drop that state"
        )
        self.checkpoint = checkpoint
        self.operators = operators
