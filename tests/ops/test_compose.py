"""``docker-compose.yml`` as Debian's ``docker-compose config`` resolves it, checked against the
project: every file it names exists, every daemon runs the project's own entry point with
flags and values the daemon accepts, ports agree with Prometheus's targets, each worker
shares its daemon's socket, the driver's work directory is on a volume its executors (in
the workers) see at the same path, and services report their health and restart.

There is no Docker engine here, so what can run does: the daemons' healthcheck command
against a real daemon started with the compose file's flags, and the driver's command
against a local standalone cluster (a daemon per worker, a shared directory for the volume).

``.ci/run`` installs docker-compose when it is missing and it runs as root; elsewhere the
tests that need it are skipped, saying so.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.local_connection import DAEMON_ENV
from client.main_job import parse_args as main_job_args
from tests.kit.modules import load_module

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
    # The image installs the project, so its console script (exchange-daemon) exists there;
    # the install compiles the data plane: setup.py and a compiler must be in the image.
    assert re.search(r"pip install .*'\.\[spark\]'", dockerfile), dockerfile
    assert re.search(r"^COPY .*\bsetup\.py\b", dockerfile, re.M), dockerfile
    assert dockerfile.index("build-essential") < dockerfile.index("pip install"), dockerfile


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


def _master_port(services: dict[str, Any]) -> tuple[str, str]:
    """(port, web UI port) of the master's command."""
    *_, script_text = shlex.split(services["master"]["command"])
    master = shlex.split(script_text)
    return master[master.index("--port") + 1], master[master.index("--webui-port") + 1]


def _driver_argv(services: dict[str, Any]) -> list[str]:
    command = services["driver"]["command"]
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    assert argv[:3] == ["python", "-m", "client.main_job"], argv
    return argv[3:]


def test_the_driver_and_the_workers_executors_share_its_work_directory(
    resolved: dict[str, Any],
) -> None:
    services = resolved["services"]
    args = main_job_args(_driver_argv(services))
    assert args.master == f"spark://master:{_master_port(services)[0]}"
    # input, checkpoints and output live under --workdir: on a named volume that the
    # workers (where executors run) mount at the same path
    assert args.workdir is not None
    [(target, volume)] = [
        (t, src)
        for t, src in _mounts(services["driver"]).items()
        if args.workdir == t or args.workdir.startswith(t + "/")
    ]
    assert volume in resolved["volumes"] and not volume.startswith(("/", ".")), volume
    for worker in ("worker-1", "worker-2"):
        assert _mounts(services[worker]).get(target) == volume, (worker, services[worker])
    # the job's tasks fit: 2 x parallelism slots (README), workers' cores as their script says
    script = (ROOT / "deploy" / "spark-worker.sh").read_text()
    cores = re.search(r'--cores "\$\{WORKER_CORES:-(\d+)\}"', script)
    assert cores is not None, script
    assert 2 * int(cores.group(1)) >= 2 * args.parallelism
    assert services["driver"]["restart"] == "no"  # a job, run once
    assert services["driver"]["depends_on"] == {
        w: {"condition": "service_healthy"} for w in ("worker-1", "worker-2")
    }


def _health_url(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"], test
    url = re.search(r"urlopen\('([^']+)'", test[3])
    assert url is not None, test
    return url.group(1)


def test_services_report_their_health_and_restart(resolved: dict[str, Any], deploy: Any) -> None:
    services = resolved["services"]
    daemons = _daemons(resolved, deploy)
    http_server = (ROOT / "server" / "http_server.py").read_text()
    for name, (svc, cfg) in daemons.items():
        url = _health_url(svc)
        assert url == f"http://127.0.0.1:{cfg.http_port}/healthz", (name, url)
        assert 'case "/healthz"' in http_server
    webui = _master_port(services)[1]
    assert _health_url(services["master"]) == f"http://127.0.0.1:{webui}/json/"
    script = (ROOT / "deploy" / "spark-worker.sh").read_text()
    assert "--webui-port" not in script  # so the worker's UI is on Spark's default, 8081
    for n in (1, 2):
        worker = services[f"worker-{n}"]
        assert _health_url(worker) == "http://127.0.0.1:8081/json/"
        assert worker["depends_on"] == {
            "master": {"condition": "service_healthy"},
            f"daemon-{n}": {"condition": "service_healthy"},
        }
    for name, svc in services.items():
        if name != "driver":
            assert svc["restart"] == "unless-stopped", name


def test_the_daemon_healthcheck_passes_while_a_daemon_serves_and_fails_after(
    resolved: dict[str, Any], deploy: Any, start_daemon: Any, tmp_path: Path
) -> None:
    """The healthcheck's own command, run against a daemon started with the compose file's
    flags (ports 0, paths in a temporary directory)."""
    svc, cfg = _daemons(resolved, deploy)["daemon-1"]
    argv = deploy.local_flags(shlex.split(svc["command"])[1:], tmp_path)
    advertise = svc["environment"]["EXCHANGE_ADVERTISE_HOST"]
    d = start_daemon(*argv, "--advertise-host", advertise)
    assert d.data_address.rpartition(":")[0] == advertise
    port = d.info["http"].rpartition(":")[2]
    code = svc["healthcheck"]["test"][3].replace(f":{cfg.http_port}/", f":{port}/")

    def check() -> int:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=60
        ).returncode

    assert check() == 0
    d.stop_clean()
    assert check() != 0


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_the_driver_command_runs_against_a_local_standalone_cluster(
    resolved: dict[str, Any], tmp_path: Path
) -> None:
    """The driver service's command with its master and the volume's path replaced by a
    local cluster (a Master, two Workers of one core, a daemon per Worker, all on 127.0.0.1)
    and a shared directory; smaller (20,000 events, parallelism 1: two slots)."""
    pytest.importorskip("pyspark")
    sx: Any = load_module("exchange_tests_spark_cluster", ROOT / "tests" / "spark" / "_cluster.py")
    services = resolved["services"]
    argv = _driver_argv(services)
    args = main_job_args(argv)
    [target] = [t for t in _mounts(services["driver"]) if args.workdir.startswith(t + "/")]
    volume = tmp_path / "volume"  # what the named volume is to every container
    workdir = volume / os.path.relpath(args.workdir, target)
    cluster = sx.StandaloneCluster(workers=2)
    try:
        cluster.start()
        argv[argv.index("--master") + 1] = cluster.master_url
        argv[argv.index("--workdir") + 1] = str(workdir)
        argv += ["--events", "20000", "--parallelism", "1"]
        env = sx.child_env(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
        out = subprocess.run(
            [sys.executable, "-m", "client.main_job", *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=800,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        # the driver's input, checkpoints and output all went to the shared directory
        assert {"in", "out", "checkpoints"} <= set(os.listdir(workdir)), os.listdir(workdir)
        assert any(n.startswith("part-") for n in os.listdir(workdir / "out"))
        # the executors wrote through their workers' daemons, which are left holding nothing
        for i in range(2):
            stats = cluster.daemon_stats(i)
            assert stats["network"]["available_segments"] == stats["network"]["total_segments"]
    finally:
        cluster.close()
