"""The Grafana dashboard (``deploy/grafana/dashboards/exchange.json``) asks only for metrics a
live daemon exports, and its provisioning files fit the compose file.

Names are compared with the ``# TYPE`` lines of a real daemon's ``/metrics`` (so families
without series yet, like the task gates', count too) under the exposition's suffix rules:
a counter's series end in ``_total``, a histogram's in ``_bucket`` / ``_sum`` / ``_count``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "exchange.json"
#: Series Prometheus makes itself for every target rather than scraping them.
PROMETHEUS_SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"}
    | {"unless", "offset", "atan2", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\b(?!\s*\()")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*\w+\s*\)\s*$")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels, grouping, durations
    and Grafana's ``$variables`` left out). ``label_values(expr, label)``, Grafana's
    template query, gives the names of ``expr``."""
    if m := _LABEL_VALUES.match(expr):
        expr = m.group("expr")
    e = _STRING.sub('""', expr)
    e = re.sub(r"\$\{?\w+\}?", "", e)  # Grafana variables ($__rate_interval, ${instance})
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges and subqueries
    e = _GROUPING.sub("", e)
    return {n for n in _IDENT.findall(e) if n.lower() not in _KEYWORDS}


def exported_names(exposition: str) -> set[str]:
    """Every series name a scrape of ``exposition`` can hold: the samples present, and for
    each ``# TYPE`` line the names its type gives (also when it has no series yet)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            if kind == "counter":
                base = family.removesuffix("_total")
                names |= {base + "_total", base + "_created"}
            elif kind == "histogram":
                names |= {family + s for s in ("_bucket", "_sum", "_count", "_created")}
            elif kind == "summary":
                names |= {family, family + "_sum", family + "_count", family + "_created"}
            else:
                names.add(family)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target (rows' nested panels included) and every
    query variable."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "query":
            q = v["query"]
            yield f"variable {v['name']!r}", q["query"] if isinstance(q, dict) else q


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return result


def test_metric_names_reads_promql_as_prometheus_would() -> None:
    assert metric_names(
        'sum by (instance) (rate(exchange_bytes_sent_total{instance=~"$instance"}[1m])) * 1000'
    ) == {"exchange_bytes_sent_total"}
    assert metric_names(
        "exchange_a / on (task, gate) group_left(x) exchange_b offset 5m > bool 1e3"
    ) == {"exchange_a", "exchange_b"}
    assert metric_names('max(x_bucket{le="0.5", job=~"a|b"}[$__rate_interval:10s])') == {"x_bucket"}
    assert metric_names("label_values(exchange_build_info, instance)") == {"exchange_build_info"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))") == {
        "h_bucket"
    }


def test_exported_names_follow_the_suffix_rules() -> None:
    text = (
        "# TYPE c_total counter\nc_total 1.0\n"
        "# TYPE g gauge\n"  # no series yet: still a name
        '# TYPE h histogram\nh_bucket{le="+Inf"} 1.0\nh_count 1.0\nh_sum 2.0\n'
    )
    names = exported_names(text)
    assert {"c_total", "g", "h_bucket", "h_sum", "h_count"} <= names
    assert "c" not in names and "h" not in names


def test_every_dashboard_query_names_a_metric_the_daemon_exports(
    start_daemon: Callable[..., Any], dashboard: dict[str, Any]
) -> None:
    d = start_daemon()
    exposition = d.http_get("/metrics").decode()
    exported = exported_names(exposition)
    # the figures the dashboard is for are all there, under their real names
    assert {
        "exchange_network_memory_used_ratio",
        "exchange_partition_back_pressured_seconds_total",
        "exchange_bytes_sent_total",
        "exchange_checkpoints_triggered_total",
        "exchange_job_restarts_total",
        "exchange_job_checkpoints_completed_total",
        "exchange_gate_buffer_size_bytes",
        "exchange_asyncio_tasks",
    } <= exported
    assert "exchange_bytes_sent" not in exported  # a counter is only seen with _total
    assert "exchange_checkpoints_triggered" not in exported  # a count: a counter
    assert "exchange_job_restarts" not in exported

    queries = list(dashboard_queries(dashboard))
    assert len(queries) >= 20, queries
    used: set[str] = set()
    unknown: list[str] = []
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        used |= names
        unknown += [
            f"{where}: {n} ({expr})" for n in sorted(names - exported - PROMETHEUS_SYNTHETIC)
        ]
    assert not unknown, "dashboard queries name metrics the daemon does not export:\n" + "\n".join(
        unknown
    )
    # Each area the dashboard promises has at least one query.
    for family in (
        "exchange_network_segments_used",  # pool usage
        "exchange_out_pool_usage",  # backpressure per task
        "exchange_bytes_out_total",  # throughput
        "exchange_checkpoint_alignment_seconds",  # checkpoints
        "exchange_gate_buffer_size_bytes",  # debloated sizes
        "exchange_job_restarts_total",  # streaming jobs: restarts,
        "exchange_job_last_checkpoint_duration_seconds",  # checkpoint duration,
        "exchange_job_last_checkpoint_alignment_seconds",  # alignment,
        "exchange_task_back_pressure_status",  # OK / LOW / HIGH per task
    ):
        assert family in used, family


def test_dashboard_panels_use_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    sources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert [s["type"] for s in sources] == ["prometheus"]
    uid = sources[0]["uid"]
    assert sources[0]["url"] == "http://prometheus:9090"  # the compose service and its port
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == uid, p["title"]
        assert all(t["datasource"]["uid"] == uid for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_compose_mounts_the_provisioning_where_grafana_reads_it() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"]
    )
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "exchange.yml").read_text()
    )["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert "prometheus" in compose["services"]
