"""The main job (the README's ``make run``) at a small size, its SIGKILL included: it exits
0 and prints the verdict that the committed output equals Spark's DataFrame groupBy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def run_main_job(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The main job at a small size (80k events, 3,000 users, 4 files) with ``args``."""
    pytest.importorskip("pyspark")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "client.main_job",
            "--events",
            "80000",
            "--users",
            "3000",
            "--files",
            "4",
            "--checkpoint-interval",
            "0.25",
            "--workdir",
            str(tmp_path),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )


def test_main_job_restarts_after_a_sigkill_and_its_output_equals_spark(tmp_path: Path) -> None:
    proc = run_main_job(tmp_path, "--parallelism", "1")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    verdict = re.search(
        r"^verdict +PASSED: the committed output equals Spark's DataFrame groupBy for all "
        r"([\d,]+) users \(nothing lost, nothing twice\)$",
        out,
        re.M,
    )
    assert verdict is not None, out[-4000:]
    assert int(verdict.group(1).replace(",", "")) > 1000
    kill = re.search(r"^kill +SIGKILL to task totals-0's Python worker \(pid (\d+)\)", out, re.M)
    assert kill is not None, out[-4000:]
    restarts = re.search(r"^restarts +(\d+), from checkpoint (\d+)", out, re.M)
    assert restarts is not None and int(restarts.group(1)) >= 1, out[-4000:]
    assert re.search(r"^committed +80,000 running-total records", out, re.M), out[-4000:]
    assert "network buffer pool whole: True" in out
    # the output is where --workdir said, and nothing uncommitted survived the end
    assert list((tmp_path / "out").glob("part-*"))
    assert not list((tmp_path / "out" / ".inprogress").iterdir())


def test_main_job_unaligned_restarts_after_a_sigkill_and_its_output_equals_spark(
    tmp_path: Path,
) -> None:
    """``--checkpointing unaligned`` with two subtasks per operator (the running totals
    read two channels, so a checkpoint triggers at its first barrier and persists what
    the other channel delivers before its own): SIGKILL, restart, output exact."""
    proc = run_main_job(tmp_path, "--parallelism", "2", "--checkpointing", "unaligned")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert re.search(r"^verdict +PASSED: ", out, re.M), out[-4000:]
    assert re.search(r"exactly-once unaligned checkpoints every", out), out[-4000:]
    unaligned = re.search(r"^unaligned +(\d+) of (\d+) checkpoints triggered unaligned", out, re.M)
    assert unaligned is not None, out[-4000:]
    restarts = re.search(r"^restarts +(\d+), from checkpoint (\d+)", out, re.M)
    assert restarts is not None and int(restarts.group(1)) >= 1, out[-4000:]
    assert re.search(r"^committed +80,000 running-total records", out, re.M), out[-4000:]
    assert "network buffer pool whole: True" in out
