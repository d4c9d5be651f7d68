"""``docker-compose.yml`` as Debian's ``docker-compose config`` resolves it, checked against the
project: every file it names exists, every daemon runs the project's own entry point with
flags and values the daemon accepts, ports agree with Prometheus's targets, and each worker
shares its daemon's socket.

``.ci/run`` installs docker-compose when it is missing and it runs as root; elsewhere the
tests that need it are skipped, saying so.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.local_connection import DAEMON_ENV
from client.main_job import parse_args as main_job_args

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
NO_COMPOSE = (
    "Debian's docker-compose is not installed (.ci/run installs it with apt-get when it runs "
    "as root: apt-get install docker-compose)"
)
SERVICES = {"master", "daemon-1", "daemon-2", "worker-1", "worker-2", "driver"}
SERVICES |= {"prometheus", "grafana"}


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    return subprocess.run(
        [COMPOSE, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, paths absolute)."""
    if COMPOSE is None:
        pytest.skip(NO_COMPOSE)
    out = _compose("config")
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (``source:target[:mode]``)."""
    result = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        result[parts[1]] = parts[0]
    return result


def _repo_path(source: str) -> Path:
    """A bind mount's source inside the repository (docker-compose makes it absolute)."""
    path = Path(source)
    path = path if path.is_absolute() else ROOT / path
    assert path.resolve().is_relative_to(ROOT), f"{source} is outside the repository"
    return path


def _in_container(service: dict[str, Any], path: str) -> Path:
    """The repository file a container sees at ``path`` through a bind mount."""
    for target, source in sorted(_mounts(service).items(), key=lambda m: -len(m[0])):
        if source.startswith(("/", ".")) and (path == target or path.startswith(target + "/")):
            return _repo_path(source) / os.path.relpath(path, target)
    raise AssertionError(f"{path} is not mounted from the repository: {service.get('volumes')}")


def _daemons(resolved: dict[str, Any], deploy: Any) -> dict[str, Any]:
    """service name -> (service, DaemonConfig) of every service that runs the daemon."""
    name, _ = deploy.daemon_script()
    result = {}
    for svc_name, svc in resolved["services"].items():
        command = svc.get("command") or ""
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if argv[:1] == [name]:
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
            result[svc_name] = (svc, deploy.daemon_config(argv, env))
    return result


@pytest.mark.skipif(COMPOSE is None, reason=NO_COMPOSE)
def test_docker_compose_config_accepts_the_file() -> None:
    out = _compose("config", "-q")
    assert out.returncode == 0, out.stderr
    services = _compose("config", "--services")
    assert set(services.stdout.split()) == SERVICES, services.stdout


def test_daemon_services_run_the_project_daemon_with_flags_it_accepts(
    resolved: dict[str, Any], deploy: Any
) -> None:
    daemons = _daemons(resolved, deploy)
    assert set(daemons) == {"daemon-1", "daemon-2"}
    for name, (svc, cfg) in daemons.items():
        assert cfg.host == "0.0.0.0", name  # reachable from the other containers
        assert svc["environment"]["EXCHANGE_ADVERTISE_HOST"] == name  # what consumers dial
        # the HTTP port is the published one (the dashboard, Prometheus)
        assert cfg.http_port in {int(p["target"]) for p in svc["ports"]}, svc["ports"]
        assert cfg.data_port != 0 and cfg.http_port != 0
        # the socket lives on the volume shared with the worker
        sock_dir = os.path.dirname(cfg.resolved_local_socket())
        assert sock_dir in _mounts(svc), (sock_dir, svc["volumes"])
    assert len({cfg.data_port for _, cfg in daemons.values()}) == 1


def test_prometheus_scrapes_every_daemon_on_its_http_port(
    resolved: dict[str, Any], deploy: Any
) -> None:
    prom = resolved["services"]["prometheus"]
    config_path = _in_container(prom, "/etc/prometheus/prometheus.yml")
    assert config_path == ROOT / "deploy" / "prometheus.yml"
    scrape = yaml.safe_load(config_path.read_text())["scrape_configs"]
    targets = {t for job in scrape for sc in job["static_configs"] for t in sc["targets"]}
    daemons = _daemons(resolved, deploy)
    assert targets == {f"{name}:{cfg.http_port}" for name, (_, cfg) in daemons.items()}
    image = prom["image"]
    version = (
        subprocess.run(
            ["prometheus", "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        if shutil.which("prometheus")
        else ""
    )
    m = re.search(r"version (\d+\.\d+\.\d+)", version)
    if m:  # the image is the version tests/ops/test_prometheus.py runs
        assert image == f"prom/prometheus:v{m.group(1)}", (image, version)


def test_every_file_the_compose_file_names_exists(resolved: dict[str, Any]) -> None:
    dockerfiles = set()
    for name, svc in resolved["services"].items():
        if "build" in svc:
            context = _repo_path(svc["build"]["context"])
            assert context == ROOT, name
            dockerfiles.add(context / svc["build"]["dockerfile"])
        for target, source in _mounts(svc).items():
            if source.startswith(("/", ".")):
                assert _repo_path(source).exists(), f"{name}: {source} -> {target}"
    assert dockerfiles == {ROOT / "deploy" / "Dockerfile"}
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    # The image installs the project, so its console script (exchange-daemon) exists there.
    assert re.search(r"pip install .*'\.\[spark\]'", dockerfile), dockerfile


def test_workers_run_the_repository_script_and_find_their_daemon(
    resolved: dict[str, Any], deploy: Any
) -> None:
    daemons = _daemons(resolved, deploy)
    services = resolved["services"]
    sh, dash_c, script_text = shlex.split(services["master"]["command"])
    assert (sh, dash_c) == ("sh", "-c")
    master = shlex.split(script_text)
    assert "org.apache.spark.deploy.master.Master" in master
    master_port = master[master.index("--port") + 1]
    for n in (1, 2):
        worker, (daemon, cfg) = services[f"worker-{n}"], daemons[f"daemon-{n}"]
        script = _in_container(worker, worker["command"])
        assert script.is_file() and os.access(script, os.X_OK), script
        text = script.read_text()
        # the socket the worker's executors use is the one its daemon listens on
        assert f"export SPARK_HOME {DAEMON_ENV}={cfg.resolved_local_socket()}" in text
        sock_dir = os.path.dirname(cfg.resolved_local_socket())
        volume = _mounts(daemon)[sock_dir]
        assert _mounts(worker)[sock_dir] == volume
        assert [s for s in services.values() if volume in _mounts(s).values()] == [
            daemon,
            worker,
        ], "a daemon's socket volume is shared with its own worker only"
        assert f"spark://master:{master_port}" in text
        assert f"daemon-{n}" in worker["depends_on"]
    # the job the file's header tells to run exists and takes the master it names
    header = (ROOT / "docker-compose.yml").read_text().split("services:")[0]
    run = re.search(r"python -m (client\.\w+) (.*)", header)
    assert run is not None and run.group(1) == "client.main_job", header
    assert main_job_args(shlex.split(run.group(2))).master == f"spark://master:{master_port}"
