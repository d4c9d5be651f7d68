"""``docs/deploy.md`` names only what exists: the daemon's flags, the environment variables
the daemon and the tasks read, and the repository's files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from client.local_connection import DAEMON_ENV, SECRET_FILE_ENV
from client.tls import TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV
from server.config import OTHER_ENV_VARS, DaemonConfig, env_var_name
from server.daemon import ADVERTISE_HOST_ENV

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "deploy.md").read_text()
#: Flags of other programs the page shows (spark-submit, kubectl, docker compose, systemctl).
OTHER_TOOLS = {
    "--conf",
    "--from-literal",
    "--build",
    "--wait",
    "--rm",
    "--master",
    "--workdir",
    "--now",
}


def test_every_daemon_flag_it_names_exists(deploy: Any) -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", DOC)) - OTHER_TOOLS
    assert {"--secret-file", "--tls-cert-file", "--network-memory", "--spill-dir"} <= named
    assert named <= deploy.daemon_flags(), named - deploy.daemon_flags()


def test_every_environment_variable_it_names_is_read() -> None:
    named = set(re.findall(r"\bEXCHANGE_[A-Z_]+[A-Z]\b", DOC))
    settings = {env_var_name(name) for name in DaemonConfig.__dataclass_fields__}
    tasks = {DAEMON_ENV, SECRET_FILE_ENV, TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV}
    tasks |= OTHER_ENV_VARS
    assert named <= settings | tasks | {ADVERTISE_HOST_ENV}, named - settings - tasks


def test_every_file_it_names_exists() -> None:
    named = set(re.findall(r"\b(?:deploy|bench|tests|docs|client|server)/[\w./-]*\w/?", DOC))
    assert len(named) >= 10
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
