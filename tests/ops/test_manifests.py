"""The Kubernetes manifests (``deploy/k8s``) and the systemd unit start the daemon the way the
project's CLI accepts it: the same console script, flags the daemon's parser has, values its
loader takes (the ConfigMap's TOML file included, read by the daemon's own loader), ports,
probes and mounts that agree with those flags.

And they work on first contact with the official Spark image, whose executors run as uid and
gid 185: the users each container runs as, the owner, group and mode kubelet gives a Secret's
files (``fsGroup`` adds group read), and the socket's group and mode the daemon sets decide
who may read and connect to what, checked the way the kernel checks it (owner bits, else
group bits, else other bits; root passes) - and once with a real daemon started with the
manifest's configuration and a client running as uid 185.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.local_connection import DAEMON_ENV, SECRET_FILE_ENV
from server.config import DaemonConfig
from tests.kit.users import SPARK_GID, SPARK_UID, fetch_info_as

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
HTTP_SERVER = (ROOT / "server" / "http_server.py").read_text()


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"], path
            doc["_file"] = path.name
            docs.append(doc)
    return docs


DOCS = _documents()


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def _pod_specs() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file, pod metadata, pod spec) of every pod the manifests define."""
    for d in DOCS:
        if d["kind"] == "Pod":
            yield d["_file"], d["metadata"], d["spec"]
        elif "template" in d.get("spec", {}):
            yield d["_file"], d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"]


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _daemon_containers() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    found = [
        (f, meta, spec, c)
        for f, meta, spec in _pod_specs()
        for c in _containers(spec)
        if (c.get("command") or [""])[0] == "exchange-daemon"
    ]
    return found


def _executor(file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, container) of the executor the daemon of ``file`` serves."""
    pod_file = "executor-pod.yaml" if file == "daemonset.yaml" else file
    [(spec, c)] = [
        (spec, c)
        for f, _, spec in _pod_specs()
        if f == pod_file
        for c in spec["containers"]
        if c["name"] == "spark-executor"
    ]
    return spec, c


def _volume(
    spec: dict[str, Any], container: dict[str, Any], path: str
) -> tuple[dict[str, Any], str]:
    """The pod volume holding ``path`` in ``container``, and ``path`` relative to its mount."""
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    for m in mounts:
        if path == m["mountPath"] or path.startswith(m["mountPath"] + "/"):
            [volume] = [v for v in spec["volumes"] if v["name"] == m["name"]]
            return volume, os.path.relpath(path, m["mountPath"])
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def _config_of(
    spec: dict[str, Any], container: dict[str, Any], deploy: Any, tmp_path: Path
) -> DaemonConfig:
    """The daemon container's config, its ``--config`` file taken from the ConfigMap."""
    argv = [*container["command"], *container.get("args", [])]
    assert "--config" in argv
    i = argv.index("--config") + 1
    volume, key = _volume(spec, container, argv[i])
    config_map = _by_kind("ConfigMap")[volume["configMap"]["name"]]
    toml = tmp_path / key
    toml.write_text(config_map["data"][key])
    argv[i] = str(toml)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    cfg: DaemonConfig = deploy.daemon_config(argv, env)
    return cfg


def test_manifests_define_a_daemonset_a_sidecar_a_configmap_and_a_secret() -> None:
    kinds = sorted((d["kind"], d["_file"]) for d in DOCS)
    assert kinds == [
        ("ConfigMap", "configmap.yaml"),
        ("DaemonSet", "daemonset.yaml"),
        ("Pod", "executor-pod.yaml"),
        ("Pod", "executor-sidecar.yaml"),
        ("Secret", "secret.yaml"),
    ]
    files = [f for f, *_ in _daemon_containers()]
    assert sorted(files) == ["daemonset.yaml", "executor-sidecar.yaml"]


@pytest.mark.parametrize("file", ["daemonset.yaml", "executor-sidecar.yaml"])
def test_daemon_container_flags_ports_and_probes_match_the_cli(
    file: str, deploy: Any, tmp_path: Path
) -> None:
    [(_, meta, spec, c)] = [x for x in _daemon_containers() if x[0] == file]
    cfg = _config_of(spec, c, deploy, tmp_path)
    # the ConfigMap's TOML file went through the daemon's loader: its 512mb are in force,
    # unless the container's flags override them (a sidecar serves one executor only)
    mib = 512 if file == "daemonset.yaml" else 128
    assert cfg.network_memory == mib * 1024 * 1024
    assert cfg.host == "0.0.0.0"
    ports = {p["name"]: p for p in c["ports"]}
    assert ports["data"]["containerPort"] == cfg.data_port != 0
    assert ports["http"]["containerPort"] == cfg.http_port != 0
    if file == "daemonset.yaml":  # other nodes dial the node's IP
        assert ports["data"]["hostPort"] == cfg.data_port
    advertise = {e["name"]: e for e in c["env"]}["EXCHANGE_ADVERTISE_HOST"]
    ip = "status.hostIP" if file == "daemonset.yaml" else "status.podIP"
    assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == ip
    for probe in ("readinessProbe", "livenessProbe"):
        if probe in c:
            get = c[probe]["httpGet"]
            assert get["port"] in ("http", cfg.http_port)
            assert f'case "{get["path"]}"' in HTTP_SERVER, get["path"]
    notes = meta["annotations"]
    assert notes["prometheus.io/port"] == str(cfg.http_port)
    assert f'case "{notes["prometheus.io/path"]}"' in HTTP_SERVER
    # memory asked for covers the network memory
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith(("Mi", "Gi"))
    mib = int(limit[:-2]) * (1024 if limit.endswith("Gi") else 1)
    assert mib * 1024 * 1024 > cfg.network_memory, (limit, cfg.network_memory)


@pytest.mark.parametrize("file", ["daemonset.yaml", "executor-sidecar.yaml"])
def test_secret_socket_and_spill_dir_are_mounted_where_the_flags_point(
    file: str, deploy: Any, tmp_path: Path
) -> None:
    [(_, _, spec, c)] = [x for x in _daemon_containers() if x[0] == file]
    cfg = _config_of(spec, c, deploy, tmp_path)
    assert cfg.secret_file is not None
    volume, key = _volume(spec, c, cfg.secret_file)
    secret = _by_kind("Secret")[volume["secret"]["secretName"]]
    assert key in secret.get("stringData", {}) or key in secret.get("data", {})

    socket_volume, _ = _volume(spec, c, cfg.resolved_local_socket())
    spill_volume, spill_path = _volume(spec, c, cfg.spill_dir)
    ex_spec, executor = _executor(file)
    env = {e["name"]: e.get("value") for e in executor["env"]}
    assert env[DAEMON_ENV] == cfg.resolved_local_socket()
    ex_socket_volume, _ = _volume(ex_spec, executor, env[DAEMON_ENV])
    ex_secret_volume, ex_key = _volume(ex_spec, executor, env[SECRET_FILE_ENV])
    # the executor reads the same Secret's key, through a mount of its own pod
    assert ex_secret_volume["secret"]["secretName"] == volume["secret"]["secretName"]
    assert ex_key == key
    if file == "daemonset.yaml":
        # executor pods on the node mount the same host directory; the spill directory is
        # the host's, so blocking partitions outlive the daemon's pod (upgrades)
        sock_dir = os.path.dirname(cfg.resolved_local_socket())
        assert socket_volume["hostPath"] == {"path": sock_dir, "type": "DirectoryOrCreate"}
        # the executor's pod needs the daemon's directory, never creates an empty one
        assert ex_socket_volume["hostPath"] == {"path": sock_dir, "type": "Directory"}
        assert "hostPath" in spill_volume
        assert spec.get("terminationGracePeriodSeconds", 30) >= 10
    else:
        assert ex_spec is spec and ex_socket_volume is socket_volume
        assert "emptyDir" in socket_volume
        # kubelet makes an emptyDir 0777, which the daemon refuses as its spill directory
        # (docs/security.md): it spills into a directory of its own inside it
        assert "emptyDir" in spill_volume and spill_path not in (".", "")


# -- who may read and connect to what (official Spark image: uid/gid 185) --------------------

_READ, _WRITE = 4, 2


def _user(spec: dict[str, Any], container: dict[str, Any]) -> tuple[int, set[int]]:
    """(uid, gids) a container runs as; the manifests say it rather than rely on an image's
    USER line."""
    pod = spec.get("securityContext", {})
    own = container.get("securityContext", {})
    uid = own.get("runAsUser", pod.get("runAsUser"))
    gid = own.get("runAsGroup", pod.get("runAsGroup"))
    assert uid is not None and gid is not None, f"{container['name']}: runAsUser/runAsGroup"
    gids = {gid, *pod.get("supplementalGroups", [])}
    if "fsGroup" in pod:
        gids.add(pod["fsGroup"])
    return uid, gids


def _secret_file(spec: dict[str, Any], volume: dict[str, Any]) -> tuple[int, int, int]:
    """(uid, gid, mode) kubelet gives the files of a Secret volume: root's, with defaultMode;
    with an fsGroup, that group and read for it added (read-only volumes: mode | 0440)."""
    mode = volume["secret"].get("defaultMode", 0o644)
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    if fs_group is None:
        return 0, 0, mode
    return 0, fs_group, mode | 0o440


def _allowed(user: tuple[int, set[int]], owner: int, group: int, mode: int, want: int) -> bool:
    """The kernel's permission check: root passes; else the owner's, group's or others' bits."""
    uid, gids = user
    if uid == 0:
        return True
    bits = mode >> 6 if uid == owner else mode >> 3 if group in gids else mode
    return bits & want == want


@pytest.mark.parametrize("file", ["daemonset.yaml", "executor-sidecar.yaml"])
def test_executors_of_the_spark_image_reach_the_socket_and_read_the_secret(
    file: str, deploy: Any, tmp_path: Path
) -> None:
    [(_, _, spec, c)] = [x for x in _daemon_containers() if x[0] == file]
    cfg = _config_of(spec, c, deploy, tmp_path)
    daemon = _user(spec, c)
    ex_spec, executor = _executor(file)
    spark = _user(ex_spec, executor)
    assert spark[0] == SPARK_UID and SPARK_GID in spark[1], spark
    assert ex_spec.get("securityContext", {}).get("runAsNonRoot") or executor[
        "securityContext"
    ].get("runAsNonRoot")

    # the daemon's own secret: it can read it, and nobody else (the daemon refuses more)
    assert cfg.secret_file is not None
    owner, group, mode = _secret_file(spec, _volume(spec, c, cfg.secret_file)[0])
    assert _allowed(daemon, owner, group, mode, _READ)
    assert mode & 0o077 == 0, f"{file}: the daemon's secret is mode {mode:04o}"

    # the executor's copy: readable by uid 185
    env = {e["name"]: e.get("value") for e in executor["env"]}
    owner, group, mode = _secret_file(ex_spec, _volume(ex_spec, executor, env[SECRET_FILE_ENV])[0])
    assert _allowed(spark, owner, group, mode, _READ), (file, owner, group, oct(mode))

    # the socket: the daemon's, of local_socket_group, mode local_socket_mode; connecting
    # takes write permission
    gid = cfg.local_socket_gid()
    assert gid is not None, f"{file}: the socket stays root's group, uid 185 cannot connect"
    assert _allowed(spark, daemon[0], gid, cfg.local_socket_mode, _READ | _WRITE)
    # nobody else: neither other users nor other groups
    assert not _allowed((1000, {1000}), daemon[0], gid, cfg.local_socket_mode, _WRITE)
    # a root daemon gives the socket away only with CAP_CHOWN
    caps = c.get("securityContext", {}).get("capabilities", {})
    if "ALL" in caps.get("drop", []):
        assert "CHOWN" in caps.get("add", []), caps
    assert c["securityContext"].get("allowPrivilegeEscalation") is False


def test_the_sidecar_is_a_native_sidecar_that_serves_before_the_executor_starts() -> None:
    [(_, _, spec, c)] = [x for x in _daemon_containers() if x[0] == "executor-sidecar.yaml"]
    # an init container that keeps running: started (and probed) before the executor,
    # stopped after it, so the pod completes when the executor exits
    assert c in spec.get("initContainers", []) and c not in spec["containers"]
    assert c["restartPolicy"] == "Always"
    probe = c["startupProbe"]["httpGet"]
    assert probe["port"] == "http" and f'case "{probe["path"]}"' in HTTP_SERVER
    assert [x["name"] for x in spec["containers"]] == ["spark-executor"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as uid 185")
def test_a_daemon_with_the_daemonsets_settings_admits_uid_185(
    start_daemon: Any, deploy: Any, tmp_path: Path
) -> None:
    """The DaemonSet's own command line and ConfigMap, paths moved under a temporary
    directory: a client running as uid/gid 185 completes the handshake on its socket."""
    [(_, _, spec, c)] = [x for x in _daemon_containers() if x[0] == "daemonset.yaml"]
    cfg = _config_of(spec, c, deploy, tmp_path)
    shared = Path(tempfile.mkdtemp(prefix="xk8s-"))
    try:
        shared.chmod(0o755)  # as kubelet creates the hostPath
        sock = shared / os.path.basename(cfg.resolved_local_socket())
        secret = shared / "secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o400)
        values = {
            "--config": str(tmp_path / "exchange.toml"),  # the ConfigMap's file (_config_of)
            "--host": "127.0.0.1",
            "--local-socket": str(sock),
            "--secret-file": str(secret),
        }
        d = start_daemon(*deploy.local_flags(c["command"][1:], tmp_path, values))
        st = sock.stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (SPARK_GID, cfg.local_socket_mode)
        key = secret.read_bytes()
        assert fetch_info_as(SPARK_UID, [SPARK_GID], str(sock), key) == f"ok {d.daemon_id}"
        assert fetch_info_as(1000, [1000], str(sock), key).startswith("refused ")
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_the_daemonset_replaces_one_node_at_a_time() -> None:
    ds = _by_kind("DaemonSet")["exchange-daemon"]
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    namespaces = {d["metadata"].get("namespace") for d in DOCS if d["kind"] != "Pod"}
    assert namespaces == {"spark"}


def test_systemd_unit_runs_the_daemon_with_flags_it_accepts(deploy: Any) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "deploy" / "exchange-daemon.service").read_text())
    service = unit["Service"]
    exec_start = service["ExecStart"].replace("\\\n", " ")
    argv = shlex.split(exec_start)
    name, _ = deploy.daemon_script()
    assert Path(argv[0]).name == name
    env = dict(kv.split("=", 1) for kv in shlex.split(service.get("Environment", "")))
    cfg = deploy.daemon_config([name, *argv[1:]], env)
    assert cfg.data_port == 7100 and cfg.http_port == 7101  # the ports the docs give
    assert os.path.dirname(cfg.resolved_local_socket()) == "/run/" + service["RuntimeDirectory"]
    assert cfg.spill_dir == "/var/lib/" + service["StateDirectory"]
    assert re.fullmatch(r"\d+", service["TimeoutStopSec"])
