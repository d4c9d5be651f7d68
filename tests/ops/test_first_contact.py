"""What a first-time operator meets, run for real: the README's daemon command and its
low-level client snippet against each other (with the secret the command names), what a
daemon bound to a wildcard address advertises (host names from a private ``/etc/hosts``
in a mount and UTS namespace), a misspelled ``EXCHANGE_*`` variable, and ``--help``'s
socket default."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client.local_connection import DAEMON_ENV, SECRET_FILE_ENV, default_socket_path
from server.config import OTHER_ENV_VARS, DaemonConfig, env_var_name, unknown_env_vars
from server.daemon import ADVERTISE_HOST_ENV

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _readme_daemon_args() -> list[str]:
    """The flags of the daemon command README's "Running on a cluster" gives."""
    section = README.split("## Running on a cluster", 1)[1]
    block = re.search(r"```bash\n\s*(exchange-daemon .*?)```", section, re.S)
    assert block is not None, "README shows no exchange-daemon command"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    assert argv[0] == "exchange-daemon"
    return argv[1:]


def _readme_snippet() -> str:
    """README's low-level client API snippet (PartitionWriter, then PartitionReader)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    [snippet] = [b for b in blocks if "PartitionWriter(" in b and "PartitionReader(" in b]
    return snippet


def test_the_readme_snippet_reads_from_a_daemon_started_as_the_readme_says(
    start_daemon: Any, deploy: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    sock = tmp_path / "daemon.sock"
    args = deploy.local_flags(_readme_daemon_args(), tmp_path, {"--secret-file": str(secret)})
    assert "--host" in args
    # the README's wildcard host, on a test machine whose name may resolve to loopback only
    d = start_daemon(*args, "--advertise-host", "127.0.0.1")
    assert d.data_address.startswith("127.0.0.1:")

    snippet = _readme_snippet()
    assert '"10.0.0.5:7100"' in snippet and "    ...\n" in snippet
    code = snippet.replace('"10.0.0.5:7100"', repr(d.data_address)).replace(
        "    ...\n", "    print(repr(record))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXCHANGE_")}
    # what README's "Running on a cluster" tells executors to set, nothing else
    env.update({DAEMON_ENV: str(sock), SECRET_FILE_ENV: str(secret), "PYTHONPATH": str(ROOT)})
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # subpartition 0 holds the broadcast record, and whatever the key routed there
    assert "('config', 1)" in out.stdout.splitlines(), out.stdout
    d.wait_pool_whole()


# -- what a wildcard bind advertises ---------------------------------------------------------


def _in_namespace_with_hosts(hosts: str, tmp_path: Path, argv: list[str]) -> list[str]:
    """``argv`` run with host name ``node1`` and ``hosts`` as /etc/hosts (private mount
    and UTS namespaces: the machine's own files and name stay as they are)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /etc/hosts")
    probe = subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount/UTS namespaces here: {probe.stderr!r}")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    script = (
        f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts && hostname node1 && "
        f"exec {shlex.join(argv)}"
    )
    return ["unshare", "--mount", "--uts", "sh", "-c", script]


def _daemon_argv(tmp_path: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "server",
        "--host",
        "0.0.0.0",
        "--data-port",
        "0",
        "--http-port",
        "0",
        "--spill-dir",
        str(tmp_path / "spill"),
        *flags,
    ]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXCHANGE_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_a_wildcard_bind_whose_host_name_is_loopback_only_refuses_to_start(
    tmp_path: Path,
) -> None:
    argv = _in_namespace_with_hosts(
        "127.0.0.1 localhost\n127.0.1.1 node1\n", tmp_path, _daemon_argv(tmp_path)
    )
    out = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, env=_clean_env(), timeout=120
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""  # never ready: no port was opened
    assert ADVERTISE_HOST_ENV in out.stderr and "'node1'" in out.stderr, out.stderr
    assert "127.0.1.1" in out.stderr and "would dial themselves" in out.stderr, out.stderr


def _ready_line(argv: list[str], dm: Any) -> dict[str, Any]:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_clean_env(),
    )
    out, err = dm._LineReader(proc.stdout, "out"), dm._LineReader(proc.stderr, "err")
    try:
        line = out.next_line(dm.READY_TIMEOUT)
        assert line is not None, "".join(err.all)
        info: dict[str, Any] = json.loads(line)
    finally:
        proc.terminate()
        code = proc.wait(dm.STOP_TIMEOUT)
        out.join()
        err.join()
    assert code == 0, "".join(err.all)
    return info


def test_a_wildcard_bind_advertises_a_host_name_that_resolves_off_loopback(
    tmp_path: Path, dm: Any
) -> None:
    argv = _in_namespace_with_hosts(
        "127.0.0.1 localhost\n192.0.2.77 node1\n", tmp_path, _daemon_argv(tmp_path)
    )
    info = _ready_line(argv, dm)
    host, _, port = info["data"].rpartition(":")
    assert host == "node1" and int(port) > 0, info


def test_advertise_host_wins_over_the_host_name(tmp_path: Path, dm: Any) -> None:
    argv = _in_namespace_with_hosts(
        "127.0.1.1 node1\n",
        tmp_path,
        _daemon_argv(tmp_path, "--advertise-host", "exchange-7.example"),
    )
    info = _ready_line(argv, dm)
    assert info["data"].rpartition(":")[0] == "exchange-7.example", info


# -- environment variables and --help ------------------------------------------------------


def test_a_misspelled_variable_is_named_with_the_setting_it_resembles(
    run_daemon_cli: Any, tmp_path: Path
) -> None:
    env = {
        **_clean_env(),
        "EXCHANGE_NETWORK_MEMROY": "128mb",
        "EXCHANGE_DAEMON": "/run/exchange/daemon.sock",  # a task's variable: no warning
    }
    # a refused segment size makes the daemon exit right after loading its settings
    out = subprocess.run(
        [*_daemon_argv(tmp_path)[:3], "--segment-size", "3", "--spill-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    warnings = [line for line in out.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, out.stderr
    assert "EXCHANGE_NETWORK_MEMROY" in warnings[0]
    assert "did you mean EXCHANGE_NETWORK_MEMORY?" in warnings[0]


def test_every_variable_the_tasks_read_is_known_to_the_warning() -> None:
    read: set[str] = set()
    for path in (ROOT / "client").rglob("*.py"):
        read |= set(re.findall(r'Final = "(EXCHANGE_[A-Z_]+)"', path.read_text()))
    assert {DAEMON_ENV, SECRET_FILE_ENV} <= read
    settings = {env_var_name(name) for name in DaemonConfig.__dataclass_fields__}
    assert read <= settings | OTHER_ENV_VARS, read - settings - OTHER_ENV_VARS
    assert unknown_env_vars({name: "x" for name in read | settings | OTHER_ENV_VARS}) == []
    [warning] = unknown_env_vars({"EXCHANGE_SECRETFILE": "/x", "PATH": "/bin"})
    assert "EXCHANGE_SECRETFILE" in warning and "EXCHANGE_SECRET_FILE?" in warning


def test_help_names_the_socket_the_daemon_and_its_tasks_really_use() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_clean_env(), "COLUMNS": "1000"},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    [line] = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("--local-socket ")]
    default = re.search(r"default: ([^\]]+)\]", line)
    assert default is not None, line
    real = DaemonConfig().resolved_local_socket()
    assert default.group(1) == real == default_socket_path(), line
