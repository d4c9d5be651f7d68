"""The Kubernetes manifests (``deploy/k8s``) and the systemd unit start the daemon the way the
project's CLI accepts it: the same console script, flags the daemon's parser has, values its
loader takes (the ConfigMap's TOML file included, read by the daemon's own loader), ports,
probes and mounts that agree with those flags.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.local_connection import DAEMON_ENV, SECRET_FILE_ENV
from server.config import DaemonConfig

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


def _daemon_containers() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    found = [
        (f, meta, spec, c)
        for f, meta, spec in _pod_specs()
        for c in spec["containers"]
        if (c.get("command") or [""])[0] == "exchange-daemon"
    ]
    return found


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
    # the daemon refuses a secret file other users may read (load_secret): mode 0400
    assert volume["secret"]["defaultMode"] & 0o077 == 0, oct(volume["secret"]["defaultMode"])

    socket_volume, _ = _volume(spec, c, cfg.resolved_local_socket())
    spill_volume, _ = _volume(spec, c, cfg.spill_dir)
    if file == "daemonset.yaml":
        # executor pods on the node mount the same host directory; the spill directory is
        # the host's, so blocking partitions outlive the daemon's pod (upgrades)
        assert socket_volume["hostPath"]["path"] == os.path.dirname(cfg.resolved_local_socket())
        assert "hostPath" in spill_volume
        assert spec.get("terminationGracePeriodSeconds", 30) >= 10
    else:
        [executor] = [x for x in spec["containers"] if x is not c]
        env = {e["name"]: e.get("value") for e in executor["env"]}
        assert env[DAEMON_ENV] == cfg.resolved_local_socket()
        assert env[SECRET_FILE_ENV] == cfg.secret_file
        assert _volume(spec, executor, cfg.resolved_local_socket())[0] is socket_volume
        assert _volume(spec, executor, cfg.secret_file)[0] is volume


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
