"""The job graph: what the user's DataStream program becomes before it runs.

A program is a DAG of *nodes* (one operator each, with a parallelism). Nodes joined by a
forward edge with the same parallelism, where the upstream node has no other consumer and
the downstream node no other input, are *chained* into one vertex (Flink's operator
chaining): they run in one task, records passed by a function call. Every other edge is an
*exchange*: each producer subtask writes one pipelined partition on its local daemon with
one subpartition per consumer subtask, routed by the edge's partitioner:

* ``forward``: subtask i to subtask i (same parallelism);
* ``hash``: by ``exchange.state.subtask_for_key(key, max_parallelism, parallelism)``, so
  a key always reaches the subtask that owns its key group;
* ``rebalance``: round robin;
* ``broadcast``: every record to every subtask.

Tasks are numbered vertex by vertex, subtask by subtask: task ``t`` of the Spark barrier
stage runs ``tasks[t]``. Vertex and task ids depend on the chaining, so they name nothing
in checkpoints: state belongs to an operator's *uid* (``Node.state_id``: the uid given
with ``DataStream.uid``, else the operator's name), which must be unique and stable
across runs, as Flink's ``uid()``. ``JobGraph.operator_tasks`` says which task runs each
subtask of each operator.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from client.streaming.functions import Operator
from exchange.errors import UsageError

__all__ = ["Edge", "JobGraph", "Node", "Partitioning", "TaskSpec", "Vertex", "check_operator_id"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class Partitioning(Enum):
    FORWARD = "forward"
    HASH = "hash"
    REBALANCE = "rebalance"
    BROADCAST = "broadcast"


@dataclass(eq=False)
class Node:
    """One operator of the program (before chaining)."""

    node_id: int
    name: str
    factory: Callable[[], Operator]
    parallelism: int
    is_source: bool = False
    #: the key of each input record (set on nodes after ``key_by``): keyed state
    key_fn: Callable[[Any], Any] | None = None
    inputs: list[tuple[Node, Partitioning, Callable[[Any], Any] | None]] = field(
        default_factory=list
    )
    outputs: list[Node] = field(default_factory=list)
    #: the stable id of the operator's state (``DataStream.uid``); None: its name
    uid: str | None = None

    @property
    def state_id(self) -> str:
        """What names this operator's state in checkpoints: its uid, else its name."""
        return self.uid if self.uid is not None else self.name


@dataclass(frozen=True)
class Edge:
    """An exchange between two vertices."""

    edge_id: int
    source: int  # vertex ids
    target: int
    partitioning: Partitioning
    key_fn: Callable[[Any], Any] | None = None


@dataclass
class Vertex:
    """A chain of nodes run as one task per subtask."""

    vertex_id: int
    nodes: list[Node]
    parallelism: int
    inputs: list[Edge] = field(default_factory=list)
    outputs: list[Edge] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "-".join(n.name for n in self.nodes)

    @property
    def is_source(self) -> bool:
        return self.nodes[0].is_source


@dataclass(frozen=True)
class TaskSpec:
    """One task of the barrier stage: a vertex's subtask."""

    index: int
    vertex_id: int
    subtask: int

    @property
    def task_id(self) -> str:
        return f"v{self.vertex_id}-{self.subtask}"


class JobGraph:
    """Vertices, edges and tasks of a program; built by ``JobGraph.build(sinks)``."""

    def __init__(self, vertices: Sequence[Vertex], max_parallelism: int) -> None:
        self.vertices = list(vertices)
        self.max_parallelism = max_parallelism
        self.tasks = [
            TaskSpec(0, v.vertex_id, s) for v in self.vertices for s in range(v.parallelism)
        ]
        self.tasks = [TaskSpec(i, t.vertex_id, t.subtask) for i, t in enumerate(self.tasks)]
        self.edges = [e for v in self.vertices for e in v.outputs]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def vertex(self, vertex_id: int) -> Vertex:
        return self.vertices[vertex_id]

    def source_task_ids(self) -> list[str]:
        return [t.task_id for t in self.tasks if self.vertex(t.vertex_id).is_source]

    def operator_tasks(self) -> dict[str, list[str]]:
        """Every operator's state id -> the task id of each of its subtasks, in order."""
        return {
            n.state_id: [f"v{v.vertex_id}-{s}" for s in range(v.parallelism)]
            for v in self.vertices
            for n in v.nodes
        }

    @classmethod
    def build(cls, nodes: Sequence[Node], max_parallelism: int) -> JobGraph:
        """Chain ``nodes`` (every node of the program, in creation order) into vertices."""
        seen: set[str] = set()
        uids: set[str] = set()
        for n in nodes:
            check_operator_id(n.name, "operator name")
            if n.name in seen:
                raise UsageError(f"two operators are named {n.name!r}; names must be unique")
            seen.add(n.name)
            if n.uid is not None:
                check_operator_id(n.uid, "uid")
        for n in nodes:
            if n.state_id in uids:
                raise UsageError(
                    f"two operators have the state id {n.state_id!r} (a uid equal to another "
                    "operator's uid or name); uids must be unique"
                )
            uids.add(n.state_id)
            if n.parallelism > max_parallelism:
                raise UsageError(
                    f"{n.name}: parallelism {n.parallelism} exceeds max_parallelism "
                    f"{max_parallelism}"
                )
        chain_of: dict[int, Vertex] = {}
        vertices: list[Vertex] = []
        for n in nodes:  # creation order is a topological order
            up = _chainable_upstream(n)
            if up is not None:
                v = chain_of[up.node_id]
                v.nodes.append(n)
            else:
                v = Vertex(len(vertices), [n], n.parallelism)
                vertices.append(v)
            chain_of[n.node_id] = v
        edge_id = 0
        for n in nodes:
            if _chainable_upstream(n) is not None:
                continue
            target = chain_of[n.node_id]
            for up, part, key_fn in n.inputs:
                if part is Partitioning.FORWARD and up.parallelism != n.parallelism:
                    part = Partitioning.REBALANCE  # as Flink does for a parallelism change
                src = chain_of[up.node_id]
                e = Edge(edge_id, src.vertex_id, target.vertex_id, part, key_fn)
                edge_id += 1
                src.outputs.append(e)
                target.inputs.append(e)
        for v in vertices:
            if not v.is_source and not v.inputs:
                raise UsageError(f"operator {v.nodes[0].name} has no input")
        return cls(vertices, max_parallelism)


def check_operator_id(value: object, what: str) -> str:
    """An operator name or uid: UsageError unless 1-64 of [A-Za-z0-9_-]."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise UsageError(f"{what} {value!r}: use [A-Za-z0-9_-], at most 64")
    return value


def _chainable_upstream(n: Node) -> Node | None:
    if len(n.inputs) != 1 or n.is_source:
        return None
    up, part, _ = n.inputs[0]
    if part is not Partitioning.FORWARD or up.parallelism != n.parallelism:
        return None
    if len(up.outputs) != 1:
        return None
    return up
