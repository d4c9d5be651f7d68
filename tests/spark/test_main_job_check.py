"""The main job's checker (``client.main_job.check_output`` and ``output_equals``) on its
own: committed outputs with a record lost, a record doubled, a wrong sum or a wrong count
fail the verdict; the right output passes. test_main_job trusts this verdict."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.main_job import check_output, output_equals

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

#: (user, duration, bytes) of the input events, in order.
EVENTS = [(1, 10, 100), (2, 5, 50), (1, 20, 200), (3, 7, 70), (1, 30, 300), (2, 6, 60)]


def _running_totals() -> list[dict[str, int]]:
    """The right output: per event, its user's running count and sums."""
    totals: dict[int, tuple[int, int, int]] = {}
    out = []
    for user, d, b in EVENTS:
        n, dd, bb = totals.get(user, (0, 0, 0))
        totals[user] = (n + 1, dd + d, bb + b)
        out.append({"user": user, "n": n + 1, "duration": dd + d, "bytes": bb + b})
    return out


def _lose(lines: list[dict[str, int]]) -> list[dict[str, int]]:
    return lines[:2] + lines[3:]  # user 1's second event


def _double(lines: list[dict[str, int]]) -> list[dict[str, int]]:
    return [*lines, lines[3]]


def _wrong_sum(lines: list[dict[str, int]]) -> list[dict[str, int]]:
    return [{**r, "bytes": r["bytes"] + 1} if r == lines[-2] else r for r in lines]


def _wrong_count(lines: list[dict[str, int]]) -> list[dict[str, int]]:
    return [{**r, "n": 9} if r == lines[1] else r for r in lines]


def _lost_user(lines: list[dict[str, int]]) -> list[dict[str, int]]:
    return [r for r in lines if r["user"] != 3]


@pytest.fixture
def inputs(tmp_path: Path) -> str:
    d = tmp_path / "in"
    d.mkdir()
    with open(d / "clicks-000.jsonl", "w") as f:
        for i, (u, dur, b) in enumerate(EVENTS):
            rec = {"user": u, "ts": i, "type": "view", "page": 1, "duration": dur, "bytes": b}
            f.write(json.dumps(rec) + "\n")
    return str(d / "*.jsonl")


def _committed(tmp_path: Path, lines: list[dict[str, int]]) -> str:
    out = tmp_path / "out"
    (out / ".inprogress").mkdir(parents=True)
    half = len(lines) // 2
    for i, part in enumerate((lines[:half], lines[half:])):
        (out / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    # uncommitted files never count, whatever they hold
    (out / ".inprogress" / "part-9.jsonl").write_text(json.dumps(lines[0]) + "\n")
    (out / "_pending-part-8.jsonl").write_text(json.dumps(lines[0]) + "\n")
    return str(out)


def test_the_right_output_passes(spark: Any, tmp_path: Path, inputs: str) -> None:
    verdict = check_output(spark, inputs, _committed(tmp_path, _running_totals()))
    assert verdict == {
        "users": 3,
        "bad_users": 0,
        "events": 6,
        "lines": 6,
        "duplicates": 0,
        "missing": 0,
    }
    assert output_equals(verdict, len(EVENTS))
    assert not output_equals(verdict, len(EVENTS) + 1)  # the input it was asked to read


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_lose, {"bad_users": 1, "lines": 5, "duplicates": 0, "missing": 1}),
        (_double, {"bad_users": 0, "lines": 7, "duplicates": 1, "missing": 0}),
        (_wrong_sum, {"bad_users": 1, "lines": 6, "duplicates": 0, "missing": 0}),
        (_wrong_count, {"bad_users": 1, "lines": 6, "duplicates": 0, "missing": 0}),
        (_lost_user, {"bad_users": 1, "lines": 5, "duplicates": 0, "missing": 1}),
    ],
    ids=["record-lost", "record-doubled", "wrong-sum", "wrong-count", "user-lost"],
)
def test_a_damaged_output_fails(
    spark: Any,
    tmp_path: Path,
    inputs: str,
    damage: Callable[[list[dict[str, int]]], list[dict[str, int]]],
    expected: dict[str, int],
) -> None:
    verdict = check_output(spark, inputs, _committed(tmp_path, damage(_running_totals())))
    assert {k: verdict[k] for k in expected} == expected, verdict
    assert verdict["users"] == 3 and verdict["events"] == 6
    assert not output_equals(verdict, len(EVENTS))
