"""``bench/soak.py``: a short run end to end (real daemons, 100 channels, consumers changing
pace), and the checks that make it fail (a lost, duplicated or corrupted record; growth)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "bench" / "soak.py"


def _soak() -> ModuleType:
    name = "exchange_bench_soak"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SOAK)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


soak = _soak()


def test_channel_checker_catches_loss_duplication_reordering_and_corruption() -> None:
    channels = [(0, 0), (1, 4)]
    ok = soak.ChannelChecker(channels)
    for seq in range(3):
        ok.add((0, 0, seq, soak.pad_for(seq)))
        ok.add((1, 4, seq, soak.pad_for(seq)))
    ok.verify(3)
    assert ok.records == 6

    cases = {
        "lost": [(0, 0, 0), (0, 0, 2)],
        "duplicated": [(0, 0, 0), (0, 0, 0)],
        "does not read": [(2, 0, 0)],
    }
    for what, records in cases.items():
        c = soak.ChannelChecker(channels)
        with pytest.raises(soak.BenchError, match=what):
            for p, s, seq in records:
                c.add((p, s, seq, soak.pad_for(seq)))
    c = soak.ChannelChecker(channels)
    with pytest.raises(soak.BenchError, match="corrupted"):
        c.add((0, 0, 0, soak.pad_for(1)))
    c = soak.ChannelChecker(channels)
    c.add((0, 0, 0, soak.pad_for(0)))
    with pytest.raises(soak.BenchError, match="ended early"):
        c.verify(1)  # channel (1, 4) got nothing


def test_growth_failures_flags_what_keeps_growing_and_nothing_flat() -> None:
    flat = [100.0, 101.0, 99.0, 100.0, 102.0, 100.0, 101.0, 100.0, 99.0]
    leaking = [16.0 + 2 * i for i in range(30)]  # two fds per round, never given back
    mib = float(2**20)
    assert soak.growth_failures({"fds": [flat], "tasks": [flat]}) == []
    failures = soak.growth_failures({"fds": [flat, leaking], "tasks": [flat, flat]})
    assert len(failures) == 1 and failures[0].startswith("daemon 1 fds")
    rss_flat = [34 * mib + i * 1024 for i in range(30)]
    rss_leak = [34 * mib + i * mib for i in range(60)]  # 1 MiB per round
    assert soak.growth_failures({"rss": [rss_flat]}) == []
    assert soak.growth_failures({"rss": [rss_leak]})[0].startswith("daemon 0 rss")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_soak_moves_everything_once_and_exits_zero() -> None:
    out = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "20", "--interval", "5", "--records", "200"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["growth_failures"] == []
    assert result["channels"] == 100
    assert result["rounds"] >= 2
    assert result["records"] == result["rounds"] * 100 * 200
    assert result["pools_whole_at_stop"] is True
    assert result["final_partitions"] == [0, 0, 0, 0]
    assert result["consumer_pace_changes"] > 0 and result["consumer_paused_s"] > 0
    # the sampler printed figures over time for each of the 4 daemons
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    assert lines and all(ln.count("tasks ") == 4 for ln in lines), out.stdout[-2000:]
