"""``python -m server`` refuses bad flags and bad config values: exit 2, the setting named."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

# (flags, TOML file content or None, what stderr must name)
REFUSED = {
    "toml-wrong-type": ([], 'data_port = "8080"\n', ["data_port", "TOML type str"]),
    "toml-bool-for-size": ([], "network_memory = true\n", ["network_memory"]),
    "toml-unknown-key": (
        [],
        'netwrok_memory = "64mb"\n',
        ["unknown setting", "netwrok_memory", "did you mean 'network_memory'"],
    ),
    "toml-not-toml": ([], "segment_size = = 3\n", ["config", "not valid TOML"]),
    "segment-size-1000": (["--segment-size", "1000"], None, ["segment_size", "--segment-size"]),
    "segment-size-not-power-of-two": (["--segment-size", "48kb"], None, ["segment_size"]),
    "network-memory-lots": (
        ["--network-memory", "lots"],
        None,
        ["network_memory", "'lots'", "--network-memory"],
    ),
    "network-memory-too-small": (["--network-memory", "64kb"], None, ["network_memory"]),
    "data-port-70000": (["--data-port", "70000"], None, ["data_port", "70000", "--data-port"]),
    "low-watermark-equals-default-high": (
        ["--low-watermark", "256kb"],
        None,
        ["low_watermark", "high_watermark"],
    ),
    "low-watermark-above-high": (
        ["--low-watermark", "64kb", "--high-watermark", "32kb"],
        None,
        ["low_watermark", "high_watermark"],
    ),
    # below the smallest buffer a producer cuts: announced, never honoured (issue 18)
    "debloat-min-below-the-writers-floor": (
        ["--debloat", "--debloat-min-buffer-size", "128"],
        None,
        ["debloat_min_buffer_size", "'128'", "256 bytes", "--debloat-min-buffer-size"],
    ),
    "unknown-flag": (["--bogus-flag", "1"], None, ["unrecognized arguments", "--bogus-flag"]),
    "flag-overrides-bad-toml-still-refused": (
        ["--data-port", "0"],
        "data-port = 99999\n",
        ["data_port", "99999"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_setting_is_refused_with_exit_2(case: str, dm: ModuleType, tmp_path: Path) -> None:
    flags, toml, named = REFUSED[case]
    spill = tmp_path / "spill"
    args = ["--spill-dir", str(spill), "--data-port", "0", "--http-port", "0", *flags]
    if toml is not None:
        cfg = tmp_path / "daemon.toml"
        cfg.write_text(toml)
        args = ["--config", str(cfg), *args]
    res = dm.run_daemon_cli(args)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    for text in named:
        assert text in res.stderr, f"{text!r} not in stderr: {res.stderr}"
    assert res.stdout == "", "a refused daemon must not print a ready line"
    assert "Traceback" not in res.stderr


def test_secret_file_readable_by_others_is_refused(dm: ModuleType, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\n")
    os.chmod(secret, 0o644)
    res = dm.run_daemon_cli(["--spill-dir", str(tmp_path / "spill"), "--secret-file", str(secret)])
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "secret_file" in res.stderr and "chmod 600" in res.stderr, res.stderr
    assert res.stdout == ""


def test_env_variable_with_bad_value_is_refused(dm: ModuleType, tmp_path: Path) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "server", "--spill-dir", str(tmp_path / "spill")],
        capture_output=True,
        text=True,
        cwd=dm.ROOT,
        env=dm.child_env(EXCHANGE_MAX_CONNECTIONS="zero"),
        timeout=30,
    )
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "max_connections" in res.stderr and "EXCHANGE_MAX_CONNECTIONS" in res.stderr
