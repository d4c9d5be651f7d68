"""The driver's rendezvous service over real loopback TCP: tasks meet, rounds stay apart,
a bad token is refused, and a failing task's report runs the abort hook once. Rounds of
an ordinary stage (``whole_stage_retries=False``) take one attempt per index, launched
at any time, and refuse at once what can never complete."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import pytest

from client.rendezvous import (
    RendezvousServer,
    RendezvousTicket,
    TaskLocation,
    rendezvous,
    report_abort,
)
from exchange.addresses import parse_address
from exchange.errors import ProtocolError, SchedulingError, TransportError, UsageError
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, encode
from exchange.protocol.driver_messages import Met
from tests.kit.polling import wait_for
from tests.kit.sockets import closed_by_peer, has_ipv6_loopback


@pytest.fixture
def server() -> Any:
    s = RendezvousServer()
    yield s
    s.close()


def loc(index: int, attempt: int) -> TaskLocation:
    """Task ``index``'s location (only index and attempt matter here)."""
    return TaskLocation(index, attempt, "daemon", "127.0.0.1:1", "/tmp/sock", 32768)


def pairs(locations: list[TaskLocation]) -> list[list[int]]:
    return [[x.index, x.attempt] for x in locations]


def meet_all(
    ticket: RendezvousTicket, attempts: list[int], timeout: float = 10, round_id: int = 0
) -> list[Any]:
    results: list[Any] = [None] * len(attempts)

    def one(i: int) -> None:
        try:
            results[i] = pairs(
                rendezvous(ticket, loc(i, attempts[i]), timeout=timeout, round_id=round_id)
            )
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(attempts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_tasks_meet_and_each_gets_everyone_in_index_order(server: RendezvousServer) -> None:
    ticket = server.open_group("x1", 3)
    results = meet_all(ticket, [10, 11, 12])
    assert results == [[[0, 10], [1, 11], [2, 12]]] * 3
    server.close_group("x1")


def test_a_new_round_is_answered_with_its_own_attempts_only(server: RendezvousServer) -> None:
    ticket = server.open_group("x2", 2)
    assert meet_all(ticket, [5, 6]) == [[[0, 5], [1, 6]]] * 2
    # the stage re-runs with new, higher attempt ids: the old entries are superseded
    assert meet_all(ticket, [20, 21]) == [[[0, 20], [1, 21]]] * 2


def test_rounds_with_adjacent_attempts_stay_apart(server: RendezvousServer) -> None:
    """Two actions on one pipelined result: two stages whose attempt ids are adjacent.
    A task of the second is answered with its own round only, even while the other
    task of its round has not registered yet (it then waits, never takes attempt 6)."""
    ticket = server.open_group("x6", 2)
    assert meet_all(ticket, [5, 6], round_id=1) == [[[0, 5], [1, 6]]] * 2
    with pytest.raises(TransportError, match="waited"):
        rendezvous(ticket, loc(0, 7), timeout=0.5, round_id=2)
    assert meet_all(ticket, [7, 8], round_id=2) == [[[0, 7], [1, 8]]] * 2


def test_a_lone_task_of_a_dead_round_gives_up_typed(server: RendezvousServer) -> None:
    ticket = server.open_group("x3", 2)
    with pytest.raises(TransportError, match="waited"):
        rendezvous(ticket, loc(0, 1), timeout=0.5)


def test_a_bad_token_is_refused(server: RendezvousServer) -> None:
    ticket = server.open_group("x4", 1)
    forged = RendezvousTicket(ticket.address, "x4", "0" * 32, 1)
    with pytest.raises(TransportError, match="refused"):
        rendezvous(forged, loc(0, 1), timeout=5)


def test_a_failing_task_runs_the_abort_hook_once_with_every_location(
    server: RendezvousServer,
) -> None:
    calls: list[tuple[int, list[Any]]] = []

    async def hook(round_id: int, locations: list[TaskLocation]) -> None:
        calls.append((round_id, sorted(pairs(locations))))

    ticket = server.open_group("x5", 2, hook)
    meet_all(ticket, [7, 8], round_id=3)
    report_abort(ticket, 0, 7, round_id=3)
    report_abort(ticket, 1, 8, round_id=3)  # the stage's other failure: released once already
    assert calls == [(3, [[0, 7], [1, 8]])]
    meet_all(ticket, [9, 10], round_id=4)  # the next action's run fails too: its own hook
    report_abort(ticket, 1, 10, round_id=4)
    assert calls[1:] == [(4, [[0, 9], [1, 10]])]


def _registered(server: RendezvousServer, exchange_id: str, round_id: int) -> int:
    """How many tasks of a round registered (read from the service's state)."""
    group = server._groups.get(exchange_id)
    rnd = group[1].rounds.get(round_id) if group is not None else None
    return 0 if rnd is None else len(rnd.entries)


def test_an_ordinary_stage_meets_whatever_its_attempt_ids(server: RendezvousServer) -> None:
    """Its tasks start as slots free up, between other jobs' tasks: attempt ids far apart
    (a barrier round would wait for a set within n of each other, for ever)."""
    ticket = server.open_group("o1", 2, whole_stage_retries=False)
    assert meet_all(ticket, [3, 400]) == [[[0, 3], [1, 400]]] * 2


def test_an_ordinary_stage_refuses_a_task_run_again_alone(server: RendezvousServer) -> None:
    """Spark retries a failed task of an ordinary stage alone: the new attempt, and every
    task waiting in its round, get a SchedulingError at once (not after the timeout),
    the round's clean-up runs once, and later registrations are refused as well."""
    calls: list[tuple[int, list[Any]]] = []

    async def hook(round_id: int, locations: list[TaskLocation]) -> None:
        calls.append((round_id, sorted(pairs(locations))))

    ticket = server.open_group("o2", 3, hook, whole_stage_retries=False)
    waiting: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: waiting.append(meet_all_one(ticket, i, 5 + i)))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: _registered(server, "o2", 0) == 2, 30, "two tasks registered")
    with pytest.raises(SchedulingError, match="ran task 0 again") as excinfo:
        rendezvous(ticket, loc(0, 9), timeout=120)
    assert "mode='blocking'" in str(excinfo.value)  # the way out
    for t in threads:
        t.join(30)
    assert len(waiting) == 2
    assert all(isinstance(e, SchedulingError) for e in waiting), waiting
    assert calls == [(0, [[0, 5], [1, 6]])]
    with pytest.raises(SchedulingError, match="ran task 0 again"):
        rendezvous(ticket, loc(2, 7), timeout=120)


def meet_all_one(ticket: RendezvousTicket, i: int, attempt: int) -> Any:
    try:
        return pairs(rendezvous(ticket, loc(i, attempt), timeout=120))
    except Exception as e:
        return e


def test_an_ordinary_round_a_task_failed_in_refuses_the_rest(server: RendezvousServer) -> None:
    ticket = server.open_group("o3", 2, whole_stage_retries=False)
    report_abort(ticket, 0, 4, round_id=1)
    with pytest.raises(SchedulingError, match="a task of its stage failed"):
        rendezvous(ticket, loc(1, 5), timeout=120, round_id=1)
    assert meet_all(ticket, [6, 7], round_id=2) == [[[0, 6], [1, 7]]] * 2  # the next run


def test_a_round_its_check_finds_short_of_tasks_is_refused_as_misuse(
    server: RendezvousServer,
) -> None:
    """``check_round`` (in Spark: the job runs only some of the stage's tasks) answers
    the waiting task with a UsageError at once; a round it lets be meets as usual."""
    checked: list[int] = []

    async def check(round_id: int) -> str | None:
        checked.append(round_id)
        return "the job runs 1 of the 2 tasks" if round_id == 1 else None

    ticket = server.open_group("o4", 2, whole_stage_retries=False, check_round=check)
    with pytest.raises(UsageError, match="the job runs 1 of the 2 tasks"):
        rendezvous(ticket, loc(0, 3), timeout=120, round_id=1)
    assert meet_all(ticket, [4, 5], round_id=2) == [[[0, 4], [1, 5]]] * 2
    assert checked == [1, 2]  # once per round


def test_an_ordinary_round_short_of_tasks_times_out_naming_the_slots(
    server: RendezvousServer,
) -> None:
    ticket = server.open_group("o5", 3, whole_stage_retries=False)
    with pytest.raises(SchedulingError, match="waited") as excinfo:
        rendezvous(ticket, loc(0, 1), timeout=0.5)
    assert "needs 3 free task slots" in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(struct.pack(">IIB", FRAME_HEADER_SIZE + 1, MAGIC, 128) + b"\xc1", id="body"),
        pytest.param(struct.pack(">IIB", 1 << 20, MAGIC, 128), id="oversized"),
        pytest.param(struct.pack(">IIB", FRAME_HEADER_SIZE, MAGIC, 136), id="control-id"),
        pytest.param(b"".join(encode(Met(()))), id="an-answer"),
        pytest.param(b'{"exchange": "m1", "index": 0}\n', id="json"),
    ],
)
def test_a_bad_request_is_dropped_and_the_tasks_still_meet(
    server: RendezvousServer, data: bytes
) -> None:
    ticket = server.open_group("m1", 2)
    with socket.create_connection(parse_address(ticket.address), timeout=10) as s:
        s.sendall(data)
        assert closed_by_peer(s, 10)  # no answer: the connection ends
    assert _registered(server, "m1", 0) == 0
    assert meet_all(ticket, [1, 2]) == [[[0, 1], [1, 2]]] * 2


def test_a_bad_answer_fails_the_task_typed() -> None:
    """A peer at the rendezvous's address that answers garbage: ProtocolError, not a hang."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        ticket = RendezvousTicket(f"127.0.0.1:{port}", "b1", "t" * 32, 2)

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(struct.pack(">IIB", FRAME_HEADER_SIZE + 1, MAGIC, 130) + b"\x90")
                closed_by_peer(conn, 10)

        peer = threading.Thread(target=answer, daemon=True)
        peer.start()
        with pytest.raises(ProtocolError, match="locations"):
            rendezvous(ticket, loc(0, 1), timeout=10)
        peer.join(10)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_tasks_meet_over_ipv6() -> None:
    server = RendezvousServer(host="::1")
    try:
        ticket = server.open_group("v6", 2)
        assert ticket.address == f"[::1]:{server.port}"
        assert meet_all(ticket, [3, 4]) == [[[0, 3], [1, 4]]] * 2
    finally:
        server.close()
