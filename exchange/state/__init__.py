"""Keyed and operator state of the streaming runtime, and its snapshot format (sans I/O).

``KeyedStateBackend`` (ValueState, MapState per operator, state name and key, split into key
groups so it can be restored into another parallelism), ``OperatorStateBackend`` (list state
for sources' offsets and sinks' pending transactions), and ``snapshot`` (the checksummed,
versioned envelope every state file and checkpoint metadata file uses). Snapshots are bytes:
writing them somewhere is the checkpoint storage's job (``client/streaming``).
"""

from __future__ import annotations

from exchange.state.errors import (
    CorruptSnapshotError,
    KeyGroupOutOfRangeError,
    NonRestoredStateError,
    SnapshotAuthenticationError,
    StateError,
)
from exchange.state.key_groups import (
    DEFAULT_MAX_PARALLELISM,
    MAX_MAX_PARALLELISM,
    KeyGroupRange,
    key_group_for_key,
    key_group_range_for_subtask,
    subtask_for_key,
    subtask_for_key_group,
)
from exchange.state.keyed_state_backend import KeyedStateBackend, MapState, StateKind, ValueState
from exchange.state.operator_state import Distribution, OperatorListState, OperatorStateBackend
from exchange.state.snapshot import (
    FORMAT_VERSION,
    SnapshotKind,
    checkpoint_key,
    decode_envelope,
    decode_snapshot,
    encode_envelope,
    encode_snapshot,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "FORMAT_VERSION",
    "MAX_MAX_PARALLELISM",
    "CorruptSnapshotError",
    "Distribution",
    "KeyGroupOutOfRangeError",
    "KeyGroupRange",
    "KeyedStateBackend",
    "MapState",
    "NonRestoredStateError",
    "OperatorListState",
    "OperatorStateBackend",
    "SnapshotAuthenticationError",
    "SnapshotKind",
    "StateError",
    "StateKind",
    "ValueState",
    "checkpoint_key",
    "decode_envelope",
    "decode_snapshot",
    "encode_envelope",
    "encode_snapshot",
    "key_group_for_key",
    "key_group_range_for_subtask",
    "subtask_for_key",
    "subtask_for_key_group",
]
