"""The driver's rendezvous service over real loopback TCP: tasks meet, rounds stay apart,
a bad token is refused, and a failing task's report runs the abort hook once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from client.rendezvous import RendezvousServer, RendezvousTicket, rendezvous, report_abort
from exchange.errors import TransportError


@pytest.fixture
def server() -> Any:
    s = RendezvousServer()
    yield s
    s.close()


def meet_all(
    ticket: RendezvousTicket, attempts: list[int], timeout: float = 10, round_id: int = 0
) -> list[Any]:
    results: list[Any] = [None] * len(attempts)

    def one(i: int) -> None:
        try:
            location = [i, attempts[i]]
            results[i] = rendezvous(
                ticket, i, attempts[i], location, timeout=timeout, round_id=round_id
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
        rendezvous(ticket, 0, 7, [0, 7], timeout=0.5, round_id=2)
    assert meet_all(ticket, [7, 8], round_id=2) == [[[0, 7], [1, 8]]] * 2


def test_a_lone_task_of_a_dead_round_gives_up_typed(server: RendezvousServer) -> None:
    ticket = server.open_group("x3", 2)
    with pytest.raises(TransportError, match="waited"):
        rendezvous(ticket, 0, 1, [0, 1], timeout=0.5)


def test_a_bad_token_is_refused(server: RendezvousServer) -> None:
    ticket = server.open_group("x4", 1)
    forged = RendezvousTicket(ticket.address, ticket.port, "x4", "0" * 32, 1)
    with pytest.raises(TransportError, match="refused"):
        rendezvous(forged, 0, 1, [0, 1], timeout=5)


def test_a_failing_task_runs_the_abort_hook_once_with_every_location(
    server: RendezvousServer,
) -> None:
    calls: list[tuple[int, list[Any]]] = []

    async def hook(round_id: int, locations: list[Any]) -> None:
        calls.append((round_id, sorted(locations)))

    ticket = server.open_group("x5", 2, hook)
    meet_all(ticket, [7, 8], round_id=3)
    report_abort(ticket, 0, 7, round_id=3)
    report_abort(ticket, 1, 8, round_id=3)  # the stage's other failure: released once already
    assert calls == [(3, [[0, 7], [1, 8]])]
    meet_all(ticket, [9, 10], round_id=4)  # the next action's run fails too: its own hook
    report_abort(ticket, 1, 10, round_id=4)
    assert calls[1:] == [(4, [[0, 9], [1, 10]])]
