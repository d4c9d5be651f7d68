"""Checks shared by the deployment tests (compose file, Kubernetes manifests): a daemon
command line as ``exchange-daemon`` / ``python -m server`` would take it."""

from __future__ import annotations

import shlex
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from server.config import DaemonConfig, build_arg_parser, load_config

ROOT = Path(__file__).resolve().parents[2]


def daemon_script() -> tuple[str, str]:
    """(name, entry point) of the daemon's console script in pyproject.toml."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    [(name, entry)] = [(n, e) for n, e in scripts.items() if e.startswith("server.")]
    return name, entry


def daemon_flags() -> set[str]:
    """Every option string the daemon's parser accepts (``--network-memory``, ...)."""
    return {s for a in build_arg_parser()._actions for s in a.option_strings}


def daemon_config(command: str | Sequence[str], env: Mapping[str, str] = {}) -> DaemonConfig:
    """The config a daemon started with ``command`` (``exchange-daemon ...`` or ``python -m
    server ...``) and ``env`` would run with; AssertionError for another program, a flag
    the daemon does not have (abbreviations too: argparse would take them, a reader would
    not recognise them) and a value it refuses (``ConfigError``)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    name, entry = daemon_script()
    assert entry == "server.__main__:main", entry
    if argv[:1] == [name]:
        args = argv[1:]
    else:
        assert argv[1:3] == ["-m", "server"] and "python" in argv[0], argv
        args = argv[3:]
    flags = daemon_flags()
    for arg in args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert flag in flags, f"{flag} is not a flag of {name} ({sorted(flags)})"
    return load_config(args, env=dict(env))


def local_flags(
    args: Sequence[str], tmp: Path, values: Mapping[str, str] | None = None
) -> list[str]:
    """A deployed daemon's flags (``args``, without the program) made to run here: ports 0,
    the spill directory and the socket under ``tmp``, then ``values`` (flag -> value). Each
    flag replaced must be among ``args``: the deployment's own command line is what runs."""
    argv = list(args)
    replace = {
        "--data-port": "0",
        "--http-port": "0",
        "--spill-dir": str(tmp / "spill"),
        "--local-socket": str(tmp / "daemon.sock"),
        **(values or {}),
    }
    for flag, value in replace.items():
        assert flag in argv, f"{flag} is not in {argv}"
        argv[argv.index(flag) + 1] = value
    if "--http-host" in argv:  # what probes and Prometheus reach there: loopback here
        argv[argv.index("--http-host") + 1] = "127.0.0.1"
    return argv
